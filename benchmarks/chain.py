"""The classic unfused expert-parallel MoE chain, the baseline users run today.

NCCL all_to_all_single dispatch (split sizes exchanged and read on the host) -> grouped GEMM
(torch._scaled_grouped_mm with rowwise FP8 scales for "fp8-block", torch._grouped_mm for BF16)
-> SwiGLU x top-k weight -> grouped GEMM -> all_to_all_single combine -> top-k sum.
Not capturable in a CUDA graph (host-synchronised splits), exactly like the anchor measurement.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn


def _rowwise_fp8(t: torch.Tensor):
    """Per-row FP8 (one float scale per row of the last dim)."""
    scale = t.float().abs().amax(-1).clamp_min(1e-10) / 448.0
    return (t.float() / scale.unsqueeze(-1)).clamp(-448, 448).to(FP8), scale


class UnfusedChain:
    """Prepared weights of this rank's experts plus the per-call chain."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, fmt: str, group):
        """w13 [El, 2I, H], w2 [El, H, I] float (dequantized) on the GPU."""
        self._prepare(w13.shape[0], lambda e: (w13[e], w2[e]), fmt, group)

    @classmethod
    def from_weights(cls, weights, fmt: str, group) -> "UnfusedChain":
        """From an ExpertWeights, one expert's float copy at a time: a float copy of a whole
        DeepSeek-V3-like layer (45 GB at EP1) does not fit an 80 GB GPU beside the other paths."""
        chain = cls.__new__(cls)
        chain._prepare(weights.num_experts, weights.dequantize_expert, fmt, group)
        return chain

    def _prepare(self, num_experts: int, expert, fmt: str, group):
        """expert(e) -> (w13 [2I, H], w2 [H, I]) float of local expert e."""
        if num_experts < 1:
            raise ValueError(f"the chain needs at least one local expert, got {num_experts}")
        self.fmt, self.group = fmt, group
        self.el = num_experts
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.fp8 = fmt == "fp8-block" and hasattr(torch, "_scaled_grouped_mm")
        self.gemm_kind = "scaled_grouped_mm fp8 rowwise" if self.fp8 else "grouped_mm bf16"
        for e in range(num_experts):
            w13, w2 = expert(e)
            if e == 0:
                dtype = FP8 if self.fp8 else torch.bfloat16
                self.w13 = torch.empty((num_experts, *w13.shape), dtype=dtype, device=w13.device)
                self.w2 = torch.empty((num_experts, *w2.shape), dtype=dtype, device=w2.device)
                if self.fp8:  # one float scale per weight row
                    self.s13 = torch.empty(num_experts, w13.shape[0], device=w13.device)
                    self.s2 = torch.empty(num_experts, w2.shape[0], device=w2.device)
            if self.fp8:
                (self.w13[e], self.s13[e]), (self.w2[e], self.s2[e]) = _rowwise_fp8(w13), _rowwise_fp8(w2)
            else:
                self.w13[e], self.w2[e] = w13, w2

    def _gemm(self, a: torch.Tensor, w: torch.Tensor, s, offs) -> torch.Tensor:
        if self.fp8:
            qa, sa = _rowwise_fp8(a)
            return torch._scaled_grouped_mm(qa, w.transpose(1, 2), sa, s, offs=offs,
                                            out_dtype=torch.bfloat16)
        return torch._grouped_mm(a.to(torch.bfloat16), w.transpose(1, 2), offs=offs)

    def __call__(self, x, topk_idx, topk_weights):
        el, world = self.el, self.world
        t, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        valid = flat >= 0
        dst = torch.where(valid, flat // el, torch.full_like(flat, world))
        order = torch.argsort(dst, stable=True)
        send_counts = torch.bincount(dst, minlength=world + 1)[:world]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # host sync
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        sel = order[:n_send]
        send_x = x[token[sel]].to(torch.bfloat16)
        send_e = (flat[sel] % el).to(torch.int32)
        recv_x = torch.empty(n_recv, x.shape[1], dtype=torch.bfloat16, device=x.device)
        recv_e = torch.empty(n_recv, dtype=torch.int32, device=x.device)
        dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=self.group)
        dist.all_to_all_single(recv_e, send_e, recv_splits, send_splits, group=self.group)
        eorder = torch.argsort(recv_e, stable=True)
        offs = torch.cumsum(torch.bincount(recv_e, minlength=el), 0).to(torch.int32)
        rows = recv_x[eorder]
        h = self._gemm(rows, self.w13, getattr(self, "s13", None), offs)
        gate, up = h.float().chunk(2, dim=-1)
        act = F.silu(gate) * up
        y_sorted = self._gemm(act.to(torch.bfloat16), self.w2, getattr(self, "s2", None), offs)
        y_recv = torch.empty_like(y_sorted)
        y_recv[eorder] = y_sorted
        back = torch.empty(n_send, x.shape[1], dtype=torch.bfloat16, device=x.device)
        dist.all_to_all_single(back, y_recv, send_splits, recv_splits, group=self.group)
        w = topk_weights.reshape(-1)[sel].float().unsqueeze(1)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token[sel], back.float() * w)
        return out.to(torch.bfloat16)
