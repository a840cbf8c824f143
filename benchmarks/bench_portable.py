"""Portable megamoe path vs the unfused NCCL chain, on N GPUs of one host (one process each).

    python -m benchmarks.bench_portable --gpus 2 --out results/portable_ep2.json

For each shape, format and tokens-per-rank it times (CUDA events, median after warm-up, three
rotating input sets): the unfused chain (eager: it synchronises on the host), the portable path
eager, and the portable path replayed from a CUDA graph. Rank 0 prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess

import torch
import torch.distributed as dist

from vllm_megamoe import SymmBuffer, portable, reference
from vllm_megamoe.launch import run_ranks

from benchmarks.chain import UnfusedChain
from benchmarks.common import STANDARD_SHAPES, local_weights, median_us, routing, time_calls

ROTATE = 3


def _case(rank, world, group, shape, fmt, tokens, iters, weights, chain, buf):
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(77 + rank)
    sets = []
    for _ in range(ROTATE):
        x = torch.randn(tokens, shape.hidden, device=dev, generator=gen).to(torch.bfloat16)
        idx, w = routing(shape, tokens, dev, gen)
        sets.append((x, idx, w))
    static = [t.clone() for t in sets[0]]

    def load(i):
        for dst, src in zip(static, sets[i % ROTATE]):
            dst.copy_(src)
        torch.cuda.synchronize()
        dist.barrier(group)

    # Correctness cross-check of the two paths before timing them.
    y_chain = chain(*sets[0])
    y_port = portable.mega_moe(*sets[0], weights, buf)
    agree = reference.relative_error(y_port.float(), y_chain.float())

    chain_ms = time_calls(lambda: chain(*static), iters, load)
    eager_ms = time_calls(lambda: portable.mega_moe(*static, weights, buf), iters, load)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        portable.mega_moe(*static, weights, buf, mode="padded")
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        portable.mega_moe(*static, weights, buf)
    graph_ms = time_calls(graph.replay, iters, load)
    del graph
    portable.check_errors(buf)
    return dict(chain_us=median_us(chain_ms), portable_eager_us=median_us(eager_ms),
                portable_graph_us=median_us(graph_ms), portable_vs_chain_rel_err=agree)


def _rank_main(rank, world, group, shapes, fmts, tokens_list, iters):
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in shapes:
        shape = STANDARD_SHAPES[name]
        for fmt in fmts:
            weights = local_weights(shape, world, rank, fmt, dev)
            w13, w2 = weights.dequantize()
            chain = UnfusedChain(w13, w2, fmt, group)
            del w13, w2
            buf = SymmBuffer(shape, max(tokens_list), group, format=fmt, device=dev)
            for tokens in tokens_list:
                res = _case(rank, world, group, shape, fmt, tokens, iters, weights, chain, buf)
                res.update(shape=name, format=fmt, tokens_per_rank=tokens, chain_gemm=chain.gemm_kind)
                rows.append(res)
            buf.destroy()
            del weights, chain, buf
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    ap.add_argument("--formats", nargs="+", default=["fp8-block", "bf16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8, 128, 4096])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/portable.json")
    args = ap.parse_args(argv)
    per_rank = run_ranks(_rank_main, args.gpus, (args.shapes, args.formats, args.tokens, args.iters),
                         backend="nccl", timeout_s=3000, pg_timeout_s=600)
    # A call ends when the slowest rank ends: report the max over ranks.
    rows = []
    for i, row in enumerate(per_rank[0]):
        merged = dict(row)
        for key in ("chain_us", "portable_eager_us", "portable_graph_us", "portable_vs_chain_rel_err"):
            merged[key] = max(r[i][key] for r in per_rank)
        merged["graph_speedup_vs_chain"] = merged["chain_us"] / merged["portable_graph_us"]
        rows.append(merged)
    print(f"{'shape':<14} {'fmt':<9} {'tok':>5} {'chain us':>9} {'eager us':>9} {'graph us':>9} "
          f"{'x chain':>7} {'rel err':>8}")
    for r in rows:
        print(f"{r['shape']:<14} {r['format']:<9} {r['tokens_per_rank']:>5} {r['chain_us']:>9.0f} "
              f"{r['portable_eager_us']:>9.0f} {r['portable_graph_us']:>9.0f} "
              f"{r['graph_speedup_vs_chain']:>7.2f} {r['portable_vs_chain_rel_err']:>8.1e}")
    env = dict(gpu=torch.cuda.get_device_name(0), gpus=args.gpus, torch=torch.__version__,
               cuda=torch.version.cuda, python=platform.python_version(),
               commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or os.environ.get("MEGAMOE_COMMIT", ""))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, args=vars(args), rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
