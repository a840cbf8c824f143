"""The `vllm-megamoe` command: doctor, demo, convert / inspect / verify, bench."""
from __future__ import annotations

import argparse
import sys


def _doctor(args) -> int:
    from . import doctor
    return doctor.run()


def _demo(args) -> int:
    from . import demo
    return demo.run(ranks=args.ranks, tokens=args.tokens, fmt=args.format)


def _bench(args) -> int:
    # The benchmarks live in the repository's benchmarks/ folder, beside this package.
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    if (root / "benchmarks" / "bench.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from benchmarks import bench
    except ImportError as exc:
        print(f"vllm-megamoe bench needs the benchmarks/ folder of a source checkout ({exc})",
              file=sys.stderr)
        return 2
    return bench.main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-megamoe",
        description="Fused expert-parallel MoE for vLLM: tools around the megamoe backend.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("doctor", help="report the environment and which megamoe path would run here")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("demo", help="run a small random MoE layer on N ranks and compare with the reference")
    p.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks (CPU processes)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per rank")
    p.add_argument("--format", choices=("fp8-block", "bf16"), default="fp8-block")
    p.set_defaults(func=_demo)
    from .convert.commands import add_subcommands as add_convert_subcommands
    add_convert_subcommands(sub)  # convert, inspect, verify
    p = sub.add_parser("bench", add_help=False,
                       help="time megamoe vs the portable path, the unfused chain and SGLang on N GPUs "
                       "(`vllm-megamoe bench --help` for its options)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option after "bench" belongs to the benchmark's own parser
        return _bench(argparse.Namespace(bench_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
