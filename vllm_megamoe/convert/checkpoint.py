"""`convert_checkpoint`: source directory -> complete converted checkpoint, atomically.

Everything is written into `<parent>/.<DST name>.megamoe-partial/` and renamed to DST only when
complete (weights hashed, index, config and the other files written). An error removes the
temporary directory; an interrupt (Ctrl-C, SIGTERM) keeps its finished shards so `--resume`
continues; a hard kill leaves it behind and the next run resumes (`--resume`) or removes it.
DST itself never exists half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .discovery import CONFIG_FILE, INDEX_FILE, SourceCheckpoint, open_source
from .layouts import LAYOUT_VERSION
from .marker import build_marker, converted_config
from .plan import (DEFAULT_MAX_SHARD_BYTES, ExpertUnit, Plan, check_at_least, make_plan,
                   non_expert_linear_modules)
from .safetensors_io import sha256_file
from .writer import DEFAULT_CHUNK_BYTES, PARTIAL_SUFFIX, write_shards

PARTIAL_DIR_SUFFIX = ".megamoe-partial"
STATE_FILE = ".megamoe-convert-state.json"


@dataclass
class ConvertResult:
    dst: str
    arch: str
    fmt: str
    shards: int
    output_bytes: int
    source_bytes: int
    seconds: float
    resumed_shards: int = 0
    source_format: Optional[str] = None
    precision_change: Optional[str] = None   # layouts.precision_change: None when kept
    changed_tensors: tuple = ()              # expert tensors whose precision changed


def partial_dir_for(dst: str) -> str:
    dst = os.path.abspath(dst)
    return os.path.join(os.path.dirname(dst), "." + os.path.basename(dst) + PARTIAL_DIR_SUFFIX)


def dump_json(path: str, obj) -> None:
    """Deterministic JSON (sorted keys, 2-space indent, trailing newline), written atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def replaceable_checkpoint(path: str) -> Optional[str]:
    """Why `--overwrite` may not replace the existing directory `path`, or None when it may: it
    holds a checkpoint (config.json beside safetensors weights: an earlier conversion or a Hugging
    Face checkpoint, intact or not), a converter's partial output (its state file), or nothing."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return f"it cannot be listed ({exc})"
    if not names or STATE_FILE in names:
        return None
    weights = INDEX_FILE in names or any(n.endswith(".safetensors") for n in names)
    if CONFIG_FILE in names and os.path.isfile(os.path.join(path, CONFIG_FILE)) and weights:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"it holds {shown}, not a checkpoint ({CONFIG_FILE} with *.safetensors weights)"


def _check_destination(source: SourceCheckpoint, dst: str, overwrite: bool) -> None:
    src = os.path.realpath(source.root)
    real = os.path.realpath(dst)
    if real == src or real.startswith(src + os.sep) or src.startswith(real + os.sep):
        raise ValueError(f"DST {dst} overlaps SRC {source.root}; choose a separate directory")
    if os.path.lexists(dst) and not overwrite:
        raise ValueError(f"DST {dst} already exists; pass --overwrite to replace it")
    if os.path.lexists(dst) and (os.path.islink(dst) or not os.path.isdir(dst)):
        raise ValueError(f"DST {dst} exists and is not a directory; --overwrite replaces only a "
                         "checkpoint directory. Nothing was changed; remove it yourself or choose "
                         "another DST")
    why = replaceable_checkpoint(dst) if os.path.lexists(dst) else None
    if why is not None:
        raise ValueError(f"DST {dst} is not a checkpoint that --overwrite may replace: {why}. "
                         "--overwrite replaces only an earlier conversion or another model "
                         "checkpoint; nothing was changed. Remove it yourself or choose another DST")


class _State:
    """The partial directory's record of finished shards (for --resume)."""

    def __init__(self, directory: str, fingerprint: str):
        self.path = os.path.join(directory, STATE_FILE)
        self.fingerprint = fingerprint
        self.done: dict = {}
        self._lock = threading.Lock()

    def save(self) -> None:
        dump_json(self.path, {"fingerprint": self.fingerprint, "done": self.done})

    def shard_done(self, filename: str, digest: str) -> None:
        with self._lock:
            self.done[filename] = digest
            self.save()


def _prepare_partial_dir(partial: str, fingerprint: str, resume: bool, log) -> _State:
    state = _State(partial, fingerprint)
    if os.path.lexists(partial):
        if not os.path.exists(state.path):
            raise ValueError(f"{partial} exists but was not written by `vllm-megamoe convert`; "
                             "remove it or choose another DST")
        with open(state.path, encoding="utf-8") as f:
            old = json.load(f)
        if resume and old.get("fingerprint") == fingerprint:
            for name, digest in sorted(old.get("done", {}).items()):
                path = os.path.join(partial, name)
                if os.path.exists(path) and sha256_file(path) == digest:
                    state.done[name] = digest
            log(f"resuming: {len(state.done)} finished shard(s) kept from {partial}")
        else:
            why = "--resume not given" if not resume else "source or options changed"
            log(f"removing the unfinished conversion in {partial} ({why})")
            shutil.rmtree(partial)
    os.makedirs(partial, exist_ok=True)
    for name in os.listdir(partial):  # drop half-written shards of an interrupted run
        if name.endswith(PARTIAL_SUFFIX) or (name.endswith(".safetensors")
                                             and name not in state.done):
            os.remove(os.path.join(partial, name))
    state.save()
    return state


def _write_metadata(source: SourceCheckpoint, plan: Plan, out: str, digests: dict) -> None:
    marker = build_marker(plan.arch, plan.fmt, source.source_format,
                          [layer.prefix for layer in source.layers])
    source_is_fp8 = source.source_format == "fp8-block"
    config = converted_config(source.config, marker, source_is_fp8,
                              non_expert_linear_modules(source))
    dump_json(os.path.join(out, CONFIG_FILE), config)
    index = {
        "metadata": {"total_size": plan.total_bytes},
        "weight_map": plan.weight_map,
        "megamoe": {"format": plan.fmt, "arch": plan.arch, "layout_version": LAYOUT_VERSION,
                    "sha256": {s.filename: digests[s.filename] for s in plan.shards}},
    }
    dump_json(os.path.join(out, INDEX_FILE), index)
    for rel in source.other_files:
        target = os.path.join(out, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(source.root, rel), target)


def _move_into_place(partial: str, dst: str) -> None:
    if os.path.lexists(dst):
        old = partial[: -len(PARTIAL_DIR_SUFFIX)] + ".megamoe-old"
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(dst, old)
        os.rename(partial, dst)
        shutil.rmtree(old)
    else:
        os.rename(partial, dst)
    dir_fd = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def convert_checkpoint(src: str, dst: str, *, arch: str, fmt: Optional[str] = None,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, workers: int = 1,
                       overwrite: bool = False, resume: bool = False, progress: bool = False,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES, log=print) -> ConvertResult:
    """Convert the Hugging Face checkpoint at `src` into a megamoe checkpoint at `dst`."""
    start = time.perf_counter()
    check_at_least("max_shard_bytes", max_shard_bytes, 1, " byte")
    check_at_least("workers", workers, 1)
    source = open_source(src)
    plan = make_plan(source, arch, fmt, max_shard_bytes)
    dst = os.path.abspath(dst)
    _check_destination(source, dst, overwrite)
    if plan.precision_change is not None:  # said before the work starts; the tensors are listed when done
        log(describe_precision(plan))
    partial = partial_dir_for(dst)
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        state = _prepare_partial_dir(partial, plan.fingerprint(source), resume, log)
    except OSError as exc:
        raise ValueError(f"cannot create DST {dst}: {exc}") from None
    resumed = len(state.done)
    try:
        digests = write_shards(plan, partial, workers=workers, chunk_bytes=chunk_bytes,
                               progress=progress, done=state.done,
                               on_shard_done=state.shard_done)
        _write_metadata(source, plan, partial, digests)
        os.remove(state.path)
        _move_into_place(partial, dst)
    except (KeyboardInterrupt, SystemExit):
        if os.path.isdir(partial):
            for name in os.listdir(partial):
                if name.endswith(PARTIAL_SUFFIX):
                    os.remove(os.path.join(partial, name))
            log(f"interrupted: {len(state.done)} of {len(plan.shards)} shards finished in "
                f"{partial}; run again with --resume to continue (or delete it). {dst} was not "
                "written.")
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ConvertResult(dst, plan.arch, plan.fmt, len(plan.shards), plan.total_bytes,
                         source.total_bytes, time.perf_counter() - start, resumed,
                         plan.source_format, plan.precision_change, tuple(plan.changed_tensors))


def describe_precision(plan: Plan) -> str:
    """One line saying whether the experts keep the source's precision (logged before converting)."""
    layers = sum(1 for s in plan.shards for u in s.units if isinstance(u, ExpertUnit))
    if plan.precision_change is None:
        return (f"{plan.arch} {plan.fmt}: the experts of {layers} MoE layer(s) keep the source's "
                f"precision ({plan.source_format}); nothing is quantized")
    return (f"{plan.arch} {plan.fmt}: the experts of {layers} MoE layer(s) are "
            f"{plan.precision_change} (the source's are {plan.source_format}); "
            f"{len(plan.changed_tensors)} tensors, listed when done")
