"""First timing table of the fused SM90 kernel (issue 6): kernel vs portable path vs unfused chain.

    python3 -m benchmarks.first_kernel_timing --gpus 2 --out results/first_kernel_ep2.json
Graph-replayed kernel and portable path, eager chain; CUDA events, median; max over ranks.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from vllm_megamoe import SymmBuffer, portable, reference
from vllm_megamoe.kernels import sm90_mega_moe
from vllm_megamoe.launch import run_ranks

from benchmarks.chain import UnfusedChain
from benchmarks.common import STANDARD_SHAPES, local_weights, median_us, rotating_inputs
from benchmarks.timing import capture_graph, time_events


def _rank_main(rank, world, group, shapes, fmt, tokens_list, iters):
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in shapes:
        shape = STANDARD_SHAPES[name]
        weights = local_weights(shape, world, rank, fmt, dev)
        chain = UnfusedChain.from_weights(weights, fmt, group)
        buf = SymmBuffer(shape, max(tokens_list), group, format=fmt, device=dev)
        for tokens in tokens_list:
            sets, static, load = rotating_inputs(shape, tokens, dev, rank + tokens, group)
            y = torch.empty(tokens, shape.hidden, dtype=torch.bfloat16, device=dev)

            y_kernel = sm90_mega_moe.mega_moe(*sets[0], weights, buf).clone()
            y_port = portable.mega_moe(*sets[0], weights, buf)
            agree = reference.relative_error(y_kernel, y_port)
            chain_ms = time_events(lambda: chain(*static), iters, 1, load)
            g_port = capture_graph(lambda: portable.mega_moe(*static, weights, buf, mode="padded"))
            port_ms = time_events(g_port.replay, iters, 1, load)
            del g_port
            g_kern = capture_graph(lambda: sm90_mega_moe.mega_moe(*static, weights, buf, y=y))
            kern_ms = time_events(g_kern.replay, iters, 1, load)
            del g_kern
            rows.append(dict(shape=name, format=fmt, tokens_per_rank=tokens, chain_us=median_us(chain_ms),
                             portable_graph_us=median_us(port_ms), kernel_graph_us=median_us(kern_ms),
                             kernel_vs_portable_rel_err=agree))
        buf.destroy()
        del weights, chain, buf
        torch.cuda.empty_cache()
    return rows


def markdown_table(path: str) -> str:
    """The recorded run as a markdown table (what docs/kernel_design.md shows)."""
    with open(path) as f:
        data = json.load(f)
    env = data["env"]
    lines = [f"Source: `{os.path.relpath(path)}` ({env['gpus']} x {env['gpu']}, torch {env['torch']}); "
             "graph-replayed kernel and portable path, eager chain; median us, max over ranks.", "",
             "| shape | format | tokens/rank | chain us | portable us | kernel us | kernel x chain | kernel x portable | kernel vs portable rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        lines.append(f"| {r['shape']} | {r['format']} | {r['tokens_per_rank']} | {r['chain_us']:.0f} | "
                     f"{r['portable_graph_us']:.0f} | {r['kernel_graph_us']:.0f} | "
                     f"{r['chain_us'] / r['kernel_graph_us']:.2f} | {r['portable_graph_us'] / r['kernel_graph_us']:.2f} | "
                     f"{r['kernel_vs_portable_rel_err']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", metavar="JSON", help="print a recorded run as a markdown table and exit")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    ap.add_argument("--format", default="fp8-block")
    ap.add_argument("--tokens", nargs="+", type=int, default=[8, 128, 4096])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/first_kernel.json")
    args = ap.parse_args(argv)
    if args.report:
        print(markdown_table(args.report))
        return
    per_rank = run_ranks(_rank_main, args.gpus, (args.shapes, args.format, args.tokens, args.iters),
                         backend="nccl", timeout_s=1500, pg_timeout_s=600)
    rows = []
    for i, row in enumerate(per_rank[0]):
        merged = dict(row)
        for key in ("chain_us", "portable_graph_us", "kernel_graph_us", "kernel_vs_portable_rel_err"):
            merged[key] = max(r[i][key] for r in per_rank)
        rows.append(merged)
    print(f"{'shape':<14} {'fmt':<9} {'tok':>5} {'chain us':>9} {'portable':>9} {'kernel':>9} {'x chain':>7} {'x port':>7} {'err':>8}")
    for r in rows:
        print(f"{r['shape']:<14} {r['format']:<9} {r['tokens_per_rank']:>5} {r['chain_us']:>9.0f} "
              f"{r['portable_graph_us']:>9.0f} {r['kernel_graph_us']:>9.0f} {r['chain_us'] / r['kernel_graph_us']:>7.2f} "
              f"{r['portable_graph_us'] / r['kernel_graph_us']:>7.2f} {r['kernel_vs_portable_rel_err']:>8.1e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=dict(gpu=torch.cuda.get_device_name(0), gpus=args.gpus, torch=torch.__version__,
                                commit=os.environ.get("MEGAMOE_COMMIT", "")), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
