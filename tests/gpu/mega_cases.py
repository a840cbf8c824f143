"""Problems for the fused-kernel GPU tests, generated on the GPU (the standard shapes' weights
are too large to build on the host quickly), and the checks every rank runs."""
from __future__ import annotations

import torch

from vllm_megamoe import ExpertWeights, MoEShape, SymmBuffer, portable, quant, reference
from vllm_megamoe.kernels import sm90_mega_moe

# vs the reference's emulated mode (same rounding points: differences come from accumulation
# order flipping a BF16/FP8 rounding now and then) and vs the exact float math.
EMULATED_BOUND = {"fp8-block": 1.5e-2, "bf16": 5e-3}
EXACT_BOUND = {"fp8-block": 0.08, "bf16": 0.02}

SHAPES = {
    "small-odd": MoEShape(hidden=512, intermediate=384, num_experts=24, topk=5),
    "qwen3-30b-a3b": MoEShape(hidden=2048, intermediate=768, num_experts=128, topk=8),
    "v4-flash": MoEShape(hidden=4096, intermediate=2048, num_experts=256, topk=6),
    # DeepSeek-V3's hidden/intermediate/top-k with 64 experts: the float reference of 256 such
    # experts would not fit next to the test on one GPU.
    "deepseek-v3-64e": MoEShape(hidden=7168, intermediate=2048, num_experts=64, topk=8),
}


def global_weights(shape: MoEShape, fmt: str, device, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, e = shape.hidden, shape.intermediate, shape.num_experts
    w13 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16) / i ** 0.5
    if fmt == "bf16":
        return ExpertWeights("bf16", w13, w2)
    q13, s13 = zip(*(quant.quantize_fp8_blocks(w) for w in w13))
    q2, s2 = zip(*(quant.quantize_fp8_blocks(w) for w in w2))
    return ExpertWeights("fp8-block", torch.stack(q13), torch.stack(q2), torch.stack(s13), torch.stack(s2))


def routing(case: str, tokens: int, shape: MoEShape, gen, device) -> torch.Tensor:
    e, k = shape.num_experts, shape.topk
    if tokens == 0:
        return torch.zeros(0, k, dtype=torch.int64, device=device)
    weights = torch.ones(tokens, e, device=device)
    if case == "skewed":
        weights[:, 0] = 1000.0  # expert 0 (rank 0) is in nearly every token's top-k
        weights[:, 1] = 300.0
    idx = torch.multinomial(weights, k, replacement=False, generator=gen)
    if case == "masked":
        idx[torch.rand(idx.shape, generator=gen, device=device) < 0.3] = -1
        idx[0] = -1
    return idx


def inputs(shape, tokens_per_rank, case, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for t in tokens_per_rank:
        x = (torch.randn(t, shape.hidden, generator=gen, device=device) * 2).to(torch.bfloat16)
        out.append((x, routing(case, t, shape, gen, device), torch.rand(t, shape.topk, generator=gen, device=device)))
    return out


def run_cases(rank, world, group, shape_name, fmt, cases, compare_portable=True, calls_per_case=1, options=None):
    """Run each (tokens_per_rank, case, seed) through the kernel on this rank; return error rows."""
    shape = SHAPES[shape_name]
    dev = torch.device("cuda", torch.cuda.current_device())
    weights = global_weights(shape, fmt, dev)
    el = shape.experts_per_rank(world)
    local = weights.experts(rank * el, el)
    # One expert's float weights at a time: two ranks' float copies of the V4-Flash-like layer
    # (26 GB each) do not fit beside each other on one 80 GB GPU (MEGAMOE_SHARED_GPU=1).
    expert_weights = weights.dequantize_expert
    max_tokens = max(max(t) for t, _, _ in cases)
    buf = SymmBuffer(shape, max_tokens, group, format=fmt, device=dev)
    rows = []
    for tokens_per_rank, case, seed in cases:
        for call in range(calls_per_case):
            x, idx, tw = inputs(shape, tokens_per_rank, case, seed + 1000 * call, dev)[rank]
            y = torch.full((x.shape[0], shape.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
            sm90_mega_moe.mega_moe(x, idx, tw, local, buf, y=y, options=options or sm90_mega_moe.SERVING)
            torch.cuda.synchronize(dev)
            emulate = "fp8" if fmt == "fp8-block" else "bf16"
            ref_emu = reference.moe_forward_per_expert(x, idx, tw, shape.num_experts, expert_weights,
                                                       emulate=emulate)
            ref = reference.moe_forward_per_expert(x, idx, tw, shape.num_experts, expert_weights)
            row = dict(tokens=tokens_per_rank, case=case, call=call,
                       err_emulated=reference.relative_error(y, ref_emu),
                       err_exact=reference.relative_error(y, ref), finite=bool(torch.isfinite(y).all()))
            if compare_portable and call == 0:
                y_port = portable.mega_moe(x, idx, tw, local, buf)
                row["err_vs_portable"] = reference.relative_error(y, y_port)
            rows.append(row)
    portable.check_errors(buf)
    buf.destroy()
    return rows


def assert_rows(rows_per_rank, fmt):
    for rank, rows in enumerate(rows_per_rank):
        for r in rows:
            where = f"rank {rank} {r}"
            assert r["finite"], f"unwritten or non-finite output: {where}"
            if r["tokens"][rank] == 0:
                continue
            assert r["err_emulated"] <= EMULATED_BOUND[fmt], where
            assert r["err_exact"] <= EXACT_BOUND[fmt], where
            if "err_vs_portable" in r:
                assert r["err_vs_portable"] <= 2 * EMULATED_BOUND[fmt], where
