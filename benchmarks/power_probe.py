"""Does an FP8 GEMM run faster when part of its token rows are zeros? The SM clock under the
power cap, sustained.

    python -m benchmarks.power_probe --out power_probe.json          # one GPU, ~30 s

Why (docs/kernel_design.md): at 8192 tokens per rank the fused kernel's SM clock falls from
~1.78 GHz (math alone, or copies alone) to ~1.5 GHz (both: the weights streaming from HBM beside
the tensor work), and the cycles per task stay the same, so the time is what the power cap allows.
A 128-token tile of an expert with 192 rows computes 64 padding rows in its second block, rows
that hold the next expert's tokens. If zero operands draw less power, zeroing those rows in the
token fragment (they are dropped by the epilogue anyway) gives the clock back.

For each fraction of A's rows (the M side: tokens) set to zero, an M x N x K torch._scaled_mm runs
back to back for --seconds after --warmup seconds; the table gives its TFLOPS over the timed
window and the SM clock and board power nvidia-smi sampled meanwhile (none without nvidia-smi).
The first row also gives the TFLOPS of 10 calls right after an idle second, as
benchmarks/ceilings.py times its ceiling (before the clock settles).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time


def sample_clocks(device_index: int):
    """A running nvidia-smi sampling SM clock (MHz) and power (W) every 100 ms, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "-i", str(device_index), "--query-gpu=clocks.sm,power.draw",
                             "--format=csv,noheader,nounits", "-lms", "100"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def stop_samples(proc) -> tuple[float | None, float | None]:
    if proc is None:
        return None, None
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    mhz, watts = [], []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz.append(float(parts[0]))
            watts.append(float(parts[1]))
        except (ValueError, IndexError):
            continue
    return (statistics.median(mhz) if mhz else None), (statistics.median(watts) if watts else None)


def operands(m: int, n: int, k: int, zero_fraction: float, seed: int = 0):
    """FP8 A [m, k] with its last round(zero_fraction * m) rows zero, B [k, n] column-major,
    unit rowwise scales. Random values elsewhere (never all zeros unless asked)."""
    import torch
    if not 0.0 <= zero_fraction <= 1.0:
        raise ValueError(f"zero fraction {zero_fraction}: expected 0..1")
    g = torch.Generator(device="cuda").manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    a = (torch.randn(m, k, device="cuda", generator=g) * 0.5).to(fp8)
    zero_rows = round(zero_fraction * m)
    if zero_rows:
        a[m - zero_rows:] = 0
    b = (torch.randn(n, k, device="cuda", generator=g) * 0.5).to(fp8).t()
    return a, b, torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")


def measure(m: int, n: int, k: int, zero_fraction: float, seconds: float, warmup: float, cold_calls: int = 0) -> dict:
    import torch
    a, b, sa, sb = operands(m, n, k, zero_fraction)
    gemm = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
    flops = 2.0 * m * n * k
    row = dict(m=m, n=n, k=k, zero_fraction=zero_fraction)
    gemm()
    torch.cuda.synchronize()
    if cold_calls:  # as a short ceiling measurement sees it: after an idle second
        time.sleep(1.0)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(cold_calls):
            gemm()
        stop.record()
        torch.cuda.synchronize()
        row["cold_tflops"] = flops * cold_calls / (start.elapsed_time(stop) * 1e-3) / 1e12
    t_end = time.time() + warmup
    while time.time() < t_end:
        for _ in range(20):
            gemm()
        torch.cuda.synchronize()
    proc = sample_clocks(torch.cuda.current_device())
    calls, t0 = 0, time.time()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            gemm()
        calls += 20
        torch.cuda.synchronize()
    stop.record()
    torch.cuda.synchronize()
    row["tflops"] = flops * calls / (start.elapsed_time(stop) * 1e-3) / 1e12
    row["sm_mhz"], row["power_w"] = stop_samples(proc)
    return row


def table(rows: list[dict]) -> str:
    out = [f"{'M x N x K':>20} {'zero rows':>9} {'TFLOPS':>8} {'vs 0':>6} {'SM MHz':>7} {'power W':>8} {'cold TFLOPS':>11}"]
    base = rows[0]["tflops"] if rows else None
    for r in rows:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        out.append(f"{str(r['m']) + 'x' + str(r['n']) + 'x' + str(r['k']):>20} {r['zero_fraction']:>9.2f} {r['tflops']:>8.0f} "
                   f"{r['tflops'] / base:>6.3f} {fmt(r['sm_mhz'], '.0f'):>7} {fmt(r['power_w'], '.0f'):>8} "
                   f"{fmt(r.get('cold_tflops'), '.0f'):>11}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 8192, 8192], metavar=("M", "N", "K"))
    ap.add_argument("--zero-fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    ap.add_argument("--seconds", type=float, default=3.0, help="timed window per fraction")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of the same GEMM before the window")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if any(not 0.0 <= f <= 1.0 for f in args.zero_fractions):
        ap.error(f"--zero-fractions {args.zero_fractions}: each in 0..1")
    if any(d <= 0 or d % 16 for d in args.shape):
        ap.error(f"--shape {args.shape}: positive multiples of 16 (FP8 _scaled_mm)")
    import torch
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    m, n, k = args.shape
    rows = []
    for i, f in enumerate(args.zero_fractions):
        rows.append(measure(m, n, k, f, args.seconds, args.warmup, cold_calls=10 if i == 0 else 0))
        print(table(rows).splitlines()[-1], flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
