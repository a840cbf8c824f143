"""The output of a conversion, decided from the source's headers alone (no tensor data).

Units: every non-expert tensor (copied byte for byte under its own name) and every MoE layer's
experts (2 or 4 stacked [E, ...] tensors, kept in one shard). Units are ordered by name (natural
order, so a layer's tensors sit together) and packed greedily into shards of at most
max_shard_size bytes (a unit larger than that gets a shard of its own). The plan depends only on
the source and the options, never on --workers, so output bytes are deterministic.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from .discovery import ExpertLayer, SourceCheckpoint, natural_key
from .layouts import check_arch_format, precision_change, tensor_specs
from .safetensors_io import OutputTensor, TensorInfo

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def check_at_least(name: str, value, minimum: int, unit: str = "") -> None:
    """ValueError naming the argument unless `value` is a whole number >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be at least {minimum}{unit}, got {value!r}")


def parse_size(text) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500*2**20, '1234' -> 1234 bytes; at least 1 byte."""
    if isinstance(text, int):
        size = text
    else:
        m = SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"size {text!r} is not understood; write e.g. 5GB, 500MB, 2GiB or "
                             "a number of bytes")
        power = "KMGT".find(m[2].upper()) + 1 if m[2] else 0
        base = 1024 if m[3] else 1000
        size = int(float(m[1]) * base ** power)
    if size < 1:
        raise ValueError(f"size {text!r} is {size} bytes; give at least 1 byte, e.g. 5GB, 500MB, "
                         "2GiB or a positive number of bytes")
    return size


@dataclass
class CopyUnit:
    """One non-expert tensor, copied unchanged."""

    info: TensorInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def outputs(self) -> list:
        return [OutputTensor(self.info.name, self.info.dtype, tuple(self.info.shape))]


@dataclass
class ExpertUnit:
    """One MoE layer's experts, converted to the kernel layout."""

    layer: ExpertLayer
    fmt: str

    @property
    def name(self) -> str:
        return self.layer.prefix

    @property
    def outputs(self) -> list:
        specs = tensor_specs(self.layer.num_experts, self.layer.hidden,
                             self.layer.intermediate, self.fmt)
        return [OutputTensor(f"{self.layer.prefix}.{n}", dt, shape)
                for n, (dt, shape) in specs.items()]


@dataclass
class Shard:
    filename: str
    units: list = field(default_factory=list)

    @property
    def tensors(self) -> list:
        return [t for unit in self.units for t in unit.outputs]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    arch: str
    fmt: str
    shards: list
    source_format: Optional[str] = None

    @property
    def precision_change(self) -> Optional[str]:
        """What the conversion does to the experts' values (layouts.precision_change), or None."""
        return precision_change(self.source_format, self.fmt)

    @property
    def changed_tensors(self) -> list:
        """Names of the expert weight tensors whose values change precision (the scales written
        beside them are new tensors); empty when the experts keep the source's precision."""
        if self.precision_change is None:
            return []
        return [t.name for s in self.shards for u in s.units if isinstance(u, ExpertUnit)
                for t in u.outputs if t.name.endswith((".w13_weight", ".w2_weight"))]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def weight_map(self) -> dict:
        return {t.name: s.filename for s in self.shards for t in s.tensors}

    def fingerprint(self, source: SourceCheckpoint) -> str:
        """Identifies the plan and its source files (for resuming a partial conversion)."""
        desc = {"arch": self.arch, "fmt": self.fmt,
                "shards": {s.filename: [[t.name, t.dtype, list(t.shape)] for t in s.tensors]
                           for s in self.shards},
                "sources": {t.name: [t.file, t.begin, t.end] for t in source.tensors.values()},
                "files": {f: [os.stat(os.path.join(source.root, f)).st_size,
                              os.stat(os.path.join(source.root, f)).st_mtime_ns]
                          for f in source.weight_files}}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def shard_filename(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def make_plan(source: SourceCheckpoint, arch: str, fmt: Optional[str],
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Plan:
    if not source.layers:
        raise ValueError(f"{source.root}: no MoE expert tensors found; supported naming: "
                         "see `vllm-megamoe convert --help` (nothing to convert)")
    fmt = check_arch_format(arch, fmt, source.source_format)
    expert_names = source.expert_tensor_names
    units = [CopyUnit(info) for name, info in source.tensors.items() if name not in expert_names]
    units += [ExpertUnit(layer, fmt) for layer in source.layers]
    units.sort(key=lambda u: natural_key(u.name))
    groups, current, size = [], [], 0
    for unit in units:
        unit_bytes = sum(t.nbytes for t in unit.outputs)
        if current and size + unit_bytes > max_shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(unit)
        size += unit_bytes
    if current:
        groups.append(current)
    shards = [Shard(shard_filename(i, len(groups)), g) for i, g in enumerate(groups)]
    seen = set()
    for name in (t.name for s in shards for t in s.tensors):
        if name in seen:
            raise ValueError(f"converted tensor name {name!r} already exists in the source "
                             "checkpoint; was it converted before?")
        seen.add(name)
    return Plan(arch, fmt, shards, source.source_format)


def non_expert_linear_modules(source: SourceCheckpoint) -> list:
    """Module paths of the source's 2-D `.weight` tensors outside the experts (linear layers
    and embeddings; vLLM consults the list for linear layers only)."""
    expert_names = source.expert_tensor_names
    return sorted({n[: -len(".weight")] for n, t in source.tensors.items()
                   if n.endswith(".weight") and len(t.shape) == 2 and n not in expert_names},
                  key=natural_key)
