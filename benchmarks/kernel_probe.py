"""Where the fused SM90 kernel spends a launch: per-phase times and build variants.

    python3 -m benchmarks.kernel_probe --gpus 2 --shapes v4-flash --tokens 8 128 1024 \
        --variants stages=2 stages=3 stages=4 tile=64 --out probe.json

For every shape, tokens per rank and variant (KNOB=VALUE, several joined by commas, `default` for
none). Tuning knobs, through the environment the op reads (sm90_tuning.env_overrides): `stages=N`
-> VLLM_MEGAMOE_SM90_STAGES, `tile=32|64|128|auto` -> VLLM_MEGAMOE_SM90_TOKEN_TILE, `sms=N` ->
VLLM_MEGAMOE_NUM_SMS, `csrc=DIR` -> VLLM_MEGAMOE_CSRC_DIR (another source tree's build, e.g. a
commit's `csrc/` from `git archive`). Development builds, passed to the op as
sm90_mega_moe.BuildOptions (no environment variable): `ablate=promotion|mma|token_rows|weight_rows|
tma|tma_warm|narrow|half_rows|epilogue|keep_padding|stores|transpose|task_scales` (joined with +:
profiling builds without that part of the mainloop: wrong outputs, times only; keep_padding alone:
right outputs, the padding rows as the box read them), `trace=1` (the FP8 K loop's chunk trace and
the task trace), `trace_task=N` (which L1 task of a CTA it traces), `epilogue_wg=0`,
`epilogue_wg128=1`, `evict_first=1|0|auto` (the weight copies' L2 policy). It times graph-replayed calls with CUDA events (median,
max over ranks), checks the output against the default variant, and runs one call with the phase
clock (vllm_megamoe.kernels.phase_clock): the table shows how long the slowest CTA of the slowest
rank needed from one phase mark to the next, and for trace builds the SM cycles of each interval of
a traced K chunk (phase_clock.chunk_trace) and around a traced GEMM task of each phase: lookup,
token-block check and barrier, K loop, hand-off, the task queue's barrier (phase_clock.task_trace).
With --rounds N the variants run N times in turn and
each case reports its median round. With --power, nvidia-smi samples the SM clock and board power
while rank 0 times each case (its medians in the row: at prefill the time is what the 700 W cap
allows, docs/kernel_design.md).

    python3 -m benchmarks.kernel_probe --gpus 1 --tokens 1 8 --variants default csrc=.probe_base/csrc --rounds 3

--compile-only needs no GPU: it compiles every build the same arguments would load into
VLLM_MEGAMOE_CACHE_DIR (the keys depend on the sources, the build and NVRTC's version only), so a
cache filled here and carried in the working tree spares the device its compiles:

    VLLM_MEGAMOE_CACHE_DIR=$PWD/.probe_jit python3 -m benchmarks.kernel_probe --compile-only --gpus 1 ...
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os

PHASES = (("dispatch", "start", "dispatched"), ("pull", "dispatched", "l1_start"), ("L1", "l1_start", "l1_done"),
          ("L1 sync", "l1_done", "l2_start"), ("L2", "l2_start", "l2_done"), ("combine", "l2_done", "combined"),
          ("reduce", "combined", "end"))
SHORT_POWER_WINDOW_S = 2.0  # --power: nvidia-smi's power.draw averages ~1 s, so shorter windows read low
KNOBS = {"stages": "VLLM_MEGAMOE_SM90_STAGES", "sms": "VLLM_MEGAMOE_NUM_SMS",
         "tile": "VLLM_MEGAMOE_SM90_TOKEN_TILE",
         # another source tree (a csrc/ directory, e.g. `git archive <commit> csrc` unpacked): its
         # build next to this tree's in the same process, same inputs (an A/B of two commits)
         "csrc": "VLLM_MEGAMOE_CSRC_DIR"}
# Development builds: knob -> (BuildOptions field, parser). ablate: profiling builds that drop part
# of the mainloop (sm90_mega_moe.ABLATIONS; wrong outputs; keep_padding: right outputs); trace: clock
# values inside a few K chunks of one L1 task per CTA (phase_clock.chunk_trace); trace_task: which of
# a CTA's L1 tasks a trace build traces (default 2; 0 at a few tokens per rank); epilogue_wg=0: the
# 32- and 64-token builds without their epilogue warpgroup (a csrc= tree from before it must run with
# 0: its kernel has 256 threads); epilogue_wg128=1: the 128-token builds with one where its 64 KB tile
# fits (3 stages); evict_first=1 / 0: every build's weight copies with an L2 evict-first policy / none
# (auto: the serving rule, sm90_tuning.weights_evict_first_*).


def _flag(value: str) -> bool:
    from vllm_megamoe.env_flags import parse_flag
    return parse_flag(value)


def _auto_flag(value: str):
    from vllm_megamoe.env_flags import parse_auto_flag
    return parse_auto_flag(value)


def _ablate(value: str) -> int:
    from vllm_megamoe.kernels.sm90_mega_moe import parse_ablation
    return parse_ablation(value)


def _task(value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"trace_task={value!r} must be a task number (0, 1, 2, ...)")
    return int(value)


BUILD_KNOBS = {"ablate": ("ablate", _ablate), "trace": ("chunk_trace", _flag), "trace_task": ("trace_task", _task),
               "epilogue_wg": ("epilogue_warpgroup", _flag), "epilogue_wg128": ("epilogue_warpgroup_128", _flag),
               "evict_first": ("weights_evict_first", _auto_flag)}


def _parts(variant: str) -> list[tuple[str, str]]:
    if variant == "default":
        return []
    out = []
    for part in variant.split(","):
        key, sep, value = part.partition("=")
        if not sep or (key not in KNOBS and key not in BUILD_KNOBS) or not value:
            raise ValueError(f"variant {variant!r}: expected default or KNOB=VALUE[,KNOB=VALUE] with KNOB in "
                             f"{sorted([*KNOBS, *BUILD_KNOBS])}")
        out.append((key, value))
    return out


def variant_env(variant: str) -> dict:
    """The environment a variant sets: 'stages=3' -> {'VLLM_MEGAMOE_SM90_STAGES': '3'};
    'tile=64,stages=5' sets both; 'default' and the development knobs -> {}."""
    return {KNOBS[k]: v for k, v in _parts(variant) if k in KNOBS}


def variant_options(variant: str):
    """The development build a variant asks for (sm90_mega_moe.BuildOptions): 'trace=1,trace_task=0'
    -> BuildOptions(chunk_trace=True, trace_task=0); 'default' and the tuning knobs -> SERVING."""
    from vllm_megamoe.kernels.sm90_mega_moe import BuildOptions
    fields = {}
    for key, value in _parts(variant):
        if key in BUILD_KNOBS:
            name, parse = BUILD_KNOBS[key]
            try:
                fields[name] = parse(value)
            except ValueError as e:
                raise ValueError(f"variant {variant!r}: {key}={value!r}: {e}") from None
    return BuildOptions(**fields)


@contextlib.contextmanager
def scoped_env(values: dict, unset: tuple = ()):
    """os.environ with `values` set and `unset` removed for the block, restored after it."""
    saved = {k: os.environ.get(k) for k in (*values, *unset)}
    os.environ.update(values)
    for k in unset:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def probe_shape(spec: str):
    """A standard shape name or HIDDENxINTERxEXPERTSxTOPK (benchmarks.bench.parse_shape) as a MoEShape."""
    from benchmarks.bench import parse_shape
    from vllm_megamoe.shape import MoEShape
    _, hidden, inter, experts, topk = parse_shape(spec)
    return MoEShape(hidden, inter, experts, topk)


def phase_row(summary: dict) -> dict:
    """Phase name -> microseconds between the latest CTA's marks (phase_clock.summarize output)."""
    marks = summary["marks"]
    return {name: marks[b]["last_us"] - marks[a]["last_us"] for name, a, b in PHASES}


def combine_rounds(rounds: list[dict]) -> dict:
    """One case's rows from successive rounds (--rounds) as one: the row of the round with the
    median graph time (the lower one of an even count: a measured row, phases and spans
    included), every round's time in `graph_us_rounds`, the largest error, and the output
    digests joined with '|' if the rounds disagree (they run the same inputs)."""
    ordered = sorted(rounds, key=lambda r: r["graph_us"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["graph_us_rounds"] = [r["graph_us"] for r in rounds]
    out["rel_err_vs_first_variant"] = max(r["rel_err_vs_first_variant"] for r in rounds)
    digests = list(dict.fromkeys(r.get("out_sha1") for r in rounds))
    out["out_sha1"] = digests[0] if len(digests) == 1 else "|".join(map(str, digests))
    return out


def _rank_main(rank, world, group, shapes, fmt, tokens_list, variants, iters, rounds=1, power=False):
    import torch

    from vllm_megamoe import SymmBuffer, reference
    from vllm_megamoe.kernels import phase_clock, sm90_mega_moe, sm90_tuning

    from benchmarks.common import local_weights, median_us, rotating_inputs
    from benchmarks.power_probe import sample_clocks, stop_samples
    from benchmarks.timing import capture_graph, time_events

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in shapes:
        shape = probe_shape(name)
        weights = local_weights(shape, world, rank, fmt, dev)
        # A buffer per source tree: trees may differ in the barrier protocol (which workspace words
        # a call signals and waits on, against targets from the buffer's call count), so one tree's
        # calls must not move another's counters.
        trees = {variant_env(v).get(KNOBS["csrc"], "") for v in variants}
        bufs = {t: SymmBuffer(shape, max(tokens_list), group, format=fmt, device=dev) for t in sorted(trees)}
        for tokens in tokens_list:
            sets, static, load = rotating_inputs(shape, tokens, dev, rank + 7 * tokens, group)
            y = torch.empty(tokens, shape.hidden, dtype=torch.bfloat16, device=dev)

            baseline = None
            measured: dict[str, list[dict]] = {}
            # Round after round over the variants: a drift of the GPU during the call (two runs of
            # one build 18 % apart at 1 token, docs/kernel_design.md) then reaches every variant.
            for variant in [v for _ in range(rounds) for v in variants]:
                env, options = variant_env(variant), variant_options(variant)
                buf = bufs[env.get(KNOBS["csrc"], "")]
                with scoped_env(env):
                    out = sm90_mega_moe.mega_moe(*sets[0], weights, buf, options=options).clone()
                    if baseline is None:
                        baseline = out
                    # Inputs and weights are seeded, so builds of other sources (kernel_probe runs with
                    # VLLM_MEGAMOE_CSRC_DIR) that must not change results can be compared bit for bit.
                    digest = hashlib.sha1(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
                    err = reference.relative_error(out, baseline)
                    graph = capture_graph(lambda: sm90_mega_moe.mega_moe(*static, weights, buf, y=y, options=options))
                    sampler = sample_clocks(torch.cuda.current_device()) if power and rank == 0 else None
                    times = time_events(graph.replay, iters, 2, load)
                    timed_mhz, timed_w = stop_samples(sampler)
                    del graph
                    load(0)
                    clock = phase_clock.new_clock(sm90_mega_moe.grid_size(shape, buf, options), dev,
                                                  trace=options.chunk_trace)
                    sm90_mega_moe.mega_moe(*static, weights, buf, y=y, phase_clock=clock, options=options)
                    torch.cuda.synchronize()
                    summary = phase_clock.summarize(clock)
                    resolved = sm90_tuning.choose(shape, fmt, world, tokens).label()
                row = dict(shape=name, hidden=shape.hidden, intermediate=shape.intermediate,
                           experts=shape.num_experts, topk=shape.topk, format=fmt, tokens_per_rank=tokens,
                           variant=variant, rank=rank, mainloop=resolved,
                           graph_us=median_us(times), rel_err_vs_first_variant=err, out_sha1=digest,
                           timed_sm_mhz=timed_mhz, timed_power_w=timed_w,
                           timed_window_s=sum(times) * 1e-3 if sampler is not None else None,  # times in ms
                           clock_total_us=summary.get("total_us"), ctas=summary.get("ctas"),
                           phases_us=phase_row(summary) if summary else {},
                           # every mark's first and latest CTA (us from the first CTA's start): the
                           # steps inside a phase, e.g. staged -> dispatched (the dispatch barrier)
                           marks_us={m: [round(v["first_us"], 3), round(v["last_us"], 3)]
                                     for m, v in summary.get("marks", {}).items()},
                           task_us=summary.get("task_us", {}) if summary else {},
                           chunk_trace=summary.get("chunk_trace", {}) if summary else {},
                           task_trace=summary.get("task_trace", {}) if summary else {})
                measured.setdefault(variant, []).append(row)
            rows += [combine_rounds(measured[v]) for v in variants]
        for buf in bufs.values():
            buf.destroy()
        del weights, buf, bufs
        torch.cuda.empty_cache()
    return rows


def compile_only(shapes: list[str], fmt: str, tokens_list: list[int], variants: list[str], world: int) -> list[str]:
    """Compiles every build the probe of these arguments would run into the JIT cache
    (VLLM_MEGAMOE_CACHE_DIR), without a GPU: the cache keys depend only on the spec, the sources
    and the compiler (NVRTC's version), so a cache filled here and carried to the device saves
    the device its compile time. Returns one line per build."""
    from vllm_megamoe.kernels import jit, sm90_mega_moe

    lines = []
    for name in shapes:
        shape = probe_shape(name)
        for variant in variants:
            with scoped_env(variant_env(variant)):
                # kernel_probe's buffers hold max(tokens) per rank (_rank_main), and its first call of
                # a shape loads every build the layer may run (sm90_mega_moe.load_kernel).
                for spec in sm90_mega_moe.layer_kernel_specs([shape], fmt, world, max(tokens_list),
                                                             options=variant_options(variant)):
                    compiled = jit.compile_kernel(spec)
                    lines.append(f"{name} {variant}: {sm90_mega_moe.describe_spec(spec)} "
                                 f"{'cached' if compiled.from_cache else 'compiled'} {compiled.key[:12]}")
    return lines


def merge(rows_per_rank: list[list[dict]]) -> list[dict]:
    """One row per case: the slowest rank's time and, per phase, the largest over ranks (a skew or
    imbalance between the ranks then shows in two phases: the early rank's barrier waits and the
    late rank's work); `per_rank` keeps each rank's own time, phases and task counts."""
    cases: dict[tuple, dict] = {}
    for rows in rows_per_rank:
        for r in rows:
            key = (r["shape"], r["format"], r["tokens_per_rank"], r["variant"])
            m = cases.setdefault(key, dict(r, phases_us=dict(r["phases_us"]), ranks=0, per_rank=[]))
            m["ranks"] += 1
            tasks = r.get("task_us") or {}
            m["per_rank"].append(dict(rank=r.get("rank"), graph_us=r["graph_us"], phases_us=dict(r["phases_us"]),
                                      l1_tasks=tasks.get("l1_tasks"), l2_tasks=tasks.get("l2_tasks")))
            if m["ranks"] > 1:  # each rank's output digest, in rank order
                m["out_sha1"] = f"{m.get('out_sha1')},{r.get('out_sha1')}"
            m["graph_us"] = max(m["graph_us"], r["graph_us"])
            if m["ranks"] > 1 and r.get("graph_us_rounds"):  # per round, the slower rank's
                m["graph_us_rounds"] = [max(a, b) for a, b in zip(m["graph_us_rounds"], r["graph_us_rounds"])]
            m["rel_err_vs_first_variant"] = max(m["rel_err_vs_first_variant"], r["rel_err_vs_first_variant"])
            m["clock_total_us"] = max(m["clock_total_us"] or 0.0, r["clock_total_us"] or 0.0)
            for k, v in r["phases_us"].items():
                m["phases_us"][k] = max(m["phases_us"].get(k, 0.0), v)
            m["task_us"] = dict(m.get("task_us") or {})
            for k, v in (r.get("task_us") or {}).items():  # task counts summed, times the slower rank's
                m["task_us"][k] = (m["task_us"].get(k, 0.0) + v if k.endswith("_tasks") and m["ranks"] > 1
                                   else max(m["task_us"].get(k, 0.0), v))
            if not m.get("chunk_trace"):  # kept from the first rank that traced (one rank's cycles, not a max)
                m["chunk_trace"] = r.get("chunk_trace") or {}
            if not m.get("task_trace"):
                m["task_trace"] = r.get("task_trace") or {}
            m.pop("rank", None)
    return list(cases.values())


def _row_label(r: dict) -> str:
    return f"{r['shape'][:9]:>9} {r['tokens_per_rank']:>5} {r['variant'][-9:]:>9}: "


def table(rows: list[dict]) -> str:
    head = ["shape", "tok", "variant", "graph us", "clock us"] + [p[0] for p in PHASES] + ["err"]
    lines = ["  ".join(f"{h:>9}" for h in head)]
    for r in rows:
        cells = [r["shape"][:9], str(r["tokens_per_rank"]), r["variant"][-9:], f"{r['graph_us']:.0f}",
                 f"{r['clock_total_us']:.0f}"]
        cells += [f"{r['phases_us'].get(p[0], float('nan')):.0f}" for p in PHASES]
        cells.append(f"{r['rel_err_vs_first_variant']:.1e}")
        lines.append("  ".join(f"{c:>9}" for c in cells))
    repeated = [r for r in rows if len(r.get("graph_us_rounds") or []) > 1]
    if repeated:  # graph us of each round (the table above: their median)
        lines += ["", "graph us per round:"]
        lines += [_row_label(r) + "  ".join(f"{us:9.1f}" for us in r["graph_us_rounds"]) for r in repeated]
    ranked = [r for r in rows if len(r.get("per_rank") or []) > 1]
    if ranked:  # each rank's own phases: which rank waited in a barrier and which one worked
        lines += ["", f"{'phases per rank (us):':<29}" + "  ".join(f"{p[0]:>9}" for p in PHASES) + "  graph us  tasks L1/L2"]
        for r in ranked:
            for pr in r["per_rank"]:
                lines.append(_row_label(r) + f"r{pr['rank']} " + "  ".join(
                    f"{pr['phases_us'].get(p[0], float('nan')):9.0f}" for p in PHASES)
                    + f"  {pr['graph_us']:8.0f}  {pr.get('l1_tasks') or 0:.0f}/{pr.get('l2_tasks') or 0:.0f}")
    spans = [r for r in rows if r.get("task_us")]
    if spans:  # an average task's spans (phase_clock.task_spans)
        keys = ("l1_gemm", "l1_epilogue", "l1_between", "l2_wait", "l2_gemm", "l2_epilogue", "l2_between")
        # The SM clock of the clocked call, and the K loops in kilocycles: at prefill the clock is what
        # the power cap leaves (docs/kernel_design.md), so a change's time can move with the clock alone.
        lines += ["", "us per task: " + "  ".join(f"{k:>11}" for k in keys)
                  + "  tasks L1/L2    GHz  L1/L2 gemm kcycles"]
        for r in spans:
            t = r["task_us"]
            ghz = t.get("sm_ghz", float("nan"))
            lines.append(_row_label(r) + "  ".join(f"{t.get(k, float('nan')):11.2f}" for k in keys)
                         + f"  {t.get('l1_tasks', 0):.0f}/{t.get('l2_tasks', 0):.0f}  {ghz:5.2f}"
                         + f"  {t.get('l1_gemm', float('nan')) * ghz:.1f}/{t.get('l2_gemm', float('nan')) * ghz:.1f}")
    powered = [r for r in rows if r.get("timed_power_w") is not None]
    if powered:  # --power: nvidia-smi's medians while rank 0 timed the case (its median round)
        # power.draw is an average over about a second: a window under ~2 s reads low (idle before it)
        lines += ["", "while timed (rank 0):  SM MHz  power W  window s"]
        for r in powered:
            window = r.get("timed_window_s")
            lines.append(_row_label(r) + f"{r['timed_sm_mhz']:13.0f}  {r['timed_power_w']:7.0f}  "
                         + ("-" if window is None else f"{window:8.1f}")
                         + ("  (short: reads low)" if window is not None and window < SHORT_POWER_WINDOW_S else ""))
    traced = [r for r in rows if r.get("chunk_trace")]
    if traced:  # SM cycles per interval of a traced K chunk, warpgroup 0 / warpgroup 1 (phase_clock.chunk_trace)
        from vllm_megamoe.kernels.phase_clock import TRACE_INTERVALS
        lines += ["", "cycles per chunk, wg0/wg1: " + "  ".join(f"{k:>15}" for k in TRACE_INTERVALS) + "  total"]
        for r in traced:
            t = r["chunk_trace"]
            lines.append(_row_label(r) + "  ".join(f"{t[k]['wg0']:7.0f}/{t[k]['wg1']:<7.0f}" for k in TRACE_INTERVALS)
                         + f"  {t['chunk_cycles']:.0f}")
    tasked = [r for r in rows if r.get("task_trace")]
    if tasked:  # SM cycles around a traced GEMM task, warpgroup 0 / 1 (phase_clock.task_trace)
        from vllm_megamoe.kernels.phase_clock import TASK_INTERVALS
        lines += ["", "cycles per task, wg0/wg1:  " + "  ".join(f"{k:>15}" for k in TASK_INTERVALS) + "  CTAs"]
        for r in tasked:
            for phase, t in sorted(r["task_trace"].items()):
                cells = [f"{t[k]['wg0']:7.0f}/{t[k]['wg1']:<7.0f}" if k in t else f"{'-':>15}" for k in TASK_INTERVALS]
                lines.append(_row_label(r) + f"{phase} " + "  ".join(cells) + f"  {t['ctas']}")
    return "\n".join(lines)


def markdown(path: str) -> str:
    """A recorded probe (--out) as a markdown table (what docs/kernel_design.md shows)."""
    with open(path) as f:
        data = json.load(f)
    env = data["env"]
    lines = [f"Source: `{os.path.relpath(path)}` ({env['gpus']} x {env['gpu']}, torch {env['torch']}, commit "
             f"`{env.get('commit') or '?'}`); graph-replayed median us (max over ranks); phases from one "
             "eager call with the phase clock (the latest CTA, max over ranks; dispatch includes the "
             "ranks' launch skew); err: vs the first variant.", "",
             "| shape | tokens/rank | variant | mainloop/stages/tile | graph us | " + " | ".join(p[0] for p in PHASES) + " | err |",
             "|" + " --- |" * (6 + len(PHASES))]
    for r in data["rows"]:
        phases = " | ".join(f"{r['phases_us'].get(p[0], float('nan')):.0f}" for p in PHASES)
        lines.append(f"| {r['shape']} | {r['tokens_per_rank']} | {r['variant']} | {r.get('mainloop', '?')} | "
                     f"{r['graph_us']:.0f} | {phases} | "
                     f"{r['rel_err_vs_first_variant']:.1e} |")
    return "\n".join(lines)


def versus(probe_path: str, bench_path: str, routing: str = "uniform") -> str:
    """The probe's default-variant times next to a benchmark file's SGLang, portable and chain
    figures and roofline for the same shape and tokens per rank (two runs: read as indicative)."""
    from benchmarks import report
    with open(probe_path) as f:
        probe = json.load(f)
    rows, doc = report.load_rows(bench_path)
    bench = {(r["shape"], r["tokens_per_rank"], r["path"]): r for r in rows
             if r.get("routing") == routing and r.get("format") == "fp8-block" and not r.get("error")}
    lines = [f"Fused kernel: `{os.path.relpath(probe_path)}` (commit `{probe['env'].get('commit') or '?'}`, "
             f"graph-replayed); the other paths and the roofline: `{os.path.relpath(bench_path)}` (commit "
             f"`{doc.get('env', {}).get('commit') or '?'}`, {routing} routing, end-to-end us). Two runs on "
             "the same kind of machine; SGLang's kernel-only time in brackets.", "",
             "| shape | tokens/rank | roofline us | megamoe us | frac | sglang us [kernel] | megamoe x sglang | "
             "portable us | chain us | megamoe x chain |", "|" + " --- |" * 10]
    for r in probe["rows"]:
        if r["variant"] != "default":
            continue
        key = (r["shape"], r["tokens_per_rank"])
        sg, po, ch = (bench.get(key + (p,)) or {} for p in ("sglang", "portable", "chain"))
        roof = (sg or po or ch).get("roofline", {}).get("roofline_us")
        mine = r["graph_us"]

        def f(v, fmt=".0f"):
            return format(v, fmt) if v else "n/a"
        lines.append(f"| {r['shape']} | {r['tokens_per_rank']} | {f(roof)} | {f(mine)} | "
                     f"{f(roof / mine if roof else None, '.2f')} | {f(sg.get('e2e_us'))} [{f(sg.get('kernel_us'))}] | "
                     f"{f(sg.get('e2e_us') / mine if sg.get('e2e_us') else None, '.2f')} | {f(po.get('e2e_us'))} | "
                     f"{f(ch.get('e2e_us'))} | {f(ch.get('e2e_us') / mine if ch.get('e2e_us') else None, '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", metavar="JSON", help="print a recorded probe as a markdown table and exit")
    ap.add_argument("--versus", metavar="BENCH_JSON",
                    help="with --report: the probe's default variant next to a benchmark file's other paths")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["v4-flash"],
                    help="standard shape names (benchmarks.common.STANDARD_SHAPES) or HIDDENxINTERxEXPERTSxTOPK")
    ap.add_argument("--format", default="fp8-block")
    ap.add_argument("--tokens", nargs="+", type=int, default=[8, 128, 1024])
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variants this many times in turn (v1 v2 .. v1 v2 ..) and report each "
                         "case's median round: A/B at a few tokens per rank drifts within one call")
    ap.add_argument("--power", action="store_true",
                    help="sample the SM clock and board power (nvidia-smi) while rank 0 times each case")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile every build of these arguments into VLLM_MEGAMOE_CACHE_DIR (carry that "
                         "folder to the device and point VLLM_MEGAMOE_CACHE_DIR at it there)")
    args = ap.parse_args(argv)
    if args.report:
        print(versus(args.report, args.versus) if args.versus else markdown(args.report))
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    if len(set(args.variants)) < len(args.variants):
        ap.error(f"--variants {' '.join(args.variants)}: each variant once (--rounds repeats them)")
    for v in args.variants:
        variant_env(v), variant_options(v)  # bad variants and shapes fail before any process starts
    for spec in args.shapes:
        probe_shape(spec)
    if args.compile_only:
        for line in compile_only(args.shapes, args.format, args.tokens, args.variants, args.gpus):
            print(line, flush=True)
        return 0
    from vllm_megamoe.launch import run_ranks
    results = run_ranks(_rank_main, args.gpus,
                        (args.shapes, args.format, args.tokens, args.variants, args.iters, args.rounds, args.power),
                        backend="nccl", timeout_s=args.timeout)
    rows = merge(results)
    print(table(rows), flush=True)
    if args.out:
        import torch

        from benchmarks.bench import commit_id
        from vllm_megamoe.kernels.sm90_tuning import FP8_TILE128_BUILD
        with open(args.out, "w") as f:
            json.dump(dict(env=dict(gpu=torch.cuda.get_device_name(0), gpus=args.gpus, torch=torch.__version__,
                                    commit=commit_id(), fp8_tile128=FP8_TILE128_BUILD), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
