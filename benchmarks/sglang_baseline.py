"""Optional baseline: SGLang's SM90 fused Mega MoE (`deep_gemm.fp8_mega_moe`), public API only.

Available when `deep_gemm` imports and has `fp8_mega_moe`, `get_symm_buffer_for_sm90_mega_moe`
and `transform_weights_for_mega_moe_sm90` (PyPI `sgl-deep-gemm==0.1.5.post1` with
`apache-tvm-ffi==0.1.11` on torch 2.11), the GPU is SM90, and the format is FP8 block.
It is fed this benchmark's weights (FP8 e4m3, float32 128x128 block scales, gate rows then up)
and routing; activations are staged as it expects: per-token FP8 with one float scale per 128
channels copied into its symmetric buffer, which is part of the timed call (end-to-end time).
"""
from __future__ import annotations

import importlib

REQUIRED = ("fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90")


def status(fmt: str, hidden: int) -> tuple[bool, str]:
    """(usable, why) on this process's GPU for a layer of this format and hidden size."""
    import torch

    if fmt != "fp8-block":
        return False, f"SGLang SM90 mega MoE is FP8-only (format {fmt})"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False, "SGLang SM90 mega MoE needs an SM90 GPU"
    if hidden % 256:
        return False, f"SGLang SM90 mega MoE needs hidden % 256 == 0 (hidden {hidden})"
    try:
        dg = importlib.import_module("deep_gemm")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return False, f"deep_gemm does not import: {type(exc).__name__}: {str(exc)[:200]}"
    missing = [n for n in REQUIRED if not hasattr(dg, n)]
    if missing:
        return False, f"deep_gemm {getattr(dg, '__version__', '?')} lacks {', '.join(missing)}"
    return True, f"deep_gemm {getattr(dg, '__version__', '?')}"


def version() -> str:
    try:
        return str(importlib.import_module("deep_gemm").__version__)
    except Exception:  # noqa: BLE001
        return ""


class SGLangMegaMoE:
    """One layer of SGLang's SM90 fused Mega MoE on this rank (a collective, like ours)."""

    name = "sglang"
    capturable = True

    def __init__(self, weights, group, num_experts: int, topk: int, max_tokens: int):
        import deep_gemm as dg

        self.dg = dg
        self.hidden, self.intermediate = weights.hidden, weights.intermediate
        self.buffer = dg.get_symm_buffer_for_sm90_mega_moe(
            group, num_experts, max_tokens, topk, self.hidden, self.intermediate)
        self.l1, self.l2 = dg.transform_weights_for_mega_moe_sm90(
            (weights.w13.contiguous(), weights.w13_scale.contiguous()),
            (weights.w2.contiguous(), weights.w2_scale.contiguous()))

    def call(self, x, topk_idx, topk_weights):
        import torch

        from vllm_megamoe import quant

        n = x.shape[0]
        q, s = quant.quantize_fp8_tokens(x, 128, "float")
        buf = self.buffer
        buf.x[:n].copy_(q)
        buf.x_sf[:n].copy_(s)
        buf.topk_idx[:n].copy_(topk_idx)
        buf.topk_weights[:n].copy_(topk_weights)
        y = torch.empty(n, self.hidden, dtype=torch.bfloat16, device=x.device)
        self.dg.fp8_mega_moe(y, self.l1, self.l2, buf)
        return y

    graph_call = call

    def close(self):
        try:
            self.buffer.destroy()
        finally:
            self.buffer = self.l1 = self.l2 = None
