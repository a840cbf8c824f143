"""Per-phase timing of one launch of the fused SM90 kernel (csrc/sm90/mega/phase_clock.cuh).

Kernel-level tools see one launch; this sees inside it. Pass `phase_clock=new_clock(...)` to
`sm90_mega_moe.mega_moe`: thread 0 of every CTA writes %globaltimer at each mark below, and
`summarize` turns the [CTAs, marks] nanoseconds into phase durations (from the earliest start):
when the slowest CTA finished each step and how far apart the CTAs were.
"""
from __future__ import annotations

import torch

# Same names, same order as enum PhaseMark in csrc/sm90/mega/phase_clock.cuh (tested).
MARKS = ("start", "staged", "dispatched", "pulled", "l1_start", "l1_done", "l2_start", "l2_done", "combined",
         "end")


def new_clock(grid: int, device: torch.device) -> torch.Tensor:
    """A zeroed [grid, len(MARKS)] int64 tensor for one launch with `grid` CTAs."""
    return torch.zeros(grid, len(MARKS), dtype=torch.int64, device=device)


def summarize(clock: torch.Tensor) -> dict:
    """Per mark: microseconds from the first CTA's start to the earliest / latest CTA reaching
    it; per phase: the latest CTA's time from the previous mark (critical path) and the spread."""
    ns = clock.detach().to("cpu", torch.float64)
    ns = ns[(ns > 0).all(dim=1)]  # CTAs that wrote every mark
    if ns.numel() == 0:
        return {}
    rel = (ns - ns[:, 0].min()) / 1e3
    first, last = rel.min(dim=0).values.tolist(), rel.max(dim=0).values.tolist()
    out = dict(ctas=int(ns.shape[0]), total_us=last[-1],
               marks={m: dict(first_us=f, last_us=l) for m, f, l in zip(MARKS, first, last)})
    out["phases_us"] = {f"{a}->{b}": last[i + 1] - last[i] for i, (a, b) in enumerate(zip(MARKS, MARKS[1:]))}
    return out
