"""Which implementation the portable path uses for each of its optional Triton kernels on CUDA.

Every knob takes `torch`, `triton` or `auto` (triton when the package imports):
    VLLM_MEGAMOE_PORTABLE_SCATTER      combine writes of the padded mode   (default auto)
    VLLM_MEGAMOE_PORTABLE_ACTIVATION   SwiGLU x weight + FP8 requantization (default auto)
    VLLM_MEGAMOE_PORTABLE_REDUCE       the top-k reduce                    (default auto)
`torch` keeps the ops any torch build runs (the CPU path always uses them).
"""
from __future__ import annotations

import functools
import os

from .shape import require

CHOICES = ("auto", "torch", "triton")
DEFAULTS = {"VLLM_MEGAMOE_PORTABLE_SCATTER": "auto",
            "VLLM_MEGAMOE_PORTABLE_ACTIVATION": "auto",
            "VLLM_MEGAMOE_PORTABLE_REDUCE": "auto"}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_choice(var: str) -> str:
    """"triton" or "torch" for knob `var` (one of DEFAULTS); errors name the variable."""
    raw = os.environ.get(var, DEFAULTS[var])
    require(raw in CHOICES, f"{var}={raw!r} must be one of {CHOICES}")
    if raw == "auto":
        return "triton" if triton_available() else "torch"
    require(raw != "triton" or triton_available(), f"{var}=triton needs the triton package (pip install triton), "
            "or set it to torch")
    return raw
