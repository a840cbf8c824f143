"""Per-call activation staging for the fp8xfp4 kernel, with no allocation.

x [T, H] bf16 -> the buffer's `x` (e4m3 [T_max, H]) and `x_sf` (int32 [T_max, H/128], 4 UE8M0
exponents per int, byte b of int j = K group 4j+b), one scale per 32 values:
    sf = 2^ceil(log2(max(amax, 1e-10) * (1/448))),  q = e4m3(x / sf)
(the same numbers as quant.quantize_fp8_tokens(x, 32, "ue8m0")). Every op writes into scratch
preallocated once per worker (`ActScratch`, shared by all layers) or into the buffer itself, so
the sequence is CUDA-graph safe; rows go `chunk_rows` at a time to bound the scratch.
The power-of-two ceiling is exact integer arithmetic on the float bits: adding 0x7FFFFF to a
positive normal float's bits and clearing the mantissa rounds it up to the next power of two.
"""
from __future__ import annotations

import torch

from .. import quant

GROUP = 32
CHUNK_ROWS = 1024
_MANTISSA = 0x007FFFFF
_EXPONENT = 0x7F800000


class ActScratch:
    """Scratch for `stage_fp8`: [chunk_rows, H] bf16 plus a few [chunk_rows, H/32] tensors."""

    def __init__(self, hidden: int, chunk_rows: int, device):
        g = hidden // GROUP
        self.hidden, self.chunk_rows = hidden, chunk_rows
        self.amax_b = torch.empty(chunk_rows, g, dtype=torch.bfloat16, device=device)
        self.scale = torch.empty(chunk_rows, g, dtype=torch.float32, device=device)
        self.scale_b = torch.empty(chunk_rows, g, dtype=torch.bfloat16, device=device)
        self.exp = torch.empty(chunk_rows, g, dtype=torch.int32, device=device)
        self.xs = torch.empty(chunk_rows, hidden, dtype=torch.bfloat16, device=device)
        # Constants as 0-dim tensors of the operand dtypes: Python scalars would be wrapped into
        # (host) tensors and converted on every call.
        const = (lambda v, dt: torch.tensor(v, dtype=dt, device=device))  # noqa: E731
        self.floor = const(quant.AMAX_FLOOR, torch.float32)
        self.inv_max = const(1.0 / quant.FP8_MAX, torch.float32)
        self.mantissa = const(_MANTISSA, torch.int32)
        self.exponent = const(_EXPONENT, torch.int32)
        self.shift = const(23, torch.int32)

    def fits(self, hidden: int) -> bool:
        return hidden <= self.hidden


def stage_fp8(x: torch.Tensor, out_x: torch.Tensor, out_sf: torch.Tensor, s: ActScratch) -> None:
    """Quantize x [T, H] into out_x[:T] (e4m3) and out_sf[:T] (int32 [.., H/128])."""
    t, h = x.shape
    g = h // GROUP
    sf_bytes = out_sf.view(torch.uint8)  # [T_max, H/32]: the byte order of the packed ints
    for r0 in range(0, t, s.chunk_rows):
        r1 = min(t, r0 + s.chunk_rows)
        c = r1 - r0
        xg = x[r0:r1].view(c, g, GROUP)
        amax_b, scale, scale_b = s.amax_b[:c, :g], s.scale[:c, :g], s.scale_b[:c, :g]
        exp, xs = s.exp[:c, :g], s.xs[:c, :h].view(c, g, GROUP)
        torch.linalg.vector_norm(xg, float("inf"), dim=-1, out=amax_b)  # exact: a bf16 value
        scale.copy_(amax_b).clamp_min_(s.floor).mul_(s.inv_max)
        bits = scale.view(torch.int32)
        bits.add_(s.mantissa).bitwise_and_(s.exponent)      # scale := 2^ceil(log2(scale))
        torch.bitwise_right_shift(bits, s.shift, out=exp)   # biased exponent = UE8M0 byte
        sf_bytes[r0:r1, :g].copy_(exp)
        scale_b.copy_(scale)                                # powers of two: exact in bf16
        torch.div(xg, scale_b.unsqueeze(-1), out=xs)        # exact: division by 2^k
        out_x[r0:r1].view(c, g, GROUP).copy_(xs)


def stage_bf16(x: torch.Tensor, out_x: torch.Tensor) -> None:
    out_x[:x.shape[0]].copy_(x)
