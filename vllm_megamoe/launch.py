"""Run a function on N local processes joined in a gloo process group (CPU multi-rank).

Used by the demo, the tests and the benchmarks to exercise the multi-rank protocol without GPUs:
    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, group, *args)
Each result is what fn returned on that rank; an exception on any rank is re-raised here with
the rank's traceback. Every process is bounded by `timeout_s` and killed after it.
"""
from __future__ import annotations

import datetime
import os
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised or died; `.rank` and `.remote_traceback` say which and how."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        super().__init__(f"rank {rank}: {message}\n{remote_traceback}")
        self.rank, self.remote_traceback = rank, remote_traceback


# NVLink multicast stays off: it is not needed and can take shared GPUs out of service.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank, world_size, port, fn, args, queue, pg_timeout_s, env, backend):
    import torch
    import torch.distributed as dist
    os.environ.update(SAFE_ENV)
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        result = fn(rank, world_size, dist.group.WORLD, *args)
        queue.put((rank, True, result))
    except BaseException as exc:  # report everything, including SystemExit from a test
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *,
              timeout_s: float = 300.0, pg_timeout_s: float = 60.0, env: dict | None = None,
              allow_failures: bool = False, backend: str = "gloo") -> list:
    """Run fn(rank, world_size, group, *args) on `world_size` processes; return their results.

    backend "gloo" (CPU) or "nccl" (rank r uses cuda:r and the group is an NCCL group).
    With allow_failures=True, a failed rank's entry is a RankFailed instead of raising.
    """
    import torch.distributed as dist
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # The rendezvous store listens here, on a port the OS picks while binding it: a port chosen
    # first and bound later by rank 0 was taken by another process in between (EADDRINUSE).
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout_s))
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, pg_timeout_s,
                                               dict(env or {}), backend), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:
                # A rank that died without reporting (killed, os._exit) never answers.
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive() and queue.empty():
                        results[r] = RankFailed(r, f"process exited with code {p.exitcode}")
                continue
            results[rank] = payload if ok else RankFailed(rank, "raised", payload)
    finally:
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join()
    for r in range(world_size):
        results.setdefault(r, RankFailed(r, f"no result within {timeout_s:g} s"))
    ordered = [results[r] for r in range(world_size)]
    failed = [res for res in ordered if isinstance(res, RankFailed)]
    if failed and not allow_failures:
        if len(failed) == 1:
            raise failed[0]
        # Report every failed rank: the first one is often only the victim of another's crash.
        raise RankFailed(failed[0].rank, "several ranks failed:\n" + "\n".join(str(f) for f in failed))
    return ordered
