"""The plugin's SM100 wiring at layer level, on the CPU: with the path oracle answering "sm100"
and a recording fake of DeepGEMM standing in for the compiled kernel (tests/sm100_fake_deepgemm.py
computes the kernel's math in torch from what was staged), vLLM's modular kernel runs
MegaMoEExperts through sm100.convert_experts, the worker's DeepGEMM buffers and Sm100MoE.
No SM100 GPU has run this: it checks the plumbing (conversion, buffers made once, the call's
arguments), not DeepGEMM."""
import os
import sys

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough import (  # noqa: E402
    PassThroughPrepareAndFinalize,
)

from sm100_fake_deepgemm import make_fake  # noqa: E402
from test_vllm_layer import FakeLayer, make_weights, moe_config, routing, run  # noqa: E402
from vllm_megamoe import ops, reference  # noqa: E402
from vllm_megamoe.sm100 import discovery  # noqa: E402

pytestmark = pytest.mark.vllm

H, I, E, K = 512, 512, 8, 2


@pytest.fixture
def sm100_worker(monkeypatch):
    import vllm_megamoe.plugin as plugin
    from vllm_megamoe.plugin import runtime
    plugin.register()
    runtime.reset()
    runtime.STATE.max_num_batched_tokens = 64
    runtime.STATE.checkpoint_marker = None
    fake = make_fake("2.8.1")
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    discovery.reset()
    monkeypatch.setattr(ops, "select_path", lambda *a, **k: ("sm100", "test: SM100 forced on the CPU"))
    yield runtime, fake
    runtime.reset()
    discovery.reset()


def sm100_layer(runtime, weights, quant):
    """A MegaMoEExperts set up on the SM100 path as the loader hook does: (kernel, layer, experts)."""
    from vllm_megamoe.plugin.experts import MegaMoEExperts
    layer = FakeLayer(weights)
    experts = MegaMoEExperts(moe_config(hidden_dim=H, intermediate_size=I), quant)
    kernel = mk.FusedMoEKernel(PassThroughPrepareAndFinalize(), experts)
    experts.process_weights_after_loading(layer)
    runtime.ensure_buffer()
    experts.bind_buffer()
    return kernel, layer, experts


def sm100_routing(t, gen):
    """routing() at this file's sizes (hidden H, top-K of E)."""
    _, _, tw = routing(t, gen)
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(t, E, generator=gen), dim=1)[:, :K].to(torch.int32)
    return x, idx, tw


@pytest.mark.parametrize("fmt,bound", [("bf16", 1e-2), ("fp8-block", 6e-2)])
def test_sm100_path_through_vllm_modular_kernel(sm100_worker, gen, fmt, bound):
    runtime, fake = sm100_worker
    weights, quant = make_weights(fmt, gen, hidden=H, inter=I)
    checkpoint = weights.dequantize()  # before the layer's parameters take the kernel's tensors
    kernel, layer, experts = sm100_layer(runtime, weights, quant)
    assert len(runtime.STATE.sm100_buffers) == 1 and runtime.STATE.buffer is None
    # The layer's parameters alias the kernel-layout tensors (FP8 checkpoints become MXFP4).
    assert layer.w13_weight.data_ptr() == experts._weights.w13.data_ptr()
    # ... and hold nothing more: the checkpoint's storage (FP8: twice MXFP4's bytes) is freed.
    for param in (layer.w13_weight, layer.w2_weight):
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size()
    assert experts._weights.mma_type == ("bf16xbf16" if fmt == "bf16" else "fp8xfp4")
    x, idx, tw = sm100_routing(21, gen)
    y = run(kernel, layer, x, idx, tw)
    kernels = [c[0] for c in fake.calls if c[0].endswith("mega_moe")]
    assert kernels == ["bf16_mega_moe" if fmt == "bf16" else "fp8_fp4_mega_moe"]
    # Against the weights the kernel holds (MXFP4 for FP8 checkpoints): only the activation
    # rounding (FP8 with UE8M0 per-32 scales, BF16 intermediates) separates the two.
    held = reference.moe_forward(x, idx, tw, *experts._weights.dequantize())
    err_held = reference.relative_error(y, held)
    # Against the checkpoint's weights: MXFP4 (1 mantissa bit) costs ~15% per weight matrix.
    err_ckpt = reference.relative_error(y, reference.moe_forward(x, idx, tw, *checkpoint))
    print(f"{fmt}: relative error {err_held:.3e} vs held weights, {err_ckpt:.3e} vs checkpoint")
    assert err_held < bound
    assert err_ckpt < (2e-2 if fmt == "bf16" else 0.25)


def test_sm100_path_refuses_eplb(sm100_worker, gen):
    """EPLB permutes the layer's parameters; the SM100 path keeps its MXFP4 scales apart from them,
    so a rebalanced layer would read moved weights with unmoved scales: refused at load time."""
    import dataclasses

    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    from vllm_megamoe.plugin.experts import MegaMoEExperts
    weights, quant = make_weights("fp8-block", gen, hidden=H, inter=I)
    eplb = dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), enable_eplb=True)
    experts = MegaMoEExperts(moe_config(hidden_dim=H, intermediate_size=I, moe_parallel_config=eplb),
                             quant)
    with pytest.raises(ValueError, match="remove --enable-eplb"):
        experts.process_weights_after_loading(FakeLayer(weights))


def test_sm100_weight_update_refills_in_place(sm100_worker, gen):
    """A weight update (layerwise reload: new checkpoint parameters) converts to MXFP4 again and
    overwrites the tensors the per-layer op was built with; the next call computes with the new
    experts."""
    runtime, fake = sm100_worker
    kernel, layer, experts = sm100_layer(runtime, *make_weights("fp8-block", gen, hidden=H, inter=I))
    held = experts._weights
    assert experts._sm100_op._l1[0] is held.w13  # what the op was built with
    x, idx, tw = sm100_routing(13, gen)
    before = run(kernel, layer, x, idx, tw)
    new, new_quant = make_weights("fp8-block", gen, hidden=H, inter=I)
    layer.w13_weight = torch.nn.Parameter(new.w13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(new.w2, requires_grad=False)
    experts.update_weights(layer, new_quant)
    assert experts._weights is held and experts._sm100_op._l1[0] is held.w13
    assert layer.w13_weight.data_ptr() == held.w13.data_ptr()
    y = run(kernel, layer, x, idx, tw)
    assert reference.relative_error(y, reference.moe_forward(x, idx, tw, *held.dequantize())) < 6e-2
    assert reference.relative_error(y, reference.moe_forward(x, idx, tw, *new.dequantize())) < 0.25
    assert reference.relative_error(y, before) > 0.5  # a different model: not the old experts
