"""Shared pieces of the benchmarks: standard shapes, problem generation on the GPU, timing."""
from __future__ import annotations

import statistics

import torch

from vllm_megamoe import ExpertWeights, MoEShape, quant

STANDARD_SHAPES = {
    "v4-flash": MoEShape(hidden=4096, intermediate=2048, num_experts=256, topk=6),
    "deepseek-v3": MoEShape(hidden=7168, intermediate=2048, num_experts=256, topk=8),
    "qwen3-30b-a3b": MoEShape(hidden=2048, intermediate=768, num_experts=128, topk=8),
}


def local_weights(shape: MoEShape, num_ranks: int, rank: int, fmt: str, device) -> ExpertWeights:
    """Random weights of this rank's experts, built expert by expert on the GPU (bounded memory)."""
    el, h, i = shape.experts_per_rank(num_ranks), shape.hidden, shape.intermediate
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    dt = torch.bfloat16
    if fmt == "bf16":
        w13 = torch.empty(el, 2 * i, h, dtype=dt, device=device)
        w2 = torch.empty(el, h, i, dtype=dt, device=device)
        for e in range(el):
            w13[e] = torch.randn(2 * i, h, generator=gen, device=device, dtype=dt) / h ** 0.5
            w2[e] = torch.randn(h, i, generator=gen, device=device, dtype=dt) / i ** 0.5
        return ExpertWeights("bf16", w13, w2)
    w13 = torch.empty(el, 2 * i, h, dtype=quant.FP8_DTYPE, device=device)
    w2 = torch.empty(el, h, i, dtype=quant.FP8_DTYPE, device=device)
    s13 = torch.empty(el, 2 * i // 128, h // 128, dtype=torch.float32, device=device)
    s2 = torch.empty(el, h // 128, i // 128, dtype=torch.float32, device=device)
    for e in range(el):
        w13[e], s13[e] = quant.quantize_fp8_blocks(
            torch.randn(2 * i, h, generator=gen, device=device, dtype=dt) / h ** 0.5)
        w2[e], s2[e] = quant.quantize_fp8_blocks(
            torch.randn(h, i, generator=gen, device=device, dtype=dt) / i ** 0.5)
    return ExpertWeights("fp8-block", w13, w2, s13, s2)


ROUTINGS = {"uniform": 0.0, "skewed": 1.0}  # name -> Zipf exponent of expert popularity
POPULARITY_SEED = 2024  # same expert order on every rank and every run


def expert_probs(num_experts: int, skew: float, device) -> torch.Tensor:
    """Draw weights of the experts: uniform for skew 0, else Zipf-like 1/(j+1)^skew where j is
    the expert's place in a fixed random order (so hot experts spread over the ranks)."""
    if skew <= 0:
        return torch.ones(num_experts, device=device)
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(POPULARITY_SEED))
    place = torch.empty(num_experts, dtype=torch.float32)
    place[order] = torch.arange(num_experts, dtype=torch.float32)
    return (1.0 / (place + 1.0) ** skew).to(device)


def routing(shape: MoEShape, tokens: int, device, gen: torch.Generator, skew: float = 0.0):
    """Top-k ids [T, K] int64 without repeats and weights [T, K] float32 summing to 1 per token;
    skew > 0 draws experts Zipf-like (see expert_probs)."""
    probs = expert_probs(shape.num_experts, skew, device)
    probs = probs.expand(tokens, -1) if tokens else probs[None][:0]
    idx = torch.multinomial(probs, shape.topk, replacement=False, generator=gen)
    w = torch.rand(tokens, shape.topk, device=device, generator=gen)
    return idx, w / w.sum(-1, keepdim=True)


def rotating_inputs(shape: MoEShape, tokens: int, device, seed: int, group=None, count: int = 3):
    """`count` input sets (x bf16, top-k ids, weights), the static tensors a CUDA graph captures
    (a copy of the first set) and load(i), which copies set i % count into them, synchronises
    and meets the other ranks: every timed call sees new data and starts with its peers."""
    import torch.distributed as dist
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(count):
        x = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(torch.bfloat16)
        sets.append((x, *routing(shape, tokens, device, gen)))
    static = [t.clone() for t in sets[0]]

    def load(i: int) -> None:
        for dst, src in zip(static, sets[i % count]):
            dst.copy_(src)
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group)
    return sets, static, load


def median_us(times_ms: list[float]) -> float:
    return statistics.median(times_ms) * 1e3
