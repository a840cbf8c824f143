"""Per-phase timing of one launch of the fused SM90 kernel (csrc/sm90/mega/phase_clock.cuh).

Kernel-level tools see one launch; this sees inside it. Pass `phase_clock=new_clock(...)` to
`sm90_mega_moe.mega_moe`: thread 0 of every CTA writes %globaltimer at each mark below and, at the
end, the SM cycles its GEMM tasks spent in each span below (mainloop, epilogue, waits; two spans
count tasks). `summarize` turns the [CTAs, marks + spans] row into phase durations (from the
earliest start): when the slowest CTA finished each step and how far apart the CTAs were, and the
microseconds of an average task's spans.
"""
from __future__ import annotations

import torch

# Same names, same order as enum PhaseMark in csrc/sm90/mega/phase_clock.cuh (tested).
MARKS = ("start", "staged", "dispatched", "pulled", "l1_start", "l1_done", "l2_start", "l2_done", "combined",
         "end")
# Same as enum TaskSpan: SM cycles summed over a CTA's tasks, or (*_tasks) a count of tasks.
SPANS = ("l1_loop", "l1_tasks", "l1_gemm", "l1_epilogue", "l2_loop", "l2_tasks", "l2_wait", "l2_gemm",
         "l2_epilogue")
COLUMNS = len(MARKS) + len(SPANS)
# Chunk trace (builds with sm90_mega_moe.BuildOptions.chunk_trace; the constants of phase_clock.cuh, tested):
# clock64 of lane 0 of each warp at TRACE_POINTS points of K chunks TRACE_FIRST_CHUNK.. of the
# CTA's L1 task number TRACE_TASK (the default; BuildOptions.trace_task picks another),
# as [warp][chunk][point] after the marks and spans.
WARPS = 8
TRACE_TASK, TRACE_FIRST_CHUNK, TRACE_CHUNKS = 2, 8, 5
TRACE_POINTS = ("start", "landed", "g0_issued", "g1_prev_waited", "g1_prev_promoted", "barrier", "refill",
                "g1_issued", "g0_waited")
# The interval that ends at each point, then g0's promotion (g0_waited to the next chunk's start).
TRACE_INTERVALS = ("stage_wait", "issue_g0", "wait_g1_prev", "promote_g1_prev", "cta_barrier", "refill",
                   "issue_g1", "wait_g0", "promote_g0")
TRACE_COLUMNS = WARPS * TRACE_CHUNKS * len(TRACE_POINTS)
# Task trace (the same builds; enum TaskTracePoint): clock64 of lane 0 of each MMA warp at
# TASK_POINTS of the CTA's tasks number TRACE_TASK and TRACE_TASK + 1 of each GEMM phase, as
# [phase L1 / L2][warp][task][point] after the chunk trace.
TASK_POINTS = ("entry", "operands", "barrier_arrive", "block_ready", "gemm_done", "epilogue_start", "done",
               "queued")
# The interval that ends at each point after the first (block_check: warp 0's is thread 0's checks
# of the token blocks; block_barrier: the wait at that barrier), then `between`: the first task's
# `queued` to the second's entry (the task queue's barrier).
TASK_INTERVALS = ("lookup", "block_check", "block_barrier", "gemm", "tile_wait", "epilogue", "slot_write",
                  "between")
TASK_TRACE_TASKS = 2
TASK_TRACE_COLUMNS = 2 * WARPS * TASK_TRACE_TASKS * len(TASK_POINTS)


def columns(trace: bool = False) -> int:
    """int64 columns per CTA row: marks and spans, plus the chunk and task traces in trace builds."""
    return COLUMNS + (TRACE_COLUMNS + TASK_TRACE_COLUMNS if trace else 0)


def new_clock(grid: int, device: torch.device, trace: bool = False) -> torch.Tensor:
    """A zeroed [grid, columns(trace)] int64 tensor for one launch with `grid` CTAs."""
    return torch.zeros(grid, columns(trace), dtype=torch.int64, device=device)


def summarize(clock: torch.Tensor) -> dict:
    """Per mark: microseconds from the first CTA's start to the earliest / latest CTA reaching
    it; per phase: the latest CTA's time from the previous mark (critical path) and the spread;
    with span columns, `task_us`: an average task's span in microseconds (task_spans)."""
    full = clock.detach().to("cpu", torch.float64)
    written = (full[:, :len(MARKS)] > 0).all(dim=1)  # CTAs that wrote every mark
    ns, full = full[written, :len(MARKS)], full[written]
    if ns.numel() == 0:
        return {}
    rel = (ns - ns[:, 0].min()) / 1e3
    first, last = rel.min(dim=0).values.tolist(), rel.max(dim=0).values.tolist()
    out = dict(ctas=int(ns.shape[0]), total_us=last[-1],
               marks={m: dict(first_us=f, last_us=l) for m, f, l in zip(MARKS, first, last)})
    out["phases_us"] = {f"{a}->{b}": last[i + 1] - last[i] for i, (a, b) in enumerate(zip(MARKS, MARKS[1:]))}
    if full.shape[1] >= COLUMNS:
        out["task_us"] = task_spans(full[:, :COLUMNS])
    if full.shape[1] == columns(True):
        trace = chunk_trace(full)  # the written CTAs' rows, already on the host
        if trace:
            out["chunk_trace"] = trace
        tasks = task_trace(full)
        if tasks:
            out["task_trace"] = tasks
    return out


def chunk_trace(clock: torch.Tensor) -> dict:
    """SM cycles of each interval of a traced K chunk (TRACE_INTERVALS), from the trace columns
    of a trace build's clock: mean over the CTAs that wrote the trace, the traced chunks and the
    warps of each warpgroup (`wg0`, `wg1`), and the largest warp mean (`max_warp`); promote_g0
    ends at the next chunk's start, so it comes from all traced chunks but the last. {} when no
    CTA traced (no L1 task number TRACE_TASK with enough chunks)."""
    t = clock[:, COLUMNS:COLUMNS + TRACE_COLUMNS].to(torch.float64)
    t = t.reshape(-1, WARPS, TRACE_CHUNKS, len(TRACE_POINTS))
    t = t[(t > 0).all(dim=3).all(dim=2).all(dim=1)]  # CTAs whose every warp wrote every point
    if t.shape[0] == 0:
        return {}
    within = t[..., 1:] - t[..., :-1]                 # [cta, warp, chunk, point - 1]
    promote = t[:, :, 1:, 0] - t[:, :, :-1, -1]       # g0_waited -> next chunk's start
    per_warp = torch.cat([within.mean(dim=(0, 2)), promote.mean(dim=(0, 2)).unsqueeze(1)], dim=1)  # [warp, interval]
    half = WARPS // 2
    out = {"ctas": int(t.shape[0]), "chunk_cycles": float(per_warp.sum(dim=1).mean())}
    for i, name in enumerate(TRACE_INTERVALS):
        out[name] = dict(wg0=float(per_warp[:half, i].mean()), wg1=float(per_warp[half:, i].mean()),
                         max_warp=float(per_warp[:, i].max()))
    return out


def task_trace(clock: torch.Tensor) -> dict:
    """SM cycles of each interval around a GEMM task (TASK_INTERVALS), per phase (`l1`, `l2`),
    from the task-trace columns of a trace build's clock: mean over the CTAs whose warps wrote
    every point of the traced task (`between`: and the next task's entry) of each warpgroup's
    warps (`wg0`, `wg1`), the largest warp mean (`max_warp`) and `ctas`. The warp that a barrier
    waits for is the one with the shortest interval ending past it. {} when no CTA traced."""
    start = COLUMNS + TRACE_COLUMNS
    t = clock[:, start:start + TASK_TRACE_COLUMNS].to(torch.float64)
    t = t.reshape(-1, 2, WARPS, TASK_TRACE_TASKS, len(TASK_POINTS))
    out = {}
    for p, phase in enumerate(("l1", "l2")):
        x = t[:, p]                                                  # [cta, warp, task, point]
        whole = x[(x[:, :, 0] > 0).all(dim=2).all(dim=1)]            # the first task's every point
        if whole.shape[0] == 0:
            continue
        within = whole[:, :, 0, 1:] - whole[:, :, 0, :-1]            # [cta, warp, point - 1]
        per_warp = within.mean(dim=0)                                # [warp, interval]
        nxt = whole[(whole[:, :, 1, 0] > 0).all(dim=1)]
        between = (nxt[:, :, 1, 0] - nxt[:, :, 0, -1]).mean(dim=0) if nxt.shape[0] else None
        half = WARPS // 2
        row = {"ctas": int(whole.shape[0]), "ctas_between": int(nxt.shape[0])}
        for i, name in enumerate(TASK_INTERVALS):
            v = per_warp[:, i] if name != "between" else between
            if v is None:
                continue
            row[name] = dict(wg0=float(v[:half].mean()), wg1=float(v[half:].mean()), max_warp=float(v.max()))
        out[phase] = row
    return out


def task_spans(clock: torch.Tensor) -> dict:
    """An average task's spans in microseconds, from the span columns of every CTA: cycles summed
    over CTAs / tasks, at the SM clock the CTAs' own L1 marks and cycles imply. `l*_between`: the
    loop's cycles outside its tasks (the task queue's barrier and hand-off)."""
    c = clock.to(torch.float64)
    col = {name: c[:, len(MARKS) + i] for i, name in enumerate(SPANS)}
    l1_ns = c[:, MARKS.index("l1_done")] - c[:, MARKS.index("l1_start")]
    busy = (l1_ns > 0) & (col["l1_loop"] > 0)
    if not bool(busy.any()):
        return {}
    ghz = float(col["l1_loop"][busy].sum() / l1_ns[busy].sum())  # cycles per ns
    out = {"sm_ghz": ghz}
    for phase, spans in (("l1", ("gemm", "epilogue")), ("l2", ("wait", "gemm", "epilogue"))):
        tasks = float(col[f"{phase}_tasks"].sum())
        out[f"{phase}_tasks"] = tasks
        if tasks == 0:
            continue
        per_task = {s: float(col[f"{phase}_{s}"].sum()) / tasks / ghz / 1e3 for s in spans}
        loop = float(col[f"{phase}_loop"].sum()) / tasks / ghz / 1e3
        out.update({f"{phase}_{s}": us for s, us in per_task.items()})
        out[f"{phase}_between"] = loop - sum(per_task.values())
    return out
