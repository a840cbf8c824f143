"""Multi-rank cases shared by the CPU tests and the GPU tests of the portable path.

Every rank builds the same global problem from a seed (weights of all experts, every rank's
tokens), runs its share and checks its own output against the float reference of the whole
layer. Routing cases: uniform, skewed (one hot expert), masked routes, a rank with 0 tokens,
token counts that are multiples of nothing.
"""
from __future__ import annotations

import torch

from vllm_megamoe import ExpertWeights, MoEShape, SymmBuffer, portable, reference

# Bounds: against the emulated reference (same rounding points; differences come from
# accumulation order flipping a rare FP8/BF16 rounding) and against the exact float math.
EMULATED_BOUND = {"fp8-block": 2e-2, "bf16": 1e-2}
EXACT_BOUND = {"fp8-block": 0.08, "bf16": 0.02}


def routing(case: str, tokens: int, shape: MoEShape, gen: torch.Generator) -> torch.Tensor:
    e, k = shape.num_experts, shape.topk
    if tokens == 0:
        return torch.zeros(0, k, dtype=torch.int64)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    if case == "skewed":  # expert 0 is in almost every token's top-k
        hot = torch.rand(tokens, generator=gen) < 0.9
        has0 = (idx == 0).any(1)
        fix = hot & ~has0
        idx[fix, 0] = 0
    elif case == "masked":
        idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
        idx[0] = -1  # one token with every route masked
    return idx


def make_case(shape: MoEShape, fmt: str, tokens_per_rank: list[int], case: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h, i, e = shape.hidden, shape.intermediate, shape.num_experts
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    weights = ExpertWeights.from_float(w13, w2, fmt)
    inputs = []
    for t in tokens_per_rank:
        x = (torch.randn(t, h, generator=gen) * 2).to(torch.bfloat16)
        inputs.append((x, routing(case, t, shape, gen), torch.rand(t, shape.topk, generator=gen)))
    return weights, inputs


def check_rank(rank: int, world: int, group, shape: MoEShape, fmt: str, cases: list,
               device: str = "cpu", mode: str = "exact") -> list[tuple]:
    """Run every (tokens_per_rank, case, seed) on this rank; return (case, errors) rows."""
    max_tokens = max(max(tpr) for tpr, _, _ in cases)
    buf = SymmBuffer(shape, max_tokens, group, format=fmt, device=device)
    el = shape.experts_per_rank(world)
    rows = []
    for tokens_per_rank, case, seed in cases:
        weights, inputs = make_case(shape, fmt, tokens_per_rank, case, seed)
        local = weights.experts(rank * el, el).to(device)
        x, idx, tw = inputs[rank]
        buf.view("combine").fill_(float("nan"))  # unwritten slots must show up as NaN
        bound = max(tokens_per_rank) if mode == "padded" else None
        y = portable.mega_moe(x.to(device), idx.to(device), tw.to(device), local, buf,
                              mode=mode, max_peer_tokens=bound)
        y = y.cpu()
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        w13, w2 = weights.dequantize()
        emulate = "fp8" if fmt == "fp8-block" else "bf16"
        ref_emu = reference.moe_forward(x, idx, tw, w13, w2, emulate=emulate)
        ref = reference.moe_forward(x, idx, tw, w13, w2)
        rows.append((tokens_per_rank, case, reference.relative_error(y, ref_emu),
                     reference.relative_error(y, ref), bool(torch.isfinite(y).all())))
    buf.destroy()
    return rows


def assert_rows(rows_per_rank, fmt):
    for rank, rows in enumerate(rows_per_rank):
        for tokens_per_rank, case, err_emu, err, finite in rows:
            where = f"rank {rank}, tokens {tokens_per_rank}, {case}, {fmt}"
            assert finite, f"non-finite output at {where}"
            if tokens_per_rank[rank] == 0:
                continue
            assert err_emu <= EMULATED_BOUND[fmt], f"{where}: {err_emu:.3e} vs emulated reference"
            assert err <= EXACT_BOUND[fmt], f"{where}: {err:.3e} vs float reference"
