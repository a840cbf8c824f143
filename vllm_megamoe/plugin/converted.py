"""Loading checkpoints converted offline by `vllm-megamoe convert`.

Their expert weights are stored stacked per layer, already in the kernel layout
(`<experts module>.w13_weight [E, 2I, H]`, `.w2_weight`, FP8 `.w13_weight_scale_inv`, ...), names
vLLM's per-expert loaders do not know. While such a checkpoint loads, this module takes those
tensors out of the weight stream and copies this rank's experts straight into the FusedMoE
parameters, as stored: no conversion at load time.
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

logger = logging.getLogger("vllm.plugins.megamoe")

STACKED_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


class ConvertedExpertLoader:
    """Filters a (name, tensor) stream: stacked expert tensors go into the model directly."""

    def __init__(self, model: torch.nn.Module, marker: dict):
        self.marker = marker
        self.modules = dict(model.named_modules())
        self.loaded: set[str] = set()

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            module_name, _, param_name = name.rpartition(".")
            if param_name in STACKED_PARAMS and module_name.endswith("experts"):
                self._copy(module_name, param_name, tensor)
                continue
            yield name, tensor

    def _find(self, module_name: str, param_name: str):
        """(module name, module) holding `param_name`: the experts module itself or the
        RoutedExperts child vLLM keeps the weights in (possibly under a LoRA base_layer)."""
        for suffix in ("", ".routed_experts", ".base_layer", ".routed_experts.base_layer"):
            module = self.modules.get(module_name + suffix)
            if module is not None and isinstance(getattr(module, param_name, None), torch.nn.Parameter):
                return module_name + suffix, module
        raise ValueError(
            f"converted checkpoint tensor {module_name}.{param_name} has no parameter in the vLLM "
            f"model (no {param_name} under {module_name!r}); was the checkpoint converted from this model?")

    def _copy(self, module_name: str, param_name: str, tensor: torch.Tensor) -> None:
        module_name, module = self._find(module_name, param_name)
        param = getattr(module, param_name)
        backend = getattr(module.moe_config, "moe_backend", None)
        if backend != "megamoe":
            raise ValueError(
                f"this checkpoint was converted by `vllm-megamoe convert` (arch {self.marker.get('arch')}, "
                f"format {self.marker.get('format')}): its expert weights are in the megamoe kernel "
                f"layout, which MoE backend {backend!r} would read wrongly. Serve it with "
                "--moe-backend megamoe, or serve the original checkpoint")
        par = module.moe_config.moe_parallel_config
        if par.tp_size > 1 and not par.use_ep:
            raise ValueError(
                "a checkpoint converted by vllm-megamoe stores whole experts; serve it with "
                "--enable-expert-parallel (experts split over ranks) rather than tensor-parallel "
                "experts, or serve the original checkpoint")
        local = param.shape[0]
        start = (par.ep_rank if par.use_ep else 0) * local
        shard = tensor[start:start + local]
        if tuple(shard.shape) != tuple(param.shape) or shard.dtype != param.dtype:
            raise ValueError(
                f"converted tensor {module_name}.{param_name}: experts [{start}, {start + local}) of "
                f"{tuple(tensor.shape)} {tensor.dtype} do not match the parameter "
                f"{tuple(param.shape)} {param.dtype}")
        param.data.copy_(shard)
        self.loaded.add(f"{module_name}.{param_name}")

    def log_summary(self) -> None:
        m = self.marker
        logger.info("megamoe: loaded %d stacked expert tensors of a checkpoint converted offline "
                    "(arch %s, format %s, layout v%s) as stored: no runtime conversion",
                    len(self.loaded), m.get("arch"), m.get("format"), m.get("layout_version"))


def wrap_load_weights(original):
    """DefaultModelLoader.load_weights: route converted expert tensors through the loader above."""
    def load_weights(self, model, model_config):
        from . import runtime
        # Read from the checkpoint's config whatever the MoE backend: a converted checkpoint must
        # never reach another backend's loader (it would run kernel-layout weights wrongly).
        raw = getattr(getattr(model_config, "hf_config", None), "megamoe", None)
        if raw is None:
            return original(self, model, model_config)
        marker = runtime.parse_checkpoint_marker(raw)
        loader = ConvertedExpertLoader(model, marker)
        inner = model.load_weights

        def load_filtered(weights):
            loaded = inner(loader.take(weights))
            return None if loaded is None else set(loaded) | loader.loaded

        model.load_weights = load_filtered
        try:
            result = original(self, model, model_config)
        finally:
            del model.load_weights
        loader.log_summary()
        return result
    return load_weights
