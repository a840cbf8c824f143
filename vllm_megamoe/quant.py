"""Quantization formats: FP8 e4m3 (per-token groups, 128x128 weight blocks) and MXFP4.

These functions define the numbers every path must reproduce: the kernels quantize
activations exactly as `quantize_fp8_tokens` does, and weight conversion (load time or the
offline CLI) goes through `quantize_fp8_blocks` / `quantize_mxfp4`.
"""
from __future__ import annotations

import torch

from .shape import check_tensor, require

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
# Smallest amax used to derive a scale: all-zero groups get a finite scale, never 0 or inf.
AMAX_FLOOR = 1e-10
UE8M0_BIAS = 127

SCALE_FORMATS = ("float", "ue8m0")


def _round_scale_pow2(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale: the next power of two at or above `scale`."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def quantize_fp8_tokens(x: torch.Tensor, group: int = 128, scale_format: str = "float"):
    """Per-token, per-`group`-channel FP8 quantization of activations.

    x: [..., K] float tensor, K % group == 0. Returns (q e4m3 [..., K], scales float32 [..., K/group])
    with x ~= q * scale; scale = amax/448 ("float") or that rounded up to a power of two ("ue8m0").
    """
    check_tensor("x", x, dtype=(torch.float32, torch.bfloat16, torch.float16))
    require(scale_format in SCALE_FORMATS,
            f"scale_format={scale_format!r} must be one of {SCALE_FORMATS}")
    k = x.shape[-1]
    require(group > 0 and k % group == 0, f"x's last dimension {k} must be a multiple of group={group}")
    xg = x.float().reshape(*x.shape[:-1], k // group, group)
    amax = xg.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # amax * (1/448), not amax / 448: torch turns division by a scalar into this product on CUDA,
    # and the kernels compute it the same way, so scales agree to the bit on every device.
    scale = amax * (1.0 / FP8_MAX)
    if scale_format == "ue8m0":
        scale = _round_scale_pow2(scale)
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale.contiguous()


def dequantize_fp8_tokens(q: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Inverse of quantize_fp8_tokens: float32 [..., K]."""
    check_tensor("q", q, dtype=FP8_DTYPE)
    k = q.shape[-1]
    require(k % group == 0, f"q's last dimension {k} must be a multiple of group={group}")
    require(tuple(scales.shape) == (*q.shape[:-1], k // group),
            f"scales has shape {tuple(scales.shape)}, expected {(*q.shape[:-1], k // group)}")
    qg = q.float().reshape(*q.shape[:-1], k // group, group)
    return (qg * scales.float().unsqueeze(-1)).reshape(q.shape)


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _pad_to_blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape[-2:]
    pn, pk = _ceil_div(n, bn) * bn - n, _ceil_div(k, bk) * bk - k
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128)):
    """Block FP8 quantization of weights (DeepSeek-V3 / Qwen3-FP8 checkpoint recipe).

    w: [..., N, K] float. Returns (q e4m3 [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)])
    with w ~= q * scale_inv broadcast over each bn x bk block; scale_inv = block amax / 448.
    """
    check_tensor("w", w, dtype=(torch.float32, torch.bfloat16, torch.float16))
    require(w.dim() >= 2, f"w must have at least 2 dimensions, got shape {tuple(w.shape)}")
    bn, bk = block
    n, k = w.shape[-2:]
    wp = _pad_to_blocks(w.float(), bn, bk)
    gn, gk = wp.shape[-2] // bn, wp.shape[-1] // bk
    blocks = wp.reshape(*w.shape[:-2], gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(wp.shape)[..., :n, :k].contiguous()
    return q, scale_inv.contiguous()


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Inverse of quantize_fp8_blocks: float32 [..., N, K]."""
    check_tensor("q", q, dtype=FP8_DTYPE)
    bn, bk = block
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], _ceil_div(n, bn), _ceil_div(k, bk))
    require(tuple(scale_inv.shape) == want,
            f"scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for q {tuple(q.shape)}")
    s = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return q.float() * s[..., :n, :k]


# E2M1 magnitudes by 3-bit code; the sign is bit 3.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between neighbouring codes; a tie goes to the even code (round half to even).
_E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _e2m1_codes(mag: torch.Tensor) -> torch.Tensor:
    """3-bit E2M1 code of magnitudes already divided by their scale (nearest, ties to even)."""
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for lower_code, mid in enumerate(_E2M1_MIDPOINTS):
        # A value exactly on the midpoint rounds up only when the upper code is even.
        up = mag > mid if lower_code % 2 == 0 else mag >= mid
        code += up.to(torch.uint8)
    return code


def pack_ue8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Pack UE8M0 bytes [..., G] (G % 4 == 0) into int32 [..., G/4]; byte b of int j is group 4j+b."""
    check_tensor("exponents", exponents, dtype=torch.uint8)
    g = exponents.shape[-1]
    require(g % 4 == 0, f"number of scale groups {g} must be a multiple of 4 to pack into int32")
    return exponents.contiguous().view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_ue8m0: uint8 [..., 4*G]."""
    check_tensor("packed", packed, dtype=torch.int32)
    return packed.contiguous().view(torch.uint8)


def ue8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    return torch.exp2(exponents.float() - UE8M0_BIAS)


def quantize_mxfp4(w: torch.Tensor, group: int = 32):
    """MXFP4: E2M1 values with one UE8M0 scale per `group` K values.

    w: [..., N, K] float, K % (4*group) == 0. Returns (packed int8 [..., N, K/2] with the even K
    index in the low nibble, scales int32 [..., N, K/(4*group)] holding 4 UE8M0 bytes each).
    The scale is 2^ceil(log2(amax/6)), so no value saturates.
    """
    check_tensor("w", w, dtype=(torch.float32, torch.bfloat16, torch.float16))
    k = w.shape[-1]
    require(k % (4 * group) == 0,
            f"w's last dimension {k} must be a multiple of {4 * group} (4 packed scales of {group})")
    wg = w.float().reshape(*w.shape[:-1], k // group, group)
    amax = wg.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    exp = torch.ceil(torch.log2(amax / FP4_MAX)).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    scale = torch.exp2(exp)
    mag = (wg.abs() / scale.unsqueeze(-1)).clamp_max(FP4_MAX)
    codes = _e2m1_codes(mag) | (torch.signbit(wg).to(torch.uint8) << 3)
    codes = codes.reshape(*w.shape[:-1], k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
    exponents = (exp + UE8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), pack_ue8m0(exponents)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Inverse of quantize_mxfp4: float32 [..., N, K]."""
    check_tensor("packed", packed, dtype=(torch.int8, torch.uint8))
    check_tensor("scales", scales, dtype=torch.int32)
    raw = packed.view(torch.uint8)
    k = raw.shape[-1] * 2
    want = (*raw.shape[:-1], k // (4 * group))
    require(tuple(scales.shape) == want,
            f"scales has shape {tuple(scales.shape)}, expected {want} for packed {tuple(packed.shape)}")
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(*raw.shape[:-1], k)
    values = E2M1_VALUES.to(raw.device)[(codes & 0x7).long()]
    values = torch.where((codes & 0x8) != 0, -values, values)
    scale = ue8m0_to_float(unpack_ue8m0(scales)).repeat_interleave(group, dim=-1)
    return values * scale
