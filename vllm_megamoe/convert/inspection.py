"""`inspect_checkpoint`: a readable summary of a checkpoint directory, converted or not."""
from __future__ import annotations

import os

from .discovery import CONFIG_FILE, FP8_SOURCE_DTYPE, find_weight_files, load_json, open_source, quantization_config
from .marker import read_megamoe_marker
from .safetensors_io import CorruptCheckpointError, read_header
from .verify import load_converted_index

MXFP4_VALUES_PER_BYTE = 2


def _text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _first(cfg: dict, *keys):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _dir_bytes(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def _converted_layers(root: str, marker: dict) -> list:
    tensors = {}
    for rel in find_weight_files(root):
        tensors.update(read_header(os.path.join(root, rel))[0])
    layers = []
    for prefix in marker.get("expert_modules") or []:
        w13, w2 = tensors.get(prefix + ".w13_weight"), tensors.get(prefix + ".w2_weight")
        if w13 is None or w2 is None:
            layers.append({"prefix": prefix, "error": "w13_weight/w2_weight missing"})
            continue
        layers.append({"prefix": prefix, "experts": w13.shape[0], "hidden": w2.shape[1],
                       "intermediate": w13.shape[1] // 2, "dtype": w13.dtype})
    return layers


def inspect_checkpoint(root: str) -> dict:
    """Facts about the checkpoint at `root` (see format_inspection). Raises ValueError
    (CorruptCheckpointError for truncated or malformed files) when the checkpoint cannot be read;
    experts it does not recognise in readable files are reported in the summary instead."""
    root = os.path.abspath(root)
    config = load_json(os.path.join(root, CONFIG_FILE), "config.json")
    cfg = _text_config(config)
    marker = read_megamoe_marker(config)
    info = {
        "path": root,
        "architectures": config.get("architectures"),
        "model_type": config.get("model_type"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "config_hidden_size": cfg.get("hidden_size"),
        "top_k": _first(cfg, "num_experts_per_tok", "moe_topk", "top_k"),
        "quantization": quantization_config(config, root).get("quant_method"),
        "megamoe": marker,
        "bytes_on_disk": _dir_bytes(root),
    }
    weight_files = find_weight_files(root)
    info["weight_files"] = len(weight_files)
    info["weight_bytes"] = sum(os.path.getsize(os.path.join(root, f)) for f in weight_files)
    if marker is not None:
        index = load_converted_index(root)
        info["checksummed_files"] = len((index.get("megamoe") or {}).get("sha256") or {})
        info["layers"] = _converted_layers(root, marker)
        info["layout"] = (f"{marker['arch']} {marker['format']}, gate/up interleaved x"
                          f"{marker.get('interleave')}, scales {marker.get('scale_layout')}")
    else:
        try:
            source = open_source(root)
            info["layers"] = [{"prefix": l.prefix, "experts": l.num_experts, "hidden": l.hidden,
                               "intermediate": l.intermediate, "dtype": l.source_dtype,
                               "convention": l.stacked and f"stacked ({l.stacked})"
                               or "per expert"} for l in source.layers]
            info["layout"] = "checkpoint order, gate rows | up rows"
        except CorruptCheckpointError:
            raise  # truncated or malformed files: an error, not a summary
        except ValueError as exc:  # readable, but experts the converter does not support
            info["layers"] = []
            info["layout"] = f"experts not recognised: {exc}"
    return info


def sm90_layer_shapes(info: dict, *, ep_size: int = 1, tp_size: int = 1,
                      redundant_experts: int = 0) -> tuple[list, str]:
    """(MoE layer shapes, format) of the checkpoint `info` (inspect_checkpoint) as the megamoe plugin
    registers them on the SM90 path: global experts (redundant ones added), the intermediate split
    over `tp_size` ranks when there is no expert parallelism (`ep_size` 1), FP8 128x128 block
    checkpoints as fp8-block and the rest as bf16 (vLLM's --dtype bfloat16). ValueError names
    what is missing or what the SM90 path does not run."""
    from ..shape import MoEShape, check_int, require
    for name, value in (("ep_size", ep_size), ("tp_size", tp_size), ("redundant_experts", redundant_experts)):
        check_int(name, value)
    require(ep_size >= 1 and tp_size >= 1 and redundant_experts >= 0,
            f"ep_size={ep_size}, tp_size={tp_size} must be >= 1 and redundant_experts={redundant_experts} >= 0")
    require(ep_size == 1 or ep_size % tp_size == 0,
            f"an EP group of {ep_size} ranks holds whole tensor-parallel groups of {tp_size} (vLLM's EP size is "
            "data x tensor parallel size)")
    layers = [l for l in info["layers"] if "error" not in l]
    require(layers, f"{info['path']}: no MoE expert layers found ({info.get('layout')})")
    top_k = info.get("top_k")
    require(isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1,
            f"{info['path']}: config.json names no top-k (num_experts_per_tok: {top_k!r}); give --shape instead")
    marker = info.get("megamoe")
    if marker is not None:
        require(marker["arch"] == "sm90", f"{info['path']} was converted for {marker['arch']}, not the SM90 kernel")
        fmt = marker["format"]
    else:
        fmt = "fp8-block" if {l["dtype"] for l in layers} == {FP8_SOURCE_DTYPE} else "bf16"
    split = tp_size if ep_size == 1 else 1  # TP without EP: each rank runs a slice of every expert
    shapes = []
    for l in layers:
        require(l["intermediate"] % split == 0,
                f"intermediate {l['intermediate']} does not split over {tp_size} tensor-parallel ranks")
        shape = MoEShape(l["hidden"], l["intermediate"] // split, l["experts"] + redundant_experts, top_k)
        try:
            shape.validate(ep_size)
        except ValueError as exc:
            what = f"intermediate {l['intermediate']} / tensor-parallel {tp_size}" if split > 1 else "the layer"
            raise ValueError(f"{l['prefix']} ({what}): {exc}") from None
        shapes.append(shape)
    return list(dict.fromkeys(shapes)), fmt


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def format_inspection(info: dict) -> str:
    layers = info["layers"]
    shapes = sorted({(l.get("experts"), l.get("hidden"), l.get("intermediate"), l.get("dtype"))
                     for l in layers if "error" not in l}, key=str)
    lines = [
        f"checkpoint     {info['path']}",
        f"architecture   {', '.join(info['architectures'] or ['?'])} "
        f"(model_type {info['model_type']})",
        f"layers         {info['num_hidden_layers']} ({len(layers)} MoE)",
    ]
    for e, h, i, dtype in shapes:
        lines.append(f"experts        {e} per MoE layer, top-{info['top_k']}, hidden {h}, "
                     f"intermediate {i}, stored {dtype}")
    conventions = sorted({l["convention"] for l in layers if "convention" in l})
    if conventions:
        lines.append(f"naming         {', '.join(conventions)}")
    lines.append(f"quantization   {info['quantization'] or 'none'}")
    marker = info["megamoe"]
    if marker:
        lines.append(f"megamoe        converted: arch {marker['arch']}, format {marker['format']}, "
                     f"layout_version {marker['layout_version']}, from {marker.get('source_format')}")
        lines.append(f"layout         {info['layout']}")
        lines.append(f"checksums      {info['checksummed_files']} of {info['weight_files']} "
                     "weight files")
    else:
        lines.append(f"megamoe        not converted ({info['layout']})")
    lines.append(f"size on disk   {_gb(info['bytes_on_disk'])} "
                 f"({info['weight_files']} weight files, {_gb(info['weight_bytes'])})")
    for l in layers:
        if "error" in l:
            lines.append(f"problem        {l['prefix']}: {l['error']}")
    return "\n".join(lines)
