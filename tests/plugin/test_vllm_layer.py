"""Layer level, through vLLM's own MoE API (in process, no engine): vLLM's oracles hand out
MegaMoEExperts for "megamoe"; vLLM's modular kernel (FusedMoEKernel with the pass-through
prepare/finalize) runs it on BF16 and FP8 128x128-block weights and matches the reference;
0-token batches, too-large batches, offline-converted weights."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough import (  # noqa: E402
    PassThroughPrepareAndFinalize,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
    kFp8StaticTensorSym,
    kNvfp4Static,
)

import vllm_megamoe.plugin as plugin  # noqa: E402
from vllm_megamoe import reference, transforms  # noqa: E402
from vllm_megamoe.weights import ExpertWeights, transform_weights_for_mega_moe  # noqa: E402

pytestmark = pytest.mark.vllm

H, I, E, K = 256, 128, 8, 2
BOUND = {"bf16": 1e-2, "fp8-block": 2e-2}  # vs the reference rounding where the kernels round


@pytest.fixture(autouse=True)
def fresh_worker():
    plugin.register()
    from vllm_megamoe.plugin import runtime
    runtime.reset()
    runtime.STATE.max_num_batched_tokens = 64
    runtime.STATE.checkpoint_marker = None
    yield runtime
    runtime.reset()


def moe_config(**overrides):
    kw = dict(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=I,
              num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
              device="cpu", routing_method=RoutingMethodType.Renormalize,
              moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
              in_dtype=torch.bfloat16, moe_backend="megamoe")
    kw.update(overrides)
    return FusedMoEConfig(**kw)


class FakeLayer(torch.nn.Module):
    """What MegaMoEExperts reads from vLLM's RoutedExperts."""

    def __init__(self, weights: ExpertWeights):
        super().__init__()
        self.layer_name = "model.layers.0.mlp.experts"
        self.expert_placement_strategy = "linear"
        self.apply_router_weight_on_input = False
        self.w13_weight = torch.nn.Parameter(weights.w13, requires_grad=False)
        self.w2_weight = torch.nn.Parameter(weights.w2, requires_grad=False)


def make_weights(fmt, gen, hidden=H, inter=I):
    """Random checkpoint-layout experts in `fmt` and the quant config vLLM would hand the experts."""
    w13 = torch.randn(E, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(E, hidden, inter, generator=gen) / inter ** 0.5
    weights = ExpertWeights.from_float(w13, w2, fmt)
    if fmt == "bf16":
        return weights, FUSED_MOE_UNQUANTIZED_CONFIG
    return weights, fp8_w8a8_moe_quant_config(w1_scale=weights.w13_scale, w2_scale=weights.w2_scale,
                                              a1_scale=None, a2_scale=None, block_shape=[128, 128])


def make_kernel(fmt, gen, *, layout="checkpoint"):
    from vllm_megamoe.plugin.experts import MegaMoEExperts
    weights, quant = make_weights(fmt, gen)
    loaded = weights
    if layout == "interleaved":  # what an offline-converted (sm90) checkpoint stores
        from dataclasses import replace
        loaded = replace(weights, w13=transforms.interleave_gate_up(weights.w13))
    layer = FakeLayer(loaded)
    experts = MegaMoEExperts(moe_config(), quant)
    kernel = mk.FusedMoEKernel(PassThroughPrepareAndFinalize(), experts)
    experts.process_weights_after_loading(layer)
    return kernel, layer, weights


def run(kernel, layer, x, idx, tw):
    return kernel.apply(x, layer.w13_weight, layer.w2_weight, topk_weights=tw, topk_ids=idx,
                        activation=MoEActivation.SILU, global_num_experts=E, expert_map=None,
                        apply_router_weight_on_input=False)


def routing(t, gen):
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(t, E, generator=gen), dim=1)[:, :K].to(torch.int32)
    tw = torch.softmax(torch.randn(t, K, generator=gen), -1)
    return x, idx, tw


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_modular_kernel_matches_reference(fmt, gen, fresh_worker):
    kernel, layer, weights = make_kernel(fmt, gen)
    assert kernel.output_is_reduced()
    x, idx, tw = routing(37, gen)
    idx[3, 1] = -1  # a masked route
    y = run(kernel, layer, x, idx, tw)
    w13, w2 = weights.dequantize()
    emulate = "fp8" if fmt == "fp8-block" else "bf16"
    ref = reference.moe_forward(x, idx, tw, w13, w2, emulate=emulate)
    assert y.shape == (37, H) and y.dtype == torch.bfloat16
    assert reference.relative_error(y, ref) < BOUND[fmt]
    # The layer's parameters alias what the op reads (EPLB would permute exactly these).
    experts = kernel.fused_experts
    assert layer.w13_weight.data_ptr() == experts._weights.w13.data_ptr()
    assert fresh_worker.STATE.buffer is not None and fresh_worker.STATE.buffer_tokens == 64


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_vllm_kernel_factories_run_megamoe(fmt, gen, fresh_worker):
    """The way vLLM's MoE methods build the kernel: the oracle's choice, then vLLM's own factory
    (make_*_moe_kernel picks the prepare/finalize and constructs the experts class)."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8, unquantized

    from vllm_megamoe.plugin.experts import MegaMoEExperts
    weights, quant = make_weights(fmt, gen)
    checkpoint = weights.dequantize()  # before the layer's parameters take the kernel's tensors
    config = moe_config()
    if fmt == "bf16":
        backend, experts_cls = unquantized.select_unquantized_moe_backend(config)
        kernel = unquantized.make_unquantized_moe_kernel(quant, config, backend, experts_cls)
    else:
        backend, experts_cls = fp8.select_fp8_moe_backend(config, kFp8Static128BlockSym,
                                                          kFp8Dynamic128Sym)
        kernel = fp8.make_fp8_moe_kernel(quant, config, experts_cls, backend)
    assert isinstance(kernel.fused_experts, MegaMoEExperts)
    layer = FakeLayer(weights)
    kernel.fused_experts.process_weights_after_loading(layer)
    x, idx, tw = routing(29, gen)
    y = run(kernel, layer, x, idx, tw)
    emulate = "fp8" if fmt == "fp8-block" else "bf16"
    ref = reference.moe_forward(x, idx, tw, *checkpoint, emulate=emulate)
    assert y.shape == (29, H) and y.abs().max() > 0
    assert reference.relative_error(y, ref) < BOUND[fmt]


def test_experts_refuse_a_batched_all2all():
    """The experts' own capability check (vLLM's oracle loop calls it): DeepEP low-latency hands
    out batches per expert, which megamoe does not read (0.34 moved the flag it asks)."""
    import dataclasses

    from vllm_megamoe.plugin.experts import MegaMoEExperts
    standard = mk.FusedMoEActivationFormat.Standard
    assert MegaMoEExperts.is_supported_config(MegaMoEExperts, moe_config(), None, None,
                                              standard) == (True, None)
    low_latency = dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), use_ep=True,
                                      all2all_backend="deepep_low_latency", dp_size=2, ep_size=2)
    assert low_latency.use_deepep_ll_kernels
    supported, reason = MegaMoEExperts.is_supported_config(
        MegaMoEExperts, moe_config(moe_parallel_config=low_latency), None, None, standard)
    assert not supported and "deepep_low_latency" in reason
    from vllm_megamoe.plugin.experts import check_layer
    with pytest.raises(ValueError, match="leave --all2all-backend unset"):  # the layer check too
        check_layer(moe_config(moe_parallel_config=low_latency))


def test_zero_tokens_and_too_many(gen):
    kernel, layer, _ = make_kernel("bf16", gen)
    x, idx, tw = routing(0, gen)
    y = run(kernel, layer, x, idx, tw)  # an idle DP rank: the op still runs (a collective)
    assert y.shape == (0, H)
    x, idx, tw = routing(65, gen)
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_MAX_TOKENS_PER_RANK"):
        run(kernel, layer, x, idx, tw)


def test_offline_converted_weights_are_recognised(gen, fresh_worker):
    """A checkpoint converted for sm90 stores w13 interleaved; on a CPU worker (portable path)
    the plugin undoes the interleave instead of converting again, and the math is the same."""
    fresh_worker.STATE.checkpoint_marker = fresh_worker.parse_checkpoint_marker(
        {"format": "bf16", "arch": "sm90", "layout_version": 1})
    kernel, layer, weights = make_kernel("bf16", gen, layout="interleaved")
    x, idx, tw = routing(9, gen)
    y = run(kernel, layer, x, idx, tw)
    ref = reference.moe_forward(x, idx, tw, *weights.dequantize(), emulate="bf16")
    assert reference.relative_error(y, ref) < BOUND["bf16"]
    with pytest.raises(ValueError, match="layout_version"):
        fresh_worker.parse_checkpoint_marker({"format": "bf16", "arch": "sm90",
                                              "layout_version": 99})


def _matches(kernel, layer, weights, fmt, gen):
    x, idx, tw = routing(21, gen)
    ref = reference.moe_forward(x, idx, tw, *weights.dequantize(),
                                emulate="fp8" if fmt == "fp8-block" else "bf16")
    return reference.relative_error(run(kernel, layer, x, idx, tw), ref) < BOUND[fmt]


def _addresses(experts):
    w = experts._weights
    return [t.data_ptr() for t in (w.w13, w.w2, w.w13_scale, w.w2_scale) if t is not None]


@pytest.mark.parametrize("how", ["new_parameters", "in_place"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_weight_update_refills_the_kernel_tensors(fmt, how, gen, fresh_worker):
    """A weight update hands update_weights the layer with new checkpoint weights: in new
    parameters (vLLM's layerwise reload) or written into the old storage (0.34's direct
    reload, where the kernel's own tensors are the source). The layer then computes with the new
    weights, through tensors at the old addresses (CUDA graphs hold them)."""
    kernel, layer, _ = make_kernel(fmt, gen)
    experts = kernel.fused_experts
    before = _addresses(experts)
    x, idx, tw = routing(5, gen)
    run(kernel, layer, x, idx, tw)  # fills the portable path's dense-weight cache
    new, quant = make_weights(fmt, gen)
    if how == "new_parameters":
        layer.w13_weight = torch.nn.Parameter(new.w13.clone(), requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(new.w2.clone(), requires_grad=False)
    else:
        layer.w13_weight.data.copy_(new.w13)
        layer.w2_weight.data.copy_(new.w2)
    experts.update_weights(layer, quant)
    assert _matches(kernel, layer, new, fmt, gen)
    assert _addresses(experts) == before
    assert layer.w13_weight.data_ptr() == experts._weights.w13.data_ptr()


def test_weight_update_through_the_quant_method(gen, fresh_worker):
    """follow_weight_updates: a later run of the method's process_weights_after_loading (how
    vLLM ends every checkpoint-format update) refills the experts. Like vLLM's FP8 method, this
    one builds a new kernel with the update's scales; megamoe's kernel stays in place."""
    from types import SimpleNamespace

    from vllm_megamoe.plugin.experts import MegaMoEExperts
    kernel, layer, _ = make_kernel("fp8-block", gen)
    new, quant = make_weights("fp8-block", gen)

    runs = []

    def rebuild(updated_layer):
        runs.append(updated_layer)
        method.moe_kernel = mk.FusedMoEKernel(PassThroughPrepareAndFinalize(),
                                              MegaMoEExperts(moe_config(), quant))
        method.moe_quant_config = quant

    method = SimpleNamespace(moe_kernel=kernel, moe_quant_config=None,
                             process_weights_after_loading=rebuild)
    kernel.fused_experts.follow_weight_updates(layer, method)
    kernel.fused_experts.follow_weight_updates(layer, method)  # wraps once
    layer.w13_weight = torch.nn.Parameter(new.w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(new.w2.clone(), requires_grad=False)
    method.process_weights_after_loading(layer)
    assert len(runs) == 1
    assert method.moe_kernel is kernel and method.moe_quant_config is None
    assert _matches(kernel, layer, new, "fp8-block", gen)
    # A failed update leaves megamoe's kernel in place, not vLLM's unprepared one.
    wider, _ = make_weights("fp8-block", gen, inter=2 * I)
    layer.w13_weight = torch.nn.Parameter(wider.w13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(wider.w2, requires_grad=False)
    with pytest.raises(ValueError, match="shape"):
        method.process_weights_after_loading(layer)
    assert method.moe_kernel is kernel and method.moe_quant_config is None


def _copy_loader(param, loaded_weight):
    param.data.copy_(loaded_weight)


class MethodLayer(torch.nn.Module):
    """A MoE layer as vLLM's RoutedExperts sets it up: vLLM's own quantization method (unquantized,
    or FP8 with 128x128 blocks) creates the parameters and runs process_weights_after_loading."""

    def __init__(self, fmt):
        super().__init__()
        self.layer_name = "model.layers.0.mlp.experts"
        self.expert_placement_strategy = "linear"
        self.apply_router_weight_on_input = False
        self.moe_config = moe_config()
        if fmt == "bf16":
            from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
                UnquantizedFusedMoEMethod,
            )
            self.quant_method = UnquantizedFusedMoEMethod(self.moe_config)
        else:
            from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
            self.quant_method = Fp8MoEMethod(Fp8Config(weight_block_size=[128, 128]), self)
        self.quant_method.create_weights(self, num_experts=E, hidden_size=H,
                                         intermediate_size_per_partition=I,
                                         params_dtype=torch.bfloat16, weight_loader=_copy_loader)

    def _expert_routing_tables(self):
        return None

    def load(self, weights: ExpertWeights) -> None:
        """What the model's load_weights does: each checkpoint tensor through its loader."""
        tensors = {"w13_weight": weights.w13, "w2_weight": weights.w2,
                   "w13_weight_scale_inv": weights.w13_scale, "w2_weight_scale_inv": weights.w2_scale}
        for name, tensor in tensors.items():
            if tensor is not None:
                param = getattr(self, name)
                param.weight_loader(param, tensor)


@pytest.mark.parametrize("sent", [True, False], ids=["sent", "not_sent"])
@pytest.mark.parametrize("kernel_layout", ["checkpoint", "interleaved"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("mode", ["layerwise", "direct"])
def test_vllm_reload_through_its_moe_methods(mode, fmt, kernel_layout, sent, gen, fresh_worker,
                                             monkeypatch):
    """vLLM's reload machinery on a layer with vLLM's own MoE methods: cold start (loaders, then
    vLLM's model-level process_weights_after_loading with the plugin's hook), a weight update in
    the layerwise mode (0.32+: new parameters, copied back into the old storage) or the direct
    mode (0.34: checkpoint bytes written over the kernel's tensors, then post-processing again).
    kernel_layout "interleaved" stands in for the GPU kernels' layout (the CPU path reads it
    too), so the update must be converted, not just copied. An update that does not send this
    layer's experts leaves them as they were (the direct mode post-processes every layer)."""
    import types

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import utils as loader_utils
    if kernel_layout == "interleaved":
        from vllm_megamoe.plugin import experts as experts_module
        monkeypatch.setattr(experts_module.ops, "prepare_weights",
                            lambda weights, path: transform_weights_for_mega_moe(weights))
    if mode == "direct":
        direct = pytest.importorskip("vllm.model_executor.model_loader.reload.direct",
                                     reason="direct reload is new in vLLM 0.34")
        monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
        begin, finish = direct.begin_direct_reload, direct.finish_direct_reload
        record = direct.record_checkpoint_layout
    else:
        from vllm.model_executor.model_loader.reload import layerwise
        record = layerwise.record_metadata_for_reloading
        begin = layerwise.initialize_layerwise_reload
        finish = lambda model, config, device: layerwise.finalize_layerwise_reload(model, config)  # noqa: E731
    config = types.SimpleNamespace(word_embeddings_untied_by_checkpoint=False,
                                   dtype=torch.bfloat16, quantization=None)
    cpu = torch.device("cpu")
    import vllm.distributed
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    with set_current_vllm_config(VllmConfig()):
        model = torch.nn.Module()
        model.experts = layer = MethodLayer(fmt)
        old, _ = make_weights(fmt, gen)
        new, _ = make_weights(fmt, gen)
        layer.load(old)
        record(model)
        loader_utils.process_weights_after_loading(model, config, cpu)  # the plugin's hook runs
        kernel = layer.quant_method.moe_kernel
        experts = kernel.fused_experts
        assert experts._weights.layout == kernel_layout
        addresses = _addresses(experts)
        assert _matches(kernel, layer, old, fmt, gen)
        begin(model)
        if sent:
            layer.load(new)
        finish(model, config, cpu)
    assert layer.quant_method.moe_kernel is kernel
    assert _addresses(experts) == addresses
    assert _matches(kernel, layer, new if sent else old, fmt, gen)


def test_weight_update_of_an_offline_converted_checkpoint_is_refused(gen, fresh_worker):
    """Updates arrive in the original checkpoint's layout, not in the converted one's."""
    fresh_worker.STATE.checkpoint_marker = fresh_worker.parse_checkpoint_marker(
        {"format": "bf16", "arch": "sm90", "layout_version": 1})
    kernel, layer, _ = make_kernel("bf16", gen, layout="interleaved")
    new, quant = make_weights("bf16", gen)
    layer.w13_weight = torch.nn.Parameter(new.w13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(new.w2, requires_grad=False)
    with pytest.raises(ValueError, match="Serve the original checkpoint"):
        kernel.fused_experts.update_weights(layer, quant)


def test_weight_update_of_another_shape_is_refused(gen, fresh_worker):
    kernel, layer, _ = make_kernel("bf16", gen)
    wider, quant = make_weights("bf16", gen, inter=2 * I)
    layer.w13_weight = torch.nn.Parameter(wider.w13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(wider.w2, requires_grad=False)
    with pytest.raises(ValueError, match="intermediate=256; the layer serves 8 of hidden=256, "
                                         "intermediate=128"):
        kernel.fused_experts.update_weights(layer, quant)


def test_oracles_are_intercepted():
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as uq_method
    from vllm.model_executor.layers.fused_moe.oracle import fp8, nvfp4, unquantized
    from vllm.model_executor.layers.quantization import fp8 as fp8_method

    from vllm_megamoe.plugin.experts import MegaMoEExperts
    # Every module that imported an oracle name holds the wrapper.
    assert uq_method.select_unquantized_moe_backend is unquantized.select_unquantized_moe_backend
    assert fp8_method.select_fp8_moe_backend is fp8.select_fp8_moe_backend
    assert hasattr(fp8.select_fp8_moe_backend, "__megamoe_original__")

    assert unquantized.select_unquantized_moe_backend(moe_config())[1] is MegaMoEExperts
    assert fp8.select_fp8_moe_backend(moe_config(), kFp8Static128BlockSym,
                                      kFp8Dynamic128Sym)[1] is MegaMoEExperts
    with pytest.raises(ValueError, match="128x128 block scales"):
        fp8.select_fp8_moe_backend(moe_config(), kFp8StaticTensorSym, kFp8StaticTensorSym)
    with pytest.raises(ValueError, match="does not run NVFP4"):
        nvfp4.select_nvfp4_moe_backend(moe_config(), kNvfp4Static, None)
    with pytest.raises(ValueError, match="remove --enable-lora"):
        unquantized.select_unquantized_moe_backend(moe_config(is_lora_enabled=True))
    # Other backends still reach vLLM's own oracle.
    assert unquantized.select_unquantized_moe_backend(moe_config(moe_backend="auto"))[1] \
        is not MegaMoEExperts
