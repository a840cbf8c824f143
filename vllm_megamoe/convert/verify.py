"""`verify_checkpoint`: check a converted checkpoint's files, checksums, shapes and (given the
source) bit equality of a random sample of re-derived tensors. Returns the problems found, each
naming the shard or tensor; an empty list means it passed."""
from __future__ import annotations

import os
import random
from typing import Optional

from .discovery import CONFIG_FILE, INDEX_FILE, json_type, load_json, natural_key, open_source
from .layouts import tensor_specs
from .marker import read_megamoe_marker
from .plan import CopyUnit, ExpertUnit, check_at_least, make_plan
from .safetensors_io import (COPY_CHUNK_BYTES, TensorInfo, read_header, read_tensor,
                             sha256_file, tensor_bytes)
from .writer import convert_expert_chunk

UNLIMITED_SHARD = 2**62


def _first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    for i in range(0, n, 4096):
        if a[i:i + 4096] != b[i:i + 4096]:
            return i + next(j for j in range(min(4096, n - i)) if a[i + j] != b[i + j])
    return n


def _same_bytes(a: TensorInfo, b: TensorInfo) -> Optional[int]:
    """None when the two tensors' raw bytes are equal, else the first differing byte offset."""
    if a.nbytes != b.nbytes:
        return min(a.nbytes, b.nbytes)
    fa, fb = os.open(a.file, os.O_RDONLY), os.open(b.file, os.O_RDONLY)
    try:
        for pos in range(0, a.nbytes, COPY_CHUNK_BYTES):
            n = min(COPY_CHUNK_BYTES, a.nbytes - pos)
            xa, xb = os.pread(fa, n, a.begin + pos), os.pread(fb, n, b.begin + pos)
            if xa != xb:
                return pos + _first_difference(xa, xb)
    finally:
        os.close(fa)
        os.close(fb)
    return None


def _check_str_map(value, where: str, what: str) -> None:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        got = (f"a JSON {json_type(value)}" if not isinstance(value, dict) else
               "an object with non-string values")
        raise ValueError(f"{where} must map {what}, got {got}; convert again")


def load_converted_index(root: str) -> dict:
    """The index of the converted checkpoint at `root`, checked by check_converted_index."""
    path = os.path.join(root, INDEX_FILE)
    index = load_json(path, INDEX_FILE)
    check_converted_index(index, path)
    return index


def check_converted_index(index: dict, path: str) -> None:
    """ValueError naming `path` (the index file) unless `index` has the structure `vllm-megamoe
    convert` writes: weight_map {tensor: shard file}, megamoe.sha256 {shard file: digest}."""
    _check_str_map(index.get("weight_map"), f"{path} ['weight_map']",
                   "tensor names to shard file names")
    megamoe = index.get("megamoe")
    if megamoe is None:
        return
    if not isinstance(megamoe, dict):
        raise ValueError(f"{path} ['megamoe'] must be an object, got a JSON {json_type(megamoe)}; "
                         "convert again")
    if megamoe.get("sha256") is not None:
        _check_str_map(megamoe["sha256"], f"{path} ['megamoe']['sha256']",
                       "shard file names to sha256 hex digests")


def mismatch_problem(filename: str, expected: str, actual: str) -> str:
    return (f"{filename}: sha256 mismatch (index has {expected[:16]}..., the file {actual[:16]}...); the "
            "shard is corrupt or was modified; convert again")


def check_files(root: str, index: dict, problems: list) -> dict:
    """Checksums and headers of every shard; returns {tensor name: TensorInfo}."""
    weight_map = index.get("weight_map") or {}
    digests = (index.get("megamoe") or {}).get("sha256") or {}
    tensors, unreadable = {}, set()
    for fn in sorted(set(weight_map.values()), key=natural_key):
        path = os.path.join(root, fn)
        if not os.path.isfile(path):
            problems.append(f"{fn}: listed in {INDEX_FILE} but missing")
            unreadable.add(fn)
            continue
        if fn not in digests:
            problems.append(f"{fn}: no sha256 in {INDEX_FILE} ['megamoe']['sha256']")
        elif (actual := sha256_file(path)) != digests[fn]:
            problems.append(mismatch_problem(fn, digests[fn], actual))
            unreadable.add(fn)
            continue
        try:
            header, _ = read_header(path)
        except ValueError as exc:
            problems.append(f"{fn}: {exc}")
            unreadable.add(fn)
            continue
        for name in sorted(set(header) - {n for n, f in weight_map.items() if f == fn}):
            problems.append(f"{fn}: holds tensor {name!r}, which {INDEX_FILE} does not list")
        tensors.update(header)
    for name, fn in sorted(weight_map.items()):
        if name not in tensors and fn not in unreadable:
            problems.append(f"{fn}: tensor {name!r} listed in {INDEX_FILE} is missing")
    return tensors


def check_expert_shapes(marker: dict, tensors: dict, problems: list) -> None:
    fmt = marker["format"]
    for prefix in marker.get("expert_modules") or []:
        w13, w2 = tensors.get(prefix + ".w13_weight"), tensors.get(prefix + ".w2_weight")
        if w13 is None or w2 is None or len(w13.shape) != 3 or len(w2.shape) != 3:
            problems.append(f"{prefix}: w13_weight/w2_weight missing or not [E, ., .]")
            continue
        e, h, i = w13.shape[0], w2.shape[1], w13.shape[1] // 2
        for name, (dtype, shape) in tensor_specs(e, h, i, fmt).items():
            got = tensors.get(f"{prefix}.{name}")
            if got is None:
                problems.append(f"{prefix}.{name}: missing (format {fmt})")
            elif got.dtype != dtype or tuple(got.shape) != tuple(shape):
                problems.append(f"{os.path.basename(got.file)}: tensor {got.name!r} is "
                                f"{got.dtype} {list(got.shape)}, expected {dtype} {list(shape)}")


def check_against_source(source_dir: str, marker: dict, tensors: dict, samples: int,
                         seed: int, problems: list) -> int:
    """Compare names/shapes with a fresh plan and re-derive `samples` experts and `samples`
    non-expert tensors, requiring equal bytes. Returns the number of comparisons made."""
    source = open_source(source_dir)
    plan = make_plan(source, marker["arch"], marker["format"], UNLIMITED_SHARD)
    units = [u for s in plan.shards for u in s.units]
    expected = {t.name: t for u in units for t in u.outputs}
    for name in sorted(set(expected) - set(tensors), key=natural_key):
        problems.append(f"tensor {name!r} of the source's conversion is missing")
    for name in sorted(set(tensors) - set(expected), key=natural_key):
        problems.append(f"{os.path.basename(tensors[name].file)}: tensor {name!r} is not in "
                        "the source's conversion")
    for name, want in expected.items():
        got = tensors.get(name)
        if got is not None and (got.dtype != want.dtype or tuple(got.shape) != want.shape):
            problems.append(f"{os.path.basename(got.file)}: tensor {name!r} is {got.dtype} "
                            f"{list(got.shape)}, the source converts to {want.dtype} "
                            f"{list(want.shape)}")
    if problems:
        return 0
    rng = random.Random(seed)
    experts = [(u, e) for u in units if isinstance(u, ExpertUnit) for e in range(u.layer.num_experts)]
    copies = [u for u in units if isinstance(u, CopyUnit)]
    compared = 0
    for unit, e in rng.sample(experts, min(samples, len(experts))):
        for name, tensor in convert_expert_chunk(unit, marker["arch"], e, e + 1).items():
            stored = read_tensor(tensors[name], slice(e, e + 1))
            a, b = bytes(tensor_bytes(stored)), bytes(tensor_bytes(tensor))
            if a != b:
                problems.append(f"{os.path.basename(tensors[name].file)}: tensor {name!r} "
                                f"expert {e} differs from the source's conversion (first "
                                f"differing byte {_first_difference(a, b)} of the expert)")
            compared += 1
    for unit in rng.sample(copies, min(samples, len(copies))):
        at = _same_bytes(unit.info, tensors[unit.name])
        if at is not None:
            problems.append(f"{os.path.basename(tensors[unit.name].file)}: tensor "
                            f"{unit.name!r} differs from the source (first differing byte {at})")
        compared += 1
    return compared


def verify_checkpoint(path: str, source: Optional[str] = None, samples: int = 8,
                      seed: int = 0, log=print) -> list:
    """Problems found in the converted checkpoint at `path` (empty: it passed)."""
    check_at_least("samples", samples, 0)
    problems: list = []
    try:
        config = load_json(os.path.join(path, CONFIG_FILE), "config.json")
        marker = read_megamoe_marker(config)
        if marker is None:
            return [f"{path}/{CONFIG_FILE} has no 'megamoe' entry: not a checkpoint written by "
                    "`vllm-megamoe convert`"]
        index = load_converted_index(path)
    except ValueError as exc:
        return [str(exc)]
    tensors = check_files(path, index, problems)
    log(f"checked sha256 of {len(set((index.get('weight_map') or {}).values()))} shard(s)")
    if not problems:  # shapes only of intact files (a bad shard is the problem to report)
        check_expert_shapes(marker, tensors, problems)
    if source is not None and not problems:
        n = check_against_source(source, marker, tensors, samples, seed, problems)
        log(f"compared {n} re-derived tensor(s) with {source}")
    return problems
