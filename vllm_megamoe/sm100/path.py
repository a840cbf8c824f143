"""Whether the SM100 path runs a layer, for ops.select_path (the path oracle).

Policy on an SM100-family GPU (compute capability 10.x):
- DeepGEMM with the mega API found and the layer fits the kernel: "sm100".
- DeepGEMM missing: an error at startup that says what to install, unless the user allowed the
  portable path with VLLM_MEGAMOE_FALLBACK=portable (set explicitly; the default does not).
- Layer shape/format the kernel cannot run: the portable path with the reason (like sm90).
"""
from __future__ import annotations

import os

from ..errors import UnsupportedError
from ..shape import MoEShape
from . import discovery
from .weights import DEFAULT_KERNEL_FORMAT

MAX_RANKS = 72
MAX_TOPK = 32
# hidden and intermediate: multiples of 128 for the scale groups and UTCCP; the reference doc
# notes the FP4 path effectively needs 512 (to re-check on the first SM100 run, docs/blackwell.md).
K_ALIGN = {"mxfp4": 512, "bf16": 128}


def supports(shape: MoEShape, fmt: str, num_ranks: int) -> tuple[bool, str]:
    kfmt = DEFAULT_KERNEL_FORMAT.get(fmt)
    if kfmt is None:
        return False, f"format {fmt!r} (SM100 runs {sorted(DEFAULT_KERNEL_FORMAT)})"
    align = K_ALIGN[kfmt]
    checks = [
        (shape.hidden % align == 0, f"hidden={shape.hidden} is not a multiple of {align} ({kfmt})"),
        (shape.intermediate % align == 0,
         f"intermediate={shape.intermediate} is not a multiple of {align} ({kfmt})"),
        (1 <= num_ranks <= MAX_RANKS, f"{num_ranks} ranks (DeepGEMM allows at most {MAX_RANKS})"),
        (shape.num_experts % max(num_ranks, 1) == 0,
         f"num_experts={shape.num_experts} is not divisible by {num_ranks} ranks"),
        (shape.topk <= MAX_TOPK, f"topk={shape.topk} (at most {MAX_TOPK})"),
    ]
    for ok, why in checks:
        if not ok:
            return False, why
    return True, f"DeepGEMM mega kernel, {kfmt}"


def fallback_allowed() -> bool:
    return os.environ.get("VLLM_MEGAMOE_FALLBACK", "").strip().lower() == "portable"


def select(shape: MoEShape, fmt: str, num_ranks: int, forced: str, arch: str) -> tuple[str, str]:
    """(path, reason) on an SM100-family GPU; raises UnsupportedError when it must not run."""
    api, reasons = discovery.find_deep_gemm()
    if api is None:
        if forced != "sm100" and fallback_allowed():
            return "portable", (f"{arch} GPU without DeepGEMM's mega API "
                                f"({'; '.join(reasons)}); VLLM_MEGAMOE_FALLBACK=portable")
        raise UnsupportedError(discovery.missing_message(reasons))
    ok, why = supports(shape, fmt, num_ranks)
    if ok:
        return "sm100", f"{arch} GPU, format {fmt}: {why} {api.describe()}"
    if forced == "sm100":
        raise UnsupportedError(f"VLLM_MEGAMOE_PATH=sm100 but DeepGEMM's kernel cannot run this "
                               f"layer: {why}")
    return "portable", f"{arch} GPU but DeepGEMM's mega kernel cannot run this layer: {why}"
