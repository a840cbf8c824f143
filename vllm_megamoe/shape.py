"""The MoE layer shape and the validation rules every path shares.

All rules live here so that Python, the portable path and the compiled kernels reject the same
inputs with the same message.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

# Limits shared with the kernels (csrc/ reads them from the generated layout header).
MAX_RANKS = 72
MAX_TOPK = 32
CHANNEL_ALIGN = 128  # hidden and intermediate must be multiples of this (FP8 block size)

FORMATS = ("bf16", "fp8-block")


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) when condition is false."""
    if not condition:
        raise ValueError(message)


def check_int(name: str, value) -> None:
    """An integer (numpy's too), not a bool, float or string: sizes are counts."""
    require(isinstance(value, numbers.Integral) and not isinstance(value, bool),
            f"{name}={value!r} must be an integer")


def check_multiple(name: str, value: int, multiple: int) -> None:
    require(value > 0 and value % multiple == 0,
            f"{name}={value} must be a positive multiple of {multiple}")


def check_format(fmt: str) -> str:
    require(fmt in FORMATS, f"format={fmt!r} is not supported; expected one of {FORMATS}")
    return fmt


def check_tensor(name: str, t: torch.Tensor, *, dtype=None, ndim=None, shape=None,
                 contiguous: bool = False) -> None:
    """Check a tensor argument; the error names the argument and what was expected."""
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        require(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected "
                + " or ".join(str(d) for d in dtypes))
    if ndim is not None:
        require(t.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple(shape)
        ok = len(want) == t.dim() and all(w is None or w == s for w, s in zip(want, t.shape))
        pretty = tuple("*" if w is None else w for w in want)
        require(ok, f"{name} has shape {tuple(t.shape)}, expected {pretty}")
    if contiguous:
        require(t.is_contiguous(), f"{name} must be contiguous (call .contiguous() first)")


@dataclass(frozen=True)
class MoEShape:
    """Sizes of one MoE layer (global view: num_experts counts every rank's experts).

    hidden: model width H (token rows); intermediate: expert width I (w13 has 2*I rows).
    """

    hidden: int
    intermediate: int
    num_experts: int
    topk: int

    def validate(self, num_ranks: int = 1) -> "MoEShape":
        for name, value in (("hidden", self.hidden), ("intermediate", self.intermediate),
                            ("num_experts", self.num_experts), ("topk", self.topk), ("num_ranks", num_ranks)):
            check_int(name, value)
        check_multiple("hidden", self.hidden, CHANNEL_ALIGN)
        check_multiple("intermediate", self.intermediate, CHANNEL_ALIGN)
        require(self.num_experts > 0, f"num_experts={self.num_experts} must be positive")
        require(1 <= self.topk <= MAX_TOPK, f"topk={self.topk} must be in [1, {MAX_TOPK}]")
        require(self.topk <= self.num_experts,
                f"topk={self.topk} must not exceed num_experts={self.num_experts}")
        require(1 <= num_ranks <= MAX_RANKS, f"num_ranks={num_ranks} must be in [1, {MAX_RANKS}]")
        require(self.num_experts % num_ranks == 0,
                f"num_experts={self.num_experts} must be divisible by num_ranks={num_ranks} "
                "(every rank owns the same number of experts)")
        return self

    def experts_per_rank(self, num_ranks: int) -> int:
        return self.num_experts // num_ranks

    def fits_in(self, other: "MoEShape") -> bool:
        """True when a buffer built for `other` can serve a layer of this shape."""
        return (self.hidden <= other.hidden and self.intermediate <= other.intermediate
                and self.num_experts <= other.num_experts and self.topk <= other.topk)

    def buffer_mismatch(self, buffer_shape: "MoEShape", num_ranks: int):
        """Why a SymmBuffer built for `buffer_shape` over `num_ranks` ranks cannot serve a layer of
        this shape (None when it can): the layer is larger, or its ranks own other expert counts."""
        if not self.fits_in(buffer_shape):
            return (f"layer shape {self} does not fit the SymmBuffer built for {buffer_shape}; build the "
                    "buffer for the largest layer")
        mine, theirs = self.experts_per_rank(num_ranks), buffer_shape.experts_per_rank(num_ranks)
        if mine != theirs:
            return f"layer has {mine} local experts, the buffer was built for {theirs}"
        return None

    @classmethod
    def covering(cls, shapes) -> "MoEShape":
        """The smallest shape every one of `shapes` fits in (fits_in): the shape of a buffer that
        serves all those layers."""
        shapes = list(shapes)
        require(len(shapes) > 0, "no layer shapes to cover")
        return cls(max(s.hidden for s in shapes), max(s.intermediate for s in shapes),
                   max(s.num_experts for s in shapes), max(s.topk for s in shapes))

    @classmethod
    def parse(cls, text: str) -> "MoEShape":
        """HIDDENxINTERMEDIATExEXPERTSxTOPK (global experts), e.g. 4096x2048x256x6; see spec()."""
        parts = text.strip().lower().split("x")
        require(len(parts) == 4 and all(p.isdigit() for p in parts),
                f"shape {text!r} must be HIDDENxINTERMEDIATExEXPERTSxTOPK, e.g. 4096x2048x256x6")
        return cls(*(int(p) for p in parts))

    def spec(self) -> str:
        """The shape as parse() reads it."""
        return f"{self.hidden}x{self.intermediate}x{self.num_experts}x{self.topk}"
