"""Grouped FP8 GEMM with 128x128 weight blocks for the portable path on CUDA (Triton).

torch has no grouped GEMM for block-scaled FP8, and dequantizing weights to BF16 doubles the
bytes a memory-bound MoE layer streams. This kernel reads FP8 tokens (per-128 scales) and FP8
weights (128x128 block scale_inv) and accumulates in FP32 with one promotion per 128-K block,
the same arithmetic as the SM90 mega kernel, without host synchronisation:

    out[rows of expert g] = (a_q * a_s) @ (w_q[g] * w_s[g])^T   (bf16 out)

Rows are sorted by expert; `ends[g]` is the cumulative end row of expert g (device int32).
Tiles are scheduled per expert from device-side counts, so the launch grid is fixed
(cdiv(P, BLOCK_M) + G programs along M) and CUDA graphs can capture it.
"""
from __future__ import annotations

import functools

import torch

from ..shape import check_tensor, require

BLOCK_K = 128


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_fp8_block_gemm(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, ends_ptr, tile_ends_ptr,
                               N, K, G,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               G_POW2: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g_idx = tl.arange(0, G_POW2)
        tile_ends = tl.load(tile_ends_ptr + g_idx, mask=g_idx < G, other=2**30)
        total_tiles = tl.max(tl.where(g_idx < G, tile_ends, 0))
        if pid_m >= total_tiles:
            return
        g = tl.sum((tile_ends <= pid_m).to(tl.int32))
        tile_start = tl.load(tile_ends_ptr + g - 1, mask=g > 0, other=0)
        row_begin = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        row_end = tl.load(ends_ptr + g)
        rows = row_begin + (pid_m - tile_start) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        num_kb = K // BLOCK_K
        w_base = w_ptr + g.to(tl.int64) * N * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(num_kb):
            k0 = kb * BLOCK_K
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * K + k0 + ks[None, :],
                        mask=row_ok[:, None], other=0.0)
            w = tl.load(w_base + cols[None, :].to(tl.int64) * K + k0 + ks[:, None],
                        mask=col_ok[None, :], other=0.0)
            a_s = tl.load(a_scale_ptr + rows.to(tl.int64) * num_kb + kb, mask=row_ok, other=0.0)
            w_s = tl.load(w_scale_ptr + (g * ((N + 127) // 128) + cols // 128) * num_kb + kb,
                          mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.bfloat16),
                 mask=row_ok[:, None] & col_ok[None, :])

    return grouped_fp8_block_gemm


def _block_m(rows: int, groups: int) -> int:
    per_group = max(1, rows // max(groups, 1))
    for bm in (16, 32, 64):
        if per_group <= bm:
            return bm
    return 128


def grouped_fp8_block_gemm(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                           ends: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [P, N] bf16; a_q [P, K] e4m3, a_s [P, K/128] f32, w_q [G, N, K] e4m3,
    w_s [G, ceil(N/128), K/128] f32, ends [G] int32 cumulative row ends (rows sorted by expert;
    rows at or past ends[-1] are left untouched)."""
    p, k = a_q.shape
    g, n, _ = w_q.shape
    check_tensor("a_q", a_q, dtype=torch.float8_e4m3fn, contiguous=True)
    check_tensor("w_q", w_q, dtype=torch.float8_e4m3fn, shape=(g, n, k), contiguous=True)
    check_tensor("a_s", a_s, dtype=torch.float32, shape=(p, k // BLOCK_K), contiguous=True)
    check_tensor("w_s", w_s, dtype=torch.float32, shape=(g, -(-n // 128), k // BLOCK_K), contiguous=True)
    check_tensor("ends", ends, dtype=torch.int32, shape=(g,))
    require(k % BLOCK_K == 0, f"K={k} must be a multiple of {BLOCK_K}")
    if out is None:
        out = torch.empty(p, n, dtype=torch.bfloat16, device=a_q.device)
    if p == 0:
        return out
    bm = _block_m(p, g)
    bn = 128 if n % 128 == 0 else 64
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_ends = torch.cumsum((counts + bm - 1) // bm, 0).to(torch.int32)
    grid = (-(-p // bm) + g, -(-n // bn))
    g_pow2 = 1 << max(0, (g - 1).bit_length())
    _kernel()[grid](a_q, a_s, w_q, w_s, out, ends, tile_ends, n, k, g,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, G_POW2=g_pow2,
                    num_warps=4, num_stages=3)
    return out


def available(device: torch.device) -> bool:
    """True where this kernel can run: a CUDA GPU with FP8 tensor cores (sm89+) and Triton."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
