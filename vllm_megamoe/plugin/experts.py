"""MegaMoEExperts: the megamoe op as a vLLM modular-kernel experts implementation.

Paired with vLLM's pass-through prepare/finalize (all2all_backend="passthrough"): the op routes
on vLLM's top-k output, dispatches tokens to the ranks owning their experts, runs both expert
GEMMs and combines the weighted results itself, so vLLM does no EP communication around it.
Template: vllm/model_executor/layers/fused_moe/experts/flashinfer_moe_ep.py.
"""
from __future__ import annotations

import functools

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)

from .. import ops
from ..shape import CHANNEL_ALIGN, MoEShape
from ..weights import ExpertWeights, overwrite_weights_
from . import runtime

BACKEND = "megamoe"
# (weight_key, activation_key) pairs the backend runs: BF16, and FP8 128x128 block weights with
# dynamic per-token-group (1x128) FP8 activations (DeepSeek-V3 / Qwen3-FP8 recipe).
SUPPORTED_QUANT = {(None, None): "bf16", (kFp8Static128BlockSym, kFp8Dynamic128Sym): "fp8-block"}
SUPPORTED_TEXT = ("unquantized BF16 checkpoints and FP8 checkpoints with 128x128 block scales "
                  "(quantization_config.weight_block_size [128, 128])")


def _all2all_format_is_not_standard(par: FusedMoEParallelConfig) -> bool:
    """Whether the all2all hands the experts tokens in another layout than one row per token
    (DeepEP low-latency / NIXL batches, DeepEP v2's padded rows). vLLM 0.32-0.33 have the
    parallel config's `use_batched_activation_format`; 0.34 moved that to FusedMoEConfig."""
    if hasattr(type(par), "use_batched_activation_format"):
        return bool(par.use_batched_activation_format)
    return any(getattr(par, kind, False) for kind in
               ("use_deepep_ll_kernels", "use_nixl_ep_kernels", "use_deepep_v2_kernels"))


def unsupported_reasons(moe: FusedMoEConfig, weight_key: QuantKey | None = None,
                        activation_key: QuantKey | None = None) -> list[str]:
    """What keeps megamoe from running this MoE layer, each with the change that fixes it."""
    par = moe.moe_parallel_config
    reasons = []
    if (weight_key, activation_key) not in SUPPORTED_QUANT:
        reasons.append(f"quantization {weight_key} x {activation_key}: megamoe runs only "
                       f"{SUPPORTED_TEXT}; serve this checkpoint without --moe-backend megamoe")
    if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
        reasons.append(f"activation {moe.activation.value}: megamoe runs SwiGLU (silu and mul) "
                       "experts only")
    if moe.in_dtype != torch.bfloat16:
        reasons.append(f"activation dtype {moe.in_dtype}: serve with --dtype bfloat16")
    if moe.has_bias:
        reasons.append("expert biases: megamoe experts have no bias terms")
    if moe.swiglu_alpha is not None or moe.swiglu_beta is not None:
        reasons.append("custom SwiGLU alpha/beta")
    if moe.is_lora_enabled:
        reasons.append("LoRA on MoE layers: remove --enable-lora (or drop --moe-backend megamoe)")
    if moe.skip_final_all_reduce:
        reasons.append("a model that fuses the MoE all-reduce into its next layer "
                       "(skip_final_all_reduce)")
    if par.dp_size > 1 and not par.use_ep:
        reasons.append(f"data parallel (size {par.dp_size}) without expert parallel: add "
                       "--enable-expert-parallel")
    if par.pcp_size > 1:
        reasons.append("prefill context parallel: megamoe does not gather PCP ranks' tokens")
    if _all2all_format_is_not_standard(par):
        reasons.append(f"all2all backend {par.all2all_backend!r}: leave --all2all-backend unset")
    if moe.num_experts % max(par.ep_size, 1):
        reasons.append(f"{moe.num_experts} experts on {par.ep_size} EP ranks: megamoe needs the "
                       "same number of experts on every rank (pick an EP size that divides it)")
    for name, size in (("hidden size", moe.hidden_dim),
                       ("expert intermediate size per rank", moe.intermediate_size_per_partition)):
        if size % CHANNEL_ALIGN:
            hint = (" (use --enable-expert-parallel instead of sharding experts with TP)"
                    if "intermediate" in name and par.tp_size > 1 else "")
            reasons.append(f"{name} {size} is not a multiple of {CHANNEL_ALIGN}{hint}")
    return reasons


def check_layer(moe: FusedMoEConfig, weight_key=None, activation_key=None) -> str:
    """Raise ValueError listing every unsupported feature of the layer; return its format."""
    reasons = unsupported_reasons(moe, weight_key, activation_key)
    if reasons:
        raise ValueError(
            f"--moe-backend {BACKEND} cannot run this model's MoE layers "
            f"({moe.num_experts} experts, top-{moe.experts_per_token}, hidden {moe.hidden_dim}, "
            f"intermediate {moe.intermediate_size_per_partition} per rank):\n  - "
            + "\n  - ".join(reasons)
            + f"\nTo serve it anyway, leave --moe-backend unset (vLLM picks its default).")
    return SUPPORTED_QUANT[(weight_key, activation_key)]


def _point_parameter_at(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    """Make `param` hold `tensor` itself (same storage, shape, dtype), so the layer keeps one copy
    of its experts, the one EPLB permutes, and the checkpoint's storage is freed. Not vLLM's
    replace_parameter: 0.32 makes a new Parameter (dropping the loader's attributes), 0.33 and
    0.34 copy a tensor that fits into the old storage, which 0.34 keeps whole even when the
    kernel's tensor is smaller (MXFP4 from FP8 on the SM100 path)."""
    same = (param.data_ptr() == tensor.data_ptr() and param.dtype == tensor.dtype
            and param.shape == tensor.shape and param.stride() == tensor.stride())
    if not same:
        param.data = tensor


class _ReduceNoOp(TopKWeightAndReduceNoOP):
    """The op's output is weighted and reduced already. Also copes with the one padding row
    MegaMoEExperts.moe_problem_size adds for empty batches."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        if output is not None and fused_expert_output.size(0) != output.size(0):
            fused_expert_output = fused_expert_output[: output.size(0)]
        return super().apply(output, fused_expert_output, topk_weights, topk_ids,
                             apply_router_weight_on_input)


class MegaMoEExperts(mk.FusedMoEExpertsModular):
    """One megamoe call per MoE layer forward; see the module docstring."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig) -> None:
        super().__init__(moe_config, quant_config)
        self._weights = None  # ExpertWeights, or sm100.weights.Sm100Weights on the SM100 path
        self._path: str | None = None
        self._tp_group = None
        self._sm100_op = None
        self._shape = None
        self._format = self._layout = None
        self._written = False  # a loader wrote into the layer's parameters (_note_writes)
        self.layer_name = "?"

    # -- capabilities (the oracle's checks) -----------------------------------------------
    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        supported, reason = mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format)
        if not supported:
            return False, reason
        reasons = unsupported_reasons(moe_config, weight_key, activation_key)
        return (False, "; ".join(reasons)) if reasons else (True, None)

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # CUDA runs a kernel or the portable path; anything else the portable path

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) in SUPPORTED_QUANT

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not _all2all_format_is_not_standard(moe_parallel_config)

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # the op quantizes activations itself

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return _ReduceNoOp()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (0,), (0,), (M, K)

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        # vLLM skips the experts for an empty batch, but the op is a collective: an idle rank
        # (0 tokens) must still take part, so report one row and let apply() use none of it.
        E, M, N, K, topk = super().moe_problem_size(a1, w1, w2, topk_ids)
        return E, max(M, 1), N, K, topk

    # -- load time ------------------------------------------------------------------------
    @property
    def is_prepared(self) -> bool:
        return self._weights is not None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Convert the layer's weights to the layout of the path that will run, point the
        layer's parameters at them (the originals are freed), register with the worker.
        Idempotent; vLLM's FP8 method does not call it, the loader hook (hooks.py) does."""
        if self._weights is not None:
            return
        moe = self.moe_config
        par = moe.moe_parallel_config
        self.layer_name = getattr(layer, "layer_name", type(layer).__name__)
        placement = getattr(layer, "expert_placement_strategy", "linear")
        if par.use_ep and placement != "linear":
            raise ValueError(f"{self.layer_name}: --moe-backend {BACKEND} needs linear expert "
                             f"placement, got {placement!r}; set "
                             "--expert-placement-strategy linear")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise ValueError(f"{self.layer_name}: the model applies router weights to the MoE "
                             f"input; --moe-backend {BACKEND} applies them after SwiGLU. Leave "
                             "--moe-backend unset for this model")
        fmt = "fp8-block" if self.quant_config.use_fp8_w8a8 else "bf16"
        if fmt == "fp8-block" and list(self.quant_config.block_shape or []) != [128, 128]:
            raise ValueError(f"{self.layer_name}: FP8 block shape {self.quant_config.block_shape}"
                             f"; --moe-backend {BACKEND} needs 128x128 weight blocks")
        marker = runtime.STATE.checkpoint_marker
        self._layout = "checkpoint"
        if marker is not None:
            if marker["format"] != fmt:
                raise ValueError(
                    f"config.json says the checkpoint was converted to megamoe format "
                    f"{marker['format']!r} but vLLM loaded {fmt!r} MoE weights; check the "
                    "quantization_config of the converted checkpoint")
            self._layout = marker["layout"]
        self._format = fmt
        weights = self._loaded_weights(layer, self.quant_config)
        ep_size = par.ep_size if par.use_ep else 1
        shape = MoEShape(weights.hidden, weights.intermediate, weights.num_experts * ep_size,
                         moe.experts_per_token).validate(ep_size)
        device = weights.w13.device
        self._path, _ = runtime.choose_path(shape, fmt, device, ep_size)
        if self._path == "sm100" and getattr(par, "enable_eplb", False):
            raise ValueError(f"{self.layer_name}: --enable-eplb with megamoe's SM100 path: EPLB "
                             "would move the experts' weights but not their MXFP4 scales, which "
                             "the kernel keeps apart; remove --enable-eplb")
        weights = self._kernel_weights(weights)
        for name, tensor in (("w13_weight", weights.w13), ("w2_weight", weights.w2)):
            _point_parameter_at(getattr(layer, name), tensor)
        self._weights = weights
        self._clamp = self.activation_config.clamp_limit
        group = None
        if par.use_ep and ep_size > 1:
            from vllm.distributed import get_ep_group
            coord = get_ep_group()
            group = coord.cpu_group if device.type == "cpu" else coord.device_group
        elif par.tp_size > 1:
            # EP off: experts are TP-sharded on the intermediate dim; each rank runs its shard
            # alone and the partial sums are all-reduced here (pass-through finalize is final).
            from vllm.distributed import get_tp_group
            self._tp_group = get_tp_group()
        layer_format = weights.mma_type if self._path == "sm100" else fmt
        runtime.register_layer(runtime.LayerInfo(
            self.layer_name, shape, layer_format, device, group, par.ep_rank if group else 0, ep_size))
        self._shape = shape

    def _loaded_weights(self, layer: torch.nn.Module, quant_config: FusedMoEQuantConfig) -> ExpertWeights:
        """The weights vLLM's loaders wrote into the layer (checkpoint or converted layout)."""
        from vllm.model_executor import utils as vllm_utils
        if getattr(vllm_utils, "is_weights_pre_processed", lambda: False)():
            raise ValueError(f"{self.layer_name}: the weights arrive pre-processed (vLLM's weight "
                             f"cache IPC loader); --moe-backend {BACKEND} converts the "
                             "checkpoint's weights itself and cannot take another process's")
        scaled = self._format != "bf16"
        return ExpertWeights(self._format, layer.w13_weight.data, layer.w2_weight.data,
                             quant_config.w1_scale if scaled else None,
                             quant_config.w2_scale if scaled else None, layout=self._layout)

    def _kernel_weights(self, weights: ExpertWeights):
        """`weights` in the layout the chosen path reads."""
        if self._path == "sm100":
            # DeepGEMM's Blackwell kernel: MXFP4 (FP8 checkpoints) or BF16, its own layout.
            from ..sm100.weights import convert_experts
            return convert_experts(weights.w13, weights.w2, w13_scale_inv=weights.w13_scale,
                                   w2_scale_inv=weights.w2_scale)
        return ops.prepare_weights(weights, self._path)

    # -- weight updates (reload_weights, RL weight sync) ----------------------------------
    def follow_weight_updates(self, layer: torch.nn.Module, method) -> None:
        """Make every later run of the layer's quantization method's process_weights_after_loading,
        which is how vLLM finishes a checkpoint-format weight update (layerwise reload, 0.34's
        direct reload, the weight-transfer engines), end in update_weights. vLLM's method would
        otherwise leave checkpoint-layout bytes in the kernel's tensors (BF16) or build a new,
        unprepared MegaMoEExperts (FP8)."""
        if getattr(method, "_megamoe_follows", None) is self:
            return
        self._note_writes(layer)
        first_run = method.process_weights_after_loading

        def process_weights_after_loading(updated_layer: torch.nn.Module) -> None:
            kernel, quant = method.moe_kernel, method.moe_quant_config
            try:
                first_run(updated_layer)
                if self._received_weights(updated_layer):
                    # FP8 builds a new kernel whose quant config holds the update's scales.
                    rebuilt = getattr(method.moe_kernel, "fused_experts", self)
                    self.update_weights(updated_layer, rebuilt.quant_config)
            finally:  # megamoe's kernel and tensors stay the layer's, whatever happened
                method.moe_kernel, method.moe_quant_config = kernel, quant

        method.process_weights_after_loading = process_weights_after_loading
        method._megamoe_follows = self

    def _note_writes(self, layer: torch.nn.Module) -> None:
        """Have the loaders of the layer's parameters say when they write (0.34's direct reload
        writes into these same parameters, then post-processes every layer, sent or not)."""
        self._written = False
        for param in layer.parameters(recurse=False):
            loader = getattr(param, "weight_loader", None)
            if loader is None or getattr(loader, "_megamoe_notes", False):
                continue

            @functools.wraps(loader)  # vLLM's reload binds the loader's arguments by name
            def noting_loader(*args, _loader=loader, **kwargs):
                self._written = True
                return _loader(*args, **kwargs)
            noting_loader._megamoe_notes = True
            param.weight_loader = noting_loader

    def _received_weights(self, layer: torch.nn.Module) -> bool:
        """Whether this post-processing run follows new weights: parameters other than the
        kernel's tensors (layerwise reload: fresh ones, loaded) or a loader's write into them."""
        fresh = (layer.w13_weight.data_ptr() != self._weights.w13.data_ptr()
                 or layer.w2_weight.data_ptr() != self._weights.w2.data_ptr())
        received, self._written = fresh or self._written, False
        return received

    @torch.no_grad()
    def update_weights(self, layer: torch.nn.Module, quant_config: FusedMoEQuantConfig) -> None:
        """New weights in the layer's parameters, in the layout the checkpoint has: convert them
        and overwrite the tensors the kernel reads in place (CUDA graphs keep their addresses),
        then point the parameters back at those tensors."""
        if self._weights is None:
            raise RuntimeError(f"{self.layer_name}: a weight update reached megamoe before the "
                               "first load was processed")
        if self._layout != "checkpoint":
            raise ValueError(
                f"{self.layer_name}: a weight update of a checkpoint converted offline for megamoe "
                f"(layout {self._layout!r}): updates arrive in the original checkpoint's layout. "
                "Serve the original checkpoint (megamoe converts it at load time) to update weights")
        loaded = self._loaded_weights(layer, quant_config)
        if (loaded.num_experts, loaded.hidden, loaded.intermediate) != (
                self._weights.num_experts, self._weights.hidden, self._weights.intermediate):
            raise ValueError(
                f"{self.layer_name}: the weight update holds {loaded.num_experts} experts of "
                f"hidden={loaded.hidden}, intermediate={loaded.intermediate}; the layer serves "
                f"{self._weights.num_experts} of hidden={self._weights.hidden}, "
                f"intermediate={self._weights.intermediate}")
        overwrite_weights_(self._weights, self._kernel_weights(loaded))
        for name, tensor in (("w13_weight", self._weights.w13), ("w2_weight", self._weights.w2)):
            _point_parameter_at(getattr(layer, name), tensor)

    def bind_buffer(self) -> None:
        """After the worker's buffers exist (finish_model): the SM100 path's per-layer op."""
        if self._path != "sm100" or self._sm100_op is not None:
            return
        from ..sm100.activation import activation_from_hf_config
        from ..sm100.op import Sm100MoE
        buf = runtime.sm100_buffer(self._shape, self._weights.mma_type)
        # SiLU is the only activation this experts class accepts (_supports_activation); the
        # model's config adds a SwiGLU clamp or gpt-oss style alpha/beta where it has them.
        activation = activation_from_hf_config(runtime.STATE.hf_config, "silu")
        self._sm100_op = Sm100MoE(self._weights, buf, activation=activation)

    # -- forward --------------------------------------------------------------------------
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input) -> None:
        if self._weights is None:
            raise RuntimeError(f"{self.layer_name}: megamoe weights were not processed; the "
                               "vLLM loader hook of vllm_megamoe.plugin did not run")
        n = hidden_states.size(0)
        if self._path == "sm100":
            if n > runtime.STATE.buffer_tokens:
                raise ValueError(
                    f"{self.layer_name}: a batch of {n} tokens exceeds the megamoe buffer "
                    f"(max_tokens_per_rank={runtime.STATE.buffer_tokens}); raise "
                    "VLLM_MEGAMOE_MAX_TOKENS_PER_RANK or lower --max-num-batched-tokens")
            self._sm100_op(hidden_states, topk_ids, topk_weights.float(), out=output[:n])
            return
        buf = runtime.buffer()
        if n > runtime.STATE.buffer_tokens:
            raise ValueError(
                f"{self.layer_name}: a batch of {n} tokens exceeds the megamoe buffer "
                f"(max_tokens_per_rank={runtime.STATE.buffer_tokens}); raise "
                "VLLM_MEGAMOE_MAX_TOKENS_PER_RANK or lower --max-num-batched-tokens")
        y = ops.mega_moe(hidden_states, topk_ids, topk_weights.float(), self._weights, buf,
                         activation_clamp=self._clamp, path=self._path)
        if self._tp_group is not None:
            y = self._tp_group.all_reduce(y)
        output[:n].copy_(y)
