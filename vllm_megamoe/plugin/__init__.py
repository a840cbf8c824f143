"""vLLM integration of vllm-megamoe: `vllm serve MODEL --moe-backend megamoe`.

vLLM loads `register` through the `vllm.general_plugins` entry point
(`megamoe = vllm_megamoe.plugin:register`) in every process it starts: API server, engine
core, each worker, sometimes more than once. `register` is idempotent. All vLLM-importing code
of the package lives in this folder:

  settings.py  re-exports vllm_megamoe.settings (VLLM_MEGAMOE_* variables, VLLM_MEGAMOE_CONFIG file)
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
# The vLLM releases the plugin was checked on live in the core (vllm-megamoe doctor reports them).
from ..vllm_releases import CHECKED_VLLM_RELEASES, checked_vllm_release, public_version  # noqa: E402,F401

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
