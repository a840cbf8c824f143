"""Write a plan's shards: copy non-expert tensors, convert experts chunk by chunk, hash.

Every shard file is created at full size with its header, then filled by independent jobs
(a tensor copy, or a chunk of one layer's experts) with positional writes, so `workers` threads
(torch ops and file I/O release the GIL) can fill it in any order and the bytes are the same.
A shard is written as `<name>.partial`, hashed (sha256) and renamed when complete. Memory: each
running job holds one chunk of experts (about `chunk_bytes` of source weights plus the
conversion's temporaries), so peak memory is about workers x a few chunk_bytes. While it runs,
torch's intra-op threads are set to 1: parallel chunks (--workers) scale better than parallel
ops on these per-expert tensors.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Optional

import torch

from .layouts import to_kernel_layout
from .plan import CopyUnit, ExpertUnit, Plan, Shard
from .safetensors_io import build_header, copy_bytes, pwrite_all, sha256_file, tensor_bytes

# Source bytes converted per job (whole experts, at least one). Small on purpose: the
# conversion's float32 temporaries then stay below glibc's mmap threshold (32 MiB) and are
# reused from the heap instead of being page-faulted afresh, which is 4-6x faster on CPU.
DEFAULT_CHUNK_BYTES = 16 * 2**20
PARTIAL_SUFFIX = ".partial"


class Progress:
    """Thread-safe byte counter around tqdm (or nothing)."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        self._lock = threading.Lock()
        self._bar = None
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True,
                             unit_divisor=1024, desc=desc, dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def expert_chunks(unit: ExpertUnit, chunk_bytes: int) -> list:
    per_chunk = max(1, chunk_bytes // max(1, unit.layer.source_bytes_per_expert))
    n = unit.layer.num_experts
    return [(s, min(n, s + per_chunk)) for s in range(0, n, per_chunk)]


def convert_expert_chunk(unit: ExpertUnit, arch: str, start: int, stop: int) -> dict:
    """{output tensor name: converted tensor of experts [start, stop)}."""
    w13, w2, s13, s2 = unit.layer.read(start, stop)
    kernel = to_kernel_layout(w13, w2, arch=arch, fmt=unit.fmt, w13_scale_inv=s13,
                              w2_scale_inv=s2)
    return {f"{unit.layer.prefix}.{k}": v for k, v in kernel.named(unit.fmt).items()}


def _write_expert_chunk(fd, offsets, unit, arch, start, stop, progress) -> None:
    converted = convert_expert_chunk(unit, arch, start, stop)
    per_expert = {t.name: t.nbytes // unit.layer.num_experts for t in unit.outputs}
    for name, tensor in converted.items():
        data = tensor_bytes(tensor)
        if len(data) != per_expert[name] * (stop - start):
            raise RuntimeError(f"{name}: converted experts {start}..{stop} have {len(data)} "
                               f"bytes, the plan expected {per_expert[name] * (stop - start)}")
        pwrite_all(fd, data, offsets[name] + start * per_expert[name])
        progress.update(len(data))


def _write_copy(fd, offsets, unit: CopyUnit, progress) -> None:
    copy_bytes(unit.info, fd, offsets[unit.info.name])
    progress.update(unit.info.nbytes)


def shard_jobs(shard: Shard, fd: int, offsets: dict, arch: str, chunk_bytes: int,
               progress: Progress) -> list:
    jobs = []
    for unit in shard.units:
        if isinstance(unit, CopyUnit):
            jobs.append(lambda u=unit: _write_copy(fd, offsets, u, progress))
        else:
            for start, stop in expert_chunks(unit, chunk_bytes):
                jobs.append(lambda u=unit, a=start, b=stop:
                            _write_expert_chunk(fd, offsets, u, arch, a, b, progress))
    return jobs


def _open_shard(out_dir: str, shard: Shard) -> tuple:
    header, offsets = build_header(shard.tensors)
    path = os.path.join(out_dir, shard.filename + PARTIAL_SUFFIX)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, len(header) + shard.nbytes)
    pwrite_all(fd, header, 0)
    return fd, offsets, path


def _finish_shard(fd: int, partial_path: str, job_futures: list,
                  on_done: Callable[[str, str], None]) -> str:
    wait(job_futures)
    for f in job_futures:
        f.result()  # re-raise a job's error
    os.fsync(fd)
    digest = sha256_file(partial_path)
    final = partial_path[: -len(PARTIAL_SUFFIX)]
    os.replace(partial_path, final)
    on_done(os.path.basename(final), digest)
    return digest


def write_shards(plan: Plan, out_dir: str, *, workers: int = 1,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = True,
                 done: Optional[dict] = None,
                 on_shard_done: Callable[[str, str], None] = lambda name, sha: None) -> dict:
    """Write every shard of `plan` not in `done` ({filename: sha256}) into out_dir.

    Returns {filename: sha256} of all shards. On error, already running jobs finish, queued
    ones are cancelled and the error is raised (the caller removes out_dir)."""
    done = dict(done or {})
    todo = [s for s in plan.shards if s.filename not in done]
    initial = plan.total_bytes - sum(s.nbytes for s in todo)
    bar = Progress(plan.total_bytes, initial, progress, f"convert {plan.arch} {plan.fmt}")
    workers = max(1, workers)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megamoe-convert")
    open_fds = {}
    finishers = {}
    try:
        for shard in todo:
            fd, offsets, partial = _open_shard(out_dir, shard)
            open_fds[shard.filename] = fd
            jobs = [pool.submit(job) for job in
                    shard_jobs(shard, fd, offsets, plan.arch, chunk_bytes, bar)]
            # Queued after its own jobs (FIFO), so it never waits on a job that has not started.
            finishers[shard.filename] = pool.submit(_finish_shard, fd, partial, jobs,
                                                    on_shard_done)
        for name, fut in finishers.items():
            done[name] = fut.result()
            os.close(open_fds.pop(name))
    finally:
        # On error: running jobs finish, queued ones are dropped; then no thread uses the fds.
        pool.shutdown(wait=True, cancel_futures=True)
        for fd in open_fds.values():
            os.close(fd)
        bar.close()
        torch.set_num_threads(torch_threads)
    return done
