"""How fast an SM's stages fill with the fused SM90 kernel's operand boxes (TMA, no math), alone or in
2-CTA clusters that multicast one operand to both CTAs (csrc/sm90/probe/stream_rate.cu).

    python -m benchmarks.stream_probe --out stream_probe.json       # one GPU, ~30 s
    python -m benchmarks.stream_probe --compile-only                 # no GPU: the builds compile

The question (docs/kernel_design.md): without any wgmma the FP8 prefill L1 tasks still take
0.73-0.83 of their time, so the operand stream bounds the K loop. If the bound is what the L2 cache
hands out, a weight box shared by a cluster's two CTAs (each loading half, multicast) cuts the time
per chunk; if it is what an SM takes in, the chunk takes as long as before.

A config is TOKENS:CLUSTER:SHARE: a chunk of 256 weight rows and TOKENS token rows of 128 bytes,
CLUSTER CTAs per cluster (1 or 2), SHARE 0 (each CTA loads its own boxes), 1 (the pair shares
the weight box: each CTA loads 128 rows multicast) or 2 (the pair shares the token box). Tasks go out
as the fused kernel's queue hands them (`--blocks` consecutive tasks per weight tile; SHARE 2 pairs
tasks over two tiles of one token block). The weights span `--tiles` tiles (HBM-sized by default),
the tokens `--blocks` blocks (L2-resident). Each row gives SM cycles per chunk (the median CTA),
the bytes that land in an SM's stages per cycle and those it fetched itself from L2 per cycle, the
GPU's fetch rate (when every CTA ran at once: a cluster launch can leave SMs idle), and whether
they did. With few token blocks many CTAs read the same token box at once (the fused kernel's
queue does the same); the consumers read nothing, so the stage writes meet no wgmma reads.

`--layout tiled` stores each weight box whole ([tile][chunk][256 rows][128 bytes], 32 KB in a row)
instead of in rows of K (256 pieces of 128 bytes a row pitch apart), and `--ctas` runs fewer CTAs
than SMs: at a decode call's task count (`--ctas 96 --tasks 1 --blocks 1`), does HBM serve a box
faster when it is contiguous?

    python -m benchmarks.stream_probe --configs 32:1:0 --ctas 96 --blocks 1 --tasks 1 --cold --layout rows tiled
"""
from __future__ import annotations

import ctypes

from benchmarks.probe_io import compile_report, probe_arguments, report_rows

SOURCE, ENTRY = "sm90/probe/stream_rate.cu", "megamoe_stream_rate"
CONFIGS = ("128:1:0", "128:2:0", "128:2:1", "128:2:2", "64:1:0", "64:2:1")
WEIGHT_ROWS, ROW_BYTES = 256, 128
L2_FLUSH_BYTES = 256 << 20  # written between warm-up and timed launch with --cold (H200's L2: 50 MB)


def parse_config(text: str) -> dict:
    """'128:2:1' -> dict(tokens=128, cluster=2, share=1). Errors name the bad field."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"config {text!r}: expected TOKENS:CLUSTER:SHARE, e.g. 128:2:1")
    tokens, cluster, share = map(int, parts)
    if tokens not in (32, 64, 128):
        raise ValueError(f"config {text!r}: TOKENS={tokens} must be 32, 64 or 128 (the fused kernel's token tiles)")
    if cluster not in (1, 2):
        raise ValueError(f"config {text!r}: CLUSTER={cluster} must be 1 or 2")
    if share not in (0, 1, 2) or (share and cluster != 2):
        raise ValueError(f"config {text!r}: SHARE={share} must be 0, or 1 / 2 with CLUSTER=2")
    return dict(tokens=tokens, cluster=cluster, share=share)


def stage_bytes(cfg: dict) -> int:
    """One chunk's boxes as they land in a CTA's stage (stream_rate.cu kStageBytes)."""
    return (WEIGHT_ROWS + cfg["tokens"]) * ROW_BYTES


def fetched_bytes(cfg: dict) -> int:
    """What one CTA loads from global memory per chunk: a shared box counts half."""
    weight, tokens = WEIGHT_ROWS * ROW_BYTES, cfg["tokens"] * ROW_BYTES
    return weight // (2 if cfg["share"] == 1 else 1) + tokens // (2 if cfg["share"] == 2 else 1)


def smem_bytes(cfg: dict, stages: int) -> int:
    """Dynamic shared memory: the stages and 1 KB to align them for the 128-byte swizzle."""
    return stages * stage_bytes(cfg) + 1024


def check_sizes(cfg: dict, stages: int, tiles: int, blocks: int, ctas: int) -> None:
    if smem_bytes(cfg, stages) > 227 * 1024:
        raise ValueError(f"{stages} stages of {stage_bytes(cfg)} bytes need {smem_bytes(cfg, stages)} bytes of shared "
                         "memory (an SM90 CTA has 232448); use fewer --stages")
    if cfg["share"] == 1 and blocks % 2:
        raise ValueError(f"SHARE=1 pairs tasks on one weight tile: --blocks must be even, got {blocks}")
    if cfg["share"] == 2 and tiles % 2:
        raise ValueError(f"SHARE=2 pairs tasks over two weight tiles: --tiles must be even, got {tiles}")
    if ctas % cfg["cluster"]:
        raise ValueError(f"--ctas={ctas} is not a multiple of the cluster size {cfg['cluster']}")


def spec(cfg: dict, stages: int, chunks: int, checksum: bool = False, spin: int = 0, tiled: bool = False):
    from vllm_megamoe.kernels import jit
    return jit.KernelSpec.make(SOURCE, ENTRY, dict(PROBE_TOKENS=cfg["tokens"], PROBE_STAGES=stages, PROBE_CHUNKS=chunks,
                                                   PROBE_CLUSTER=cfg["cluster"], PROBE_SHARE=cfg["share"],
                                                   PROBE_CHECKSUM=int(checksum), PROBE_SPIN=int(spin),
                                                   PROBE_TILED=int(tiled)))


def expected_checksums(weights, tokens, cfg: dict, tasks: int, ctas: int, tiles: int, blocks: int) -> list[int]:
    """Each CTA's sum of the 32-bit words of every chunk it consumed (mod 2**32): a task's chunks
    hold its weight tile's and token block's rows whole, whatever the swizzle or who loaded them.
    A tile's bytes are consecutive in both weight layouts, so `tiles` equal parts of `weights`."""
    import torch
    tile_sums = weights.view(torch.int32).to(torch.int64).view(tiles, -1).sum(1).tolist()
    block_sums = tokens.view(torch.int32).to(torch.int64).view(blocks, -1).sum(1).tolist()
    out = []
    for cta in range(ctas):
        total = 0
        for t in range(tasks):
            g = t * ctas + cta
            if cfg["share"] == 2:
                tile, block = (2 * (g // (2 * blocks)) + g % 2) % tiles, (g // 2) % blocks
            else:
                tile, block = (g // blocks) % tiles, g % blocks
            total += tile_sums[tile] + block_sums[block]
        out.append(total % 2**32)
    return out


def run(cfg: dict, stages: int, chunks: int, tasks: int, tiles: int, blocks: int, ctas: int | None = None,
        checksum: bool = False, spin: int = 0, tiled: bool = False, cold: bool = False) -> dict:
    import torch

    from vllm_megamoe.kernels import jit, tma

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ctas = ctas or sms - sms % cfg["cluster"]
    check_sizes(cfg, stages, tiles, blocks, ctas)
    if ctas > sms:
        raise ValueError(f"--ctas={ctas}: this GPU has {sms} SMs (one CTA per SM)")
    kernel = jit.get_kernel(spec(cfg, stages, chunks, checksum, spin, tiled), dev)
    if kernel.read_global_int("megamoe_stream_rate_stage_bytes") != stage_bytes(cfg):
        raise RuntimeError(f"stream_rate.cu's stage is {kernel.read_global_int('megamoe_stream_rate_stage_bytes')} "
                           f"bytes, stream_probe.stage_bytes says {stage_bytes(cfg)}: fix the one that is wrong")
    k_bytes = chunks * ROW_BYTES
    # Tiled: each 256-row x 128-byte box stored whole, [tile][chunk][row][byte]; a tile's bytes stay
    # together either way (the checksums sum a tile's bytes).
    weights = torch.randint(0, 256, (tiles * chunks * WEIGHT_ROWS, ROW_BYTES) if tiled else (tiles * WEIGHT_ROWS, k_bytes),
                            dtype=torch.uint8, device="cuda")
    tokens = torch.randint(0, 256, (blocks * cfg["tokens"], k_bytes), dtype=torch.uint8, device="cuda")
    w_map = tma.make_tensor_map(weights, (ROW_BYTES, WEIGHT_ROWS // (2 if cfg["share"] == 1 else 1)))
    t_map = tma.make_tensor_map(tokens, (ROW_BYTES, cfg["tokens"] // (2 if cfg["share"] == 2 else 1)))
    cycles = torch.zeros(ctas, dtype=torch.int64, device="cuda")
    ns = torch.zeros(2 * ctas, dtype=torch.int64, device="cuda")
    sums = torch.zeros(ctas, dtype=torch.int32, device="cuda")

    def launch(n_tasks: int) -> None:
        kernel.launch(ctas, 64, smem_bytes(cfg, stages), torch.cuda.current_stream().cuda_stream,
                      [w_map, t_map, ctypes.c_int32(n_tasks), ctypes.c_int32(tiles), ctypes.c_int32(blocks),
                       ctypes.c_void_p(cycles.data_ptr()), ctypes.c_void_p(ns.data_ptr()),
                       ctypes.c_void_p(sums.data_ptr())])

    launch(max(1, tasks // 10))  # warm-up
    if cold:  # the warm-up's tiles (the timed launch's first ones) out of the L2 cache: written over
        torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").fill_(1)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch(tasks)
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop)
    per_chunk = cycles.double().median().item() / (tasks * chunks)
    spans = ns.view(ctas, 2)
    all_at_once = bool(spans[:, 0].max() < spans[:, 1].min())
    row = dict(ctas=ctas, sms=sms, ms=ms, cycles_per_chunk=per_chunk,
               # beyond the consumer's own spin: what a chunk waited for its stage
               wait_cycles_per_chunk=max(0.0, per_chunk - spin),
               landed_bytes_per_clock=stage_bytes(cfg) / per_chunk,
               fetched_bytes_per_clock=fetched_bytes(cfg) / per_chunk,
               # the launch's time is the GPU's rate only when every CTA streamed at once
               fetched_tb_per_s=fetched_bytes(cfg) * chunks * tasks * ctas / (ms * 1e-3) / 1e12 if all_at_once else None,
               all_at_once=all_at_once)
    if checksum:
        got = [v % 2**32 for v in sums.tolist()]
        row["checksum_ok"] = got == expected_checksums(weights, tokens, cfg, tasks, ctas, tiles, blocks)
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'config':>9} {'layout':>6} {'spin':>5} {'regs':>5} {'stage KB':>8} {'fetch KB':>8} {'cycles/chunk':>13} "
            f"{'wait/chunk':>10} {'landed B/clk':>12} {'fetched B/clk':>13} {'fetch TB/s':>10} {'at once':>7}")
    out = [head]
    for r in rows:
        timed = "cycles_per_chunk" in r
        out.append(f"{r['config']:>9} {r.get('layout', 'rows'):>6} {r.get('spin', 0):>5} {r['registers'] or '-':>5} {stage_bytes(r) / 1024:>8.0f} "
                   f"{fetched_bytes(r) / 1024:>8.0f} "
                   + (f"{r['cycles_per_chunk']:>13.0f} {r['wait_cycles_per_chunk']:>10.0f} {r['landed_bytes_per_clock']:>12.1f} "
                      f"{r['fetched_bytes_per_clock']:>13.1f} "
                      f"{'-' if r['fetched_tb_per_s'] is None else format(r['fetched_tb_per_s'], '.2f'):>10} "
                      f"{'yes' if r['all_at_once'] else 'NO':>7}" if timed
                      else f"{'-':>13} {'-':>10} {'-':>12} {'-':>13} {'-':>10} {'-':>7}"))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = probe_arguments(__doc__, CONFIGS, "TOKENS:CLUSTER:SHARE", tasks=60)
    ap.add_argument("--tiles", type=int, default=512, help="weight tiles of 256 rows (512 x 1 MB: from HBM)")
    ap.add_argument("--blocks", type=int, default=2, help="token blocks, each read by consecutive tasks of a tile")
    ap.add_argument("--ctas", type=int, default=None,
                    help="CTAs (one per SM; default every SM): e.g. 96 for the SMs a V4-Flash-like 1-token call streams with")
    ap.add_argument("--layout", nargs="+", choices=("rows", "tiled"), default=["rows"],
                    help="weights in rows of K (the fused kernel's layout) or each 256 x 128-byte box stored whole; "
                         "each a row per config")
    ap.add_argument("--cold", action="store_true",
                    help="evict the warm-up's tiles from the L2 cache before the timed launch (with --tasks 1 "
                         "the timed launch reads the same tiles)")
    ap.add_argument("--spin", type=int, nargs="+", default=[0],
                    help="SM clocks the consumer holds each stage (the chunk's math; ~1600 for FP8 128-token chunks), "
                         "each value a row per config")
    args = ap.parse_args(argv)
    if any(v < 0 for v in args.spin):
        ap.error(f"--spin {args.spin}: clocks must be >= 0")
    if args.ctas is not None and args.ctas < 1:
        ap.error(f"--ctas {args.ctas}: at least one CTA")
    from vllm_megamoe.kernels import jit

    def rows():
        for spin in args.spin:
            for text in args.configs:
                for layout in args.layout:
                    cfg, tiled = parse_config(text), layout == "tiled"
                    row = dict(config=text, **cfg, layout=layout, spin=spin, stages=args.stages, chunks=args.chunks,
                               tasks=args.tasks, tiles=args.tiles, blocks=args.blocks,
                               **compile_report(jit.compile_kernel(spec(cfg, args.stages, args.chunks, spin=spin,
                                                                        tiled=tiled)).log))
                    if not args.compile_only:
                        row.update(run(cfg, args.stages, args.chunks, args.tasks, args.tiles, args.blocks,
                                       ctas=args.ctas, spin=spin, tiled=tiled, cold=args.cold))
                    yield row
    return report_rows(rows(), table, args.out, args.compile_only)


if __name__ == "__main__":
    raise SystemExit(main())
