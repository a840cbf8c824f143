"""Throughput and peak memory of `vllm-megamoe convert` on a generated checkpoint.

    python benchmarks/bench_convert.py [--dir /tmp/megamoe-bench] [--layers 4] [--workers 2]
        [--targets sm90:fp8-block,sm100:mxfp4,sm90:bf16] [--keep]

Generates a random BF16 Qwen3-MoE-style checkpoint (default: hidden 2048, intermediate 768,
128 experts, 4 MoE layers = 5.0 GB, 5 shards, experts of a layer spread over shards), one shard
in memory at a time. Each conversion runs in a fresh subprocess (`vllm_megamoe.cli.main(
["convert", ...])`) that reports its own peak RSS (VmHWM), so the figure is the converter's
alone, torch import included (about 0.23 GiB). Throughput is source bytes / wall seconds of the
whole command (the page cache may hold the source: it was just written).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(root: str, layers: int, experts: int, hidden: int, inter: int, shards: int) -> int:
    """Write the checkpoint shard by shard; returns its tensor bytes."""
    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (1024, hidden), "lm_head.weight": (1024, hidden),
              "model.norm.weight": (hidden,)}
    for n in range(layers):
        p = f"model.layers.{n}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                shapes[f"{p}.mlp.experts.{e}.{proj}.weight"] = shape
    names = sorted(shapes)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    per_file = -(-len(names) // shards)
    weight_map, total = {}, 0
    for k, fn in enumerate(files):
        chunk = names[k * per_file:(k + 1) * per_file]
        tensors = {n: (torch.randn(*shapes[n], generator=gen) * 0.02).to(torch.bfloat16)
                   for n in chunk}
        save_file(tensors, os.path.join(root, fn), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: fn for n in chunk})
        del tensors
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_size": hidden, "num_hidden_layers": layers, "num_experts": experts,
              "moe_intermediate_size": inter, "num_experts_per_tok": 8}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


# Runs the CLI and prints the process's own peak RSS (VmHWM counts only the memory of this
# program; getrusage's ru_maxrss would include the forking parent's pages from before exec).
CHILD = """
import sys
from vllm_megamoe.cli import main
rc = main(sys.argv[1:])
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print("PEAK_RSS_KB", hwm)
sys.exit(rc)
"""


def run_convert(src: str, dst: str, arch: str, fmt: str, workers: int) -> dict:
    cmd = [sys.executable, "-c", CHILD, "convert", src, dst, "--arch", arch,
           "--format", fmt, "--workers", str(workers), "--no-progress", "--overwrite"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"convert failed:\n{proc.stdout}\n{proc.stderr}")
    peak_kb = int(proc.stdout.split("PEAK_RSS_KB")[1].split()[0])
    return {"seconds": seconds, "peak_rss_gib": peak_kb / 2**20, "log": proc.stdout.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/megamoe-bench")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--targets", default="sm90:fp8-block,sm100:mxfp4,sm90:bf16")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args()
    src = os.path.join(args.dir, "src")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(src, "config.json")):
        generate(src, args.layers, args.experts, args.hidden, args.intermediate, args.shards)
    src_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    print(f"source: {src} {src_bytes / 1e9:.2f} GB (generated in {time.perf_counter() - t0:.0f} s); "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, workers {args.workers}")
    for target in args.targets.split(","):
        arch, fmt = target.split(":")
        dst = os.path.join(args.dir, f"out-{arch}-{fmt}")
        r = run_convert(src, dst, arch, fmt, args.workers)
        out_bytes = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
        print(f"{arch:5s} {fmt:9s} {r['seconds']:7.1f} s  {src_bytes / r['seconds'] / 1e9:5.2f} GB/s "
              f"of source  peak RSS {r['peak_rss_gib']:.2f} GiB  output {out_bytes / 1e9:.2f} GB")
        shutil.rmtree(dst)
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
