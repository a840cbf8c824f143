"""Measured ceilings of the GPUs a benchmark runs on (one process per GPU, all at once).

    python -m benchmarks.ceilings --gpus 2 --out ceilings.json

- copy: device-to-device copy of 1 GiB, bytes read + written per second (HBM bandwidth);
- fp8 / bf16: 8192^3 torch._scaled_mm with rowwise float32 scales (tensorwise if rowwise is
  refused) and torch.mm in BF16, FLOP/s;
- nvlink read / write: every rank at once copies 1 GiB from / to the next rank's symmetric-memory
  buffer through its peer mapping, bytes per second per GPU.
Each figure is the median of timed repetitions after warm-up; the merged result keeps each
rank's figures and, as the ceiling, the best rank (a ceiling is the most the hardware gave).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

GIB = 1 << 30


def _median_ms(fn, iters: int, warmup: int = 2, between=None) -> float:
    """Median CUDA-event time (ms) of fn; between() runs untimed before each call (a rank barrier)."""
    from benchmarks.timing import time_events
    before = None if between is None else (lambda _i: between())
    return statistics.median(time_events(fn, iters, warmup, before))


def copy_bandwidth(nbytes: int = GIB, iters: int = 10) -> float:
    """Bytes/s read + written by a device-to-device copy."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def bf16_gemm_flops(n: int = 8192, iters: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: torch.mm(a, b), iters)
    return 2 * n ** 3 / (ms * 1e-3)


def fp8_gemm_flops(n: int = 8192, iters: int = 10) -> tuple[float, str]:
    """FP8 e4m3 _scaled_mm FLOP/s and which scaling ran ("rowwise" or "tensorwise")."""
    import torch

    fp8 = torch.float8_e4m3fn
    a = (torch.randn(n, n, device="cuda") * 0.5).to(fp8)
    b = (torch.randn(n, n, device="cuda") * 0.5).to(fp8).t()  # column-major [K, N]
    attempts = [("rowwise", torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")),
                ("tensorwise", torch.ones((), device="cuda"), torch.ones((), device="cuda"))]
    last = None
    for kind, sa, sb in attempts:
        def mm():
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        try:
            mm()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - try the next scaling
            last = exc
            continue
        return 2 * n ** 3 / (_median_ms(mm, iters) * 1e-3), kind
    raise RuntimeError(f"torch._scaled_mm failed: {last}")


def nvlink_bandwidth(group, nbytes: int = GIB, iters: int = 8) -> dict:
    """Per-GPU bytes/s reading from and writing to the next rank's memory (all ranks at once)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        return {}
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    handle = symm_mem.rendezvous(buf, group)
    buf.fill_(rank)
    local = torch.empty(nbytes, dtype=torch.uint8, device=buf.device).fill_(7)
    peer = handle.get_buffer((rank + 1) % world, (nbytes,), torch.uint8, 0)
    torch.cuda.synchronize()

    def meet():
        torch.cuda.synchronize()
        dist.barrier(group)

    meet()
    read = _median_ms(lambda: local.copy_(peer), iters, between=meet)
    meet()
    write = _median_ms(lambda: peer.copy_(local), iters, between=meet)
    meet()
    del peer, local, handle, buf
    return dict(nvlink_read_bytes_per_s=nbytes / (read * 1e-3),
                nvlink_write_bytes_per_s=nbytes / (write * 1e-3))


def measure_rank(group) -> dict:
    """Every ceiling on this rank's GPU; a figure that fails is recorded as an error."""
    import torch

    out: dict = dict(device=torch.cuda.get_device_name(), errors={})
    steps = [("copy_bytes_per_s", copy_bandwidth), ("bf16_flops_per_s", bf16_gemm_flops)]
    for key, fn in steps:
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001
            out["errors"][key] = f"{type(exc).__name__}: {exc}"
        torch.cuda.empty_cache()
    try:
        out["fp8_flops_per_s"], out["fp8_scaling"] = fp8_gemm_flops()
    except Exception as exc:  # noqa: BLE001
        out["errors"]["fp8_flops_per_s"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.empty_cache()
    if group is not None:
        # A failure here is not symmetric-safe to skip on one rank only: let it raise.
        out.update(nvlink_bandwidth(group))
    torch.cuda.empty_cache()
    return out


def merge(per_rank: list[dict]) -> dict:
    """Best rank per figure (plus every rank's figures) -> the dict Ceilings.from_dict reads."""
    def best(key):
        vals = [r[key] for r in per_rank if isinstance(r, dict) and r.get(key)]
        return max(vals) if vals else None

    nv = [v for v in (best("nvlink_read_bytes_per_s"), best("nvlink_write_bytes_per_s")) if v]
    return dict(hbm_bytes_per_s=best("copy_bytes_per_s"), fp8_flops_per_s=best("fp8_flops_per_s"),
                bf16_flops_per_s=best("bf16_flops_per_s"),
                nvlink_bytes_per_s=max(nv) if nv else None,
                source=f"measured on {len(per_rank)} GPU(s)", per_rank=per_rank)


def complete(measured: dict, fallback) -> dict:
    """Fill figures that could not be measured from `fallback` (a Ceilings), noting which."""
    out = dict(measured)
    filled = []
    for key in ("hbm_bytes_per_s", "fp8_flops_per_s", "bf16_flops_per_s", "nvlink_bytes_per_s"):
        if not out.get(key):
            out[key] = getattr(fallback, key)
            filled.append(key)
    if filled:
        out["source"] = f"{out.get('source', '')}; from {fallback.source}: {', '.join(filled)}"
    return out


def _rank_main(rank, world, group):
    return measure_rank(group if world > 1 else None)


def run(gpus: int, timeout_s: float = 240.0) -> dict:
    from vllm_megamoe.launch import run_ranks

    per_rank = run_ranks(_rank_main, gpus, (), backend="nccl", timeout_s=timeout_s,
                         pg_timeout_s=120)
    return merge(per_rank)


def describe(c: dict) -> str:
    def f(key, scale, unit):
        v = c.get(key)
        return f"{v / scale:.0f} {unit}" if v else "n/a"
    return (f"ceilings ({c.get('source', '')}): copy {f('hbm_bytes_per_s', 1e9, 'GB/s')}, "
            f"FP8 {f('fp8_flops_per_s', 1e12, 'TFLOPS')}, BF16 {f('bf16_flops_per_s', 1e12, 'TFLOPS')}, "
            f"NVLink {f('nvlink_bytes_per_s', 1e9, 'GB/s')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/ceilings.json")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole measurement")
    args = ap.parse_args(argv)
    result = run(args.gpus, args.timeout)
    print(describe(result))
    for r, pr in enumerate(result["per_rank"]):
        if pr.get("errors"):
            print(f"rank {r} errors: {pr['errors']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
