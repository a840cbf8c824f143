"""Expert weights of one MoE layer in one of the supported formats and layouts.

Layouts:
- "checkpoint": vLLM's order, w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I].
- "interleaved": w13 rows interleaved gate/up at granularity 8 (what the SM90 kernel reads);
  FP8 block scales stay in checkpoint order (the kernel maps each row back, see
  transforms.interleaved_row_to_source_row), w2 unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

import torch

from . import quant, transforms
from .shape import check_format, check_tensor, require

LAYOUTS = ("checkpoint", "interleaved")
WEIGHT_BLOCK = (128, 128)


@dataclass
class ExpertWeights:
    """One layer's local experts. E is the number of experts on this rank."""

    format: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: Optional[torch.Tensor] = None  # fp8-block: float32 [E, 2I/128, H/128] (scale_inv)
    w2_scale: Optional[torch.Tensor] = None   # fp8-block: float32 [E, H/128, I/128]
    layout: str = "checkpoint"

    def __post_init__(self):
        self.validate()

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def validate(self) -> None:
        check_format(self.format)
        require(self.layout in LAYOUTS, f"layout={self.layout!r} must be one of {LAYOUTS}")
        wdtype = torch.bfloat16 if self.format == "bf16" else quant.FP8_DTYPE
        check_tensor("w13", self.w13, dtype=wdtype, ndim=3)
        e, two_i, h = self.w13.shape
        require(two_i % 2 == 0, f"w13 has {two_i} rows; expected 2*intermediate (gate and up)")
        i = two_i // 2
        check_tensor("w2", self.w2, dtype=wdtype, shape=(e, h, i))
        if self.format == "fp8-block":
            require(self.w13_scale is not None and self.w2_scale is not None,
                    "format='fp8-block' needs w13_scale and w2_scale (float32 128x128 block scale_inv)")
            check_tensor("w13_scale", self.w13_scale, dtype=torch.float32,
                         shape=(e, -(-two_i // 128), -(-h // 128)))
            check_tensor("w2_scale", self.w2_scale, dtype=torch.float32,
                         shape=(e, -(-h // 128), -(-i // 128)))
        else:
            require(self.w13_scale is None and self.w2_scale is None,
                    "format='bf16' takes no scales; pass format='fp8-block' for quantized weights")
        if self.layout == "interleaved":  # the kernels read the kernel layout by pointer
            for name, t in (("w13", self.w13), ("w2", self.w2), ("w13_scale", self.w13_scale),
                            ("w2_scale", self.w2_scale)):
                require(t is None or t.is_contiguous(),
                        f"{name} (layout='interleaved') must be contiguous: the kernels read it by pointer; "
                        "pass .contiguous()")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, format: str) -> "ExpertWeights":
        """Quantize float weights in checkpoint layout into `format`."""
        check_format(format)
        for name, t in (("w13", w13), ("w2", w2)):  # an integer tensor would be cast silently
            check_tensor(name, t, dtype=(torch.float32, torch.bfloat16, torch.float16))
        if format == "bf16":
            return cls("bf16", w13.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous())
        q13, s13 = quant.quantize_fp8_blocks(w13, WEIGHT_BLOCK)
        q2, s2 = quant.quantize_fp8_blocks(w2, WEIGHT_BLOCK)
        return cls("fp8-block", q13, q2, s13, s2)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13, w2) in checkpoint layout."""
        w13, w2 = self.w13, self.w2
        if self.layout == "interleaved":
            # Scales are in checkpoint row order, so undo the interleave before applying them.
            w13 = transforms.deinterleave_gate_up(w13.view(torch.uint8)).view(w13.dtype)
        if self.format == "fp8-block":
            w13 = quant.dequantize_fp8_blocks(w13, self.w13_scale, WEIGHT_BLOCK)
            w2 = quant.dequantize_fp8_blocks(w2, self.w2_scale, WEIGHT_BLOCK)
        return w13.float(), w2.float()

    def dequantize_expert(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [2I, H], w2 [H, I]) of one expert in checkpoint layout: the reference's
        per-expert input (reference.moe_forward_per_expert), without a float copy of the layer."""
        require(0 <= index < self.w13.shape[0],
                f"expert {index} is outside this layer's {self.w13.shape[0]} experts")
        w13, w2 = self.experts(index, 1).dequantize()
        return w13[0], w2[0]

    def experts(self, start: int, count: int) -> "ExpertWeights":
        """A view of experts [start, start+count) (e.g. one rank's share of a global layer)."""
        sl = slice(start, start + count)
        pick = (lambda t: None if t is None else t[sl])
        return replace(self, w13=self.w13[sl], w2=self.w2[sl],
                       w13_scale=pick(self.w13_scale), w2_scale=pick(self.w2_scale))

    def to(self, device) -> "ExpertWeights":
        move = (lambda t: None if t is None else t.to(device))
        return replace(self, w13=move(self.w13), w2=move(self.w2),
                       w13_scale=move(self.w13_scale), w2_scale=move(self.w2_scale))


def transform_weights_for_mega_moe(weights: ExpertWeights, arch: str = "sm90") -> ExpertWeights:
    """Checkpoint-layout weights -> the layout the `arch` mega kernel reads.

    sm90: L1 rows interleaved gate/up at granularity 8; block scales and L2 unchanged.
    Idempotent: weights already in the kernel layout are returned as they are.
    """
    require(arch == "sm90", f"arch={arch!r}: only 'sm90' weights are produced here "
            "(sm100 conversion is part of the Blackwell adapter)")
    if weights.layout == "interleaved":
        return weights
    return replace(weights, w13=transforms.interleave_gate_up(weights.w13), layout="interleaved")


def derived(weights: Any, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()`, a value computed from the contents of `weights` (a dense copy, another layout),
    cached on `weights` under `name`. overwrite_weights_ refills it in place, so addresses a CUDA
    graph or a TMA descriptor took from it stay valid."""
    cache = weights.__dict__.setdefault("_derived", {})
    if name not in cache:
        cache[name] = (compute, compute())
    return cache[name][1]


def overwrite_weights_(dst: Any, src: Any) -> None:
    """Copy the tensors of `src` into those of `dst` in place, then refill what was derived from
    them (`derived`) in place: a weight update keeps every address that parameters, CUDA graphs
    and TMA descriptors hold. Both are weight objects of one class (ExpertWeights, sm100's
    Sm100Weights) with the same format, layout and shapes."""
    require(type(dst) is type(src), f"cannot overwrite {type(dst).__name__} with {type(src).__name__}")
    for f in fields(dst):
        old, new = getattr(dst, f.name), getattr(src, f.name)
        if not isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor):
            require(old == new, f"{f.name}: the update has {new!r}, the weights in use have {old!r}")
            continue
        require(isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and old.shape == new.shape and old.dtype == new.dtype,
                f"{f.name}: the update is {_describe(new)}, the weights in use are {_describe(old)}; "
                "a weight update must keep every shape and dtype")
    for f in fields(dst):
        old, new = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
            _copy_into(old, new)
    for compute, value in dst.__dict__.get("_derived", {}).values():
        _refill(value, compute())


def _copy_into(old: torch.Tensor, new: torch.Tensor) -> None:
    # A value first computed in a forward pass is an inference tensor: writable only in that mode.
    with torch.inference_mode(old.is_inference()):
        old.copy_(new)


def _refill(old: Any, new: Any) -> None:
    if isinstance(old, torch.Tensor):
        _copy_into(old, new)
    elif isinstance(old, (tuple, list)):
        for o, n in zip(old, new, strict=True):
            _refill(o, n)
    else:
        overwrite_weights_(old, new)


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
