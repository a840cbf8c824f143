"""The portable path's combine step on CUDA with Triton: the writes of the padded (CUDA-graph)
mode, and the top-k reduce (developer setting portable_kernels, `auto` by default: Triton where it
imports; vllm_megamoe/settings.py).

The padded mode has a fixed number of output rows (every pair a peer may send), most of them
masked. Written with `index_put` per peer, every row goes to every peer's buffer (masked rows
into that peer's trash row) as 2-byte element stores, over NVLink for remote peers. This kernel
instead copies each live row once, to the peer that owns its token, with 16-byte vector stores,
and skips masked rows: the bytes that cross NVLink are the live rows only.

portable_kernels `scatter=`: auto (the default: this kernel when Triton imports), triton, or torch
(the index_put version). On 2 x H200 (EP2, FP8, 8 and 128 tokens per rank, V4-Flash-like and
DeepSeek-V3-like) the portable path took 0.89-0.98x of its index_put time with this kernel.

The reduce, y[t] = sum over live slots k of combine[k][t] in FP32, is four torch kernels over a
float copy of all K slots (convert, mask, sum, round); `reduce_slots` reads each live slot row
once and writes y. portable_kernels `reduce=`: auto (the default: triton when it imports),
triton or torch. With the Triton activation (activation.py) the portable path took
0.91-0.97x of its all-torch time (2 x H200, the same four cases).
"""
from __future__ import annotations

import functools

import torch

from .. import settings
from ..shape import check_tensor, require


def scatter_setting() -> str:
    """The combine scatter the padded mode uses on CUDA: "triton" or "torch"."""
    return settings.portable_kernel("scatter")


def reduce_setting() -> str:
    """The top-k reduce on CUDA: "triton" or "torch"."""
    return settings.portable_kernel("reduce")


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # Peers' combine regions are addressed from this rank's (`anchor`, 16-byte aligned) plus an
    # element offset that is a multiple of 8, so the compiler can prove 16-byte alignment and
    # emit vector stores (a pointer made from a loaded integer would have unknown alignment).
    @triton.jit
    def scatter_rows_to_peers(out_ptr, width, anchor_ptr, deltas_ptr, peer_ptr, dst_row_ptr, live_ptr, pitch,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0)
        if tl.load(live_ptr + row) == 0:
            return
        peer = tl.load(peer_ptr + row)
        delta = tl.multiple_of(tl.load(deltas_ptr + peer), 8)
        dst = tl.multiple_of(tl.load(dst_row_ptr + row).to(tl.int64) * pitch, 8)
        src = tl.multiple_of(row.to(tl.int64) * width, 8)
        for c0 in range(0, width, BLOCK):
            cols = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, BLOCK), BLOCK), BLOCK)
            mask = cols < width
            tl.store(anchor_ptr + delta + dst + cols, tl.load(out_ptr + src + cols, mask=mask), mask=mask)

    return scatter_rows_to_peers


def combine_deltas(buffer) -> torch.Tensor:
    """int64 [R]: element offsets (bf16) of every rank's combine region from this rank's, in
    this process's address space (cached on the buffer)."""
    cache = buffer.__dict__.setdefault("_portable_combine", {})
    if "deltas" not in cache:
        mine = buffer.view("combine").data_ptr()
        deltas = []
        for p in range(buffer.num_ranks):
            diff = buffer.view("combine", p).data_ptr() - mine
            require(diff % 16 == 0, f"rank {p}'s combine region is not 16-byte aligned relative to this rank's")
            deltas.append(diff // 2)
        cache["deltas"] = torch.tensor(deltas, dtype=torch.int64, device=buffer.device)
    return cache["deltas"]


def scatter_to_peers(buffer, out_rows: torch.Tensor, peer: torch.Tensor, slot: torch.Tensor,
                     token: torch.Tensor, live: torch.Tensor) -> None:
    """combine[slot[i]][token[i]] of rank peer[i] <- out_rows[i] for every live row i (CUDA)."""
    n, width = out_rows.shape
    c, t, pitch = buffer.layout.region("combine").shape
    check_tensor("out_rows", out_rows, dtype=torch.bfloat16, contiguous=True)
    require(width <= pitch, f"rows of {width} values do not fit combine rows of {pitch}")
    for name, tensor in (("peer", peer), ("slot", slot), ("token", token), ("live", live)):
        require(tensor.shape == (n,), f"{name} must have shape ({n},), got {tuple(tensor.shape)}")
    if n == 0:
        return
    dst_row = (slot.long() * t + token.long()).contiguous()
    require(width % 8 == 0 and pitch % 8 == 0, f"rows of {width} / {pitch} values are not 16-byte multiples")
    _kernel()[(n,)](out_rows, width, buffer.view("combine"), combine_deltas(buffer), peer.long().contiguous(),
                    dst_row, live.to(torch.int8).contiguous(), pitch, BLOCK=1024)


@functools.lru_cache(maxsize=None)
def _reduce_kernel():
    import triton
    import triton.language as tl

    # One program per (token, BLOCK columns): slots in order, masked routes skipped, FP32 sums
    # (the order of torch's sum over the slot dimension), one rounding to BF16.
    @triton.jit
    def reduce_topk_slots(combine_ptr, topk_ptr, y_ptr, slot_pitch, row_pitch, hidden,
                          TOPK: tl.constexpr, BLOCK: tl.constexpr):
        tok = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(TOPK):
            if tl.load(topk_ptr + tok * TOPK + k) >= 0:
                row = combine_ptr + k * slot_pitch.to(tl.int64) + tok.to(tl.int64) * row_pitch
                acc += tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + tok.to(tl.int64) * hidden + cols, acc.to(tl.bfloat16), mask=mask)

    return reduce_topk_slots


def reduce_slots(buffer, topk_idx: torch.Tensor, hidden: int) -> torch.Tensor:
    """y [T, hidden] bf16 = sum over k with topk_idx[t, k] >= 0 of this rank's combine[k][t] (CUDA)."""
    t, k = topk_idx.shape
    combine = buffer.view("combine")  # [C, T_max, H_buf]
    c, t_max, pitch = combine.shape
    require(k <= c and t <= t_max and hidden <= pitch,
            f"top-{k} x {t} tokens x {hidden} do not fit the combine region {tuple(combine.shape)}")
    y = torch.empty(t, hidden, dtype=torch.bfloat16, device=combine.device)
    if t == 0:
        return y
    block = 1024
    _reduce_kernel()[(t, -(-hidden // block))](combine, topk_idx.to(torch.int32).contiguous(), y, t_max * pitch,
                                               pitch, hidden, TOPK=k, BLOCK=block)
    return y
