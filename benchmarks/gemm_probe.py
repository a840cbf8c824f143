"""Throughput of the standalone warp-specialized SM90 grouped GEMM on one MoE layer's expert GEMMs,
next to the FP8 / BF16 GEMM ceiling measured in the same process.

    python -m benchmarks.gemm_probe --shape v4-flash --tokens 8192 --out gemm_probe.json

It answers "what does a dedicated producer warpgroup with per-stage empty barriers, and which
token tile, give on these GEMMs" for the fused kernel's L1 (N = 2 x intermediate, K = hidden) and
L2 (N = hidden, K = intermediate) phases, without dispatch or combine. Rows per expert follow a
top-k routing of `tokens` x EP ranks random tokens (one rank's share of the experts), so the
tiles see the fused kernel's per-expert row counts.
"""
from __future__ import annotations

import argparse
import json

from benchmarks.kernel_probe import probe_shape

CONFIGS = ("64x2", "128x2", "192x2", "64x1", "128x1")  # block_tokens x consumer warpgroups


def expert_rows(tokens: int, ranks: int, experts: int, topk: int, seed: int = 0):
    """Rows per local expert of rank 0 when every rank routes `tokens` tokens top-k at random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens * ranks, experts, generator=g)
    picked = scores.topk(topk, dim=1).indices.flatten()
    counts = torch.bincount(picked, minlength=experts)
    return counts[: experts // ranks]


def time_us(fn, iters: int = 10) -> float:
    from benchmarks.common import median_us
    from benchmarks.timing import time_events

    return median_us(time_events(fn, iters, warmup=3))


def probe(shape_name: str, tokens: int, ranks: int, fmt: str, configs, iters: int) -> list[dict]:
    import torch

    from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_bf16, grouped_gemm_fp8_block

    shape = probe_shape(shape_name)
    counts = expert_rows(tokens, ranks, shape.num_experts, shape.topk)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    offsets = offsets.cuda()
    m, e = int(counts.sum()), len(counts)
    rows = []
    for phase, n, k in (("L1", 2 * shape.intermediate, shape.hidden), ("L2", shape.hidden, shape.intermediate)):
        flops = 2.0 * m * n * k
        if fmt == "fp8-block":
            fp8 = torch.float8_e4m3fn
            x = (torch.randn(m, k, device="cuda") * 0.5).to(fp8)
            xs = torch.rand(m, k // 128, device="cuda") + 0.5
            w = (torch.randn(e, n, k, device="cuda") * 0.5).to(fp8)
            ws = torch.rand(e, n // 128, k // 128, device="cuda") + 0.5
            ceiling_b = w[0].t()  # one expert's weights: the same M x N x K as a dense GEMM
            ones_a, ones_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
            ceiling = lambda: torch._scaled_mm(x, ceiling_b, ones_a, ones_b, out_dtype=torch.bfloat16)  # noqa: E731
        else:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
            ceiling_b = w[0].t()
            ceiling = lambda: torch.mm(x, ceiling_b)  # noqa: E731
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        try:
            ceiling_us = time_us(ceiling, iters)
        except RuntimeError as exc:  # a torch without FP8 _scaled_mm
            print(f"ceiling GEMM failed: {exc}")
            ceiling_us = float("nan")
        row = {"shape": shape_name, "format": fmt, "tokens_per_rank": tokens, "phase": phase, "m": m, "n": n, "k": k,
               "experts": e, "ceiling_us": ceiling_us, "ceiling_tflops": flops / ceiling_us / 1e6}
        for config in configs:
            block_tokens, wgs = (int(v) for v in config.split("x"))
            kwargs = {"block_n_tokens": block_tokens, "num_consumer_wg": wgs}
            if fmt == "fp8-block":
                call = lambda: grouped_gemm_fp8_block(x, xs, w, ws, offsets, out, **kwargs)  # noqa: E731
            else:
                call = lambda: grouped_gemm_bf16(x, w, offsets, out, **kwargs)  # noqa: E731
            try:
                us = time_us(call, iters)
                row[config] = {"us": us, "tflops": flops / us / 1e6, "of_ceiling": ceiling_us / us}
            except (ValueError, RuntimeError) as exc:
                row[config] = {"error": str(exc).splitlines()[0]}
        rows.append(row)
        del x, w, out
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], configs) -> None:
    head = f"{'shape':>14} {'fmt':>9} {'tok':>5} {'ph':>3} {'ceiling TF':>10} " + " ".join(f"{c:>13}" for c in configs)
    print(head)
    for r in rows:
        cells = []
        for c in configs:
            v = r.get(c, {})
            cells.append(f"{v['us']:7.0f}us {v['tflops']:4.0f}" if "us" in v else f"{'err':>13}")
        print(f"{r['shape'][:14]:>14} {r['format']:>9} {r['tokens_per_rank']:5d} {r['phase']:>3} "
              f"{r['ceiling_tflops']:10.0f} " + " ".join(f"{c:>13}" for c in cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["v4-flash"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192])
    ap.add_argument("--ranks", type=int, default=2, help="EP ranks the routing is spread over")
    ap.add_argument("--formats", nargs="+", default=["fp8-block"], choices=["fp8-block", "bf16"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), help="BLOCKTOKENSxCONSUMERWG")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            for tokens in args.tokens:
                rows += probe(shape, tokens, args.ranks, fmt, args.configs, args.iters)
    print_table(rows, args.configs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
