"""Where the plugin hooks into vLLM (0.32-0.34; no MoE-backend registry exists there;
scripts/vllm_releases.sh checks each release's code).

1. CLI / config: "megamoe" joins `KernelConfig.moe_backend`'s Literal, so `--moe-backend
   megamoe`, `moe-backend: megamoe` in a `--config` YAML and `KernelConfig(moe_backend=...)`
   validate (EngineArgs / LLM(moe_backend=...) never validated it).
2. All2all: like vLLM's FlashInfer MoE-EP megakernels, megamoe dispatches and combines itself,
   so it binds all2all_backend="passthrough" and rejects any other explicit choice. Startup
   checks that need the whole VllmConfig (LoRA, dtype, quantization, DP without EP) run here too.
3. Oracles: vLLM picks MoE experts per quantization through `select_*_moe_backend` functions
   that map backend names through hard-coded dicts. The unquantized and FP8 ones return
   MegaMoEExperts for "megamoe"; every other one fails with a message saying what megamoe
   runs. Wrappers replace the name in every module that imported it (and in modules imported
   later, which read the patched oracle module).
4. Loader: after vLLM post-processes the weights of the whole model, every megamoe layer
   converts its weights (vLLM's FP8 method never calls the experts' hook) and the worker
   allocates its one SymmBuffer, before profiling and CUDA-graph capture.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import typing

from . import CHECKED_VLLM_RELEASES, checked_vllm_release, public_version
from .runtime import logger

BACKEND = "megamoe"
PASSTHROUGH = "passthrough"
DEFAULT_ALL2ALL = "allgather_reducescatter"
_ORACLE_PKG = "vllm.model_executor.layers.fused_moe.oracle"
# Oracles of quantization schemes megamoe does not run: module -> scheme shown to users.
_OTHER_ORACLES = {"int8": "INT8", "int_wna16": "weight-only INT4/INT8 (GPTQ/AWQ)",
                  "mxfp4": "MXFP4", "mxfp8": "MXFP8", "nvfp4": "NVFP4", "w4a8": "W4A8",
                  "w4a8_int8": "W4A8-INT8"}


def install() -> None:
    """Install every hook; safe to call more than once (each hook checks itself). A hook point
    that moved in this vLLM release is an error naming the release and the checked ones."""
    import vllm
    version = str(getattr(vllm, "__version__", "unknown"))
    checked = checked_vllm_release(version)
    if not checked:
        logger.warning("megamoe: vLLM %s is not one of the releases the plugin was checked "
                       "against (%s): it hooks vLLM's MoE internals, so a failure at startup or in "
                       "a MoE layer may come from a change there (`bash scripts/vllm_releases.sh "
                       "%s` runs the plugin's layer and startup tests against a release).",
                       version, ", ".join(CHECKED_VLLM_RELEASES), public_version(version))
    try:
        _install_hooks()
    except Exception as e:
        if checked:
            what = (f"vLLM {version} is a release the plugin is checked on, so this is a bug in "
                    "vllm-megamoe or a broken vLLM install; please report it with this message")
        else:
            what = (f"the plugin patches vLLM's MoE internals and was checked against vLLM "
                    f"{', '.join(CHECKED_VLLM_RELEASES)}: install one of those to use --moe-backend megamoe")
        raise RuntimeError(f"vllm-megamoe cannot hook into vLLM {version}: "
                           f"{type(e).__name__}: {e}. {what}.") from e


def _install_hooks() -> None:
    # The CLI choice comes last: if an earlier hook point moved, `--moe-backend megamoe` stays an
    # unknown choice instead of reaching a half-hooked vLLM.
    _patch(f"{_ORACLE_PKG}.unquantized", "select_unquantized_moe_backend", _wrap_select_unquantized)
    _patch(f"{_ORACLE_PKG}.unquantized", "map_unquantized_backend", _wrap_map_to_triton("unquantized"))
    _patch(f"{_ORACLE_PKG}.fp8", "select_fp8_moe_backend", _wrap_select_fp8)
    _patch(f"{_ORACLE_PKG}.fp8", "map_fp8_backend", _wrap_map_to_triton("fp8"))
    _patch(f"{_ORACLE_PKG}.fp8", "resolve_fp8_moe_weight_block_shape", _wrap_resolve_fp8_block)
    for mod, scheme in _OTHER_ORACLES.items():
        module = importlib.import_module(f"{_ORACLE_PKG}.{mod}")
        for name in dir(module):
            if (name.startswith("select_") or name.startswith("map_")) and name.endswith("backend"):
                _patch(module.__name__, name, _wrap_reject(scheme))
    _patch("vllm.config.kernel", "bind_passthrough_all2all_backend", _wrap_bind_passthrough)
    _patch_method("vllm.config.kernel", "KernelConfig", "set_platform_defaults",
                  _wrap_set_platform_defaults)
    _patch("vllm.model_executor.model_loader.utils", "process_weights_after_loading",
           _wrap_process_weights_after_loading)
    from .converted import wrap_load_weights
    _patch_method("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader", "load_weights",
                  wrap_load_weights)
    _extend_moe_backend_choices()


# -- patching machinery ---------------------------------------------------------------------
def _patch(module_name: str, attr: str, make_wrapper) -> None:
    """Replace function `attr` of `module_name`, and every module's imported copy of it."""
    module = importlib.import_module(module_name)
    current = getattr(module, attr)
    if getattr(current, "__megamoe_original__", None) is not None:
        return
    wrapper = functools.wraps(current)(make_wrapper(current))
    wrapper.__megamoe_original__ = current
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if d is not None and d.get(attr) is current:
            setattr(mod, attr, wrapper)


def _patch_method(module_name: str, cls_name: str, attr: str, make_wrapper) -> None:
    cls = getattr(importlib.import_module(module_name), cls_name)
    current = cls.__dict__[attr]
    if getattr(current, "__megamoe_original__", None) is not None:
        return
    wrapper = functools.wraps(current)(make_wrapper(current))
    wrapper.__megamoe_original__ = current
    setattr(cls, attr, wrapper)


def _moe_backend_of(args, kwargs) -> str | None:
    for v in list(args[:1]) + [kwargs.get("moe_config"), kwargs.get("config"),
                               kwargs.get("moe")]:
        backend = getattr(v, "moe_backend", None)
        if backend is not None:
            return backend
    return None


# -- 1. CLI choices -------------------------------------------------------------------------
def _extend_moe_backend_choices() -> None:
    import pydantic

    from vllm.config import kernel
    field = next(f for f in dataclasses.fields(kernel.KernelConfig) if f.name == "moe_backend")
    choices = typing.get_args(field.type)
    if BACKEND in choices:
        return
    extended = typing.Literal[choices + (BACKEND,)]  # type: ignore[valid-type]
    field.type = extended
    kernel.KernelConfig.__annotations__["moe_backend"] = extended
    kernel.MoEBackend = extended
    pydantic.dataclasses.rebuild_dataclass(kernel.KernelConfig, force=True)
    from vllm.engine import arg_utils
    arg_utils._compute_kwargs.cache_clear()  # argparse kwargs are cached per config class


# -- 2. all2all binding and whole-config startup checks --------------------------------------
def _wrap_bind_passthrough(original):
    def bind(moe_backend, parallel_config):
        if moe_backend != BACKEND:
            return original(moe_backend, parallel_config)
        a2a = parallel_config.all2all_backend
        if a2a == PASSTHROUGH:
            return None
        if a2a != DEFAULT_ALL2ALL:
            raise ValueError(
                f"--moe-backend {BACKEND} dispatches and combines tokens itself and cannot be "
                f"paired with --all2all-backend {a2a}: remove --all2all-backend (or the "
                f"'all2all-backend' key of your --config YAML), or drop --moe-backend {BACKEND} "
                f"to keep {a2a}.")
        logger.info("moe_backend=%r: using all2all_backend=%r (dispatch and combine run inside "
                    "the megamoe op).", BACKEND, PASSTHROUGH)
        parallel_config.all2all_backend = PASSTHROUGH
        return None
    return bind


def _wrap_set_platform_defaults(original):
    def set_platform_defaults(self, vllm_config):
        original(self, vllm_config)
        if self.moe_backend == BACKEND:
            check_vllm_config(vllm_config)
    return set_platform_defaults


def check_vllm_config(vllm_config) -> None:
    """Startup checks on the whole deployment; each error says what to change."""
    from . import runtime
    tunables = runtime.settings()  # unknown VLLM_MEGAMOE_* keys fail here, in the front end
    problems = []
    batched = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
    cap = tunables.max_tokens_per_rank
    if cap is not None and batched is not None and cap < batched:
        problems.append(f"VLLM_MEGAMOE_MAX_TOKENS_PER_RANK={cap} is below "
                        f"--max-num-batched-tokens {batched}, so a full batch would not fit the "
                        f"buffer: pass --max-num-batched-tokens {cap} or raise the setting")
    if getattr(vllm_config, "lora_config", None) is not None:
        problems.append("LoRA is enabled; megamoe has no LoRA support on MoE layers: remove "
                        "--enable-lora, or drop --moe-backend megamoe")
    par = vllm_config.parallel_config
    if par.data_parallel_size > 1 and not par.enable_expert_parallel:
        problems.append(f"--data-parallel-size {par.data_parallel_size} without expert "
                        "parallelism: add --enable-expert-parallel")
    model_config = vllm_config.model_config
    if model_config is not None:
        import torch
        if model_config.dtype != torch.bfloat16:
            problems.append(f"dtype {model_config.dtype}: megamoe runs BF16 activations; pass "
                            "--dtype bfloat16")
        quant = model_config.quantization
        hf_quant = getattr(model_config.hf_config, "quantization_config", None) or {}
        if not isinstance(hf_quant, dict):
            hf_quant = getattr(hf_quant, "__dict__", {})
        if quant == "fp8" and list(hf_quant.get("weight_block_size") or []) != [128, 128]:
            problems.append("FP8 without 128x128 weight blocks (per-tensor FP8, or "
                            "--quantization fp8 on a BF16 checkpoint): megamoe runs FP8 "
                            "checkpoints with weight_block_size [128, 128]; serve the BF16 "
                            "checkpoint without --quantization, or drop --moe-backend megamoe")
    if problems:
        raise ValueError(f"--moe-backend {BACKEND} cannot serve this configuration:\n  - "
                         + "\n  - ".join(problems))


# -- 3. oracles -----------------------------------------------------------------------------
_logged: set = set()


def _info_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _note_config() -> None:
    from vllm.config import get_current_vllm_config_or_none

    from . import runtime
    runtime.note_vllm_config(get_current_vllm_config_or_none())


def _wrap_select_unquantized(original):
    def select(moe_config, *args, **kwargs):
        if moe_config.moe_backend != BACKEND:
            return original(moe_config, *args, **kwargs)
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

        from .experts import MegaMoEExperts, check_layer
        check_layer(moe_config)
        _note_config()
        _info_once("Using megamoe MoE backend (MegaMoEExperts) for unquantized MoE layers.")
        # TRITON is only the carrier enum: its load-time conversion is a no-op (.contiguous())
        # and its kernel factory builds whatever experts class it is handed.
        return UnquantizedMoeBackend.TRITON, MegaMoEExperts
    return select


def _wrap_select_fp8(original):
    def select(config, weight_key=None, activation_key=None, *args, **kwargs):
        if config.moe_backend != BACKEND:
            return original(config, weight_key, activation_key, *args, **kwargs)
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

        from .experts import MegaMoEExperts, check_layer
        check_layer(config, weight_key, activation_key)
        _note_config()
        _info_once("Using megamoe MoE backend (MegaMoEExperts) for FP8 block-quantized MoE "
                   "layers.")
        # TRITON: no load-time conversion, W8A8 block quant config (scales ride along).
        return Fp8MoeBackend.TRITON, MegaMoEExperts
    return select


def _wrap_map_to_triton(kind):
    def make(original):
        def map_backend(runner_backend, *args, **kwargs):
            if runner_backend != BACKEND:
                return original(runner_backend, *args, **kwargs)
            if kind == "fp8":
                from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
                return Fp8MoeBackend.TRITON
            from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
                UnquantizedMoeBackend,
            )
            return UnquantizedMoeBackend.TRITON
        return map_backend
    return make


def _wrap_resolve_fp8_block(original):
    def resolve(config, weight_block_size, *args, **kwargs):
        if config.moe_backend != BACKEND:
            return original(config, weight_block_size, *args, **kwargs)
        if list(weight_block_size) != [128, 128]:
            raise ValueError(f"--moe-backend {BACKEND} needs FP8 weight blocks of 128x128, the "
                             f"checkpoint has {list(weight_block_size)}; leave --moe-backend "
                             "unset for this checkpoint")
        if config.intermediate_size_per_partition % 128:
            raise ValueError(
                f"--moe-backend {BACKEND}: tensor parallelism splits the expert width "
                f"{config.intermediate_size} into {config.intermediate_size_per_partition} per "
                "rank, not whole 128-wide FP8 blocks; add --enable-expert-parallel (experts "
                "are then placed whole) or lower --tensor-parallel-size")
        return list(weight_block_size), None
    return resolve


def _wrap_reject(scheme):
    def make(original):
        def reject(*args, **kwargs):
            backend = args[0] if args and isinstance(args[0], str) else _moe_backend_of(args, kwargs)
            if backend != BACKEND:
                return original(*args, **kwargs)
            raise ValueError(
                f"--moe-backend {BACKEND} does not run {scheme} MoE weights (this model's "
                "quantization); it runs unquantized BF16 checkpoints and FP8 checkpoints with "
                "128x128 block scales. Leave --moe-backend unset to serve this checkpoint, or "
                "serve a BF16 / FP8-block version of the model.")
        return reject
    return make


# -- 4. loader ------------------------------------------------------------------------------
def _wrap_process_weights_after_loading(original):
    def process_weights_after_loading(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        finish_model(model)
        return result
    return process_weights_after_loading


def finish_model(model) -> int:
    """Set up every megamoe layer of `model`, then the worker's buffer; return the layer count.

    Raises when a MoE layer asked for megamoe but its quantization method built another kernel
    (a scheme without an oracle the plugin intercepts).
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    from . import runtime
    from .experts import MegaMoEExperts
    count, seen, bound = 0, set(), []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, FusedMoEMethodBase) or id(module) in seen:
            continue
        seen.add(id(module))
        moe_config = getattr(module, "moe_config", None)
        if getattr(moe_config, "moe_backend", None) != BACKEND:
            continue
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, MegaMoEExperts):
            raise ValueError(
                f"--moe-backend {BACKEND}: MoE layer {name} uses {type(method).__name__}, a "
                "quantization method megamoe does not run (it runs unquantized BF16 and FP8 "
                "128x128-block checkpoints). Leave --moe-backend unset for this checkpoint.")
        experts.process_weights_after_loading(module)
        experts.follow_weight_updates(module, method)
        bound.append(experts)
        count += 1
    if count:
        runtime.ensure_buffer()
        for experts in bound:
            experts.bind_buffer()
    return count
