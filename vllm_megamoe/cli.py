"""The `vllm-megamoe` command: doctor, demo (and later convert / inspect / verify / bench)."""
from __future__ import annotations

import argparse
import sys


def _doctor(args) -> int:
    from . import doctor
    return doctor.run()


def _demo(args) -> int:
    from . import demo
    return demo.run(ranks=args.ranks, tokens=args.tokens, fmt=args.format)


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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
