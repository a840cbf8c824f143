"""Reports of the fused kernel's device-side failures, readable after the kernel trapped.

Before `__trap()` the kernel writes {kind, rank, phase, cta, a, b, c, 0} into a small pinned,
host-mapped int32 buffer (csrc/sm90/mega/sync.cuh, report_and_trap). Device printf output is not
guaranteed to reach the host when a kernel traps and the CUDA context is lost with it; host
memory is not. A watchdog thread logs the report as soon as it appears, and `raise_if_set`
turns it into a MegaMoEError where the caller catches the CUDA error.
"""
from __future__ import annotations

import atexit
import logging
import threading
from typing import Optional

import numpy as np
import torch

from ..errors import BarrierTimeoutError, MegaMoEError

logger = logging.getLogger(__name__)

# Same order as enum Phase in csrc/sm90/mega/sync.cuh (tests/test_kernel_compile.py checks it).
PHASES = ("announce", "dispatch (NVLink barrier)", "pull -> L1 (token block pulled)",
          "L1 -> L2 (token block ready)", "L2 / combine (NVLink barrier)", "combine reduce")
KIND_GRID_TIMEOUT, KIND_NVLINK_TIMEOUT, KIND_STAGING_FULL, KIND_BLOCK_TIMEOUT, KIND_STAGE_TIMEOUT = 1, 2, 3, 4, 5
KIND_HANDOFF_TIMEOUT = 6
RECORD_INTS = 8

_records: dict[int, torch.Tensor] = {}
# The same memory as numpy arrays: the watchdog reads these, so that its thread never calls into
# torch (a daemon thread inside torch while the interpreter tears torch down can abort the process).
_words: dict[int, np.ndarray] = {}
_lock = threading.Lock()
_watchdog: Optional[threading.Thread] = None
_stop = threading.Event()
_reported: set[int] = set()


def describe(values: list[int]) -> Optional[str]:
    """The message of a record's values, or None when nothing was reported."""
    kind, rank, phase, cta, a, b, c = values[:7]
    where = PHASES[phase] if 0 <= phase < len(PHASES) else f"phase {phase}"
    if kind == KIND_GRID_TIMEOUT:
        return (f"megamoe: rank {rank} CTA {cta} timed out in {where} waiting for the other CTAs of its grid "
                f"(counter {a & 0xffffffff:#010x}, arrived at {b & 0xffffffff:#010x}); were all {c} CTAs "
                "resident? Lower VLLM_MEGAMOE_NUM_SMS if other kernels occupy SMs.")
    if kind == KIND_NVLINK_TIMEOUT:
        return (f"megamoe: rank {rank} timed out in {where}: {a} of {c} ranks arrived, rank {b} did not; "
                "a peer rank did not launch this call or died.")
    if kind == KIND_BLOCK_TIMEOUT:  # the block's counter: its rows pulled, then its L1 tiles done
        return (f"megamoe: rank {rank} CTA {cta} timed out in {where}: token block {a} reached {b} of {c} "
                "(its rows pulled, then its L1 tiles done) after the timeout; were all CTAs resident? Lower "
                "VLLM_MEGAMOE_NUM_SMS if other kernels occupy SMs.")
    if kind == KIND_STAGE_TIMEOUT:
        return (f"megamoe: rank {rank} CTA {cta} timed out in {where}: TMA stage {a} (use {b}) never landed; "
                "a copy that does not complete is a kernel bug: please report it with this line.")
    if kind == KIND_HANDOFF_TIMEOUT:  # only the MMA warpgroups' wait for the tile has a deadline (a = 1)
        return (f"megamoe: rank {rank} CTA {cta} timed out in {where} waiting for the epilogue warpgroup's "
                f"release of the tile (hand-off {b}); the other side of the CTA stalled, a kernel bug: please "
                "report it with this line.")
    if kind == KIND_STAGING_FULL:
        return (f"megamoe: rank {rank} received {a} rows but staging holds {b}; build the SymmBuffer "
                "without ring_rows or with more of them.")
    return None if kind == 0 else f"megamoe: rank {rank} reported device error kind {kind} in {where}"


def record_for(device: torch.device) -> torch.Tensor:
    """The pinned record of `device` (created once; its data_ptr is valid on the device under UVA)."""
    index = torch.device(device).index or 0
    with _lock:
        if index not in _records:
            _records[index] = torch.zeros(RECORD_INTS, dtype=torch.int32, pin_memory=True)
            _words[index] = _records[index].numpy()
            _start_watchdog()
        return _records[index]


def report(device: torch.device) -> Optional[str]:
    rec = _records.get(torch.device(device).index or 0)
    return None if rec is None else describe(rec.tolist())


def raise_if_set(device: torch.device) -> None:
    message = report(device)
    if message is not None:
        kind = int(_records[torch.device(device).index or 0][0])
        timeouts = (KIND_GRID_TIMEOUT, KIND_NVLINK_TIMEOUT, KIND_BLOCK_TIMEOUT, KIND_STAGE_TIMEOUT, KIND_HANDOFF_TIMEOUT)
        raise (BarrierTimeoutError if kind in timeouts else MegaMoEError)(message)


def _watch() -> None:
    while not _stop.wait(0.2):
        for index, words in list(_words.items()):
            if index not in _reported and int(words[0]) != 0:
                _reported.add(index)
                logger.error("%s", describe([int(w) for w in words]))


def _stop_watchdog() -> None:
    _stop.set()
    if _watchdog is not None:
        _watchdog.join(timeout=1.0)


def _start_watchdog() -> None:
    global _watchdog
    if _watchdog is None:
        _watchdog = threading.Thread(target=_watch, name="megamoe-error-watchdog", daemon=True)
        _watchdog.start()
        atexit.register(_stop_watchdog)  # before the interpreter finalizes modules
