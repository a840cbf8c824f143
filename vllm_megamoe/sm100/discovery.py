"""Find the DeepGEMM module that provides the SM100 Mega MoE kernels, at run time.

Order: an installed `deep_gemm` that has the mega API, else the copy vLLM bundles as
`vllm.third_party.deep_gemm`. Nothing is imported until `find_deep_gemm()` is called, and the
answer is cached per process (`reset()` forgets it, for tests).

The DeepGEMM Python API moved between releases (2.4: `use_fp8_dispatch`; 2.6: `mma_type`, ring
tokens chosen by `get_symm_buffer_for_mega_moe`; 2.8: `base=`, shared experts,
`activation_alpha/beta`). `DeepGemmApi` records which optional keywords the installed copy
accepts, so the adapter passes only those and names the missing one when a model needs it.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import UnsupportedError

CANDIDATES = ("deep_gemm", "vllm.third_party.deep_gemm")
# Functions the adapter cannot work without.
REQUIRED = ("fp8_fp4_mega_moe", "bf16_mega_moe")
# One of these creates the symmetric buffer (the factory aligns tokens and sizes the rings).
BUFFER_FACTORIES = ("get_symm_buffer_for_mega_moe", "SymmBuffer")
# The positional arguments the adapter passes to it (the rest go by keyword).
BUFFER_ARGS = ("group", "num_experts", "num_max_tokens_per_rank", "num_topk", "hidden",
               "intermediate_hidden")
INSTALL_HINT = ("install DeepGEMM with the Mega MoE API (>= 2.5: `pip install "
                "git+https://github.com/deepseek-ai/DeepGEMM` built for your CUDA and torch), or a "
                "vLLM build that bundles it as vllm.third_party.deep_gemm")


@dataclass(frozen=True)
class DeepGemmApi:
    """The chosen module and what its mega API accepts."""

    module: Any
    source: str                      # "deep_gemm" or "vllm.third_party.deep_gemm"
    version: str
    buffer_factory: str              # name of the callable that creates a SymmBuffer
    buffer_kwargs: frozenset = field(default_factory=frozenset)
    fp8_fp4_kwargs: frozenset = field(default_factory=frozenset)
    bf16_kwargs: frozenset = field(default_factory=frozenset)

    def fn(self, name: str):
        return getattr(self.module, name)

    @property
    def supports_base(self) -> bool:
        return "base" in self.buffer_kwargs

    def kernel_kwargs(self, mma_type: str) -> frozenset:
        return self.fp8_fp4_kwargs if mma_type == "fp8xfp4" else self.bf16_kwargs

    def describe(self) -> str:
        return f"{self.version} ({self.source})"


def _params(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: assume the documented set
        return frozenset()


def _version_of(module, source: str) -> str:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version
        return dist_version("deep_gemm" if source == "deep_gemm" else "vllm") + (
            "" if source == "deep_gemm" else " (vLLM version)")
    except Exception:
        return "unknown version"


def _required(fn) -> set:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _pick_factory(module) -> Optional[str]:
    """The buffer constructor we can call with BUFFER_ARGS only; one taking `base=` first."""
    usable = [name for name in BUFFER_FACTORIES if hasattr(module, name)
              and _required(getattr(module, name)) <= set(BUFFER_ARGS)]
    with_base = [name for name in usable if "base" in _params(getattr(module, name))]
    return (with_base or usable or [None])[0]


def inspect_module(module, source: str) -> tuple[Optional[DeepGemmApi], str]:
    """(api, "") when `module` has the mega API, else (None, why not)."""
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    factory = _pick_factory(module)
    if factory is None:
        missing.append(" or ".join(BUFFER_FACTORIES) + f" callable with {BUFFER_ARGS}")
    if missing:
        return None, f"{source} {_version_of(module, source)} has no mega API ({', '.join(missing)})"
    return DeepGemmApi(
        module, source, _version_of(module, source), factory,
        _params(getattr(module, factory)), _params(module.fp8_fp4_mega_moe),
        _params(module.bf16_mega_moe)), ""


def _import(name: str):
    return importlib.import_module(name)


_CACHE: dict = {}


def find_deep_gemm() -> tuple[Optional[DeepGemmApi], list[str]]:
    """(api or None, one line per candidate that was rejected and why). Cached."""
    if "result" not in _CACHE:
        reasons = []
        found = None
        for name in CANDIDATES:
            try:
                module = _import(name)
            except ImportError as exc:
                reasons.append(f"{name}: not importable ({exc})")
                continue
            except Exception as exc:  # a broken build: say so instead of crashing the caller
                reasons.append(f"{name}: fails to import ({type(exc).__name__}: {exc})")
                continue
            found, why = inspect_module(module, name)
            if found is not None:
                break
            reasons.append(why)
        _CACHE["result"] = (found, reasons)
    return _CACHE["result"]


def reset() -> None:
    _CACHE.clear()


def require_deep_gemm() -> DeepGemmApi:
    api, reasons = find_deep_gemm()
    if api is None:
        raise UnsupportedError(missing_message(reasons))
    return api


def missing_message(reasons: list[str]) -> str:
    return ("megamoe on a Blackwell (SM100) GPU runs DeepGEMM's Mega MoE kernel, which was not "
            f"found: {'; '.join(reasons) or 'no candidate'}. To fix: {INSTALL_HINT}. To run the "
            "slower portable path instead, set VLLM_MEGAMOE_FALLBACK=portable.")


def describe() -> str:
    """One line for `vllm-megamoe doctor`."""
    api, reasons = find_deep_gemm()
    if api is not None:
        return f"{api.describe()}, mega API: {api.buffer_factory}" + (
            ", base=" if api.supports_base else "")
    return "not found (" + "; ".join(reasons) + f"); for SM100: {INSTALL_HINT}"
