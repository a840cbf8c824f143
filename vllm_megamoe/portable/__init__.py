"""The portable expert-parallel MoE path: the mega kernel's protocol written with torch ops.

Runs wherever torch runs (CPU shared memory, CUDA symmetric memory, one rank) and is the
fallback and the oracle of the compiled kernels. One call on rank r:

 1. stage: write this rank's tokens (FP8 + per-128 scales, or BF16), top-k ids and weights and
    its token count into its own buffer regions;              barrier "dispatch"
 2. pull: read every peer's top-k ids, pick the (token, slot) pairs routed to experts this rank
    owns, gather those token rows straight from the peers' buffers;
 3. experts: L1 GEMM, SwiGLU (optional clamp) x top-k weight, L2 GEMM, rounding where the
    kernels round (gate/up to BF16, intermediate requantized per 128, output rows BF16);
 4. combine: write each output row into the *source* rank's combine[slot][token];
                                                                 barrier "combine"
 5. reduce: sum this rank's own slots in FP32 (masked routes skipped) into y (BF16).
Two barriers per call suffice: a rank cannot start writing the next call's data before every
peer has reached that call's first barrier, i.e. finished reading and reducing this one.

Two ways to size step 2-4:
- "exact" (CPU, or CUDA outside graph capture): reads the peers' token counts on the host and
  processes exactly the routed pairs.
- "padded" (CUDA, capturable): no host synchronisation; every peer is assumed to hold at most
  `max_peer_tokens` tokens (default: as many as this rank, which is what vLLM's DP padding
  guarantees under CUDA graphs); pairs of peers beyond that bound are dropped and flagged in
  the workspace `error_flag` (see check_errors: every eager call raises what a replayed captured
  call flagged). Masked pairs are sorted last and their writes
  land in the `combine_trash` row.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import quant
from . import activation, combine, gemm
from ..buffer import SymmBuffer
from ..errors import MegaMoEError
from ..reference import swiglu
from ..shape import MoEShape, check_tensor, require
from ..weights import ExpertWeights, derived

MODES = ("auto", "exact", "padded")
# Bits of the workspace error flag (shared with csrc/sm90/mega/config.cuh).
ERROR_PEER_TOKENS_OVER_BOUND = 1
ERROR_STAGING_OVERFLOW = 2
ERROR_BAD_EXPERT_ID = 4


def validate_call(x, topk_idx, topk_weights, weights: ExpertWeights, buffer: SymmBuffer,
                  activation_clamp: Optional[float] = None) -> MoEShape:
    """Checks shared by every path; raises ValueError before any communication starts."""
    c = activation_clamp
    require(c is None or (isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0),
            f"activation_clamp={c!r} must be None or a number >= 0 (gate <= c, -c <= up <= c)")
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float32, torch.float16), ndim=2)
    t, h = x.shape
    check_tensor("topk_idx", topk_idx, dtype=(torch.int32, torch.int64), ndim=2)
    k = topk_idx.shape[1]
    check_tensor("topk_idx", topk_idx, shape=(t, k))
    check_tensor("topk_weights", topk_weights, dtype=(torch.float32, torch.bfloat16, torch.float16),
                 shape=(t, k))
    require(weights.hidden == h, f"x has hidden size {h} but the expert weights have {weights.hidden}")
    lay = buffer.layout
    shape = MoEShape(h, weights.intermediate, weights.num_experts * buffer.num_ranks, k)
    shape.validate(buffer.num_ranks)
    mismatch = shape.buffer_mismatch(lay.shape, buffer.num_ranks)
    require(mismatch is None, mismatch)
    require(weights.format == lay.format,
            f"weights are {weights.format!r} but the SymmBuffer was built for {lay.format!r}")
    require(t <= lay.max_tokens_per_rank,  # the bound asked for (the regions hold it rounded up)
            f"{t} tokens on rank {buffer.rank} exceed the SymmBuffer's max_tokens_per_rank="
            f"{lay.max_tokens_per_rank}; raise max_tokens_per_rank (VLLM_MEGAMOE_MAX_TOKENS_PER_RANK) or send "
            "smaller batches")
    require(x.device.type == buffer.device.type,
            f"x is on {x.device} but the SymmBuffer lives on {buffer.device}")
    for name, tensor in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("weights.w13", weights.w13),
                         ("weights.w2", weights.w2), ("weights.w13_scale", weights.w13_scale),
                         ("weights.w2_scale", weights.w2_scale)):
        require(tensor is None or tensor.device == x.device,
                f"{name} is on {tensor.device if tensor is not None else None} but x is on {x.device}; "
                "every input and the expert weights of a call live on one device")
    if t > 0 and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        bad = (topk_idx < -1) | (topk_idx >= shape.num_experts)
        if bool(bad.any()):
            raise ValueError(f"topk_idx has expert ids outside [-1, {shape.num_experts}) "
                             f"(e.g. {topk_idx[bad][0].item()})")
    return shape


def _stage_inputs(x, topk_idx, topk_weights, buffer: SymmBuffer, shape: MoEShape):
    t, h, k = x.shape[0], shape.hidden, shape.topk
    if buffer.layout.format == "fp8-block":
        q, s = quant.quantize_fp8_tokens(x, 128, "float")
        buffer.view("x")[:t, :h].copy_(q)
        buffer.view("x_scale")[:t, :h // 128].copy_(s)
    else:
        buffer.view("x")[:t, :h].copy_(x)
    buffer.view("topk_idx")[:t, :k].copy_(topk_idx)
    buffer.view("topk_weights")[:t, :k].copy_(topk_weights)
    ws = buffer.view("workspace")
    ws[buffer.layout.workspace_slot("num_tokens")].fill_(t)


def _peer_rows(buffer: SymmBuffer, peer: int, tokens: torch.Tensor, h: int):
    """Token rows `tokens` of peer's staged x as (values, per-128 scales or None for BF16)."""
    rows = buffer.view("x", peer)[tokens, :h]
    if buffer.layout.format == "fp8-block":
        return rows, buffer.view("x_scale", peer)[tokens, :h // 128]
    return rows, None


def _dequantized(rows_q: torch.Tensor, rows_s) -> torch.Tensor:
    return rows_q.float() if rows_s is None else quant.dequantize_fp8_tokens(rows_q, rows_s, 128)


def _round_intermediate(act: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "fp8-block":
        q, s = quant.quantize_fp8_tokens(act, 128, "float")
        return quant.dequantize_fp8_tokens(q, s, 128)
    return act.to(torch.bfloat16).float()


def _dense_weights(weights: ExpertWeights, dtype: torch.dtype):
    """(w13, w2) in checkpoint layout as `dtype`, cached on the weights object; BF16 weights in
    checkpoint layout are themselves, not a second copy of every expert on the device."""
    if (weights.format, weights.layout, dtype) == ("bf16", "checkpoint", torch.bfloat16):
        return weights.w13.contiguous(), weights.w2.contiguous()

    def dense():
        w13, w2 = weights.dequantize()
        return w13.to(dtype).contiguous(), w2.to(dtype).contiguous()
    return derived(weights, f"portable_dense_{dtype}", dense)


def _count(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Occurrences of 0..n-1 in keys (bincount without its host synchronisation)."""
    counts = torch.zeros(n, dtype=torch.int64, device=keys.device)
    return counts.scatter_add_(0, keys, torch.ones_like(keys))


def _expert_mlp_loop(rows_q, rows_s, pair_weights, weights: ExpertWeights, clamp, counts):
    """Per-expert float32 matmuls (CPU): rows sorted by expert, counts on the host."""
    w13, w2 = _dense_weights(weights, torch.float32)
    rows = _dequantized(rows_q, rows_s)
    out = torch.empty(rows.shape[0], weights.hidden, dtype=torch.bfloat16, device=rows.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sl = slice(start, start + n)
        act = swiglu(rows[sl] @ w13[e].T, clamp, round_to_bf16=True) * pair_weights[sl, None]
        act = _round_intermediate(act, weights.format)
        out[sl] = (act @ w2[e].T).to(torch.bfloat16)
        start += n
    return out


def _expert_mlp_grouped(rows_q, rows_s, pair_weights, weights: ExpertWeights, clamp, ends):
    """Grouped GEMMs over experts on CUDA; ends int32 [El] cumulative row ends, on device.

    FP8 weights stay FP8 (Triton block-scaled grouped GEMM, FP32 accumulation); BF16 weights
    use torch._grouped_mm.
    """
    if weights.format == "fp8-block" and gemm.available(rows_q.device):
        gate_up = gemm.grouped_fp8_block_gemm(
            rows_q.contiguous(), rows_s.contiguous(), weights.w13, weights.w13_scale, ends)
        if activation.activation_setting() == "triton":
            act_q, act_s = activation.swiglu_quantize_fp8(gate_up, pair_weights.contiguous(), ends, clamp)
        else:
            act = swiglu(gate_up.float(), clamp, round_to_bf16=True) * pair_weights[:, None]
            act_q, act_s = quant.quantize_fp8_tokens(act, 128, "float")
        return gemm.grouped_fp8_block_gemm(act_q, act_s, weights.w2, weights.w2_scale, ends)
    w13, w2 = _dense_weights(weights, torch.bfloat16)
    rows = _dequantized(rows_q, rows_s).to(torch.bfloat16)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    act = swiglu(gate_up.float(), clamp, round_to_bf16=True) * pair_weights[:, None]
    act = _round_intermediate(act, weights.format)
    return torch._grouped_mm(act.to(torch.bfloat16), w2.transpose(1, 2), offs=ends)


def _write_combine(buffer: SymmBuffer, peer: int, slots, tokens, out_rows, valid=None):
    """combine[slot][token] of `peer` <- out_rows; rows with valid == False go to the trash row."""
    c, t, h = buffer.layout.region("combine").shape
    flat = buffer.view("combine_with_trash", peer)  # [c*t + 1, h]: trash row last
    dst = slots.long() * t + tokens.long()
    if valid is not None:
        dst = torch.where(valid, dst, torch.full_like(dst, c * t))
    flat[dst, :out_rows.shape[1]] = out_rows.to(torch.bfloat16)


def _reduce(buffer: SymmBuffer, topk_idx, t: int, h: int) -> torch.Tensor:
    if topk_idx.is_cuda and combine.reduce_setting() == "triton":
        return combine.reduce_slots(buffer, topk_idx, h)
    k = topk_idx.shape[1]
    slots = buffer.view("combine")[:k, :t, :h].float()  # [K, T, H]
    mask = (topk_idx >= 0).T.unsqueeze(-1)               # [K, T, 1]
    return torch.where(mask, slots, torch.zeros((), device=slots.device)).sum(0).to(torch.bfloat16)


def _pull_exact(buffer: SymmBuffer, shape: MoEShape):
    """Columns (rows, row scales or None, local expert, weight, src rank, src token, slot)."""
    r, el, h = buffer.rank, shape.experts_per_rank(buffer.num_ranks), shape.hidden
    ntok_slot = buffer.layout.workspace_slot("num_tokens")
    parts = []
    for p in range(buffer.num_ranks):
        tp = int(buffer.view("workspace", p)[ntok_slot].item())
        idx = buffer.view("topk_idx", p)[:tp, :shape.topk].long()
        local = (idx >= r * el) & (idx < (r + 1) * el)
        tok, slot = local.nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w = buffer.view("topk_weights", p)[tok, slot]
        rows_q, rows_s = _peer_rows(buffer, p, tok, h)
        parts.append((rows_q, rows_s, idx[tok, slot] - r * el, w, torch.full_like(tok, p), tok, slot))
    if not parts:
        return None
    return [None if col[0] is None else torch.cat(col) for col in zip(*parts)]


def _forward_exact(buffer, shape, weights, clamp):
    pulled = _pull_exact(buffer, shape)
    if pulled is None:
        return
    order = torch.argsort(pulled[2], stable=True)
    rows_q, rows_s, expert, w, src, tok, slot = (None if a is None else a[order] for a in pulled)
    el = shape.experts_per_rank(buffer.num_ranks)
    counts = _count(expert, el)
    if rows_q.is_cuda:
        out = _expert_mlp_grouped(rows_q, rows_s, w.float(), weights, clamp,
                                  torch.cumsum(counts, 0).to(torch.int32))
    else:
        out = _expert_mlp_loop(rows_q, rows_s, w.float(), weights, clamp, counts.tolist())
    for p in range(buffer.num_ranks):
        mine = src == p
        if bool(mine.any()):
            _write_combine(buffer, p, slot[mine], tok[mine], out[mine])


def _forward_padded(buffer, shape, weights, clamp, bound: int):
    """Fixed-size version of _forward_exact: no host synchronisation (CUDA graphs)."""
    r, el, h, k = buffer.rank, shape.experts_per_rank(buffer.num_ranks), shape.hidden, shape.topk
    dev = buffer.device
    ntok_slot = buffer.layout.workspace_slot("num_tokens")
    err = buffer.view("workspace")[buffer.layout.workspace_slot("error_flag")]
    tok_ids = torch.arange(bound, device=dev)
    keys, rows_q, rows_s, ws = [], [], [], []
    for p in range(buffer.num_ranks):
        tp = buffer.view("workspace", p)[ntok_slot]
        idx = buffer.view("topk_idx", p)[:bound, :k].long()
        valid = ((idx >= r * el) & (idx < (r + 1) * el) & (tok_ids < tp)[:, None])
        keys.append(torch.where(valid, idx - r * el, torch.full_like(idx, el)).reshape(-1))
        q, sc = _peer_rows(buffer, p, tok_ids, h)
        rows_q.append(q)
        rows_s.append(sc)
        ws.append(buffer.view("topk_weights", p)[:bound, :k].reshape(-1))
        over = (tp > bound).to(torch.int32) * ERROR_PEER_TOKENS_OVER_BOUND
        err.copy_(torch.maximum(err, over))
    key = torch.cat(keys)                                   # [R*bound*K]
    order = torch.argsort(key, stable=True)                 # flat pair index p*bound*K + t*K + slot
    src, tok, slot = order // (bound * k), (order // k) % bound, order % k
    row_of_pair = src * bound + tok
    pair_q = torch.cat(rows_q)[row_of_pair]
    pair_s = None if rows_s[0] is None else torch.cat(rows_s)[row_of_pair]
    w = torch.cat(ws)[order].float()
    sorted_key = key[order]
    counts = _count(sorted_key, el + 1)[:el]
    valid = sorted_key < el
    if pair_q.is_cuda:
        out = _expert_mlp_grouped(pair_q, pair_s, w, weights, clamp,
                                  torch.cumsum(counts, 0).to(torch.int32))
    else:  # CPU runs of the padded mode (tests): host counts are fine here
        out = _expert_mlp_loop(pair_q, pair_s, w, weights, clamp, counts.tolist())
    if pair_q.is_cuda and combine.scatter_setting() == "triton":
        combine.scatter_to_peers(buffer, out.contiguous(), src, slot, tok, valid)
        return
    for p in range(buffer.num_ranks):
        _write_combine(buffer, p, slot, tok, out, valid & (src == p))


def check_errors(buffer: SymmBuffer) -> None:
    """Raise if a device-side check flagged an error since the last call (host sync)."""
    slot = buffer.layout.workspace_slot("error_flag")
    flag = int(buffer.view("workspace")[slot].item())
    if flag:
        buffer.view("workspace")[slot].zero_()
        if flag & ERROR_PEER_TOKENS_OVER_BOUND:
            raise MegaMoEError(
                f"rank {buffer.rank}: a peer held more tokens than the padded portable path's "
                "bound (max_peer_tokens); its extra tokens were dropped. Pass max_peer_tokens, or "
                "pad every rank to the same token count under CUDA graphs.")
        if flag & ERROR_BAD_EXPERT_ID:
            raise MegaMoEError(f"rank {buffer.rank}: topk_idx held expert ids outside [-1, num_experts) "
                               "during a captured call; those routes were dropped")
        if flag & ERROR_STAGING_OVERFLOW:
            raise MegaMoEError(f"rank {buffer.rank}: received more rows than the staging region holds")
        raise MegaMoEError(f"rank {buffer.rank}: device error flag {flag:#x}")


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             weights: ExpertWeights, buffer: SymmBuffer, *, activation_clamp: Optional[float] = None,
             mode: str = "auto", max_peer_tokens: Optional[int] = None) -> torch.Tensor:
    """One expert-parallel MoE layer on this rank (a collective over buffer's group).

    x [T, H] (bf16), topk_idx [T, K] global expert ids (-1 = masked), topk_weights [T, K];
    weights: this rank's experts (rank r owns global experts [r*El, (r+1)*El)) in checkpoint
    layout. Returns y [T, H] bf16 = sum_k w_k * expert_k(x). T may be 0 and may differ per
    rank. mode: "exact", "padded" or "auto" (padded while a CUDA graph is being captured).
    """
    require(mode in MODES, f"mode={mode!r} must be one of {MODES}")
    shape = validate_call(x, topk_idx, topk_weights, weights, buffer, activation_clamp)
    require(weights.layout == "checkpoint" or not x.is_cuda,
            "the portable path on CUDA reads checkpoint-layout weights; convert them with "
            "ops.prepare_weights(weights, 'portable')")
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if mode == "auto":
        mode = "padded" if capturing else "exact"
    require(not (capturing and mode == "exact"),
            "mode='exact' reads token counts on the host and cannot run under CUDA graph capture")
    t = x.shape[0]
    _stage_inputs(x, topk_idx, topk_weights, buffer, shape)
    buffer.barrier("dispatch")
    if mode == "exact":
        _forward_exact(buffer, shape, weights, activation_clamp)
    else:
        bound = t if max_peer_tokens is None else int(max_peer_tokens)
        require(0 <= bound <= buffer.layout.max_tokens_per_rank,
                f"max_peer_tokens={bound} must be in [0, {buffer.layout.max_tokens_per_rank}] (max_tokens_per_rank)")
        if bound > 0:
            _forward_padded(buffer, shape, weights, activation_clamp, bound)
    buffer.barrier("combine")
    if not capturing:  # eager: raise what the device-side checks flagged in this call, or in the
        check_errors(buffer)  # captured calls replayed since the last eager one (they cannot raise)
    return _reduce(buffer, topk_idx, t, shape.hidden)
