"""The kernel weight layout of each arch and format: the one function both the offline
converter and the vLLM plugin (load time) call, and the tensor names a converted checkpoint uses.

    to_kernel_layout(w13, w2, arch=, fmt=, w13_scale_inv=None, w2_scale_inv=None) -> KernelExperts

Input: one layer's experts (or any slice of them) in vLLM's checkpoint layout, w13 [E, 2I, H]
(gate rows then up rows) and w2 [E, H, I], either float (bf16/fp16/fp32) or FP8 e4m3 with
float32 128x128 block `scale_inv` ([E, 2I/128, H/128], [E, H/128, I/128]). Every step is per
expert, so converting experts in chunks gives the same bytes as converting the whole layer.

| arch  | fmt       | w13 / w2                         | scales                                   |
| sm90  | fp8-block | e4m3, w13 interleaved (gran 8)   | float32 scale_inv, checkpoint row order  |
| sm90  | bf16      | bf16, w13 interleaved            | none                                     |
| sm100 | mxfp4     | packed E2M1 int8 [.., K/2], w13 interleaved | int32 UE8M0 x4 [.., N, K/128]; L1 interleaved then UTCCP-transposed, L2 UTCCP-transposed |
| sm100 | bf16      | bf16, w13 interleaved            | none                                     |
sm90 goes through weights.transform_weights_for_mega_moe (what the plugin runs at load time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import quant
from ..shape import CHANNEL_ALIGN, require
from ..weights import WEIGHT_BLOCK, ExpertWeights, transform_weights_for_mega_moe

LAYOUT_VERSION = 1
ARCH_FORMATS = {"sm90": ("fp8-block", "bf16"), "sm100": ("mxfp4", "bf16")}
MXFP4_GROUP = 32
# What each format does to experts of each source precision (None: nothing, the values are kept).
FLOAT_SOURCES = ("bf16", "f16", "f32")

# Output tensor names under each experts module (vLLM FusedMoE parameter names).
W13, W2 = "w13_weight", "w2_weight"
SCALE_SUFFIX = {"fp8-block": "_scale_inv", "mxfp4": "_scale", "bf16": None}


def default_format(arch: str, source_format: Optional[str]) -> str:
    """The format that keeps the source experts' precision on `arch`: bf16 for float experts
    (BF16, or F16 / F32 cast to BF16), fp8-block for FP8 128x128-block experts where the arch runs
    it. Quantizing is never a default: where the arch does not run the source's precision (FP8 on
    sm100) or the source mixes precisions, ValueError asks for an explicit --format."""
    formats = ARCH_FORMATS[arch]
    if source_format and set(source_format.split("/")) <= set(FLOAT_SOURCES):
        return "bf16"
    if source_format == "fp8-block" and source_format in formats:
        return "fp8-block"
    what = ("FP8 128x128-block" if source_format == "fp8-block"
            else f"a mix of {source_format or 'unknown'}")
    choices = "; ".join(f"--format {f} ({precision_change(source_format, f) or 'kept'})" for f in formats)
    raise ValueError(f"the source's experts are {what}, which {arch} does not run as they are: pick "
                     f"the format explicitly: {choices}")


def precision_change(source_format: Optional[str], fmt: str) -> Optional[str]:
    """What converting experts of `source_format` to `fmt` does to their values, in words (None:
    they are kept as stored, apart from the kernel's reordering)."""
    if fmt == "fp8-block":
        return None if source_format == "fp8-block" else "quantized to FP8 e4m3 with 128x128 block scales"
    if fmt == "mxfp4":
        return ("dequantized, then quantized to MXFP4 (E2M1 with UE8M0 scales per 32 values)"
                if source_format == "fp8-block" else
                "quantized to MXFP4 (E2M1 with UE8M0 scales per 32 values)")
    if source_format == "fp8-block":
        return "dequantized from FP8 to BF16"
    return None if source_format == "bf16" else f"cast from {str(source_format).upper()} to BF16"


def check_arch_format(arch: str, fmt: Optional[str], source_format: Optional[str] = None) -> str:
    """The format to use (when fmt is None, the one keeping the source's precision: default_format);
    ValueError when unsupported."""
    require(arch in ARCH_FORMATS, f"--arch {arch!r} is not supported; choose one of "
            f"{sorted(ARCH_FORMATS)}")
    if fmt is None:
        require(source_format is not None, "give the expert format (fmt / --format): one of "
                f"{' or '.join(ARCH_FORMATS[arch])} for {arch}")
        return default_format(arch, source_format)
    require(fmt in ARCH_FORMATS[arch], f"--format {fmt!r} does not run on {arch}; {arch} runs "
            f"{' or '.join(ARCH_FORMATS[arch])}")
    return fmt


@dataclass
class KernelExperts:
    """Expert weights in a kernel layout (scales None for bf16)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None

    def named(self, fmt: str) -> dict:
        """{parameter name: tensor} with the names a converted checkpoint stores."""
        out = {W13: self.w13, W2: self.w2}
        suffix = SCALE_SUFFIX[fmt]
        if suffix:
            out[W13 + suffix] = self.w13_scale
            out[W2 + suffix] = self.w2_scale
        return out


def tensor_specs(num_experts: int, hidden: int, intermediate: int, fmt: str) -> dict:
    """{parameter name: (safetensors dtype, shape)} of one converted layer."""
    e, h, i = num_experts, hidden, intermediate
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if fmt == "bf16":
        return {W13: ("BF16", (e, 2 * i, h)), W2: ("BF16", (e, h, i))}
    if fmt == "fp8-block":
        bn, bk = WEIGHT_BLOCK
        return {W13: ("F8_E4M3", (e, 2 * i, h)), W2: ("F8_E4M3", (e, h, i)),
                W13 + "_scale_inv": ("F32", (e, cdiv(2 * i, bn), cdiv(h, bk))),
                W2 + "_scale_inv": ("F32", (e, cdiv(h, bn), cdiv(i, bk)))}
    if fmt == "mxfp4":
        g = 4 * MXFP4_GROUP
        return {W13: ("I8", (e, 2 * i, h // 2)), W2: ("I8", (e, h, i // 2)),
                W13 + "_scale": ("I32", (e, 2 * i, h // g)),
                W2 + "_scale": ("I32", (e, h, i // g))}
    raise ValueError(f"format {fmt!r} has no tensor layout; expected one of {sorted(SCALE_SUFFIX)}")


def _require_scales(s13, s2) -> None:
    missing = [name for name, s in (("w13_scale_inv", s13), ("w2_scale_inv", s2)) if s is None]
    require(not missing, "FP8 expert weights need w13_scale_inv and w2_scale_inv (float32 "
            f"128x128 block scales); {' and '.join(missing)} not given")


def _check_sm90_sizes(w13, w2) -> None:
    """sm90 runs hidden and intermediate sizes that are multiples of 128 (as sm100 does)."""
    for name, size in (("hidden", w13.shape[2]), ("intermediate", w13.shape[1] // 2)):
        require(size > 0 and size % CHANNEL_ALIGN == 0,
                f"{name}={size} (w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}) must be a "
                f"positive multiple of {CHANNEL_ALIGN} for sm90")


def _float_weights(w13, w2, s13, s2):
    if w13.dtype == quant.FP8_DTYPE:
        _require_scales(s13, s2)
        return (quant.dequantize_fp8_blocks(w13, s13, WEIGHT_BLOCK),
                quant.dequantize_fp8_blocks(w2, s2, WEIGHT_BLOCK))
    return w13, w2


def to_kernel_layout(w13: torch.Tensor, w2: torch.Tensor, *, arch: str, fmt: str,
                     w13_scale_inv: Optional[torch.Tensor] = None,
                     w2_scale_inv: Optional[torch.Tensor] = None) -> KernelExperts:
    """Checkpoint-layout experts -> the layout the `arch` mega kernel reads in `fmt`."""
    fmt = check_arch_format(arch, fmt)
    require(w13.dim() == 3 and w2.dim() == 3,
            f"w13 and w2 must be [E, 2I, H] and [E, H, I], got {tuple(w13.shape)} and "
            f"{tuple(w2.shape)}")
    is_fp8 = w13.dtype == quant.FP8_DTYPE
    if arch == "sm90":
        _check_sm90_sizes(w13, w2)
        if fmt == "fp8-block" and is_fp8:
            _require_scales(w13_scale_inv, w2_scale_inv)
            weights = ExpertWeights("fp8-block", w13, w2, w13_scale_inv.float(),
                                    w2_scale_inv.float())
        else:
            weights = ExpertWeights.from_float(*_float_weights(w13, w2, w13_scale_inv,
                                                               w2_scale_inv), fmt)
        k = transform_weights_for_mega_moe(weights, "sm90")
        return KernelExperts(k.w13, k.w2, k.w13_scale, k.w2_scale)
    # sm100: the same conversion the plugin runs at load time (MN-major, TMA-aligned scales).
    from ..sm100.weights import convert_experts
    return convert_experts(w13, w2, fmt=fmt, w13_scale_inv=w13_scale_inv,
                           w2_scale_inv=w2_scale_inv).to_kernel_experts()
