"""The worker's DeepGEMM SymmBuffer(s) for the SM100 path, created once, shared by all layers.

A DeepGEMM buffer is specified by (num_experts, topk, hidden, intermediate, mma_type); the kernel
reads those from the buffer object, so layers of one spec share one object. Layers of another
spec get their own object on the *same memory* through DeepGEMM's `base=` (2.8+); without
`base=` they get a separate allocation and a warning says what that costs.

Creation is a collective over the EP group (symmetric-memory rendezvous + barrier): every rank
creates the same specs in the same order, outside CUDA-graph capture (vLLM: at load time, after
weight post-processing), sized by vLLM's max batched tokens per rank. Per call, inputs are copied
into the buffer's `x / x_sf / topk_idx / topk_weights` views; nothing is allocated.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..settings import unknown_environment_names
from ..shape import MoEShape, require
from . import act_quant
from .discovery import DeepGemmApi

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferSpec:
    num_experts: int          # global
    topk: int
    hidden: int
    intermediate: int
    mma_type: str             # "fp8xfp4" | "bf16xbf16"
    max_tokens_per_rank: int  # before DeepGEMM's alignment (384)

    @classmethod
    def of(cls, shape: MoEShape, mma_type: str, max_tokens_per_rank: int) -> "BufferSpec":
        return cls(shape.num_experts, shape.topk, shape.hidden, shape.intermediate, mma_type,
                   int(max_tokens_per_rank))

    def size_hint(self) -> int:
        """Bytes of the dominant regions (combine + inputs), to create the largest spec first."""
        return self.max_tokens_per_rank * self.hidden * (2 * self.topk + 2)


class _SingleRankGroup:
    """What DeepGEMM calls on a ProcessGroup, for one process without torch.distributed."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def barrier(self) -> None:
        return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Sm100Buffer:
    """One DeepGEMM SymmBuffer plus the activation scratch; `.dg` is DeepGEMM's object."""

    def __init__(self, api: DeepGemmApi, group, spec: BufferSpec, *, base: Optional["Sm100Buffer"] = None,
                 scratch: Optional[act_quant.ActScratch] = None):
        if _capturing():
            raise RuntimeError(
                "megamoe: the SM100 SymmBuffer must be created before CUDA-graph capture (it "
                "allocates symmetric memory and runs a collective rendezvous); create it at load "
                "time with vllm_megamoe.sm100.create_worker_buffers()")
        self.api, self.spec = api, spec
        self.group = group if group is not None else _SingleRankGroup()
        self.num_ranks, self.rank = self.group.size(), self.group.rank()
        kwargs = {"mma_type": spec.mma_type, "activation": "swiglu"}
        if base is not None:
            kwargs["base"] = base.dg
        self.dg = api.fn(api.buffer_factory)(
            self.group, spec.num_experts, spec.max_tokens_per_rank, spec.topk, spec.hidden,
            spec.intermediate, **kwargs)
        self.max_tokens = int(self.dg.num_max_tokens_per_rank)
        self.x, self.x_sf = self.dg.x, getattr(self.dg, "x_sf", None)
        self.topk_idx, self.topk_weights = self.dg.topk_idx, self.dg.topk_weights
        self.shared_with = base
        self.scratch = scratch
        if spec.mma_type == "fp8xfp4" and (scratch is None or not scratch.fits(spec.hidden)):
            self.scratch = act_quant.ActScratch(
                spec.hidden, min(act_quant.CHUNK_ROWS, self.max_tokens), self.x.device)

    @property
    def num_experts_per_rank(self) -> int:
        return self.spec.num_experts // self.num_ranks

    def stage_inputs(self, x: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor) -> None:
        """Copy one call's inputs into the buffer (FP8 + UE8M0 for fp8xfp4)."""
        t = x.shape[0]
        if self.spec.mma_type == "fp8xfp4":
            act_quant.stage_fp8(x, self.x, self.x_sf, self.scratch)
        else:
            act_quant.stage_bf16(x, self.x)
        self.topk_idx[:t].copy_(topk_idx)
        self.topk_weights[:t].copy_(topk_weights)

    def destroy(self) -> None:
        if hasattr(self.dg, "destroy") and self.shared_with is None:
            self.dg.destroy()
        self.dg = self.x = self.x_sf = self.topk_idx = self.topk_weights = None

    def __repr__(self):
        return (f"Sm100Buffer({self.spec}, rank={self.rank}/{self.num_ranks}, "
                f"max_tokens={self.max_tokens}, shared={self.shared_with is not None})")


def create_worker_buffers(api: DeepGemmApi, group, specs) -> dict:
    """{spec: Sm100Buffer} for every distinct spec; one allocation when DeepGEMM has `base=`.

    Call once per worker, on every EP rank with the same specs, before CUDA-graph capture.
    """
    unique = sorted(set(specs), key=lambda s: (-s.size_hint(), repr(s)))  # same order on all ranks
    require(unique, "create_worker_buffers needs at least one BufferSpec")
    # A misspelt VLLM_MEGAMOE_* variable would do nothing (the core's SymmBuffer refuses it too).
    # Raised before DeepGEMM's rendezvous: a worker group's ranks share the launcher's environment,
    # so each of them raises here rather than waiting for a peer that did.
    problem = unknown_environment_names()
    require(problem is None, f"megamoe: SM100 buffers not created: {problem}")
    out: dict[Any, Sm100Buffer] = {}
    first = Sm100Buffer(api, group, unique[0])
    out[unique[0]] = first
    for spec in unique[1:]:
        if api.supports_base:
            out[spec] = Sm100Buffer(api, group, spec, base=first, scratch=first.scratch)
        else:
            logger.warning(
                "megamoe: DeepGEMM %s has no SymmBuffer(base=): layer spec %s gets its own "
                "symmetric buffer (extra memory); upgrade DeepGEMM to share one", api.version, spec)
            out[spec] = Sm100Buffer(api, group, spec, scratch=first.scratch)
    logger.info("megamoe: SM100 buffers %s (DeepGEMM %s)", list(out.values()), api.describe())
    return out
