"""config.json["megamoe"]: the marker of a converted checkpoint, and the config changes that let
vLLM load it.

Contract (layout_version 1):
    "megamoe": {
      "format": "fp8-block" | "bf16" | "mxfp4",
      "arch": "sm90" | "sm100",
      "layout_version": 1,
      "interleave": 8,                      # L1 gate/up interleave granularity
      "scale_layout": "checkpoint" | "utccp" | null,
      "weight_block": [128, 128],           # fp8-block only
      "mxfp4_group": 32,                    # mxfp4 only
      "source_format": "bf16" | "fp8-block" | ...,
      "tensor_names": {"w13": "w13_weight", "w2": "w2_weight",
                       "w13_scale": "w13_weight_scale_inv" | "w13_weight_scale" | null, ...},
      "expert_modules": ["model.layers.1.mlp.experts", ...],
      "converter": "vllm-megamoe <version>"
    }
"""
from __future__ import annotations

from typing import Optional

from .. import __version__
from ..transforms import INTERLEAVE_GRANULARITY
from ..weights import WEIGHT_BLOCK
from .layouts import ARCH_FORMATS, LAYOUT_VERSION, MXFP4_GROUP, SCALE_SUFFIX, W2, W13

MARKER_KEY = "megamoe"
REQUIRED_KEYS = ("format", "arch", "layout_version")
# The types of the fields this version reads ("expert_modules" is optional).
FIELD_TYPES = {"format": (str, "a string"), "arch": (str, "a string"),
               "layout_version": (int, "an integer"),
               "expert_modules": (list, "a list of module paths (strings)")}
FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(WEIGHT_BLOCK)}


def build_marker(arch: str, fmt: str, source_format: str, expert_modules: list) -> dict:
    suffix = SCALE_SUFFIX[fmt]
    marker = {
        "format": fmt, "arch": arch, "layout_version": LAYOUT_VERSION,
        "interleave": INTERLEAVE_GRANULARITY,
        "scale_layout": None if suffix is None else ("utccp" if fmt == "mxfp4" else "checkpoint"),
        "source_format": source_format,
        "tensor_names": {"w13": W13, "w2": W2,
                         "w13_scale": W13 + suffix if suffix else None,
                         "w2_scale": W2 + suffix if suffix else None},
        "expert_modules": list(expert_modules),
        "converter": f"vllm-megamoe {__version__}",
    }
    if fmt == "fp8-block":
        marker["weight_block"] = list(WEIGHT_BLOCK)
    if fmt == "mxfp4":
        marker["mxfp4_group"] = MXFP4_GROUP
    return marker


def read_megamoe_marker(config: dict) -> Optional[dict]:
    """The marker of a converted checkpoint's config.json dict, or None when not converted.

    Raises ValueError when the marker is present but unreadable by this version."""
    marker = config.get(MARKER_KEY) if isinstance(config, dict) else None
    if marker is None:
        return None
    if not isinstance(marker, dict):
        raise ValueError(f"config.json key {MARKER_KEY!r} must be a mapping written by "
                         f"`vllm-megamoe convert`, got {marker!r}")
    missing = [k for k in REQUIRED_KEYS if k not in marker]
    if missing:
        raise ValueError(f"config.json {MARKER_KEY!r} lacks {missing}; re-run `vllm-megamoe "
                         "convert` on the original checkpoint")
    _check_field_types(marker)
    if marker["layout_version"] != LAYOUT_VERSION:
        raise ValueError(f"checkpoint was converted with megamoe layout_version="
                         f"{marker['layout_version']}; this vllm-megamoe {__version__} reads "
                         f"layout_version {LAYOUT_VERSION}. Re-run `vllm-megamoe convert` with "
                         "this version on the original checkpoint")
    if marker["arch"] not in ARCH_FORMATS or marker["format"] not in ARCH_FORMATS[marker["arch"]]:
        raise ValueError(f"config.json {MARKER_KEY!r} names arch={marker['arch']!r} "
                         f"format={marker['format']!r}, which this version does not know")
    return marker


def _check_field_types(marker: dict) -> None:
    for key, (kind, what) in FIELD_TYPES.items():
        if key not in marker:
            continue
        value = marker[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if ok and kind is list:
            ok = all(isinstance(m, str) for m in value)
        if not ok:
            raise ValueError(f"config.json {MARKER_KEY!r} field {key!r} must be {what}, got "
                             f"{value!r}; re-run `vllm-megamoe convert` on the original "
                             "checkpoint")


def check_marker_matches(marker: dict, arch: str, fmt: Optional[str] = None) -> None:
    """Raise ValueError unless a checkpoint converted as `marker` runs on `arch` (in `fmt`)."""
    want = f"{arch}" + (f" {fmt}" if fmt else "")
    got = f"{marker.get('arch')} {marker.get('format')}"
    if marker.get("arch") != arch or (fmt is not None and marker.get("format") != fmt):
        raise ValueError(
            f"this checkpoint was converted by `vllm-megamoe convert` for {got}, but this GPU "
            f"needs {want}. Convert the original checkpoint again with `vllm-megamoe convert "
            f"SRC DST --arch {arch}" + (f" --format {fmt}" if fmt else "") + "`, or serve the "
            "original (unconverted) checkpoint, which megamoe converts at load time")


def converted_config(config: dict, marker: dict, source_is_fp8: bool,
                     non_expert_linear_modules: list) -> dict:
    """config.json of the converted checkpoint: the marker plus a quantization_config under
    which vLLM creates parameters of the converted experts' dtype.

    - fp8-block from a BF16 source: FP8 128x128 block config; every non-expert linear module
      is listed in `ignored_layers` (they stay BF16).
    - bf16 / mxfp4 experts from an FP8 source: the source's FP8 config with the expert modules
      added to `ignored_layers` (the non-expert layers stay FP8).
    mxfp4 parameters are created by the megamoe plugin from the marker (vLLM has no such recipe).
    """
    out = dict(config)
    out[MARKER_KEY] = marker
    fmt = marker["format"]
    if fmt == "fp8-block" and not source_is_fp8:
        qc = dict(FP8_QUANT_CONFIG)
        qc["ignored_layers"] = sorted(non_expert_linear_modules)
        out["quantization_config"] = qc
    elif fmt != "fp8-block" and source_is_fp8 and isinstance(out.get("quantization_config"), dict):
        qc = dict(out["quantization_config"])
        ignored = set(qc.get("ignored_layers") or []) | set(marker["expert_modules"])
        qc["ignored_layers"] = sorted(ignored)
        out["quantization_config"] = qc
    return out
