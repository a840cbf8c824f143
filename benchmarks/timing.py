"""How a call is timed: CUDA events end to end, the profiler's kernel time, CUDA graph capture.

- End to end: CUDA events around the whole op as a user calls it (input staging included),
  replayed from a CUDA graph when the path is capturable; before each timed call (untimed) the
  next of the rotating input sets is copied into the call's static inputs and the ranks meet.
- Kernel time: torch.profiler (kineto) over back-to-back calls; the sum of the durations of all
  device activities (kernels, memcpy, memset) divided by the number of calls.
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable, Optional


def summarize_kernel_events(events: Iterable[tuple[str, float]], calls: int, top: int = 3) -> dict:
    """(name, duration us) of every device activity over `calls` calls -> per-call figures."""
    if calls <= 0:
        raise ValueError("calls must be positive")
    by_name: dict[str, float] = {}
    count = 0
    for name, us in events:
        by_name[name] = by_name.get(name, 0.0) + float(us)
        count += 1
    if count == 0:
        return dict(kernel_us=None, kernels_per_call=0, top_kernels=[])
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return dict(kernel_us=sum(by_name.values()) / calls, kernels_per_call=count / calls,
                top_kernels=[[name[:80], us / calls] for name, us in ranked])


def stats_us(times_ms: list[float]) -> dict:
    """Median, min and spread (us) of per-call times in ms."""
    if not times_ms:
        return dict(median_us=None, min_us=None, p90_us=None, n=0)
    srt = sorted(times_ms)
    return dict(median_us=statistics.median(srt) * 1e3, min_us=srt[0] * 1e3,
                p90_us=srt[min(len(srt) - 1, int(0.9 * len(srt)))] * 1e3, n=len(srt))


def time_events(fn: Callable[[], object], iters: int, warmup: int,
                before: Optional[Callable[[int], None]] = None) -> list[float]:
    """Per-call times (ms) of fn with CUDA events; before(i) runs untimed ahead of each call."""
    import time

    import torch

    if not torch.cuda.is_available():  # CPU dry runs: wall clock
        out = []
        for i in range(warmup + iters):
            if before is not None:
                before(i)
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
        return out
    for i in range(warmup):
        if before is not None:
            before(i)
        fn()
    torch.cuda.synchronize()
    out = []
    for i in range(iters):
        if before is not None:
            before(warmup + i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def drop_first_call(events: list[tuple[float, str, float]], calls: int) -> list[tuple[str, float]]:
    """(start, name, duration) of `calls` + 1 back-to-back calls -> (name, duration) of the last
    `calls`. The first call absorbs what starting the profiler costs, which differs between ranks:
    a collective kernel would otherwise count the wait for the slowest rank's profiler (once
    ~250 ms) as kernel time. Calls are told apart by order, so each must launch the same number
    of device activities; otherwise every call is kept (and the caller divides by calls + 1)."""
    ordered = sorted(events)
    if calls <= 0 or len(ordered) % (calls + 1):
        return [(name, dur) for _, name, dur in ordered]
    per_call = len(ordered) // (calls + 1)
    return [(name, dur) for _, name, dur in ordered[per_call:]]


def profile_kernels(fn: Callable[[], object], calls: int) -> dict:
    """Kernel time per call of fn from torch.profiler over calls + 1 calls, the first dropped
    (see drop_first_call and summarize_kernel_events)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls + 1):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = []
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            events.append((evt.time_range.start, evt.name, evt.time_range.end - evt.time_range.start))
    kept = drop_first_call(events, calls)
    return summarize_kernel_events(kept, calls if len(kept) < len(events) else calls + 1)


def capture_graph(fn: Callable[[], object]):
    """Warm fn up on a side stream, then capture one call of it; returns the CUDAGraph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph
