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
    from .plugin import CHECKED_VLLM_RELEASES, checked_vllm_release
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


def _sm90_build() -> str:
    """The SM90 kernel build the V4-Flash-like probe layer would run at EP2 (decode / prefill)."""
    from .kernels import sm90_mega_moe, sm90_tuning
    try:
        table = sm90_tuning.table_path()
        picks = [f"{t} tok/rank -> {sm90_tuning.choose(PROBE_SHAPE, 'fp8-block', 2, t).label()}" for t in (8, 4096)]
        # every build the layer loads at its first call must fit (a forced stage count may not)
        sm90_mega_moe.layer_kernel_specs([PROBE_SHAPE], "fp8-block", 2, 4096)
    except ValueError as exc:  # a bad setting or table: say which
        return f"error: {exc}"
    return f"{', '.join(picks)} (mainloop/stages/tile; table {table or 'none: heuristic'})"


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
    device = torch.device("cuda", 0) if n else torch.device("cpu")
    for fmt in ("fp8-block", "bf16"):
        rows.append((f"path ({fmt})", _path(fmt, device)))
    rows.append(("SM90 build (fp8, EP2)", _sm90_build()))
    rows.append(("kernel compiler", _compiler()))
    return rows


def run() -> int:
    rows = collect()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
