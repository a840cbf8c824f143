"""The weight scale-factor layout DeepGEMM's SM100 Mega MoE kernel checks before it launches.

Per weight matrix [E, MN, K] the kernel takes int32 scales of logical shape [E, MN, K/128], each
int32 holding 4 UE8M0 exponents (byte b of int j covers K group 4j+b, 32 values per group), and
requires them MN-major and TMA aligned:
    stride(-2) == 1                      (consecutive rows are consecutive in memory)
    stride(-1) == align(MN, 16 / 4)      (each K column padded to 16 bytes)
    stride(-3) == stride(-1) * size(-1)  (experts back to back)
The *values* (gate/up interleave, UTCCP transpose) are a row permutation of that logical tensor;
this module only decides where they live in memory. A safetensors file stores tensors
contiguously (K-major), so checkpoints keep the logical values and `to_mn_major` restrides them
at load time.
"""
from __future__ import annotations

import torch

from ..shape import require

TMA_ALIGNMENT_BYTES = 16
SF_GRAN_MN, SF_GRAN_K = 1, 32
SF_PER_INT = 4


def tma_aligned(n: int, element_size: int) -> int:
    step = TMA_ALIGNMENT_BYTES // element_size
    return -(-n // step) * step


def empty_mn_major(num_groups: int, mn: int, k_packed: int, device=None) -> torch.Tensor:
    """An int32 [G, MN, Kp] tensor with the kernel's MN-major, TMA-aligned strides."""
    mn_pad = tma_aligned(mn, 4)
    storage = torch.empty(num_groups, k_packed, mn_pad, dtype=torch.int32, device=device)
    return storage[:, :, :mn].transpose(1, 2)


def to_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """Same values as int32 `sf` [G, MN, Kp], stored MN-major and TMA aligned (copies once;
    returns `sf` itself when it already is)."""
    require(sf.dtype == torch.int32 and sf.dim() == 3,
            f"scale factors must be int32 [E, MN, K/128], got {sf.dtype} {tuple(sf.shape)}")
    if layout_problem(sf, sf.shape[1], sf.shape[2] * SF_PER_INT * SF_GRAN_K, sf.shape[0]) is None:
        return sf
    out = empty_mn_major(*sf.shape, device=sf.device)
    out.copy_(sf)
    return out


def layout_problem(sf: torch.Tensor, mn: int, k: int, num_groups: int):
    """None when `sf` is what the kernel accepts for an [num_groups, mn, k] weight, else why not."""
    kp = -(-k // (SF_GRAN_K * SF_PER_INT))
    if sf.dtype != torch.int32:
        return f"dtype {sf.dtype}, expected torch.int32 (4 packed UE8M0 bytes)"
    if tuple(sf.shape) != (num_groups, -(-mn // SF_GRAN_MN), kp):
        return f"shape {tuple(sf.shape)}, expected {(num_groups, mn, kp)}"
    want_k = tma_aligned(mn, 4)
    if sf.stride(-2) != 1 and mn != 1:
        return f"strides {sf.stride()}: not MN-major (stride(-2) must be 1)"
    if sf.stride(-1) != want_k:
        return f"strides {sf.stride()}: stride(-1) must be the TMA-aligned MN {want_k}"
    if sf.stride(-3) != sf.stride(-1) * sf.size(-1):
        return f"strides {sf.stride()}: stride(0) must be {sf.stride(-1) * sf.size(-1)}"
    return None


def check_sf(name: str, sf: torch.Tensor, mn: int, k: int, num_groups: int) -> None:
    why = layout_problem(sf, mn, k, num_groups)
    require(why is None, f"{name}: {why}. Build it with vllm_megamoe.sm100.convert_experts (or "
            "vllm_megamoe.sm100.sf_layout.to_mn_major for already-converted values)")
