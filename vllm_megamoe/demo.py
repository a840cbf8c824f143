"""The layer demo behind `vllm-megamoe demo --layer-only`: a random MoE layer on N CPU ranks vs the
reference (no vLLM; `vllm-megamoe demo` without it runs the vLLM demo, vllm_megamoe.plugin.demo).

Builds a small random layer (hidden 512, intermediate 256, 16 experts, top-4), converts the
weights to the requested format, runs the portable expert-parallel path on `ranks` processes
(CPU shared-memory buffer) and prints each rank's relative error against the float reference.
"""
from __future__ import annotations

import time

import torch

from . import reference
from .launch import run_ranks
from .ops import mega_moe
from .buffer import SymmBuffer
from .shape import MoEShape
from .weights import ExpertWeights

DEMO_SHAPE = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4)
# Bounds the demo asserts (FP8 activations and weights vs the float reference, emulated rounding).
BOUNDS = {"fp8-block": 0.08, "bf16": 0.02}


def make_problem(shape: MoEShape, tokens_per_rank: list[int], fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, i, e, k = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    weights = ExpertWeights.from_float(w13, w2, fmt)
    xs, idxs, tws = [], [], []
    for t in tokens_per_rank:
        xs.append(torch.randn(t, h, generator=g).to(torch.bfloat16))
        idxs.append(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t
                    else torch.zeros(0, k, dtype=torch.long))
        tws.append(torch.rand(t, k, generator=g))
    return weights, xs, idxs, tws


def _rank_main(rank, world, group, shape, fmt, tokens):
    weights, xs, idxs, tws = make_problem(shape, [tokens] * world, fmt)
    el = shape.experts_per_rank(world)
    buf = SymmBuffer(shape, tokens, group, format=fmt)
    start = time.perf_counter()
    y = mega_moe(xs[rank], idxs[rank], tws[rank], weights.experts(rank * el, el), buf)
    elapsed = time.perf_counter() - start
    w13, w2 = weights.dequantize()
    ref = reference.moe_forward(xs[rank], idxs[rank], tws[rank], w13, w2)
    buf.destroy()
    return reference.relative_error(y, ref), elapsed


def run(ranks: int = 2, tokens: int = 100, fmt: str = "fp8-block") -> int:
    print(f"megamoe demo: layer {DEMO_SHAPE}, format {fmt}, {ranks} CPU ranks x {tokens} tokens")
    results = run_ranks(_rank_main, ranks, (DEMO_SHAPE, fmt, tokens))
    ok = True
    for r, (err, secs) in enumerate(results):
        good = err <= BOUNDS[fmt]
        ok &= good
        print(f"  rank {r}: relative error vs float reference {err:.2e} (bound {BOUNDS[fmt]}) "
              f"{'OK' if good else 'FAIL'}  [{secs * 1e3:.0f} ms]")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
