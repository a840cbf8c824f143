"""How fast FP8 wgmma patterns of the fused SM90 kernel's K loop run on their own, on every SM:
no copies, stage waits or epilogues (csrc/sm90/probe/wgmma_rate.cu).

    python -m benchmarks.wgmma_probe --out wgmma_probe.json         # one GPU, ~20 s
    python -m benchmarks.wgmma_probe --compile-only                  # no GPU: registers, spills

A config is N:WG:GROUPS:MODE[:OPTIONS]: m64nNk32 wgmmas, WG consumer warpgroups of GROUPS m64
weight-row groups each, and MODE
  0  straight accumulation (the shape's rate ceiling),
  1  a fresh partial per chunk and group, waited for and promoted (two groups lagged as in the
     fused kernel's k_loop_lagged_promotion),
  2  mode 1 plus a CTA barrier per chunk (the fused kernel's loop without copies),
  3  one group per warpgroup into two partials taken in turn, each chunk promoted while the next
     chunk's group runs,
  4  mode 3 plus a CTA barrier per chunk.
Without `:rs` the form is the fused kernel's swap-AB: weight rows on the M side, N = the token
tile, both operands from shared memory, so the token tile is re-read by every m64 group. With
`:rs` 64 tokens are the M side, loaded into registers once per chunk and warpgroup, and N =
the weight rows of each group (GROUPS nN groups per warpgroup on the same token registers; with
two, 64:2:2:2:rs is the fused kernel's CTA tile and lagged pattern with the tokens in registers).
OPTIONS, joined by '+': `rs` (above), `prod` (modes 1 / 2 with two groups: each promotion scale a
weight x token product made per chunk, as the fused kernel's; with rs 4 FMULs), `wait` (mode 2: a stage mbarrier
per chunk, completed by thread 0 after the CTA barrier: the fused kernel's TMA loop without
copies), `copy` (with `wait`: that refill is a real bulk copy of the stage's bytes from an
L2-resident global buffer, as the TMA refill). The default set holds the fused kernel's builds
(64:2:2:2, 32:2:2:2) next to their ceilings, one-group swap-AB alternatives (128:2:1:3 spills
~200 bytes: two 128-token partials and the accumulators fill the register file) and the
register-A form at the fused kernel's CTA tile (64 tokens x 256 weight rows: 128:2:1:*:rs) and at
smaller ones whose two partial sets fit the registers (64:2:1:3:rs, 96:2:1:3:rs / 4:rs).
Each row gives the modelled shared-memory operand reads per K chunk (smem_reads_per_chunk), SM
cycles per K chunk (128 K values), MACs per SM and cycle, that as a fraction of the FP8 peak, and
the shared-memory read rate it implies (an SM gives 128 B per cycle).
"""
from __future__ import annotations

import ctypes

from benchmarks.probe_io import compile_report, probe_arguments, report_rows

SOURCE, ENTRY = "sm90/probe/wgmma_rate.cu", "megamoe_wgmma_rate"
# Dense FP8 MACs per SM and clock on H100 / H200: 1979 TFLOPS / (2 x 132 SMs x 1.83 GHz).
FP8_MACS_PER_CLOCK = 4096
CONFIGS = ("64:2:2:0", "64:2:2:1", "64:2:2:2", "64:2:2:2:prod", "64:2:2:2:prod+wait", "32:2:2:0",
           "32:2:2:2", "64:1:2:2", "128:2:1:0", "128:2:1:2", "128:2:1:3", "128:2:1:4", "64:2:1:3", "256:2:1:0",
           "128:2:1:0:rs", "128:2:1:2:rs", "128:2:1:3:rs", "128:2:1:4:rs", "64:2:1:3:rs", "96:2:1:3:rs",
           "96:2:1:4:rs", "64:2:2:2:rs", "64:2:2:2:prod+wait+copy")
OPTIONS = ("rs", "prod", "wait", "copy")
COPY_SOURCES = 8  # stages' worth of bytes the copies cycle through (wgmma_rate.cu kCopySources)


def parse_config(text: str) -> dict:
    """'64:2:2:2' -> dict(n=64, warpgroups=2, groups=2, mode=2, a_regs=False, products=False,
    stage_wait=False, copy=False); a fifth field of options joined by '+' (rs, prod, wait, copy)
    sets the last four.
    Errors name the bad field."""
    parts = text.split(":")
    options = parts[4].split("+") if len(parts) == 5 else []
    if len(parts) == 5:
        parts = parts[:4]
    if len(parts) != 4 or not all(p.isdigit() for p in parts) or not set(options) <= set(OPTIONS):
        raise ValueError(f"config {text!r}: expected N:WG:GROUPS:MODE[:OPTIONS] with OPTIONS from {'+'.join(OPTIONS)}, "
                         "e.g. 64:2:2:2, 128:2:1:3:rs or 64:2:2:2:prod+wait")
    a_regs, products, stage_wait, copy = (name in options for name in OPTIONS)
    n, wg, groups, mode = map(int, parts)
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"config {text!r}: N={n} must be a multiple of 8 in [8, 256]")
    if wg not in (1, 2) or groups not in (1, 2) or mode not in (0, 1, 2, 3, 4):
        raise ValueError(f"config {text!r}: WG and GROUPS must be 1 or 2, MODE 0 to 4")
    if mode >= 3 and groups != 1:
        raise ValueError(f"config {text!r}: MODE 3 and 4 take one group per warpgroup (GROUPS=1)")
    if products and (groups != 2 or mode not in (1, 2)):
        raise ValueError(f"config {text!r}: prod takes MODE 1 or 2 with two groups (GROUPS=2)")
    if stage_wait and (groups != 2 or mode != 2):
        raise ValueError(f"config {text!r}: wait takes MODE 2 with two groups (GROUPS=2)")
    if copy and not stage_wait:
        raise ValueError(f"config {text!r}: copy refills through the stage waits: add wait (e.g. 64:2:2:2:wait+copy)")
    return dict(n=n, warpgroups=wg, groups=groups, mode=mode, a_regs=a_regs, products=products, stage_wait=stage_wait,
                copy=copy)


def stage_bytes(cfg: dict) -> int:
    """Weight rows and token rows of one stage, 128 bytes each (wgmma_rate.cu kStageBytes)."""
    if cfg["a_regs"]:
        return (cfg["n"] * cfg["groups"] * cfg["warpgroups"] + 64) * 128
    return (64 * cfg["groups"] * cfg["warpgroups"] + cfg["n"]) * 128


def smem_bytes(cfg: dict, stages: int) -> int:
    """Dynamic shared memory: the stages, 4 scale tables of max(N, 64) + 2 x WG floats
    (wgmma_rate.cu kScaleCols), a stage mbarrier each, 1 KB for the alignment."""
    return stages * stage_bytes(cfg) + 4 * (max(cfg["n"], 64) + 2 * cfg["warpgroups"]) * 4 + 8 * stages + 1024


def spec(cfg: dict, stages: int, chunks: int):
    from vllm_megamoe.kernels import jit
    return jit.KernelSpec.make(SOURCE, ENTRY, dict(PROBE_N=cfg["n"], PROBE_WG=cfg["warpgroups"],
                                                   PROBE_GROUPS=cfg["groups"], PROBE_MODE=cfg["mode"],
                                                   PROBE_STAGES=stages, PROBE_CHUNKS=chunks,
                                                   PROBE_A_REGS=int(cfg["a_regs"]), PROBE_PRODUCTS=int(cfg["products"]),
                                                   PROBE_STAGE_WAIT=int(cfg["stage_wait"]),
                                                   PROBE_COPY=int(cfg["copy"])))


def macs_per_chunk(cfg: dict) -> int:
    """MACs of one K chunk of the CTA: weight rows x token columns x 128."""
    if cfg["a_regs"]:
        return cfg["n"] * cfg["groups"] * cfg["warpgroups"] * 64 * 128
    return 64 * cfg["groups"] * cfg["warpgroups"] * cfg["n"] * 128


def smem_reads_per_chunk(cfg: dict) -> int:
    """Operand bytes one K chunk reads from shared memory (a model: each wgmma group reads its
    descriptor operands once). Swap-AB: every m64 group reads its 64 weight rows and the whole
    token tile; register-A: each warpgroup loads the 64 token rows once, each group its N weight
    rows. An SM's shared memory gives 128 bytes per cycle, which straight 64:2:2:0 reaches."""
    groups = cfg["groups"] * cfg["warpgroups"]
    if cfg["a_regs"]:
        return cfg["warpgroups"] * 64 * 128 + groups * cfg["n"] * 128
    return groups * (64 + cfg["n"]) * 128


def run(cfg: dict, stages: int, chunks: int, tasks: int) -> dict:
    import torch

    from vllm_megamoe.kernels import jit

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel = jit.get_kernel(spec(cfg, stages, chunks), dev)
    threads = 128 * cfg["warpgroups"]
    cycles = torch.zeros(sms * cfg["warpgroups"], dtype=torch.int64, device="cuda")
    sink = torch.empty(sms * threads, dtype=torch.float32, device="cuda")
    # the copies' source: finite e4m3 bytes (top exponent bit clear), L2-resident (a few stages)
    copy_src = torch.randint(0, 256, (COPY_SOURCES * stage_bytes(cfg),), dtype=torch.uint8, device="cuda") & 0xBF

    def args(n_tasks: int) -> list:
        return [ctypes.c_void_p(cycles.data_ptr()), ctypes.c_void_p(sink.data_ptr()), ctypes.c_int32(n_tasks),
                ctypes.c_void_p(copy_src.data_ptr())]

    stream = torch.cuda.current_stream().cuda_stream
    kernel.launch(sms, threads, smem_bytes(cfg, stages), stream, args(max(1, tasks // 10)))  # warm-up
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    kernel.launch(sms, threads, smem_bytes(cfg, stages), stream, args(tasks))
    stop.record()
    torch.cuda.synchronize()
    per_chunk = cycles.double().median().item() / (tasks * chunks)
    ms = start.elapsed_time(stop)
    macs = macs_per_chunk(cfg)
    return dict(cycles_per_chunk=per_chunk, macs_per_clock=macs / per_chunk,
                smem_bytes_per_clock=smem_reads_per_chunk(cfg) / per_chunk,
                fraction_of_peak=macs / per_chunk / FP8_MACS_PER_CLOCK,
                tflops=2 * macs * chunks * tasks * sms / (ms * 1e-3) / 1e12, sms=sms, ms=ms,
                sink_finite=bool(torch.isfinite(sink).all()))


def table(rows: list[dict]) -> str:
    head = (f"{'config':>23} {'regs':>5} {'spill':>6} {'serial':>6} {'smem KB':>7} {'cycles/chunk':>13} {'MAC/clk':>8} "
            f"{'of peak':>8} {'TFLOPS':>7} {'smem B/clk':>10}")
    out = [head]
    for r in rows:
        timed = "cycles_per_chunk" in r
        out.append(f"{r['config']:>23} {r['registers'] or '-':>5} {r['spill_bytes'] if r['spill_bytes'] is not None else '-':>6} "
                   f"{'yes' if r['serialized'] else 'no':>6} {smem_reads_per_chunk(r) / 1024:>7.0f} "
                   + (f"{r['cycles_per_chunk']:>13.0f} {r['macs_per_clock']:>8.0f} {r['fraction_of_peak']:>8.2f} "
                      f"{r['tflops']:>7.0f} {r['smem_bytes_per_clock']:>10.0f}" if timed
                      else f"{'-':>13} {'-':>8} {'-':>8} {'-':>7} {'-':>10}"))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = probe_arguments(__doc__, CONFIGS, "N:WG:GROUPS:MODE", tasks=400)
    args = ap.parse_args(argv)
    from vllm_megamoe.kernels import jit

    def rows():
        for text in args.configs:
            cfg = parse_config(text)
            if smem_bytes(cfg, args.stages) > 227 * 1024:
                raise SystemExit(f"config {text}: {args.stages} stages need {smem_bytes(cfg, args.stages)} bytes of "
                                 "shared memory (an SM90 CTA has 232448); use fewer --stages")
            row = dict(config=text, **cfg, stages=args.stages, chunks=args.chunks, tasks=args.tasks,
                       **compile_report(jit.compile_kernel(spec(cfg, args.stages, args.chunks)).log))
            if not args.compile_only:
                row.update(run(cfg, args.stages, args.chunks, args.tasks))
            yield row
    return report_rows(rows(), table, args.out, args.compile_only)


if __name__ == "__main__":
    raise SystemExit(main())
