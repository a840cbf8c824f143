"""The per-call SM100 op: stage inputs into the shared buffer, run DeepGEMM's mega kernel.

    layer = Sm100MoE(weights, buffer, activation=ActivationSpec(...))   # load time, per layer
    y = layer(x, topk_idx, topk_weights, out=output)                     # every forward

A call allocates nothing when `out` is given: inputs go into the buffer's views (the FP8
quantization uses the worker's scratch), the kernel writes `out[:T]`, and the per-expert receive
counts accumulate in `layer.recv_stats` (int32 [local experts], for EPLB).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UnsupportedError
from ..shape import check_tensor, require
from .activation import ActivationSpec
from .buffer import Sm100Buffer
from .weights import Sm100Weights

KERNEL = {"fp8xfp4": "fp8_fp4_mega_moe", "bf16xbf16": "bf16_mega_moe"}
RECIPE = (1, 1, 32)  # 1x1 activation, 1x32 weight scale granularity (UE8M0 per 32 K)


class Sm100MoE:
    """One MoE layer on the SM100 path: converted weights + the worker's shared buffer."""

    def __init__(self, weights: Sm100Weights, buffer: Sm100Buffer, *,
                 activation: Optional[ActivationSpec] = None, fast_math: bool = True,
                 recv_stats: Optional[torch.Tensor] = None):
        require(isinstance(weights, Sm100Weights),
                f"the SM100 path needs Sm100Weights (vllm_megamoe.sm100.convert_experts), got "
                f"{type(weights).__name__}")
        spec = buffer.spec
        require(weights.mma_type == spec.mma_type,
                f"weights are {weights.format} ({weights.mma_type}) but the buffer was made for "
                f"{spec.mma_type}")
        require((weights.hidden, weights.intermediate) == (spec.hidden, spec.intermediate),
                f"weights are hidden={weights.hidden}, intermediate={weights.intermediate}; the "
                f"buffer was made for {spec.hidden}, {spec.intermediate}")
        require(weights.num_experts == buffer.num_experts_per_rank,
                f"weights hold {weights.num_experts} experts; this rank owns "
                f"{buffer.num_experts_per_rank} ({spec.num_experts} over {buffer.num_ranks} ranks)")
        self.weights, self.buffer = weights, buffer
        self.activation = activation or ActivationSpec()
        self.fast_math = bool(fast_math)
        if recv_stats is None:
            recv_stats = torch.zeros(weights.num_experts, dtype=torch.int32, device=weights.w13.device)
        check_tensor("recv_stats", recv_stats, dtype=torch.int32, shape=(weights.num_experts,),
                     contiguous=True)
        self.recv_stats = recv_stats
        api = buffer.api
        self._kernel = api.fn(KERNEL[spec.mma_type])
        self._kwargs = dict(self.activation.kernel_kwargs(api.kernel_kwargs(spec.mma_type)),
                            fast_math=self.fast_math)
        if spec.mma_type == "fp8xfp4":
            self._kwargs["recipe"] = RECIPE
        self._l1, self._l2 = weights.l1(), weights.l2()

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        buf = self.buffer
        t = x.shape[0]
        if t > buf.max_tokens:
            raise ValueError(
                f"a batch of {t} tokens exceeds the SM100 buffer ({buf.max_tokens} tokens per "
                "rank); create it with a larger max_tokens_per_rank (VLLM_MEGAMOE_MAX_TOKENS_PER_RANK"
                " or vLLM's --max-num-batched-tokens)")
        require(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == buf.spec.hidden,
                f"x must be bf16 [T, {buf.spec.hidden}], got {x.dtype} {tuple(x.shape)}")
        require(tuple(topk_idx.shape) == (t, buf.spec.topk) and topk_weights.shape == topk_idx.shape,
                f"topk_idx/topk_weights must be [{t}, {buf.spec.topk}], got "
                f"{tuple(topk_idx.shape)} / {tuple(topk_weights.shape)}")
        if out is None:
            out = torch.empty(t, buf.spec.hidden, dtype=torch.bfloat16, device=x.device)
        else:
            require(out.dtype == torch.bfloat16 and out.shape[0] >= t and out.shape[1:] == x.shape[1:]
                    and out.stride(-1) == 1 and out[:t].is_contiguous(),
                    f"out must be a contiguous bf16 [>= {t}, {buf.spec.hidden}] tensor, got "
                    f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
        y = out[:t]
        buf.stage_inputs(x, topk_idx, topk_weights)
        self._kernel(y, self._l1, self._l2, buf.dg,
                     cumulative_local_expert_recv_stats=self.recv_stats, **self._kwargs)
        return y

    def take_recv_stats(self, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Add the counts since the last take into `into` (if given), zero them, return them."""
        if into is not None:
            into.add_(self.recv_stats)
        snapshot = self.recv_stats.clone()
        self.recv_stats.zero_()
        return snapshot


def mega_moe(x, topk_idx, topk_weights, weights, buffer, *, activation_clamp=None, out=None):
    """ops.mega_moe's SM100 branch: a one-off Sm100MoE (the plugin keeps one per layer)."""
    if not isinstance(buffer, Sm100Buffer):
        raise UnsupportedError(
            f"the SM100 path runs on a DeepGEMM buffer (vllm_megamoe.sm100.create_worker_buffers), "
            f"got {type(buffer).__name__}")
    return Sm100MoE(weights, buffer, activation=ActivationSpec(clamp=activation_clamp))(
        x, topk_idx, topk_weights, out=out)
