"""Find a Hugging Face checkpoint's files and its MoE expert tensors (by name patterns).

Supported expert conventions, discovered from tensor names (no model list):
- per expert: `<prefix>.experts.<e>.<proj>.weight` with proj w1/w3/w2 (Mixtral: gate/up/down) or
  gate_proj/up_proj/down_proj (Qwen2/Qwen3-MoE, DeepSeek-V2/V3), optionally FP8 e4m3 with
  `<...>.weight_scale_inv` 128x128 block scales (DeepSeek-V3 / Qwen3-FP8);
- stacked: `<prefix>.experts.gate_up_proj` + `<prefix>.experts.down_proj`, float only, gate in the
  first half of the 2I axis, in either the nn.Linear layout ([E, 2I, H] and [E, H, I]) or the
  transposed layout of transformers' Llama4 / GptOss-style modules ([E, H, 2I] and [E, I, H]);
  the two are told apart by both shapes together (they cannot both fit).
Anything else under `.experts.` is an error naming the tensor, never silently copied.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..shape import CHANNEL_ALIGN
from .safetensors_io import CorruptCheckpointError, TensorInfo, read_header, read_into, read_tensor

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight files of other formats that are never carried over into the converted checkpoint.
FOREIGN_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")

PER_EXPERT_RE = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|weight_scale_inv)$")
STACKED_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
UNDER_EXPERTS_RE = re.compile(r"\.experts\.")
ROLE_OF_PROJ = {"w1": "gate", "w3": "up", "w2": "down",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_SOURCE_DTYPE = "F8_E4M3"
FP8_BLOCK = 128
SUPPORTED_TEXT = ("per-expert `experts.<e>.{w1,w2,w3}.weight` (Mixtral) or "
                  "`experts.<e>.{gate_proj,up_proj,down_proj}.weight[_scale_inv]` (Qwen-MoE, "
                  "DeepSeek), or stacked `experts.gate_up_proj` + `experts.down_proj`")


def natural_key(name: str):
    """Sort key that orders layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass
class ExpertLayer:
    """One MoE layer's experts in the source checkpoint."""

    prefix: str                 # module path of the experts, e.g. model.layers.3.mlp.experts
    num_experts: int
    hidden: int
    intermediate: int
    source_dtype: str           # safetensors dtype of the weights ("BF16", "F8_E4M3", ...)
    stacked: Optional[str] = None   # None (per expert), "linear" or "transposed"
    tensors: dict = field(default_factory=dict)  # role -> list[TensorInfo] or TensorInfo

    @property
    def is_fp8(self) -> bool:
        return self.source_dtype == FP8_SOURCE_DTYPE

    @property
    def source_names(self) -> list[str]:
        out = []
        for value in self.tensors.values():
            out.extend(t.name for t in (value if isinstance(value, list) else [value]))
        return out

    @property
    def source_bytes_per_expert(self) -> int:
        total = 0
        for value in self.tensors.values():
            total += sum(t.nbytes for t in value) if isinstance(value, list) else value.nbytes
        return total // self.num_experts

    def read(self, start: int, stop: int):
        """Experts [start, stop) in checkpoint layout: (w13 [n, 2I, H], w2 [n, H, I],
        w13_scale_inv, w2_scale_inv) with scales None for float sources."""
        t = self.tensors
        if self.stacked is not None:
            gate_up = read_tensor(t["gate_up"], slice(start, stop))
            down = read_tensor(t["down"], slice(start, stop))
            if self.stacked == "transposed":
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            return gate_up.contiguous(), down.contiguous(), None, None
        w13 = self._read_stacked(t["gate"], t["up"], start, stop)
        w2 = self._read_stacked(t["down"], None, start, stop)
        if not self.is_fp8:
            return w13, w2, None, None
        s13 = self._read_stacked(t["gate_scale"], t["up_scale"], start, stop)
        s2 = self._read_stacked(t["down_scale"], None, start, stop)
        return w13, w2, s13.float(), s2.float()

    @staticmethod
    def _read_stacked(first: list, second: Optional[list], start: int, stop: int):
        """[n, rows(first) + rows(second), cols]: experts' tensors read in place, concatenated
        along rows (gate then up)."""
        rows_a = first[start].shape[0]
        rows = rows_a + (second[start].shape[0] if second else 0)
        out = torch.empty((stop - start, rows, first[start].shape[1]),
                          dtype=first[start].torch_dtype)
        for k, e in enumerate(range(start, stop)):
            read_into(first[e], out[k, :rows_a])
            if second:
                read_into(second[e], out[k, rows_a:])
        return out


@dataclass
class SourceCheckpoint:
    root: str
    config: dict
    weight_files: list          # relative paths of the safetensors files, sorted
    tensors: dict               # name -> TensorInfo (every tensor of every weight file)
    layers: list                # ExpertLayer, sorted by prefix (natural order)
    other_files: list           # relative paths carried over unchanged
    skipped_files: list         # relative paths of foreign weight files not carried over

    @property
    def expert_tensor_names(self) -> set:
        return {n for layer in self.layers for n in layer.source_names}

    @property
    def source_format(self) -> str:
        dtypes = {layer.source_dtype for layer in self.layers}
        return "fp8-block" if dtypes == {FP8_SOURCE_DTYPE} else "/".join(sorted(dtypes)).lower()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def json_type(value) -> str:
    """The JSON name of a parsed value's type ("array", "object", ...), for error messages."""
    for kind, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"),
                       ((int, float), "number")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def load_json(path: str, what: str) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is missing, not JSON or
    not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} not found: {path}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object ({{...}}), got a JSON {json_type(obj)}")
    return obj


def quantization_config(config: dict, root: str) -> dict:
    """config.json's "quantization_config" ({} when absent); ValueError when it is not an object."""
    quant = config.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise ValueError(f"{os.path.join(root, CONFIG_FILE)}: 'quantization_config' must be a JSON "
                         f"object, got a JSON {json_type(quant)}")
    return quant


def find_weight_files(root: str) -> list:
    """Relative paths of the checkpoint's safetensors files (from the index when present)."""
    index_path = os.path.join(root, INDEX_FILE)
    if os.path.exists(index_path):
        index = load_json(index_path, "index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map'; is it a safetensors index?")
        files = sorted(set(weight_map.values()), key=natural_key)
        for rel in files:
            if not os.path.isfile(os.path.join(root, rel)):
                raise CorruptCheckpointError(f"{INDEX_FILE} lists {rel}, which is missing from {root}")
        return files
    if os.path.isfile(os.path.join(root, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise ValueError(f"{root} holds neither {INDEX_FILE} nor {SINGLE_FILE}: expected a "
                     "Hugging Face safetensors checkpoint directory")


def list_other_files(root: str, weight_files: list) -> tuple[list, list]:
    skip = set(weight_files) | {CONFIG_FILE, INDEX_FILE}
    other, foreign = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, fn), root)
            if rel in skip or fn.startswith("."):
                continue
            (foreign if fn.endswith(FOREIGN_WEIGHT_SUFFIXES) else other).append(rel)
    return other, foreign


def open_source(root: str) -> SourceCheckpoint:
    """Read config, index and headers (no tensor data) and discover the MoE experts."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise ValueError(f"source checkpoint directory not found: {root}")
    config = load_json(os.path.join(root, CONFIG_FILE), "config.json")
    if isinstance(config.get("megamoe"), dict):
        raise ValueError(f"{root} is already converted by vllm-megamoe (config.json has "
                         "'megamoe'); convert the original checkpoint instead")
    weight_files = find_weight_files(root)
    tensors = {}
    for rel in weight_files:
        header, _ = read_header(os.path.join(root, rel))
        for name, info in header.items():
            if name in tensors:
                raise CorruptCheckpointError(f"tensor {name!r} is stored twice ({rel} and "
                                 f"{os.path.basename(tensors[name].file)})")
            tensors[name] = info
    index_path = os.path.join(root, INDEX_FILE)
    if os.path.exists(index_path):
        # (find_weight_files has checked that weight_map is a non-empty object)
        for name, rel in load_json(index_path, "index")["weight_map"].items():
            if name not in tensors or tensors[name].file != os.path.join(root, rel):
                raise CorruptCheckpointError(f"{INDEX_FILE} maps {name!r} to {rel}, which does not hold it")
    layers = discover_expert_layers(tensors, config)
    block = quantization_config(config, root).get("weight_block_size")
    if any(layer.is_fp8 for layer in layers) and block is not None and list(block) != [128, 128]:
        raise ValueError(f"{root}: FP8 experts with weight_block_size {block}; megamoe needs "
                         "128x128 block scales")
    other, foreign = list_other_files(root, weight_files)
    return SourceCheckpoint(root, config, weight_files, tensors, layers, other, foreign)


def discover_expert_layers(tensors: dict, config: dict) -> list:
    per_expert, stacked = {}, {}
    for name, info in tensors.items():
        m = PER_EXPERT_RE.match(name)
        if m:
            role = ROLE_OF_PROJ[m["proj"]] + ("_scale" if m["kind"] == "weight_scale_inv" else "")
            naming = "mixtral" if m["proj"] in ("w1", "w2", "w3") else "hf"
            per_expert.setdefault(m["prefix"], []).append((int(m["expert"]), role, naming, info))
            continue
        m = STACKED_RE.match(name)
        if m:
            stacked.setdefault(m["prefix"], {})[m["proj"]] = info
            continue
        if UNDER_EXPERTS_RE.search(name):
            hint = (" (megamoe experts have no biases)" if "bias" in name else "")
            raise ValueError(f"unsupported expert tensor {name!r}{hint}; supported naming: "
                             f"{SUPPORTED_TEXT}")
    both = set(per_expert) & set(stacked)
    if both:
        raise ValueError(f"{sorted(both)[0]} mixes per-expert and stacked expert tensors")
    layers = [_per_expert_layer(p, entries) for p, entries in per_expert.items()]
    layers += [_stacked_layer(p, found) for p, found in stacked.items()]
    layers.sort(key=lambda layer: natural_key(layer.prefix))
    hidden_cfg = _config_hidden(config)
    for layer in layers:
        if hidden_cfg is not None and layer.hidden != hidden_cfg:
            raise ValueError(f"{layer.prefix}: expert hidden size {layer.hidden} differs from "
                             f"config.json hidden_size {hidden_cfg}")
        for what, size in (("hidden", layer.hidden), ("intermediate", layer.intermediate)):
            if size % CHANNEL_ALIGN:
                raise ValueError(f"{layer.prefix}: expert {what} size {size} is not a multiple "
                                 f"of {CHANNEL_ALIGN}; the megamoe kernels cannot run it")
    return layers


def _config_hidden(config: dict) -> Optional[int]:
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = cfg.get("hidden_size")
    return value if isinstance(value, int) else None


def _check_dtype(info: TensorInfo, allowed) -> None:
    if info.dtype not in allowed:
        raise ValueError(f"expert tensor {info.name!r} has dtype {info.dtype}; supported: "
                         f"{', '.join(allowed)} (FP8 e4m3 needs 128x128 weight_scale_inv)")


def _check_shape(info: TensorInfo, want: tuple, what: str) -> None:
    if tuple(info.shape) != tuple(want):
        raise ValueError(f"expert tensor {info.name!r} has shape {list(info.shape)}, expected "
                         f"{list(want)} ({what}, like the layer's other experts)")


def _per_expert_layer(prefix: str, entries: list) -> ExpertLayer:
    namings = {naming for _, _, naming, _ in entries}
    if len(namings) > 1:
        raise ValueError(f"{prefix} mixes w1/w2/w3 and gate_proj/up_proj/down_proj names")
    by_role: dict = {}
    for expert, role, _, info in entries:
        by_role.setdefault(role, {})[expert] = info
    num_experts = 1 + max(e for e, _, _, _ in entries)
    mixtral = namings == {"mixtral"}
    proj = ({"gate": "w1", "up": "w3", "down": "w2"} if mixtral
            else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    has_scales = any(r.endswith("_scale") for r in by_role)
    roles = ["gate", "up", "down"] + (["gate_scale", "up_scale", "down_scale"] if has_scales else [])
    tensors = {}
    for role in roles:
        found = by_role.get(role, {})
        for e in range(num_experts):
            if e not in found:
                base = role.replace("_scale", "")
                kind = "weight_scale_inv" if role.endswith("_scale") else "weight"
                raise CorruptCheckpointError(f"expert tensor {prefix}.{e}.{proj[base]}.{kind} is missing "
                                 f"({num_experts} experts found under {prefix}); the checkpoint "
                                 "is incomplete")
        tensors[role] = [found[e] for e in range(num_experts)]
    first_gate = tensors["gate"][0]
    _check_dtype(first_gate, FLOAT_DTYPES + (FP8_SOURCE_DTYPE,))
    if len(first_gate.shape) != 2:
        raise ValueError(f"expert tensor {first_gate.name!r} has shape {list(first_gate.shape)}; "
                         "expected 2-D [intermediate, hidden]")
    inter, hidden = first_gate.shape
    dtype = first_gate.dtype
    is_fp8 = dtype == FP8_SOURCE_DTYPE
    if is_fp8 and not has_scales:
        raise ValueError(f"expert tensor {first_gate.name!r} is FP8 but "
                         f"{first_gate.name}_scale_inv is missing; FP8 experts need 128x128 "
                         "block scales (weight_scale_inv)")
    if has_scales and not is_fp8:
        raise ValueError(f"{prefix} has weight_scale_inv tensors but {dtype} weights; scales "
                         "belong to FP8 e4m3 weights only")
    want = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    blocks = lambda n: -(-n // FP8_BLOCK)  # noqa: E731
    for role in ("gate", "up", "down"):
        for e, info in enumerate(tensors[role]):
            _check_dtype(info, (dtype,))
            _check_shape(info, want[role], f"{role} of [{inter} intermediate, {hidden} hidden]")
            if is_fp8:
                scale = tensors[role + "_scale"][e]
                _check_dtype(scale, ("F32", "BF16"))
                r, c = want[role]
                _check_shape(scale, (blocks(r), blocks(c)), "128x128 block scales")
    return ExpertLayer(prefix, num_experts, hidden, inter, dtype, None, tensors)


def _stacked_layer(prefix: str, found: dict) -> ExpertLayer:
    for proj in ("gate_up_proj", "down_proj"):
        if proj not in found:
            raise CorruptCheckpointError(f"expert tensor {prefix}.{proj} is missing (stacked experts need "
                             "both gate_up_proj and down_proj)")
    gate_up, down = found["gate_up_proj"], found["down_proj"]
    for info in (gate_up, down):
        _check_dtype(info, FLOAT_DTYPES)
        if len(info.shape) != 3:
            raise ValueError(f"expert tensor {info.name!r} has shape {list(info.shape)}; "
                             "expected 3-D [experts, ., .]")
    if down.dtype != gate_up.dtype:
        raise ValueError(f"{down.name!r} is {down.dtype} but {gate_up.name!r} is {gate_up.dtype}")
    e, a, b = gate_up.shape
    e2, c, d = down.shape
    if e2 != e:
        raise ValueError(f"{down.name!r} has {e2} experts but {gate_up.name!r} has {e}")
    if a == 2 * d and b == c:        # nn.Linear layout: [E, 2I, H], [E, H, I]
        return ExpertLayer(prefix, e, b, d, gate_up.dtype, "linear",
                           {"gate_up": gate_up, "down": down})
    if b == 2 * c and a == d:        # transposed layout: [E, H, 2I], [E, I, H]
        return ExpertLayer(prefix, e, a, c, gate_up.dtype, "transposed",
                           {"gate_up": gate_up, "down": down})
    raise ValueError(f"stacked experts {gate_up.name!r} {list(gate_up.shape)} and {down.name!r} "
                     f"{list(down.shape)} fit neither [E, 2I, H] + [E, H, I] nor "
                     "[E, H, 2I] + [E, I, H]")

