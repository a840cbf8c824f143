"""SwiGLU x top-k weight and the FP8 requantization between the portable path's two GEMMs, in
one Triton kernel (CUDA, FP8 weights).

Written with torch ops, this step is a dozen elementwise kernels over the padded mode's whole
[pairs, 2I] float tensor (every pair any peer may send, most of them masked), each reading and
writing it in full. This kernel reads the BF16 GEMM output once, skips the rows past the last
expert's end (the second GEMM never reads them), and writes the FP8 rows and their per-128
scales: the arithmetic of `reference.swiglu(..., round_to_bf16=True) * weight` followed by
`quant.quantize_fp8_tokens(..., 128, "float")` (the same clamp, amax floor, scale and
round-to-nearest division; silu's exp may differ from torch's in the last bits).

Developer setting portable_kernels `activation=` (vllm_megamoe/settings.py): auto (the default:
triton when it imports), triton or torch.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import quant, settings
from ..shape import check_tensor, require

GROUP = 128


def activation_setting() -> str:
    """The activation step on CUDA with FP8 weights: "triton" or "torch"."""
    return settings.portable_kernel("activation")


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_quantize_fp8(gate_up_ptr, weight_ptr, ends_ptr, q_ptr, scale_ptr, inter, num_experts, clamp,
                            HAS_CLAMP: tl.constexpr, GROUP: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                            FP8_MAX: tl.constexpr):
        row = tl.program_id(0)
        grp = tl.program_id(1)
        if row >= tl.load(ends_ptr + num_experts - 1):  # past the last expert: never read again
            return
        cols = grp * GROUP + tl.arange(0, GROUP)
        src = gate_up_ptr + row.to(tl.int64) * (2 * inter)
        gate = tl.load(src + cols).to(tl.float32)  # BF16 values: the reference's bf16 rounding
        up = tl.load(src + inter + cols).to(tl.float32)
        if HAS_CLAMP:
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
        act = gate / (1.0 + tl.exp(-gate)) * up * tl.load(weight_ptr + row)
        scale = tl.maximum(tl.max(tl.abs(act), axis=0), AMAX_FLOOR) * (1.0 / FP8_MAX)
        q = tl.minimum(tl.maximum(tl.math.div_rn(act, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row.to(tl.int64) * inter + cols, q.to(tl.float8e4nv))
        tl.store(scale_ptr + row.to(tl.int64) * (inter // GROUP) + grp, scale)

    return swiglu_quantize_fp8


def swiglu_quantize_fp8(gate_up: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor,
                        clamp: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_q e4m3 [P, I], act_s f32 [P, I/128]) from gate_up bf16 [P, 2I] (gate columns first),
    per-row top-k weights f32 [P] and the experts' cumulative row ends (int32 [G], on device);
    rows at or past ends[-1] are left unwritten."""
    p, two_i = gate_up.shape
    check_tensor("gate_up", gate_up, dtype=torch.bfloat16, contiguous=True)
    check_tensor("weights", weights, dtype=torch.float32, shape=(p,), contiguous=True)
    check_tensor("ends", ends, dtype=torch.int32, ndim=1)
    require(gate_up.is_cuda, "the Triton activation runs on CUDA tensors")
    inter = two_i // 2
    require(two_i % 2 == 0 and inter % GROUP == 0, f"gate_up has {two_i} columns: 2I with I a multiple of {GROUP}")
    q = torch.empty(p, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    s = torch.empty(p, inter // GROUP, dtype=torch.float32, device=gate_up.device)
    if p == 0 or ends.numel() == 0:
        return q, s
    _kernel()[(p, inter // GROUP)](gate_up, weights, ends, q, s, inter, ends.numel(),
                                   float(clamp) if clamp is not None else 0.0,
                                   HAS_CLAMP=clamp is not None, GROUP=GROUP, AMAX_FLOOR=quant.AMAX_FLOOR,
                                   FP8_MAX=quant.FP8_MAX, num_warps=1)
    return q, s
