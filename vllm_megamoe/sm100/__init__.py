"""Blackwell (SM100) path: DeepGEMM's compiled Mega MoE kernel, fed by our conversion.

    api = find_deep_gemm()[0]                                   # discovery.py
    w = convert_experts(w13, w2, fmt="mxfp4", w13_scale_inv=.., w2_scale_inv=..)   # weights.py
    bufs = create_worker_buffers(api, ep_group, [BufferSpec.of(shape, w.mma_type, max_tokens)])
    layer = Sm100MoE(w, bufs[spec], activation=activation_spec("silu", clamp=..))  # op.py
    y = layer(x, topk_idx, topk_weights, out=out)

Importing this package imports neither DeepGEMM nor vLLM.
"""
from .activation import ActivationSpec, activation_from_hf_config, activation_spec
from .buffer import BufferSpec, Sm100Buffer, create_worker_buffers
from .discovery import DeepGemmApi, find_deep_gemm, require_deep_gemm
from .op import Sm100MoE
from .weights import Sm100Weights, convert_experts, from_kernel_experts

__all__ = [
    "ActivationSpec", "BufferSpec", "DeepGemmApi", "Sm100Buffer", "Sm100MoE", "Sm100Weights",
    "activation_from_hf_config", "activation_spec", "convert_experts", "create_worker_buffers",
    "find_deep_gemm", "from_kernel_experts", "require_deep_gemm",
]
