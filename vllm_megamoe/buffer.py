"""SymmBuffer: one buffer per worker that every rank can read and write directly.

Each rank allocates `BufferLayout.total_bytes` bytes with the same layout and maps every peer's
allocation, so `buffer.view(name, rank=r)` is a tensor over region `name` of rank r's memory.

Backends (chosen by `backend="auto"`):
- "local": one rank; a plain tensor on `device`.
- "cuda":  torch symmetric memory (`empty` + `rendezvous`) on the group; peers are NVLink/P2P
           pointers. Ranks must be on one host with peer access between all GPUs.
- "cuda-ipc": ranks that share GPUs (several processes on one GPU, e.g. the multi-rank kernel
           tests on a machine with one GPU): a plain allocation per rank whose CUDA IPC handle
           (torch's tensor sharing) goes to every peer over the group; barriers are host-side
           (synchronize, then the group's barrier), so a call that needs one cannot be captured in
           a CUDA graph. "auto" and "cuda" switch to it when two ranks name the same GPU, since
           symmetric memory refuses that.
- "cpu":   POSIX shared memory. Each rank creates a file under /dev/shm named
           `vllm_megamoe-<job token>-r<rank>-p<pid>`, maps every peer's file, and unlinks its own
           as soon as all ranks have mapped it (the mapping stays valid); the constructor returns
           only once every rank has done so, so nothing is left behind when a rank exits or dies
           later. Until then an atexit hook removes it.
           Directory: $VLLM_MEGAMOE_SHM_DIR (default /dev/shm).

Barriers time out (`timeout_s`, default 60 s, env VLLM_MEGAMOE_TIMEOUT_S) with a
BarrierTimeoutError that names this rank, the phase and the ranks that did not arrive.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import uuid
from typing import Optional

import torch
import torch.distributed as dist

from .errors import BarrierTimeoutError, PeerAccessError
from .layout import BufferLayout
from .settings import setting, unknown_environment_names
from .shape import MoEShape, require

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "local", "cuda", "cuda-ipc", "cpu")
SHM_PREFIX = "vllm_megamoe-"


def default_timeout_s() -> float:
    return setting("timeout_s")


def shm_dir() -> str:
    return setting("shm_dir")


def normalize_device(device) -> torch.device:
    """`device` as tensors report theirs: a CUDA device always with its index ("cuda" is the
    current device, torch.cuda.current_device()), a CPU device without one. torch.device("cuda")
    != torch.device("cuda:0"), so a buffer made with "cuda" would refuse the cuda:0 tensors of
    its own calls."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def shm_dir_problem() -> Optional[str]:
    """Why the CPU buffer's files cannot go to shm_dir(), or None."""
    path = shm_dir()
    return None if os.path.isdir(path) else (f"VLLM_MEGAMOE_SHM_DIR={path!r} is not a directory (the CPU "
                                             "buffer's shared-memory files live there)")


class SymmBuffer:
    """The per-worker symmetric buffer (see module docstring).

    shape / max_tokens_per_rank: the largest layer and batch it must serve; every layer whose
    shape fits (MoEShape.fits_in) can use it. group: a torch.distributed ProcessGroup over the
    expert-parallel ranks (gloo for "cpu", NCCL for "cuda"), or None for a single rank.
    """

    def __init__(self, shape: MoEShape, max_tokens_per_rank: int, group=None, *,
                 format: str = "fp8-block", device=None, backend: str = "auto",
                 timeout_s: Optional[float] = None, shared_expert: bool = False,
                 ring_rows: Optional[int] = None):
        require(backend in BACKENDS, f"backend={backend!r} must be one of {BACKENDS}")
        self.group = group
        self.num_ranks = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.layout = BufferLayout(shape, self.num_ranks, max_tokens_per_rank, format,
                                   shared_expert=shared_expert, ring_rows=ring_rows)
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        require(0 < self.timeout_s < float("inf"), f"timeout_s={self.timeout_s} must be a positive, finite "
                "number of seconds (VLLM_MEGAMOE_TIMEOUT_S)")
        self.device = normalize_device(device if device is not None else
                                       "cuda" if backend.startswith("cuda") else "cpu")
        if backend == "auto":
            backend = "local" if self.num_ranks == 1 else (
                "cuda" if self.device.type == "cuda" else "cpu")
        require(backend != "local" or self.num_ranks == 1,
                f"backend='local' serves one rank; this group has {self.num_ranks}")
        require(not backend.startswith("cuda") or self.device.type == "cuda",
                f"backend={backend!r} needs a CUDA device, got device={self.device}")
        require(backend != "cpu" or self.device.type == "cpu",
                f"backend='cpu' keeps the buffer in host shared memory; got device={self.device}")
        self.backend = backend
        # a local problem is raised on every rank: a peer would otherwise wait in the next collective
        problems = [unknown_environment_names(), shm_dir_problem() if backend == "cpu" else None]
        self._check_ranks_agree("; ".join(p for p in problems if p) or None)
        self._handle = None
        self._shm_path: Optional[str] = None
        self._peer_buffers: list[torch.Tensor] = []
        self._views: dict = {}
        self._barrier_count = 0
        getattr(self, f"_create_{backend.replace('-', '_')}")()
        self.buffer = self._peer_buffers[self.rank]
        logger.info("megamoe: SymmBuffer %s backend, rank %d/%d, %.1f MiB per rank",
                    backend, self.rank, self.num_ranks, self.layout.total_bytes / 2**20)

    # -- creation ----------------------------------------------------------------------------
    def _check_ranks_agree(self, problem: Optional[str] = None) -> None:
        """Every rank must build the same layout: a peer whose regions sit at other offsets reads
        and writes the wrong bytes, which gives wrong outputs, not an error. One small collective
        before anything is allocated; every rank raises the same message, also for a `problem`
        one rank found on its own (e.g. its shared-memory directory)."""
        if self.num_ranks == 1:
            require(problem is None, f"megamoe: {problem}")
            return
        lay = self.layout
        mine = {"hidden": lay.shape.hidden, "intermediate": lay.shape.intermediate,
                "num_experts": lay.shape.num_experts, "topk": lay.shape.topk,
                "max_tokens_per_rank": lay.max_tokens_per_rank, "format": lay.format,
                "shared_expert": lay.shared_expert, "ring_rows": lay.ring_rows}
        every = [None] * self.num_ranks
        dist.all_gather_object(every, (mine, problem), group=self.group)
        problems = [f"rank {r}: {why}" for r, (_, why) in enumerate(every) if why is not None]
        require(not problems, "megamoe: SymmBuffer not created: " + "; ".join(problems))
        every = [d for d, _ in every]
        differ = [f"{key} ({', '.join(f'rank {r}: {d[key]!r}' for r, d in enumerate(every))})"
                  for key in mine if any(d[key] != every[0][key] for d in every)]
        require(not differ, "megamoe: the ranks build different SymmBuffers; every rank of the group "
                "must pass the same shape, max_tokens_per_rank, format and options. Differing: "
                + "; ".join(differ))

    def _create_local(self):
        buf = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self._peer_buffers = [buf]

    def _create_cpu(self):
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0), group=self.group)
        name = f"{SHM_PREFIX}{token[0]}-r{self.rank}-p{os.getpid()}"
        path = os.path.join(shm_dir(), name)
        nbytes = self.layout.total_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled
        finally:
            os.close(fd)
        self._shm_path = path
        atexit.register(self._unlink_own_file)  # until it is unlinked (which unregisters it)
        paths = [None] * self.num_ranks
        dist.all_gather_object(paths, path, group=self.group)
        try:
            self._peer_buffers = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
                                  for p in paths]
            self.barrier("map shared memory")
        finally:
            self._unlink_own_file()  # every peer has mapped it (or failed): the name can go
        # When the constructor returns on any rank, no rank's file is left under shm_dir().
        self.barrier("unlink shared memory")

    def _create_cuda(self):
        import torch.distributed._symmetric_memory as symm_mem
        if self._check_peer_access():
            logger.warning("megamoe: EP ranks share a GPU; SymmBuffer uses CUDA IPC handles and host "
                           "barriers (backend 'cuda-ipc': for tests, not for serving)")
            self.backend = "cuda-ipc"
            self._create_cuda_ipc(peer_access_checked=True)
            return
        buf = symm_mem.empty(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self._handle = symm_mem.rendezvous(buf, self.group)
        buf.zero_()
        self._peer_buffers = [
            self._handle.get_buffer(r, (self.layout.total_bytes,), torch.uint8, 0)
            for r in range(self.num_ranks)]
        torch.cuda.synchronize(self.device)
        self.barrier("create")

    def _create_cuda_ipc(self, peer_access_checked: bool = False):
        from torch.multiprocessing.reductions import reduce_tensor
        if not peer_access_checked:  # _create_cuda checked it already (one all_gather less)
            self._check_peer_access()
        buf = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        handles = [None] * self.num_ranks
        dist.all_gather_object(handles, reduce_tensor(buf), group=self.group)
        # A process cannot open its own IPC handle: its own entry stays the tensor itself.
        self._peer_buffers = [buf if r == self.rank else rebuild(*args)
                              for r, (rebuild, args) in enumerate(handles)]
        self.barrier("create")

    def _check_peer_access(self) -> bool:
        """Raise unless every rank can reach every other rank's GPU; True if two ranks share one."""
        me = (socket.gethostname(), self.device.index)
        everyone = [None] * self.num_ranks
        dist.all_gather_object(everyone, me, group=self.group)
        hosts = {h for h, _ in everyone}
        if len(hosts) > 1:
            raise PeerAccessError(
                f"megamoe's CUDA buffer needs all {self.num_ranks} EP ranks on one host with "
                f"NVLink/P2P access; they span hosts {sorted(hosts)}. Multi-node expert parallelism "
                "is out of scope for this backend: use one of vLLM's all2all backends "
                "(e.g. --all2all-backend deepep_high_throughput) with another --moe-backend.")
        visible = torch.cuda.device_count()
        for r, (_, dev) in enumerate(everyone):
            if r != self.rank and dev != self.device.index and dev < visible:
                if not torch.cuda.can_device_access_peer(self.device.index, dev):
                    raise PeerAccessError(
                        f"rank {self.rank} (cuda:{self.device.index}) cannot access rank {r}'s "
                        f"GPU (cuda:{dev}) directly: megamoe needs NVLink/P2P between all EP "
                        "ranks. Check `nvidia-smi topo -m`, or use another --moe-backend.")
        return len({dev for _, dev in everyone}) < self.num_ranks

    def _unlink_own_file(self):
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None
            # The exit hook references this buffer: left registered, a buffer dropped without
            # destroy() kept every peer's mapping until the process ended. Once the file is gone
            # the hook has nothing left to do.
            atexit.unregister(self._unlink_own_file)

    # -- access ------------------------------------------------------------------------------
    def view(self, name: str, rank: Optional[int] = None) -> torch.Tensor:
        """Region `name` of rank `rank` (default: this rank), typed and shaped by the layout.

        "combine_with_trash" is the combine region flattened to [C*T + 1, H] with the trash row
        last (one tensor for writers that aim masked rows at the trash row).
        """
        r = self.rank if rank is None else rank
        require(0 <= r < self.num_ranks, f"rank={r} out of range for {self.num_ranks} ranks")
        key = (name, r)
        if key not in self._views:
            if name == "combine_with_trash":
                c, t, h = self.layout.region("combine").shape
                start = self.layout.region("combine").offset
                raw = self._peer_buffers[r][start:start + (c * t + 1) * h * 2]
                self._views[key] = raw.view(torch.bfloat16).view(c * t + 1, h)
            else:
                self._views[key] = self.layout.view(self._peer_buffers[r], name)
        return self._views[key]

    def peer(self, rank: int) -> "PeerView":
        return PeerView(self, rank)

    @property
    def buffer_ptrs(self) -> list[int]:
        """Base address of every rank's buffer as seen from this process (for kernels)."""
        return [b.data_ptr() for b in self._peer_buffers]

    # -- synchronisation ---------------------------------------------------------------------
    def barrier(self, phase: str) -> None:
        """All ranks meet; raises BarrierTimeoutError after timeout_s naming rank and phase."""
        self._barrier_count += 1
        if self.num_ranks == 1:
            return
        if self.backend == "cuda":
            # Device-side barrier on the stream: capturable, no host sync. It traps on timeout.
            self._handle.barrier(channel=0, timeout_ms=int(self.timeout_s * 1000))
            return
        if self.backend == "cuda-ipc":
            torch.cuda.synchronize(self.device)  # this rank's writes land before a peer reads them
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=self.timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as exc:
            raise BarrierTimeoutError(
                f"megamoe: rank {self.rank}/{self.num_ranks} timed out after {self.timeout_s:g} s in "
                f"barrier '{phase}' (barrier #{self._barrier_count}): {exc}") from exc

    def destroy(self) -> None:
        self._unlink_own_file()
        self._views.clear()
        self._peer_buffers = []
        self._handle = None
        self.buffer = None

    def __repr__(self):
        return (f"SymmBuffer(backend={self.backend!r}, rank={self.rank}/{self.num_ranks}, "
                f"format={self.layout.format!r}, max_tokens={self.layout.tokens}, "
                f"bytes={self.layout.total_bytes})")


class PeerView:
    """Regions of one rank's buffer: `buffer.peer(r).x` is rank r's token region."""

    def __init__(self, buf: SymmBuffer, rank: int):
        self._buf, self._rank = buf, rank

    def __getattr__(self, name: str) -> torch.Tensor:
        return self._buf.view(name, self._rank)
