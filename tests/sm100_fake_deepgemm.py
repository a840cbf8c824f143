"""A recording fake of DeepGEMM's Mega MoE Python API, for CPU tests of the SM100 adapter.

`make_fake(...)` returns a module object with the attributes the adapter looks up. It
- records every call (name, arguments described by dtype/shape/stride/data_ptr) in `.calls`;
- makes the host-side checks the real `fp8_fp4_mega_moe` / `bf16_mega_moe` make (K-major
  contiguous weights, SF int32 [E, MN, K/128] MN-major TMA-aligned, recipe (1,1,32), stats int32
  [experts per rank], num_tokens <= buffer tokens, swiglu, clamp >= 0), written here
  independently of vllm_megamoe.sm100;
- with compute=True, computes y on one rank from what the adapter put into the buffer, decoding
  the kernel formats from the reference-doc facts, so a wrong byte order or layout shows up as a
  wrong y.
Variants: version="2.8.1" (SymmBuffer(..., base=), activation_alpha/beta) or "2.6.1"
(get_symm_buffer_for_mega_moe factory; SymmBuffer needs num_ring_tokens; no alpha/beta).
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from vllm_megamoe import quant, transforms

TOKEN_ALIGN = 384


def _align(x, a):
    return -(-x // a) * a


def describe(v):
    if isinstance(v, torch.Tensor):
        return {"dtype": v.dtype, "shape": tuple(v.shape), "stride": v.stride(),
                "ptr": v.data_ptr(), "contiguous": v.is_contiguous()}
    if isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor):
        return tuple(describe(t) for t in v)
    return v


class FakeDeepGemm(types.ModuleType):
    pass


def make_fake(version: str = "2.8.1", *, compute: bool = True, name: str = "deep_gemm"):
    m = FakeDeepGemm(name)
    m.__version__ = version
    m.calls = []
    m.compute = compute
    new_api = version >= "2.8"

    def record(fn, **kwargs):
        m.calls.append((fn, {k: describe(v) for k, v in kwargs.items()}, kwargs))

    class SymmBuffer:
        def _setup(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                   intermediate_hidden, mma_type, activation, base):
            assert activation == "swiglu"
            assert mma_type in ("fp8xfp4", "bf16xbf16")
            self.group, self.num_experts, self.num_topk = group, num_experts, num_topk
            self.hidden, self.intermediate_hidden, self.mma_type = hidden, intermediate_hidden, mma_type
            t = self.num_max_tokens_per_rank = _align(num_max_tokens_per_rank, TOKEN_ALIGN)
            fp8 = mma_type == "fp8xfp4"
            sizes = [t * hidden * (1 if fp8 else 2), t * hidden // 32 if fp8 else 0,
                     t * num_topk * 8, t * num_topk * 4, num_topk * t * hidden * 2]
            offsets, total = [], 128
            for s in sizes:
                offsets.append(total)
                total = _align(total + s, 16)
            self.nbytes = total
            if base is not None and base.buffer.numel() >= total:
                self.buffer = base.buffer
            else:
                self.buffer = torch.zeros(total, dtype=torch.int8)
            b = self.buffer.view(torch.uint8)
            o = offsets
            self.x = b[o[0]:o[0] + sizes[0]].view(torch.float8_e4m3fn if fp8 else torch.bfloat16).view(t, hidden)
            self.x_sf = b[o[1]:o[1] + sizes[1]].view(torch.int32).view(t, hidden // 128) if fp8 else None
            self.topk_idx = b[o[2]:o[2] + sizes[2]].view(torch.int64).view(t, num_topk)
            self.topk_weights = b[o[3]:o[3] + sizes[3]].view(torch.float32).view(t, num_topk)
            self.handle = types.SimpleNamespace(buffer_ptrs=[self.buffer.data_ptr()])

        if new_api:
            def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                         intermediate_hidden, num_shared_experts=0, mma_type="fp8xfp4",
                         activation="swiglu", base=None):
                record("SymmBuffer", group=group, num_experts=num_experts,
                       num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                       hidden=hidden, intermediate_hidden=intermediate_hidden,
                       num_shared_experts=num_shared_experts, mma_type=mma_type,
                       activation=activation, base=base)
                self._setup(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                            intermediate_hidden, mma_type, activation, base)
        else:
            def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                         intermediate_hidden, num_ring_tokens, mma_type="fp8xfp4",
                         activation="swiglu"):
                self._setup(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                            intermediate_hidden, mma_type, activation, None)

        def destroy(self):
            self.buffer = None

    m.SymmBuffer = SymmBuffer
    if not new_api:
        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk,
                                         hidden, intermediate_hidden, use_fp8_dispatch=None,
                                         mma_type="fp8xfp4", activation="swiglu"):
            record("get_symm_buffer_for_mega_moe", group=group, num_experts=num_experts,
                   num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                   hidden=hidden, intermediate_hidden=intermediate_hidden, mma_type=mma_type,
                   activation=activation)
            return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                              intermediate_hidden, 0, mma_type=mma_type, activation=activation)
        m.get_symm_buffer_for_mega_moe = get_symm_buffer_for_mega_moe

    def check_common(y, l1w, l2w, sym_buffer, stats, activation, clamp, fp4):
        assert activation == "swiglu"
        assert clamp is None or clamp >= 0
        assert y.dtype == torch.bfloat16 and y.is_contiguous() and y.shape[1] == sym_buffer.hidden
        assert y.shape[0] <= sym_buffer.num_max_tokens_per_rank
        for w in (l1w, l2w):
            assert w.dim() == 3 and w.stride(-1) == 1 and w.is_contiguous()
            assert w.dtype == (torch.int8 if fp4 else torch.bfloat16)
        mul = 2 if fp4 else 1
        e, two_i, h = l1w.shape[0], l1w.shape[1], l1w.shape[2] * mul
        assert (l2w.shape[0], l2w.shape[1], l2w.shape[2] * mul) == (e, h, two_i // 2)
        assert h == sym_buffer.hidden and two_i // 2 == sym_buffer.intermediate_hidden
        assert e * sym_buffer.group.size() == sym_buffer.num_experts
        if stats is not None:
            assert stats.dtype == torch.int32 and stats.numel() == e and stats.is_contiguous()
        return e, two_i // 2, h

    def check_sf(sf, mn, k, groups):
        assert sf.dtype == torch.int32 and sf.dim() == 3
        assert tuple(sf.shape) == (groups, mn, -(-k // 128)), (tuple(sf.shape), mn, k)
        assert sf.stride(-3) == sf.stride(-1) * sf.size(-1)
        assert sf.stride(-2) == 1, f"SF not MN-major: {sf.stride()}"
        assert sf.stride(-1) == _align(mn, 4), f"SF not TMA aligned: {sf.stride()}"

    def run(y, w13, w2, sym_buffer, stats, clamp, alpha, beta, x_float):
        t = y.shape[0]
        idx = sym_buffer.topk_idx[:t]
        wts = sym_buffer.topk_weights[:t]
        out = torch.zeros(t, sym_buffer.hidden)
        i = w13.shape[1] // 2
        for tok in range(t):
            for k in range(idx.shape[1]):
                e = int(idx[tok, k])
                if e < 0:
                    continue
                if stats is not None:
                    stats[e] += 1
                h = w13[e] @ x_float[tok]
                gate, up = h[:i].bfloat16().float(), h[i:].bfloat16().float()
                if clamp is not None:
                    gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
                act = gate * torch.sigmoid(alpha * gate) * (up + beta) * wts[tok, k]
                out[tok] += w2[e] @ act
        y.copy_(out.bfloat16())

    def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer,
                         cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32),
                         activation="swiglu", activation_clamp=None, fast_math=True,
                         activation_alpha=1.0, activation_beta=0.0):
        record("fp8_fp4_mega_moe", y=y, l1_weights=l1_weights, l2_weights=l2_weights,
               sym_buffer=sym_buffer,
               cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
               recipe=recipe, activation=activation, activation_clamp=activation_clamp,
               fast_math=fast_math, activation_alpha=activation_alpha,
               activation_beta=activation_beta)
        assert tuple(recipe) == (1, 1, 32)
        stats = cumulative_local_expert_recv_stats
        e, i, h = check_common(y, l1_weights[0], l2_weights[0], sym_buffer, stats, activation,
                               activation_clamp, True)
        check_sf(l1_weights[1], 2 * i, h, e)
        check_sf(l2_weights[1], h, i, e)
        if not m.compute:
            return
        t = y.shape[0]
        # Decode the kernel formats from the facts: x_sf byte b of int j = group 4j+b.
        exps = sym_buffer.x_sf[:t].contiguous().view(torch.uint8).float()
        x_float = (sym_buffer.x[:t].float().view(t, -1, 32) * torch.exp2(exps - 127).unsqueeze(-1)).view(t, h)
        sf13 = transforms.deinterleave_gate_up(transforms.untranspose_sf_for_utccp(l1_weights[1]))
        w13 = quant.dequantize_mxfp4(transforms.deinterleave_gate_up(l1_weights[0]), sf13.contiguous())
        w2 = quant.dequantize_mxfp4(l2_weights[0], transforms.untranspose_sf_for_utccp(l2_weights[1]).contiguous())
        run(y, w13, w2, sym_buffer, stats, activation_clamp, activation_alpha, activation_beta, x_float)

    def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer,
                      cumulative_local_expert_recv_stats=None, activation="swiglu",
                      activation_clamp=None, fast_math=True, activation_alpha=1.0,
                      activation_beta=0.0):
        record("bf16_mega_moe", y=y, l1_weights=l1_weights, l2_weights=l2_weights,
               sym_buffer=sym_buffer,
               cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
               activation=activation, activation_clamp=activation_clamp, fast_math=fast_math,
               activation_alpha=activation_alpha, activation_beta=activation_beta)
        stats = cumulative_local_expert_recv_stats
        check_common(y, l1_weights, l2_weights, sym_buffer, stats, activation, activation_clamp, False)
        if not m.compute:
            return
        t = y.shape[0]
        run(y, transforms.deinterleave_gate_up(l1_weights).float(), l2_weights.float(), sym_buffer,
            stats, activation_clamp, activation_alpha, activation_beta, sym_buffer.x[:t].float())

    if not new_api:  # 2.6-style signatures: no activation_alpha/beta
        def fp8_old(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                    recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
            return fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer,
                                    cumulative_local_expert_recv_stats, recipe, activation,
                                    activation_clamp, fast_math)

        def bf16_old(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                     activation="swiglu", activation_clamp=None, fast_math=True):
            return bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer,
                                 cumulative_local_expert_recv_stats, activation, activation_clamp,
                                 fast_math)
        m.fp8_fp4_mega_moe, m.bf16_mega_moe = fp8_old, bf16_old
    else:
        m.fp8_fp4_mega_moe, m.bf16_mega_moe = fp8_fp4_mega_moe, bf16_mega_moe
    return m


class FakeGroup:
    """A ProcessGroup stand-in for one rank (what DeepGEMM calls on it)."""

    def __init__(self):
        self.barriers = 0

    def size(self):
        return 1

    def rank(self):
        return 0

    def barrier(self):
        self.barriers += 1
