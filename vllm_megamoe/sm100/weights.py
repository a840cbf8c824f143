"""Expert weights in the layout DeepGEMM's SM100 Mega MoE kernel reads, and the conversion to it.

    convert_experts(w13, w2, fmt="mxfp4"|"bf16", w13_scale_inv=None, w2_scale_inv=None)

Input: one layer's local experts in vLLM's checkpoint layout, w13 [E, 2I, H] (gate rows, then up
rows) and w2 [E, H, I]; float (bf16/fp16/fp32) or FP8 e4m3 with float32 128x128 block scale_inv.
The load-time path (plugin) and the offline CLI (`vllm-megamoe convert --arch sm100`) both call
it, so the bytes are the same.

fmt="mxfp4" (kernel mma_type "fp8xfp4"):
  w13 int8 [E, 2I, H/2]  E2M1 pairs (even K in the low nibble), rows interleaved gate/up by 8
  w13_sf int32 [E, 2I, H/128]  UE8M0 x4 per 1x32, rows interleaved, then UTCCP-transposed
  w2 int8 [E, H, I/2]  unchanged order
  w2_sf int32 [E, H, I/128]  UTCCP-transposed
  both scale tensors MN-major and TMA aligned (see sf_layout).
fmt="bf16" (mma_type "bf16xbf16"): w13 bf16 interleaved, w2 bf16 unchanged, no scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import quant, transforms
from ..shape import CHANNEL_ALIGN, check_tensor, require
from ..weights import WEIGHT_BLOCK
from . import sf_layout

FORMATS = ("mxfp4", "bf16")
MMA_TYPE = {"mxfp4": "fp8xfp4", "bf16": "bf16xbf16"}
# Checkpoint format -> the SM100 kernel format used when the caller does not choose.
DEFAULT_KERNEL_FORMAT = {"fp8-block": "mxfp4", "bf16": "bf16", "mxfp4": "mxfp4"}
MXFP4_GROUP = 32
CHUNK_EXPERTS = 8  # experts converted at once (bounds the float32 temporaries)


@dataclass
class Sm100Weights:
    """One layer's local experts in the SM100 kernel layout (see module docstring)."""

    format: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_sf: Optional[torch.Tensor] = None
    w2_sf: Optional[torch.Tensor] = None
    layout: str = "sm100"

    def __post_init__(self):
        self.validate()

    @property
    def mma_type(self) -> str:
        return MMA_TYPE[self.format]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def l1(self):
        return (self.w13, self.w13_sf) if self.format == "mxfp4" else self.w13

    def l2(self):
        return (self.w2, self.w2_sf) if self.format == "mxfp4" else self.w2

    def validate(self) -> None:
        """The host-side checks DeepGEMM makes, with messages that say what to change."""
        require(self.format in FORMATS, f"SM100 weight format {self.format!r} must be one of {FORMATS}")
        check_tensor("w13", self.w13, ndim=3)
        e, two_i, h_store = self.w13.shape
        h = h_store * 2 if self.format == "mxfp4" else h_store
        i = two_i // 2
        dtype = torch.int8 if self.format == "mxfp4" else torch.bfloat16
        check_tensor("w13", self.w13, dtype=dtype, contiguous=True)
        check_tensor("w2", self.w2, dtype=dtype, contiguous=True,
                     shape=(e, h, i // 2 if self.format == "mxfp4" else i))
        require(h % CHANNEL_ALIGN == 0 and i % CHANNEL_ALIGN == 0,
                f"hidden={h} and intermediate={i} must be multiples of {CHANNEL_ALIGN}")
        if self.format == "mxfp4":
            require(self.w13_sf is not None and self.w2_sf is not None,
                    "format='mxfp4' needs w13_sf and w2_sf (int32 packed UE8M0 scales)")
            sf_layout.check_sf("w13_sf", self.w13_sf, 2 * i, h, e)
            sf_layout.check_sf("w2_sf", self.w2_sf, h, i, e)
        else:
            require(self.w13_sf is None and self.w2_sf is None, "format='bf16' takes no scales")

    # -- interop with the checkpoint layout ------------------------------------------------
    def to_kernel_experts(self):
        """Contiguous tensors (same values) for a safetensors checkpoint: convert.layouts.KernelExperts."""
        from ..convert.layouts import KernelExperts
        # Fresh row-major storage: .contiguous() keeps odd strides on size-1 dims (K/128 == 1),
        # which safetensors' byte views reject.
        c = (lambda t: None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t))  # noqa: E731
        return KernelExperts(self.w13, self.w2, c(self.w13_sf), c(self.w2_sf))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13, w2) in checkpoint layout (undoes UTCCP and interleave)."""
        if self.format == "bf16":
            return (transforms.deinterleave_gate_up(self.w13).float(), self.w2.float())
        sf13 = transforms.deinterleave_gate_up(transforms.untranspose_sf_for_utccp(self.w13_sf))
        sf2 = transforms.untranspose_sf_for_utccp(self.w2_sf)
        w13 = transforms.deinterleave_gate_up(self.w13)
        return (quant.dequantize_mxfp4(w13, sf13.contiguous(), MXFP4_GROUP),
                quant.dequantize_mxfp4(self.w2, sf2.contiguous(), MXFP4_GROUP))


def from_kernel_experts(w13, w2, w13_sf=None, w2_sf=None, *, fmt: str) -> Sm100Weights:
    """Weights read from a checkpoint converted offline for sm100 (values already in kernel
    order, stored contiguously): restride the scales to the kernel's MN-major layout."""
    mn = (lambda t: None if t is None else sf_layout.to_mn_major(t))  # noqa: E731
    return Sm100Weights(fmt, w13.contiguous(), w2.contiguous(), mn(w13_sf), mn(w2_sf))


def _float_chunk(w, scale_inv, name):
    if w.dtype == quant.FP8_DTYPE:
        require(scale_inv is not None, f"FP8 {name} needs its 128x128 block scale_inv")
        return quant.dequantize_fp8_blocks(w, scale_inv.float(), WEIGHT_BLOCK)
    require(scale_inv is None, f"{name} is {w.dtype}; a scale_inv is only for FP8 weights")
    check_tensor(name, w, dtype=(torch.float32, torch.bfloat16, torch.float16))
    return w


def convert_experts(w13: torch.Tensor, w2: torch.Tensor, *, fmt: Optional[str] = None,
                    w13_scale_inv: Optional[torch.Tensor] = None,
                    w2_scale_inv: Optional[torch.Tensor] = None,
                    chunk_experts: int = CHUNK_EXPERTS) -> Sm100Weights:
    """Checkpoint-layout experts -> Sm100Weights in `fmt` (default: mxfp4 for FP8 inputs,
    bf16 for float inputs). Runs on the tensors' device, `chunk_experts` experts at a time."""
    check_tensor("w13", w13, ndim=3)
    e, two_i, h = w13.shape
    require(two_i % 2 == 0, f"w13 has {two_i} rows; expected 2*intermediate (gate then up)")
    i = two_i // 2
    check_tensor("w2", w2, ndim=3, shape=(e, h, i))
    if fmt is None:
        fmt = DEFAULT_KERNEL_FORMAT["fp8-block" if w13.dtype == quant.FP8_DTYPE else "bf16"]
    require(fmt in FORMATS, f"SM100 format {fmt!r} must be one of {FORMATS}")
    require(h % CHANNEL_ALIGN == 0 and i % CHANNEL_ALIGN == 0,
            f"hidden={h} and intermediate={i} must be multiples of {CHANNEL_ALIGN} for SM100")
    dev = w13.device
    if fmt == "bf16":
        out13 = torch.empty(e, two_i, h, dtype=torch.bfloat16, device=dev)
        out2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=dev)
        sf13 = sf2 = None
    else:
        out13 = torch.empty(e, two_i, h // 2, dtype=torch.int8, device=dev)
        out2 = torch.empty(e, h, i // 2, dtype=torch.int8, device=dev)
        g = sf_layout.SF_PER_INT * MXFP4_GROUP  # K values per packed int32
        sf13 = sf_layout.empty_mn_major(e, two_i, h // g, device=dev)
        sf2 = sf_layout.empty_mn_major(e, h, i // g, device=dev)
    for e0 in range(0, e, chunk_experts):
        sl = slice(e0, min(e, e0 + chunk_experts))
        pick = (lambda s: None if s is None else s[sl])  # noqa: E731
        f13 = _float_chunk(w13[sl], pick(w13_scale_inv), "w13")
        f2 = _float_chunk(w2[sl], pick(w2_scale_inv), "w2")
        if fmt == "bf16":
            out13[sl] = transforms.interleave_gate_up(f13.to(torch.bfloat16))
            out2[sl] = f2
            continue
        q13, s13 = quant.quantize_mxfp4(f13, MXFP4_GROUP)
        q2, s2 = quant.quantize_mxfp4(f2, MXFP4_GROUP)
        out13[sl] = transforms.interleave_gate_up(q13)
        out2[sl] = q2
        sf13[sl] = transforms.transpose_sf_for_utccp(transforms.interleave_gate_up(s13))
        sf2[sl] = transforms.transpose_sf_for_utccp(s2)
    return Sm100Weights(fmt, out13, out2, sf13, sf2)
