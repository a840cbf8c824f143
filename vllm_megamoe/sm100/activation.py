"""Map a model's expert activation onto the options DeepGEMM's Mega MoE kernel has.

The kernel computes SwiGLU only: silu(gate) * up * topk_weight, with an optional clamp c
(gate = min(gate, c), up = clamp(up, -c, c)); DeepGEMM 2.8 adds activation_alpha/beta, which we
map as gate * sigmoid(alpha * gate) * (up + beta) (alpha=1, beta=0 is plain SwiGLU; gpt-oss's
"swigluoai" is alpha=1.702, beta=1, clamp 7). Any other activation is refused with a message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import UnsupportedError

SWIGLU_NAMES = ("silu", "swiglu", "silu_and_mul")
OAI_NAMES = ("swigluoai", "swiglu_oai")
OAI_ALPHA, OAI_BETA, OAI_LIMIT = 1.702, 1.0, 7.0


@dataclass(frozen=True)
class ActivationSpec:
    clamp: Optional[float] = None
    alpha: float = 1.0
    beta: float = 0.0

    @property
    def needs_alpha_beta(self) -> bool:
        return self.alpha != 1.0 or self.beta != 0.0

    def kernel_kwargs(self, accepted: frozenset) -> dict:
        """Keyword arguments for DeepGEMM's mega MoE call, given the keywords it accepts."""
        kwargs = {"activation": "swiglu", "activation_clamp": self.clamp}
        if self.needs_alpha_beta:
            missing = {"activation_alpha", "activation_beta"} - accepted
            if accepted and missing:
                raise UnsupportedError(
                    f"this model's activation needs activation_alpha={self.alpha}, "
                    f"activation_beta={self.beta}, which the installed DeepGEMM does not accept "
                    f"(missing {sorted(missing)}); install a DeepGEMM with them (2.8+) or serve "
                    "the model with another --moe-backend")
            kwargs.update(activation_alpha=self.alpha, activation_beta=self.beta)
        return kwargs


def activation_spec(activation: str, *, clamp: Optional[float] = None,
                    alpha: Optional[float] = None, beta: Optional[float] = None) -> ActivationSpec:
    """From vLLM's MoE activation name (FusedMoE `activation`) and the model's limits."""
    name = str(activation).lower()
    if clamp is not None and not clamp >= 0:
        raise ValueError(f"activation clamp {clamp} must be >= 0 (DeepGEMM's requirement)")
    if name in SWIGLU_NAMES:
        return ActivationSpec(clamp, 1.0 if alpha is None else float(alpha),
                              0.0 if beta is None else float(beta))
    if name in OAI_NAMES:
        return ActivationSpec(OAI_LIMIT if clamp is None else clamp,
                              OAI_ALPHA if alpha is None else float(alpha),
                              OAI_BETA if beta is None else float(beta))
    raise UnsupportedError(
        f"activation {activation!r} is not supported by DeepGEMM's SM100 Mega MoE kernel, which "
        f"runs SwiGLU only (vLLM names {SWIGLU_NAMES + OAI_NAMES}); serve this model with another "
        "--moe-backend, or set VLLM_MEGAMOE_PATH=portable")


def activation_from_hf_config(hf_config: Any, activation: str = "silu") -> ActivationSpec:
    """Read the clamp from a Hugging Face config (`swiglu_limit`, as DeepSeek-V4 and gpt-oss
    name it); `activation` is what vLLM's FusedMoE layer was built with."""
    limit = getattr(hf_config, "swiglu_limit", None)
    return activation_spec(activation, clamp=None if limit is None else float(limit))
