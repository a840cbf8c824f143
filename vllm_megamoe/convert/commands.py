"""`vllm-megamoe convert | inspect | verify` (subcommands registered by vllm_megamoe.cli)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

CONVERT_EPILOG = """\
examples:
  vllm-megamoe convert /models/Qwen3-30B-A3B /models/Qwen3-30B-A3B-megamoe-sm90 --arch sm90
  vllm-megamoe convert /models/DeepSeek-V3 /models/DeepSeek-V3-sm100 --arch sm100 --workers 8
supported expert naming: experts.<e>.{w1,w2,w3}.weight (Mixtral),
  experts.<e>.{gate_proj,up_proj,down_proj}.weight[_scale_inv] (Qwen-MoE, DeepSeek; FP8 128x128),
  stacked experts.gate_up_proj [E,2I,H] or [E,H,2I] + experts.down_proj (float)."""


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _int_at_least(minimum: int):
    """argparse type: a whole number >= minimum (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _size(text: str) -> int:
    """argparse type of --max-shard-size: bytes, at least 1."""
    from .plan import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_convert(args) -> int:
    from .checkpoint import convert_checkpoint
    if threading_main():
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        result = convert_checkpoint(
            args.src, args.dst, arch=args.arch, fmt=args.format,
            max_shard_bytes=args.max_shard_size, workers=args.workers,
            overwrite=args.overwrite, resume=args.resume,
            progress=not args.no_progress and sys.stderr.isatty() or args.progress,
            log=lambda msg: print(msg, file=sys.stderr))
    except (ValueError, OSError) as exc:  # bad input, or SRC unreadable / DST not writable
        return _fail(exc)
    except KeyboardInterrupt:
        print("conversion interrupted; DST was not written", file=sys.stderr)
        return 130
    rate = result.source_bytes / max(result.seconds, 1e-9) / 1e9
    print(f"wrote {result.dst}: {result.shards} shard(s), {result.output_bytes / 1e9:.2f} GB of "
          f"weights ({result.arch} {result.fmt}) in {result.seconds:.1f} s "
          f"({rate:.2f} GB/s of source)")
    if result.precision_change is None:
        print(f"expert precision kept: {result.source_format} experts stored as {result.fmt}, no tensor "
              "quantized")
    else:
        print(f"{len(result.changed_tensors)} expert tensors {result.precision_change} (the source's are "
              f"{result.source_format}): {', '.join(result.changed_tensors)}")
    return 0


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def run_inspect(args) -> int:
    from .inspection import format_inspection, inspect_checkpoint
    from .safetensors_io import CorruptCheckpointError
    try:
        info = inspect_checkpoint(args.dir)
    except CorruptCheckpointError as exc:
        print(f"error: {args.dir} is corrupt or incomplete: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # not a checkpoint, or unreadable
        return _fail(exc)
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspection(info))
    broken = [l for l in info["layers"] if "error" in l]
    if broken:  # a converted checkpoint whose index or shards lack expert tensors
        print(f"error: {args.dir} is corrupt or incomplete: {broken[0]['prefix']}: {broken[0]['error']}"
              + (f" (and {len(broken) - 1} more layers)" if len(broken) > 1 else ""), file=sys.stderr)
        return 1
    return 0


def run_verify(args) -> int:
    from .verify import verify_checkpoint
    try:
        problems = verify_checkpoint(args.dir, source=args.source, samples=args.samples,
                                     seed=args.seed, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, OSError) as exc:
        return _fail(exc)
    if problems:
        print(f"verify FAILED for {args.dir}:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"verify OK: {args.dir}")
    return 0


def add_subcommands(sub) -> None:
    """Add convert / inspect / verify to an argparse subparsers object."""
    p = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint to the megamoe "
                       "kernel layout (offline, once)", epilog=CONVERT_EPILOG,
                       description="Convert the MoE experts of checkpoint SRC to the megamoe kernel layout "
                       "of --arch, in the source's precision unless --format says otherwise (the command "
                       "lists every tensor it quantizes), and write checkpoint DST with sha256 checksums of "
                       "its shards. DST appears only when complete; --overwrite replaces only a checkpoint. "
                       "Exit status 0 done, 2 bad input or options, SRC unreadable or DST not writable, 130 "
                       "interrupted (--resume continues). docs/conversion.md.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="source checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--arch", required=True, choices=("sm90", "sm100"),
                   help="GPU the checkpoint is for: sm90 (Hopper) or sm100 (Blackwell)")
    p.add_argument("--format", choices=("fp8-block", "bf16", "mxfp4"), default=None,
                   help="expert weight format (default: the source's precision: bf16 for BF16/F16/F32 "
                   "experts, fp8-block for FP8 128x128-block experts on sm90; FP8 sources on sm100 need "
                   "--format). fp8-block from a float source and mxfp4 quantize the experts; the "
                   "command lists the tensors it quantized")
    p.add_argument("--max-shard-size", type=_size, default="5GB",
                   help="largest output shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    p.add_argument("--workers", type=_int_at_least(1), default=min(16, os.cpu_count() or 1),
                   help="threads converting in parallel (default: CPUs, at most 16)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST that is a checkpoint (an earlier conversion, a Hugging Face "
                   "checkpoint) or empty; any other directory is refused and left as it is")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished shards of an interrupted conversion to the same DST")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when "
                   "stderr is not a terminal")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_convert)

    p = sub.add_parser("inspect", help="summarise a checkpoint (converted or not)",
                       description="Summarise a checkpoint directory: architecture, MoE layers and their "
                       "experts, quantization, the megamoe marker and checksums of a converted one, size. "
                       "Exit status 0 with the summary (also when its experts are not recognised), 1 when "
                       "the checkpoint is corrupt or incomplete (a truncated or malformed shard, a file or "
                       "tensor its index names missing), 2 when it is no checkpoint or unreadable.")
    p.add_argument("dir", help="checkpoint directory (config.json + safetensors), converted or not")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_inspect)

    p = sub.add_parser("verify", help="check a converted checkpoint: checksums, shapes and, "
                       "with --source, bit equality of re-derived tensors",
                       description="Check a checkpoint written by `vllm-megamoe convert`: every shard in "
                       "the index exists and matches its sha256, headers and index agree, each expert "
                       "tensor has the marker format's dtype and shape; with --source, re-derive sampled "
                       "tensors from the original and require equal bytes. Exit status 0 when it passed, "
                       "1 with one line per problem, 2 on bad options.")
    p.add_argument("dir", help="the converted checkpoint directory (DST of `vllm-megamoe convert`)")
    p.add_argument("--source", help="the original checkpoint, to re-derive sampled tensors")
    p.add_argument("--samples", type=_int_at_least(0), default=8,
                   help="experts and non-expert tensors to re-derive (each; default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample")
    p.set_defaults(func=run_verify)
