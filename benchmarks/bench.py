"""`vllm-megamoe bench`: every MoE path vs ceilings and baselines on N GPUs of one host.

    python -m benchmarks.bench --gpus 2 --out results/bench_ep2.json          # run
    python -m benchmarks.bench --report results/bench_ep2.json                # table + plots again
    python -m benchmarks.bench --merge a.json b.json --out all.json           # join runs
    python -m benchmarks.bench --compare A.json B.json                        # B / A per case

One process per GPU (vllm_megamoe.launch.run_ranks, NCCL). For every shape, format, routing
(uniform, or skewed: Zipf-like expert popularity) and tokens per rank it times each path
(benchmarks/paths.py: megamoe, portable, chain, sglang) end to end with CUDA events around
graph replays (eager for paths that cannot be captured), median over --iters calls after
--warmup, rotating three input sets, and its kernel time with torch.profiler; each path's
output is checked against the portable path first. Ceilings (copy, FP8/BF16 GEMM, NVLink) are
measured in the same run unless --ceilings names a file or "anchors". Every rank appends its
records to a file as it goes, so a rank that dies or hangs loses only the case it was in.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from typing import Optional

from benchmarks import report
from benchmarks import roofline as rf

DEFAULT_TOKENS = [1, 8, 32, 128, 512, 2048, 4096, 8192]
ROTATE = 3


@dataclasses.dataclass
class BenchConfig:
    shapes: list          # [(name, hidden, intermediate, experts, topk)]
    formats: list
    tokens: list
    routings: list
    paths: list
    iters: int = 20
    warmup: int = 3
    profile_calls: int = 3
    graphs: bool = True
    measure_ceilings: bool = True
    records_dir: str = ""
    device_type: str = "cuda"  # "cpu": a dry run of the whole flow on gloo (tests, no GPU)
    budget_s: float = 0.0      # > 0: cases not started within this many seconds are skipped


def parse_shape(spec: str):
    """A standard shape name (benchmarks.common.STANDARD_SHAPES) or HIDDENxINTERxEXPERTSxTOPK."""
    from benchmarks.common import STANDARD_SHAPES
    if spec in STANDARD_SHAPES:
        s = STANDARD_SHAPES[spec]
        return (spec, s.hidden, s.intermediate, s.num_experts, s.topk)
    from vllm_megamoe import MoEShape
    try:
        s = MoEShape.parse(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape {spec!r}: use one of {sorted(STANDARD_SHAPES)} or HIDDENxINTERxEXPERTSxTOPK") from None
    return (spec, s.hidden, s.intermediate, s.num_experts, s.topk)


# ======================================================================= per-rank side (GPU) ===
_DEVICE_TYPE = "cuda"
_START = 0.0


def _device():
    import torch
    if _DEVICE_TYPE == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync():
    import torch
    if _DEVICE_TYPE == "cuda":
        torch.cuda.synchronize()


def _empty_cache():
    import torch
    if _DEVICE_TYPE == "cuda":
        torch.cuda.empty_cache()


class _Recorder:
    """Appends one JSON line per record to records_dir/rank<r>.jsonl (flushed at once)."""

    def __init__(self, records_dir: str, rank: int):
        self.rank = rank
        self.f = open(os.path.join(records_dir, f"rank{rank}.jsonl"), "a")

    def __call__(self, kind: str, **fields):
        self.f.write(json.dumps(dict(kind=kind, rank=self.rank, **fields), default=str) + "\n")
        self.f.flush()


def _guarded(fn, group):
    """Run fn on every rank; (result, None) if it worked everywhere, else (None, error text).

    The ranks agree through an all-reduce so that none goes on alone into a collective.
    """
    import torch
    import torch.distributed as dist

    try:
        out = fn()
        _sync()
        err = None
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        out, err = None, f"{type(exc).__name__}: {exc}"[:600]
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=_device())
    if group is not None:
        dist.all_reduce(flag, group=group)
    if int(flag.item()):
        return None, err or "failed on another rank"
    return out, None


def _rank_env(fmt_list) -> dict:
    import torch
    from vllm_megamoe import select_path
    from vllm_megamoe.shape import MoEShape
    from benchmarks import sglang_baseline

    env = dict(torch=torch.__version__, cuda=torch.version.cuda, deep_gemm=sglang_baseline.version())
    if _DEVICE_TYPE != "cuda":
        env["gpu"] = "none (CPU dry run)"
        env["megamoe_path"] = {f: list(select_path(MoEShape(4096, 2048, 256, 8), f, "cpu")) for f in fmt_list}
        return env
    env.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
    try:
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        pass
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
             str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        env["driver"] = ""
    probe = MoEShape(4096, 2048, 256, 8)
    env["megamoe_path"] = {f: list(select_path(probe, f, torch.device("cuda"))) for f in fmt_list}
    return env


def _make_sets(shape, tokens: int, skew: float, seed: int, dev):
    import torch
    from benchmarks.common import routing

    gen = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(ROTATE):
        x = torch.randn(tokens, shape.hidden, device=dev, generator=gen).to(torch.bfloat16)
        idx, w = routing(shape, tokens, dev, gen, skew)
        sets.append((x, idx, w))
    return sets


def _over_budget(cfg: BenchConfig, group) -> bool:
    """True on every rank once any rank has used up cfg.budget_s (agreed by an all-reduce)."""
    import time

    import torch
    import torch.distributed as dist

    if cfg.budget_s <= 0:
        return False
    flag = torch.tensor([int(time.monotonic() - _START > cfg.budget_s)], dtype=torch.int32, device=_device())
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _traffic_sets(sets, num_experts: int, group) -> list:
    import torch
    import torch.distributed as dist

    out = []
    for _, idx, _ in sets:
        if group is None:
            gathered = [idx]
        else:
            gathered = [torch.empty_like(idx) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, idx.contiguous(), group=group)
        out.append([t.to_dict() for t in rf.routing_traffic(gathered, num_experts)])
    return out


def _measure_path(path, sets, ref, cfg: BenchConfig, group) -> dict:
    """Check, capture, time and profile one path on one case; every step agreed across ranks."""
    import torch
    import torch.distributed as dist
    from vllm_megamoe import reference
    from benchmarks.timing import capture_graph, profile_kernels, stats_us, time_events

    rec: dict = dict(graph=False)
    y, err = _guarded(lambda: path.call(*sets[0]), group)
    if err:
        return dict(rec, error=f"call: {err}")
    if ref is not None:
        rec["rel_err_vs_portable"] = reference.relative_error(y.float(), ref.float())
    del y
    static = [t.clone() for t in sets[0]]

    def load(i):
        for dst, src in zip(static, sets[i % ROTATE]):
            dst.copy_(src)
        _sync()
        if group is not None:
            dist.barrier(group=group)

    fn = lambda: path.call(*static)  # noqa: E731
    graph = None
    if path.capturable and cfg.graphs and _DEVICE_TYPE == "cuda":
        holder: dict = {}

        def capture():
            holder["graph"] = capture_graph(lambda: holder.__setitem__("y", path.graph_call(*static)))
            return holder["graph"]
        graph, gerr = _guarded(capture, group)
        if gerr:
            rec["graph_error"] = gerr
            holder.clear()
        else:
            fn = graph.replay
            rec["graph"] = True
            load(0)
            _, rerr = _guarded(graph.replay, group)
            if rerr:
                return dict(rec, error=f"graph replay: {rerr}")
            if ref is not None:
                rec["graph_rel_err_vs_portable"] = reference.relative_error(holder["y"].float(), ref.float())
    times, err = _guarded(lambda: time_events(fn, cfg.iters, cfg.warmup, load), group)
    if err:
        return dict(rec, error=f"timing: {err}")
    rec["e2e"] = stats_us(times)
    if cfg.profile_calls > 0:
        load(0)
        prof, perr = _guarded(lambda: profile_kernels(fn, cfg.profile_calls), group)
        if perr:
            rec["profile_error"] = perr
        else:
            rec["kernel"] = prof
    del graph
    return rec


def _open_paths(cfg: BenchConfig, shape, fmt, weights, buf, group, max_tokens, record):
    """The path objects of this shape and format (and notes on the ones that cannot run)."""
    import torch
    from vllm_megamoe import select_path
    from benchmarks import paths as P, sglang_baseline
    from benchmarks.chain import UnfusedChain

    opened, notes = [], {}
    portable = P.PortablePath(weights, buf)
    selected, why = select_path(shape, fmt, _device())
    notes["megamoe_selected"] = [selected, why]
    if "megamoe" in cfg.paths and selected != "portable":
        opened.append(P.MegaMoEPath(weights, buf, selected))
    if "portable" in cfg.paths or "megamoe" in cfg.paths:
        opened.append(portable)
    if "sglang" in cfg.paths:
        ok, why = sglang_baseline.status(fmt, shape.hidden)

        def check():
            if not ok:
                raise RuntimeError(why)
        _, err = _guarded(check, group)
        if err:
            notes["sglang"] = f"not run: {why if not ok else err}"
        else:
            sg, err = _guarded(lambda: sglang_baseline.SGLangMegaMoE(
                weights, group, shape.num_experts, shape.topk, max_tokens), group)
            if err:
                notes["sglang"] = f"set-up failed: {err}"
            else:
                opened.append(sg)
                notes["sglang"] = sglang_baseline.version()
    if "chain" in cfg.paths:
        def make_chain():
            return P.ChainPath(UnfusedChain.from_weights(weights, fmt, group))
        chain, err = _guarded(make_chain, group)
        _empty_cache()
        if err:
            notes["chain"] = f"set-up failed: {err}"
        else:
            opened.append(chain)
            notes["chain"] = chain.chain.gemm_kind
    record("note", shape=shape_name_of(shape), format=fmt, notes=notes)
    return opened, notes


def sm90_build_label(shape, fmt: str, world: int, tokens: int) -> str:
    """mainloop/stages/tile of the SM90 build a call of `tokens` per rank runs (sm90_tuning.choose,
    as the op asks it), recorded per case so a results file says which build each figure is."""
    from vllm_megamoe.kernels import sm90_tuning
    return sm90_tuning.choose(shape, fmt, world, tokens).label()


def shape_name_of(shape) -> str:
    return f"{shape.hidden}x{shape.intermediate}x{shape.num_experts}x{shape.topk}"


def _run_shape_format(rank, world, group, cfg, spec, fmt, record):
    import torch
    from vllm_megamoe import SymmBuffer, portable
    from vllm_megamoe.shape import MoEShape
    from benchmarks.common import ROUTINGS, local_weights

    name, h, i, e, k = spec
    shape = MoEShape(h, i, e, k).validate(world)
    dev = _device()
    max_tokens = max(cfg.tokens)
    weights = local_weights(shape, world, rank, fmt, dev)
    buf = SymmBuffer(shape, max_tokens, group, format=fmt, device=dev)
    paths, notes = _open_paths(cfg, shape, fmt, weights, buf, group, max_tokens, record)
    selected = notes["megamoe_selected"][0]
    try:
        for routing_name in cfg.routings:
            skew = ROUTINGS[routing_name]
            for tokens in cfg.tokens:
                if _over_budget(cfg, group):
                    record("note", shape=name, format=fmt, notes=dict(
                        skipped=f"time budget {cfg.budget_s:g} s used up before {routing_name} {tokens} tokens"))
                    return
                case = dict(shape=name, hidden=h, intermediate=i, experts=e, topk=k, format=fmt,
                            routing=routing_name, skew=skew, tokens_per_rank=tokens, world=world)
                seed = 7919 * rank + 104729 * tokens + (1 if skew else 0)
                sets = _make_sets(shape, tokens, skew, seed, dev)
                traffic = _traffic_sets(sets, e, group)
                ref, err = _guarded(lambda: portable.mega_moe(*sets[0], weights, buf), group)
                for path in paths:
                    rec = _measure_path(path, sets, ref, cfg, group)
                    extra = dict(selected=selected) if path.name == "megamoe" else {}
                    if path.name == "megamoe" and selected == "sm90":  # the build the op picks for this call
                        extra["build"] = sm90_build_label(shape, fmt, world, tokens)
                    record("case", **case, path=path.name, **extra, **rec,
                           traffic_sets=traffic if rank == 0 else None)
                    if path.name == "portable" and "megamoe" in cfg.paths and selected == "portable":
                        record("case", **case, path="megamoe", alias_of="portable", selected=selected,
                               **rec, traffic_sets=traffic if rank == 0 else None)
                del sets, ref
                _empty_cache()
    finally:
        for path in paths:
            try:
                path.close()
            except Exception as exc:  # noqa: BLE001
                record("error", message=f"closing {path.name}: {exc}")
        buf.destroy()
        del weights, paths
        _empty_cache()


def _rank_main(rank, world, group, cfg: BenchConfig):
    import torch
    from benchmarks import ceilings

    from vllm_megamoe.shape import MoEShape

    import time

    global _DEVICE_TYPE, _START
    _DEVICE_TYPE, _START = cfg.device_type, time.monotonic()
    record = _Recorder(cfg.records_dir, rank)
    record("env", env=_rank_env(cfg.formats))
    if cfg.measure_ceilings:
        c, err = _guarded(lambda: ceilings.measure_rank(group), group)
        record("ceilings", **(c or {"errors": {"all": err}}))
    for spec in cfg.shapes:
        try:  # the same on every rank, so skipping keeps the ranks in step
            MoEShape(*spec[1:]).validate(world)
        except ValueError as exc:
            record("error", message=f"shape {spec[0]} skipped: {exc}")
            continue
        for fmt in cfg.formats:
            try:
                _run_shape_format(rank, world, group, cfg, spec, fmt, record)
            except Exception as exc:
                # Outside the agreed steps the ranks may now be out of step: stop this rank (the
                # launcher reports it; the records written so far are kept).
                record("error", message=f"{spec[0]} {fmt}: {type(exc).__name__}: {exc}"[:800])
                raise
            _empty_cache()
    return "done"


# ========================================================================= parent side (CPU) ===
def read_records(records_dir: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(records_dir)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(records_dir, name)) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a killed rank
    return out


def commit_id() -> str:
    """MEGAMOE_COMMIT when set (a copied tree's .git can lag behind its files), else git's HEAD."""
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=here, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        out = ""
    return out


def resolve_ceilings(choice: str, env: dict) -> tuple[rf.Ceilings, dict]:
    """Ceilings from this run's measurement, a JSON file, or the H200 anchors (missing figures
    of a measurement are taken from the anchors)."""
    from benchmarks import ceilings as C
    if choice == "anchors":
        return rf.H200_ANCHORS, rf.H200_ANCHORS.to_dict()
    if choice == "measure":
        per_rank = [{k: v for k, v in c.items() if k not in ("kind", "rank")}
                    for c in env.get("ceilings_per_rank", [])]
        if not per_rank:
            return rf.H200_ANCHORS, dict(rf.H200_ANCHORS.to_dict(), note="measurement missing")
        measured = C.complete(C.merge(per_rank), rf.H200_ANCHORS)
    else:
        with open(choice) as f:
            doc = json.load(f)
        if "rows" in doc:  # a results file: its recorded ceilings
            doc = doc.get("ceilings") or {}
        measured = C.complete(doc, rf.H200_ANCHORS)
    return rf.Ceilings.from_dict(measured), measured


def finish(rows, env, errors, args_dict, ceilings_choice, out_path, plots_dir, quiet=False) -> dict:
    """Roofline, JSON, table and plots of merged rows; returns the document written."""
    from benchmarks import ceilings as C
    c, c_doc = resolve_ceilings(ceilings_choice, env)
    report.add_derived(rows, c)
    ranks = env.get("ranks", {})
    first = ranks.get("0") or (next(iter(ranks.values())) if ranks else {})
    doc_env = dict(first, notes=env.get("notes", first.get("notes")), gpus=args_dict.get("gpus"), python=platform.python_version(),
                   host=socket.gethostname(), commit=commit_id(), argv=sys.argv[1:],
                   safe_env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
    doc = dict(env=doc_env, args=args_dict, ceilings=c_doc, rows=rows, errors=errors)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if not quiet:
        print(C.describe(c_doc))
        print(report.text_table(rows))
        for e in errors:
            print("error:", e)
        if out_path:
            print(f"wrote {out_path}")
    if plots_dir:
        try:
            from benchmarks import plots
            prefix = os.path.splitext(os.path.basename(out_path or "bench"))[0]
            for p in plots.plot(rows, plots_dir, prefix, title=plots._title(doc)):
                print(f"wrote {p}")
        except Exception as exc:  # noqa: BLE001 - plots are a convenience
            print(f"plots skipped: {type(exc).__name__}: {exc}")
    return doc


def run(args) -> int:
    from vllm_megamoe.launch import RankFailed, run_ranks

    records_dir = args.records_dir or tempfile.mkdtemp(prefix="megamoe_bench_")
    os.makedirs(records_dir, exist_ok=True)
    cfg = BenchConfig(shapes=args.shapes, formats=args.formats, tokens=sorted(set(args.tokens)),
                      routings=args.routings, paths=args.paths, iters=args.iters, warmup=args.warmup,
                      profile_calls=args.profile_calls, graphs=not args.no_graphs,
                      measure_ceilings=(args.ceilings == "measure" and args.backend == "nccl"),
                      records_dir=records_dir, device_type="cuda" if args.backend == "nccl" else "cpu",
                      budget_s=args.budget)
    errors = []
    results = run_ranks(_rank_main, args.gpus, (cfg,), backend=args.backend, timeout_s=args.timeout,
                        pg_timeout_s=args.pg_timeout, allow_failures=True)
    for r in results:
        if isinstance(r, RankFailed):
            errors.append(str(r)[-1500:])
    rows, env, rec_errors = report.merge_rank_records(read_records(records_dir))
    args_dict = {k: v for k, v in vars(args).items()
                 if k not in ("compare", "merge", "report", "from_records")}
    finish(rows, env, rec_errors + errors, args_dict, args.ceilings, args.out,
           None if args.no_plots else (args.plots_dir or os.path.dirname(os.path.abspath(args.out))))
    print(f"raw records: {records_dir}")
    return 0 if rows and not errors else 1


def merge_files(paths: list[str], out: str, ceilings: str, plots_dir: Optional[str]) -> int:
    rows, errors, env, args_dict = [], [], {}, {}
    for p in paths:
        try:
            with open(p) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            errors.append(f"{p}: {exc}")
            continue
        rows += doc.get("rows", [])
        errors += doc.get("errors", [])
        env = env or doc.get("env", {})
        args_dict = args_dict or doc.get("args", {})
        if ceilings == "measure" and doc.get("ceilings"):
            ceilings = p  # the first file's ceilings (with their source) are kept
    env_ranks = {"ranks": {"0": env}}
    args_dict = dict(args_dict, merged_from=paths)
    finish(rows, env_ranks, errors, args_dict, _ceilings_file_from(ceilings), out, plots_dir)
    return 0 if rows else 1


def _ceilings_file_from(choice: str) -> str:
    """A results file's embedded ceilings as a standalone file (or the choice unchanged)."""
    if choice in ("anchors", "measure") or not os.path.isfile(choice):
        return "anchors" if choice == "measure" else choice
    with open(choice) as f:
        doc = json.load(f)
    if "rows" not in doc:
        return choice
    fd, tmp = tempfile.mkstemp(suffix=".json", prefix="ceilings_")
    with os.fdopen(fd, "w") as f:
        json.dump(doc["ceilings"], f)
    return tmp


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.common import ROUTINGS, STANDARD_SHAPES
    from benchmarks.paths import PATH_NAMES

    ap = argparse.ArgumentParser(prog="vllm-megamoe bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--gpus", type=int, default=2, help="GPUs = expert-parallel ranks (one process each)")
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in STANDARD_SHAPES],
                    help=f"{' '.join(STANDARD_SHAPES)} or HIDDENxINTERxEXPERTSxTOPK")
    ap.add_argument("--formats", nargs="+", default=["fp8-block", "bf16"], choices=["fp8-block", "bf16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=DEFAULT_TOKENS, help="tokens per rank")
    ap.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    ap.add_argument("--paths", nargs="+", default=list(PATH_NAMES), choices=list(PATH_NAMES))
    ap.add_argument("--iters", type=int, default=20, help="timed calls per path and case (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-calls", type=int, default=3, help="calls under torch.profiler (0: skip)")
    ap.add_argument("--no-graphs", action="store_true", help="time capturable paths eagerly too")
    ap.add_argument("--ceilings", default="measure", help="'measure' (this run), 'anchors', or a JSON file "
                    "(benchmarks.ceilings output or a results file)")
    ap.add_argument("--out", default="benchmarks/results/bench.json")
    ap.add_argument("--plots-dir", default=None, help="where PNGs go (default: next to --out)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--records-dir", default=None, help="per-rank raw records (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds for the whole multi-rank run")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds after which the ranks skip the cases not yet started (0: no limit)")
    ap.add_argument("--from-records", metavar="DIR",
                    help="build --out from the raw per-rank records of an interrupted run")
    ap.add_argument("--pg-timeout", type=float, default=180.0, help="seconds a collective may wait")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                    help="gloo: a CPU dry run of the whole flow (no timings worth reading)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print B/A per case of two results files")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join results files into --out")
    ap.add_argument("--report", metavar="JSON", help="print the table (and plots) of a results file")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        rows_a, _ = report.load_rows(args.compare[0])
        rows_b, _ = report.load_rows(args.compare[1])
        print(f"A = {args.compare[0]}\nB = {args.compare[1]}")
        print(report.compare_table(report.compare(rows_a, rows_b)))
        return 0
    if args.report:
        rows, doc = report.load_rows(args.report)
        from benchmarks import ceilings as C
        if doc.get("ceilings"):
            print(C.describe(doc["ceilings"]))
        print(report.text_table(rows))
        from benchmarks import targets
        checked = targets.evaluate(rows)
        if checked:  # the fused kernel's targets, where the file has its kernel times
            print("\nThe fused kernel against its targets (benchmarks/targets.py):")
            print(targets.markdown(checked))
        if not args.no_plots:
            from benchmarks import plots
            out_dir = args.plots_dir or os.path.dirname(os.path.abspath(args.report))
            prefix = os.path.splitext(os.path.basename(args.report))[0]
            for p in plots.plot(rows, out_dir, prefix, title=plots._title(doc)):
                print(f"wrote {p}")
        return 0
    if args.from_records:
        rows, env, errors = report.merge_rank_records(read_records(args.from_records))
        args_dict = dict(from_records=args.from_records, gpus=args.gpus)
        finish(rows, env, errors + ["rebuilt from raw records (the run did not finish)"], args_dict,
               args.ceilings if args.ceilings != "measure" or env.get("ceilings_per_rank") else "anchors",
               args.out, None if args.no_plots else (args.plots_dir or os.path.dirname(os.path.abspath(args.out))))
        return 0 if rows else 1
    if args.merge:
        plots_dir = None if args.no_plots else (args.plots_dir or os.path.dirname(os.path.abspath(args.out)))
        return merge_files(args.merge, args.out, args.ceilings, plots_dir)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
