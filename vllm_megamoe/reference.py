"""Dense float reference of the MoE layer: the oracle every path is checked against.

moe_forward computes, for each token t:
    y[t] = sum_k w[t,k] * W2[e] @ (silu(gate) * up),  (gate, up) = split(W13[e] @ x[t]),  e = idx[t,k]
with the top-k weight applied to the SwiGLU output (before L2, as the kernels do; L2 is linear so
this equals weighting the output). Masked routes (idx == -1) contribute nothing.

`emulate` rounds where the kernels round, so kernels can be held to tight bounds:
- "fp8": tokens quantized to FP8 per 128 channels (float scales); gate/up rounded to BF16;
  SwiGLU x weight requantized to FP8 per 128; each expert's output row rounded to BF16 (the
  combine buffer is BF16); the top-k sum in FP32, then rounded to BF16.
- "bf16": same with BF16 tokens and BF16 intermediate instead of FP8.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import quant
from .shape import check_tensor, require

EMULATE_MODES = (None, "fp8", "bf16")
FLOAT_WEIGHT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _fp8_roundtrip(t: torch.Tensor) -> torch.Tensor:
    q, s = quant.quantize_fp8_tokens(t, 128, "float")
    return quant.dequantize_fp8_tokens(q, s, 128)


def swiglu(gate_up: torch.Tensor, activation_clamp: Optional[float] = None,
           round_to_bf16: bool = False) -> torch.Tensor:
    """silu(gate) * up over [..., 2I] with gate first; optional clamp as DeepGEMM defines it."""
    gate, up = gate_up.chunk(2, dim=-1)
    if round_to_bf16:
        gate, up = _bf16(gate), _bf16(up)
    if activation_clamp is not None:
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(-activation_clamp, activation_clamp)
    return F.silu(gate) * up


def moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, activation_clamp: Optional[float] = None,
                shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                emulate: Optional[str] = None) -> torch.Tensor:
    """Float32 [T, H] output of the MoE layer (see module docstring).

    x [T, H]; topk_idx [T, K] int (global expert ids, -1 masks); topk_weights [T, K];
    w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], floating point (already
    dequantized; a BF16 layer is read as float one expert at a time, not copied whole);
    shared: optional (w13 [2Is, H], w2 [H, Is]) of a shared expert applied to every token with
    weight 1.
    """
    check_tensor("x", x, ndim=2)
    h = x.shape[1]
    check_tensor("w13", w13, ndim=3)
    e, two_i, _ = w13.shape
    check_tensor("w13", w13, shape=(e, two_i, h))
    check_tensor("w2", w2, shape=(e, h, two_i // 2))
    for name, w in (("w13", w13), ("w2", w2)):
        require(w.dtype in FLOAT_WEIGHT_DTYPES, f"{name} has dtype {w.dtype}: dequantize it first "
                "(ExpertWeights.dequantize, or moe_forward_per_expert with dequantize_expert)")
    return moe_forward_per_expert(x, topk_idx, topk_weights, e, lambda ex: (w13[ex], w2[ex]),
                                  activation_clamp, shared, emulate)


def moe_forward_per_expert(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           num_experts: int,
                           expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                           activation_clamp: Optional[float] = None,
                           shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                           emulate: Optional[str] = None) -> torch.Tensor:
    """moe_forward with each routed expert's weights asked for when it is computed:
    expert_weights(e) gives (w13 [2I, H], w2 [H, I]) of expert e, e.g.
    ExpertWeights.dequantize_expert. Only one expert's float weights exist at a time, so a
    large quantized layer is checked without a float copy of all of it."""
    require(emulate in EMULATE_MODES, f"emulate={emulate!r} must be one of {EMULATE_MODES}")
    check_tensor("x", x, ndim=2)
    t, h = x.shape
    check_tensor("topk_idx", topk_idx, dtype=(torch.int32, torch.int64), ndim=2)
    k = topk_idx.shape[1]
    check_tensor("topk_idx", topk_idx, shape=(t, k))
    check_tensor("topk_weights", topk_weights, shape=(t, k))
    e = num_experts
    require(bool(((topk_idx >= -1) & (topk_idx < e)).all()),
            f"topk_idx has expert ids outside [-1, {e})")

    xf = x.float()
    if emulate == "fp8":
        xf = _fp8_roundtrip(xf)
    elif emulate == "bf16":
        xf = _bf16(xf)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    flat_idx = topk_idx.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=x.device).repeat_interleave(k)
    for expert in torch.unique(flat_idx[flat_idx >= 0]).tolist():
        w13e, w2e = expert_weights(expert)
        require(w13e.dtype in FLOAT_WEIGHT_DTYPES and w2e.dtype in FLOAT_WEIGHT_DTYPES,
                f"expert {expert}: weights of dtype {w13e.dtype} / {w2e.dtype}: give dequantized "
                "ones (ExpertWeights.dequantize_expert)")
        require(w13e.dim() == 2 and w13e.shape[1] == h and w2e.shape == (h, w13e.shape[0] // 2),
                f"expert {expert}: w13 {tuple(w13e.shape)} and w2 {tuple(w2e.shape)} do not fit "
                f"hidden {h} (want [2I, {h}] and [{h}, I])")
        pairs = (flat_idx == expert).nonzero().squeeze(1)
        rows = token_of[pairs]
        act = swiglu(xf[rows] @ w13e.float().T, activation_clamp, round_to_bf16=emulate is not None)
        act = act * flat_w[pairs].unsqueeze(1)
        if emulate == "fp8":
            act = _fp8_roundtrip(act)
        elif emulate == "bf16":
            act = _bf16(act)
        y = act @ w2e.float().T
        if emulate is not None:
            y = _bf16(y)
        out.index_add_(0, rows, y)
    if shared is not None:
        s13, s2 = (s.float() for s in shared)
        act = swiglu(xf @ s13.T, activation_clamp, round_to_bf16=emulate is not None)
        if emulate == "fp8":
            act = _fp8_roundtrip(act)
        elif emulate == "bf16":
            act = _bf16(act)
        y = act @ s2.T
        out += _bf16(y) if emulate is not None else y
    return _bf16(out) if emulate is not None else out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives inf, so it never passes a bound)."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff
