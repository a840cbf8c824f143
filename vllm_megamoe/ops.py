"""The op users call, and the oracle that picks which implementation runs it.

Paths: "sm90" (our compiled Hopper mega kernel), "sm100" (DeepGEMM's Blackwell kernel),
"portable" (torch ops; any device). `select_path` says which one would run and why; setting
VLLM_MEGAMOE_PATH=portable|sm90|sm100 forces one (an impossible choice is an error).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

from . import portable, transforms
from .buffer import SymmBuffer
from .errors import UnsupportedError
from .settings import setting
from .shape import MoEShape, require
from .weights import ExpertWeights, transform_weights_for_mega_moe

logger = logging.getLogger(__name__)

PATHS = ("portable", "sm90", "sm100")


def select_path(shape: MoEShape, fmt: str, device, num_ranks: int = 1) -> tuple[str, str]:
    """(path, reason) for a layer of `shape` in format `fmt` on `device` with `num_ranks` EP ranks."""
    device = torch.device(device)
    forced = setting("path")  # auto | portable | sm90 | sm100; a bad value is a ValueError naming it
    if device.type != "cuda":
        if forced not in ("auto", "portable"):
            raise UnsupportedError(f"VLLM_MEGAMOE_PATH={forced} needs a CUDA GPU; device is {device}")
        return "portable", f"device {device} is not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm{major}{minor}"
    if forced == "portable":
        return "portable", "forced by VLLM_MEGAMOE_PATH=portable"
    if major == 9:
        from .kernels import sm90_mega_moe
        ok, why = sm90_mega_moe.supports(shape, fmt, num_ranks)
        if ok:
            return "sm90", f"{arch} GPU, format {fmt}: fused SM90 mega kernel"
        if forced == "sm90":
            raise UnsupportedError(f"VLLM_MEGAMOE_PATH=sm90 but the SM90 kernel cannot run this layer: {why}")
        return "portable", f"{arch} GPU but the SM90 kernel cannot run this layer: {why}"
    if major == 10:
        from .sm100 import path as sm100_path
        return sm100_path.select(shape, fmt, num_ranks, forced, arch)
    if forced != "auto":
        raise UnsupportedError(f"VLLM_MEGAMOE_PATH={forced} cannot run on {arch}")
    return "portable", f"{arch} GPU has no megamoe kernel (SM90 and SM100 only)"


# Weight layout each path reads.
PATH_LAYOUT = {"portable": "checkpoint", "sm90": "interleaved"}


def prepare_weights(weights: ExpertWeights, path: str, device=None) -> ExpertWeights:
    """The weights in the layout `path` reads (load-time conversion); returned unchanged when
    they already are, so weights converted offline for this path are never converted again.
    The portable path on the CPU reads either layout (it multiplies dequantized float weights);
    `device` (default: where the weights are) decides that."""
    require(path in PATH_LAYOUT, f"path {path!r} takes its own weight class (see vllm_megamoe.sm100); "
            f"prepare_weights handles {sorted(PATH_LAYOUT)}")
    want = PATH_LAYOUT[path]
    device = torch.device(device) if device is not None else weights.w13.device
    if weights.layout == want or (path == "portable" and device.type == "cpu"):
        return weights
    if want == "checkpoint":
        # Converted for a kernel, but the portable path runs here: undo the gate/up interleave
        # (on the raw bytes, which works for every weight dtype).
        w13 = transforms.deinterleave_gate_up(weights.w13.view(torch.uint8)).view(weights.w13.dtype)
        logger.warning("megamoe: weights are in the %s kernel layout but the portable path runs; "
                       "undoing the gate/up interleave", weights.layout)
        return replace(weights, w13=w13, layout="checkpoint")
    return transform_weights_for_mega_moe(weights, path)


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             weights: ExpertWeights, buffer: SymmBuffer, *,
             activation_clamp: Optional[float] = None, path: Optional[str] = None) -> torch.Tensor:
    """One expert-parallel MoE layer on this rank; a collective over `buffer`'s group.

    x [T, H] bf16; topk_idx [T, K] global expert ids (-1 masks a route); topk_weights [T, K]
    float32; weights: this rank's experts (rank r owns experts [r*El, (r+1)*El)); returns
    y [T, H] bf16 = sum_k topk_weights[:, k] * expert(x). Every rank must call it the same
    number of times, T may differ per rank and may be 0.
    """
    if path is None:
        shape = MoEShape(x.shape[-1], weights.intermediate, weights.num_experts * buffer.num_ranks,
                         topk_idx.shape[-1])
        path, _ = select_path(shape, weights.format, x.device, buffer.num_ranks)
    require(path in PATHS, f"path={path!r} must be one of {PATHS}")
    if path == "portable":
        return portable.mega_moe(x, topk_idx, topk_weights, weights, buffer,
                                 activation_clamp=activation_clamp)
    if path == "sm90":
        from .kernels import sm90_mega_moe
        return sm90_mega_moe.mega_moe(x, topk_idx, topk_weights, weights, buffer,
                                      activation_clamp=activation_clamp)
    if path == "sm100":
        from .sm100 import op as sm100_op
        return sm100_op.mega_moe(x, topk_idx, topk_weights, weights, buffer,
                                 activation_clamp=activation_clamp)
    raise UnsupportedError(f"path {path!r} is not available in this version")
