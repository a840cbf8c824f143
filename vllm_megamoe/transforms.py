"""Weight layout transforms between checkpoint (vLLM) order and the kernels' order.

vLLM keeps L1 weights as w13 [E, 2I, H] with all gate rows first, then all up rows. The mega
kernels interleave them at granularity 8 ([g0..g7, u0..u7, g8..g15, u8..u15, ...]) so one
N tile holds both halves of the SwiGLU it produces. SM100 additionally wants its UE8M0 scale
factors transposed inside every 128-row group for the UTCCP copy into tensor memory.

Every function accepts 2-D [N, K] and 3-D [E, N, K] tensors of any dtype; rows are dim -2.
"""
from __future__ import annotations

import torch

from .shape import require

INTERLEAVE_GRANULARITY = 8
UTCCP_GROUP_ROWS = 128


def _rows(t: torch.Tensor) -> int:
    require(t.dim() in (2, 3), f"expected a 2-D [N, K] or 3-D [E, N, K] tensor, got shape {tuple(t.shape)}")
    return t.shape[-2]


def interleave_gate_up(t: torch.Tensor, gran: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """[gate | up] rows -> [gate 0..gran-1, up 0..gran-1, gate gran..2gran-1, ...]."""
    n = _rows(t)
    require(n % (2 * gran) == 0, f"number of rows {n} must be a multiple of 2*gran={2 * gran}")
    half = n // 2
    lead, tail = t.shape[:-2], t.shape[-1:]
    gate = t[..., :half, :].reshape(*lead, half // gran, gran, *tail)
    up = t[..., half:, :].reshape(*lead, half // gran, gran, *tail)
    return torch.stack([gate, up], dim=-3).reshape(t.shape).contiguous()


def deinterleave_gate_up(t: torch.Tensor, gran: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """Inverse of interleave_gate_up."""
    n = _rows(t)
    require(n % (2 * gran) == 0, f"number of rows {n} must be a multiple of 2*gran={2 * gran}")
    lead, tail = t.shape[:-2], t.shape[-1:]
    pairs = t.reshape(*lead, n // (2 * gran), 2, gran, *tail)
    gate = pairs.select(-3, 0).reshape(*lead, n // 2, *tail)
    up = pairs.select(-3, 1).reshape(*lead, n // 2, *tail)
    return torch.cat([gate, up], dim=-2).contiguous()


def transpose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """Inside each 128-row group, new row i*4+j holds old row j*32+i (SM100 UTCCP order)."""
    mn = _rows(sf)
    require(mn % UTCCP_GROUP_ROWS == 0, f"number of rows {mn} must be a multiple of {UTCCP_GROUP_ROWS}")
    lead, kp = sf.shape[:-2], sf.shape[-1]
    return sf.reshape(*lead, mn // 128, 4, 32, kp).transpose(-3, -2).reshape(sf.shape).contiguous()


def untranspose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """Inverse of transpose_sf_for_utccp."""
    mn = _rows(sf)
    require(mn % UTCCP_GROUP_ROWS == 0, f"number of rows {mn} must be a multiple of {UTCCP_GROUP_ROWS}")
    lead, kp = sf.shape[:-2], sf.shape[-1]
    return sf.reshape(*lead, mn // 128, 32, 4, kp).transpose(-3, -2).reshape(sf.shape).contiguous()


def interleaved_row_to_source_row(row: torch.Tensor, n_rows: int,
                                  gran: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """For an interleaved L1 row index, the row it came from in [gate | up] order.

    The SM90 kernel keeps FP8 block scales in checkpoint order and uses this mapping to find a
    row's scale block; exposing it lets tests check the kernel's arithmetic against Python.
    """
    pair, within = row // (2 * gran), row % (2 * gran)
    is_up = within >= gran
    return pair * gran + within % gran + is_up.long() * (n_rows // 2)
