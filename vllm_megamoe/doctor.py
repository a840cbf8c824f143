"""`vllm-megamoe doctor`: what this environment has and which megamoe path would run here."""
from __future__ import annotations

import importlib.util
import platform

import torch

from .errors import UnsupportedError
from .ops import select_path
from .shape import MoEShape

# A V4-Flash-like layer: the shape doctor asks the path oracle about.
PROBE_SHAPE = MoEShape(hidden=4096, intermediate=2048, num_experts=256, topk=6)


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "installed")
    except Exception as exc:  # a broken install is worth reporting, not crashing on
        return f"installed but fails to import ({type(exc).__name__}: {exc})"


def _vllm_version() -> str:
    from .vllm_releases import CHECKED_VLLM_RELEASES, checked_vllm_release
    found = _version("vllm")
    if found[:1].isdigit():
        checked = ", ".join(CHECKED_VLLM_RELEASES)
        found += (f" (the plugin is checked on {checked})" if checked_vllm_release(found) else
                  f" (not a release the plugin is checked on: {checked}; `bash "
                  f"scripts/vllm_releases.sh {found.split('+')[0]}` tests one)")
    return found


def _cuda_bindings_version() -> str:
    try:
        from importlib.metadata import version
        return version("cuda-bindings")
    except Exception:
        return "not installed"


def _deep_gemm() -> str:
    from .sm100 import discovery
    return discovery.describe()


def _path(fmt: str, device) -> str:
    try:
        path, why = select_path(PROBE_SHAPE, fmt, device)
    except UnsupportedError as exc:  # e.g. an SM100 GPU without DeepGEMM: report, don't crash
        return f"none: {exc}"
    return f"{path}: {why}"


PLUGIN_NAME = "megamoe"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_TARGET = "vllm_megamoe.plugin:register"
PROBLEM = "problem: "  # the rows that make doctor exit 1 start with it


def _sm90_build(sm90_gpus: int) -> str:
    """The SM90 kernel build the V4-Flash-like probe layer would run at EP2 (decode / prefill), on a
    machine with an SM90 GPU; elsewhere only whether the settings would build (a bad setting or
    table is an error on any machine)."""
    from .kernels import sm90_mega_moe, sm90_tuning
    try:
        table = sm90_tuning.table_path()
        picks = [f"{t} tok/rank -> {sm90_tuning.choose(PROBE_SHAPE, 'fp8-block', 2, t).label()}" for t in (8, 4096)]
        # every build the layer loads at its first call must fit (a forced stage count may not)
        sm90_mega_moe.layer_kernel_specs([PROBE_SHAPE], "fp8-block", 2, 4096)
    except ValueError as exc:  # a bad setting or table: say which
        return f"error: {exc}"
    if not sm90_gpus:
        return ("none here: no SM90 (Hopper) GPU; `vllm-megamoe precompile --shape 4096x2048x256x6 --format "
                "fp8-block --ep-size 2 --max-tokens-per-rank 4096 --dry-run` lists what one would build")
    return f"{', '.join(picks)} (mainloop/stages/tile; table {table or 'none: heuristic'})"


def _plugin_entry_point(vllm_installed: bool, entry_points=None) -> str:
    """Whether vLLM finds the plugin: the `vllm.general_plugins` entry point named megamoe that vLLM
    loads in every process, pointing at this package and importable."""
    if entry_points is None:
        from importlib.metadata import entry_points
    found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not vllm_installed:
        return (f"{len(found)} {PLUGIN_GROUP} entry point(s) named {PLUGIN_NAME} (vLLM is not installed: nothing "
                "loads it yet)")
    if not found:
        return (f"{PROBLEM}no {PLUGIN_GROUP} entry point named {PLUGIN_NAME}: vLLM will not load the plugin and "
                "refuses --moe-backend megamoe; install this package into vLLM's environment (pip install -e "
                "/path/to/vllm-megamoe, or pip install vllm-megamoe)")
    targets = sorted({ep.value for ep in found})
    if targets != [PLUGIN_TARGET]:
        return (f"{PROBLEM}{PLUGIN_GROUP} entry point {PLUGIN_NAME} -> {', '.join(targets)}, expected "
                f"{PLUGIN_TARGET}: another or an old install; uninstall it and reinstall this package")
    try:
        found[0].load()
    except Exception as exc:  # noqa: BLE001 - vLLM would log this and go on without the plugin
        return (f"{PROBLEM}{PLUGIN_NAME} -> {PLUGIN_TARGET} fails to load ({type(exc).__name__}: {exc}); vLLM "
                "would go on without the plugin")
    return f"{PLUGIN_NAME} -> {PLUGIN_TARGET} ({PLUGIN_GROUP}: vLLM loads it in every process)"


def _vllm_plugins(environ=None) -> str:
    """VLLM_PLUGINS, vLLM's allow-list of plugins (unset: all), read the way vLLM reads it."""
    import os
    env = os.environ if environ is None else environ
    if "VLLM_PLUGINS" not in env:
        return "unset: vLLM loads every installed plugin, megamoe included"
    raw = env["VLLM_PLUGINS"]
    names = raw.split(",")  # as vllm.envs does: no spaces stripped
    if PLUGIN_NAME in names:
        return f"{raw!r}: names {PLUGIN_NAME}, so vLLM loads it"
    spaced = [n for n in names if n.strip() == PLUGIN_NAME]
    fix = (f"write it without spaces: VLLM_PLUGINS={','.join(n.strip() for n in names)!r}" if spaced
           else f"add it (VLLM_PLUGINS={','.join([n for n in names if n] + [PLUGIN_NAME])!r}) or unset it")
    return (f"{PROBLEM}VLLM_PLUGINS={raw!r} does not name {PLUGIN_NAME} (vLLM compares names exactly), so vLLM "
            f"skips the plugin and refuses --moe-backend megamoe: {fix}")


def _compiler() -> str:
    """What compiles the SM90 kernels here (at a layer's first call, or `vllm-megamoe precompile`)."""
    from .kernels import jit
    try:
        compiler = jit.choose_compiler()
        identity = jit.compiler_identity(compiler)  # "nvrtc-13.0", "nvcc:Build cuda_13.0.r13.0/..."
    except (jit.KernelCompileError, ValueError) as exc:
        return f"none: {exc}"
    except Exception as exc:  # a report, never a crash (NVRTC that fails to load, ...)
        return f"none: {type(exc).__name__}: {exc}"
    if "cuda" not in identity.lower() and compiler == "nvcc":
        return f"none: {jit.find_nvcc()} does not report a CUDA compiler version ({identity!r})"
    return f"{identity}; cache {jit.cache_dir()}"


def collect() -> list[tuple[str, str]]:
    rows = [("python", platform.python_version()),
            ("torch", torch.__version__),
            ("torch CUDA", str(torch.version.cuda)),
            ("cuda-bindings", _cuda_bindings_version()),
            ("vllm", _vllm_version()),
            ("deep_gemm (SM100)", _deep_gemm())]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows.append(("GPUs", str(n)))
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        rows.append((f"  cuda:{i}", f"{p.name}, sm{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.0f} GiB"))
    if n > 1:
        peers = []
        for i in range(n):
            ok = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
            peers.append(f"{i}->{ok}")
        rows.append(("peer access", ", ".join(peers)))
    vllm_installed = importlib.util.find_spec("vllm") is not None
    rows.append(("vLLM plugin", _plugin_entry_point(vllm_installed)))
    rows.append(("VLLM_PLUGINS", _vllm_plugins()))
    device = torch.device("cuda", 0) if n else torch.device("cpu")
    for fmt in ("fp8-block", "bf16"):
        rows.append((f"path ({fmt})", _path(fmt, device)))
    sm90 = sum(1 for i in range(n) if torch.cuda.get_device_capability(i)[0] == 9)
    rows.append(("SM90 build (fp8, EP2)", _sm90_build(sm90)))
    rows.append(("kernel compiler", _compiler()))
    return rows


def run() -> int:
    """Print the report; exit status 1 when a row is a problem (the plugin would not load), else 0."""
    rows = collect()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    problems = [key for key, value in rows if value.startswith(PROBLEM)]
    if problems:
        print(f"{len(problems)} problem(s): {', '.join(problems)}")
    return 1 if problems else 0
