"""Per-worker state of the megamoe backend: settings, path choice, the one SymmBuffer.

A vLLM worker process runs every MoE layer of its model through one `SymmBuffer`, sized for the
largest layer and for vLLM's max batched tokens per rank. Layers register here when their weights
are converted; `ensure_buffer()` allocates the buffer once all layers are known (vLLM's loader
hook calls it right after weight post-processing, before profiling and CUDA-graph capture).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import ops
from ..buffer import SymmBuffer
from ..errors import UnsupportedError
from ..shape import MoEShape
from ..settings import Settings, load_settings

# Under the "vllm" logger tree so the lines show in vLLM's log format and level.
logger = logging.getLogger("vllm.plugins.megamoe")

@dataclass
class LayerInfo:
    name: str
    shape: MoEShape          # global view: num_experts counts every rank's experts
    format: str
    device: torch.device
    group: Any               # torch ProcessGroup over the EP ranks, or None
    ep_rank: int
    ep_size: int


@dataclass
class WorkerState:
    settings: Optional[Settings] = None
    max_num_batched_tokens: Optional[int] = None
    checkpoint_marker: Optional[dict] = None
    layers: list = field(default_factory=list)
    paths: dict = field(default_factory=dict)     # (shape, fmt, device) -> (path, reason)
    buffer: Optional[SymmBuffer] = None
    sm100_buffers: dict = field(default_factory=dict)  # BufferSpec -> sm100.buffer.Sm100Buffer
    buffer_tokens: int = 0
    hf_config: Any = None


STATE = WorkerState()


def settings() -> Settings:
    if STATE.settings is None:
        STATE.settings = load_settings()
    return STATE.settings


def note_vllm_config(vllm_config) -> None:
    """Remember what the worker needs later (called while the model is built)."""
    if vllm_config is None:
        return
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is not None and getattr(sched, "max_num_batched_tokens", None):
        STATE.max_num_batched_tokens = int(sched.max_num_batched_tokens)
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    STATE.hf_config = hf_config
    marker = getattr(hf_config, "megamoe", None)
    STATE.checkpoint_marker = parse_checkpoint_marker(marker) if marker is not None else None


def parse_checkpoint_marker(marker: Any) -> dict:
    """Validate config.json["megamoe"] of an offline-converted checkpoint (the converter's own
    reader), adding the ExpertWeights layout its expert tensors are stored in."""
    from ..convert.marker import read_megamoe_marker
    marker = read_megamoe_marker({"megamoe": marker})
    if marker["arch"] != "sm90":
        raise ValueError(
            f"this checkpoint was converted by `vllm-megamoe convert` for arch={marker['arch']!r} "
            f"({marker['format']}), which the vLLM plugin cannot load yet; convert the original "
            "checkpoint with --arch sm90, or serve the original (unconverted) checkpoint")
    return dict(marker, layout="interleaved")


def choose_path(shape: MoEShape, fmt: str, device: torch.device, num_ranks: int = 1) -> tuple[str, str]:
    """(path, reason) for a layer; applies the `fallback` setting. Cached per shape."""
    key = (shape, fmt, str(device))
    if key not in STATE.paths:
        settings()  # validates the tunables and exports file values the core reads
        path, reason = ops.select_path(shape, fmt, device, num_ranks)
        if device.type == "cuda" and path == "portable" and settings().fallback == "error":
            raise UnsupportedError(
                f"megamoe has no kernel for this layer on this GPU ({reason}) and "
                "VLLM_MEGAMOE_FALLBACK=error; set fallback to 'portable' to run the portable path")
        STATE.paths[key] = (path, reason)
    return STATE.paths[key]


def register_layer(info: LayerInfo) -> None:
    if STATE.buffer is not None and not _fits(info):
        raise RuntimeError(
            f"megamoe layer {info.name} ({info.shape}, {info.format}) was set up after the "
            f"worker's SymmBuffer ({STATE.buffer.layout.shape}) and does not fit it")
    STATE.layers.append(info)


def _fits(info: LayerInfo) -> bool:
    lay = STATE.buffer.layout
    return (info.shape.fits_in(lay.shape) and info.format == lay.format
            and info.shape.num_experts // info.ep_size
            == lay.shape.num_experts // STATE.buffer.num_ranks)


def max_tokens_per_rank() -> int:
    configured = settings().max_tokens_per_rank
    if configured is not None:
        return configured
    if STATE.max_num_batched_tokens is None:
        raise RuntimeError("megamoe: vLLM's max_num_batched_tokens is unknown in this process; "
                           "set VLLM_MEGAMOE_MAX_TOKENS_PER_RANK")
    return STATE.max_num_batched_tokens


def ensure_buffer() -> Optional[SymmBuffer]:
    """Allocate the worker's SymmBuffer for every registered layer (once); return it."""
    if STATE.buffer is not None or STATE.sm100_buffers or not STATE.layers:
        return STATE.buffer
    first = STATE.layers[0]
    for info in STATE.layers[1:]:
        if (info.format, info.group, info.device, info.ep_size) != (
                first.format, first.group, first.device, first.ep_size):
            raise RuntimeError(
                f"megamoe: layers {first.name} and {info.name} differ in format, device or EP "
                "group; one worker serves one model format on one EP group")
    tokens = max_tokens_per_rank()
    if all(_layer_path(i)[0] == "sm100" for i in STATE.layers):
        return _ensure_sm100_buffers(first, tokens)
    shape = MoEShape.covering(i.shape for i in STATE.layers)
    buf = SymmBuffer(shape, tokens, first.group, format=first.format, device=first.device,
                     timeout_s=settings().timeout_s)
    if buf.rank != first.ep_rank:
        buf.destroy()
        raise RuntimeError(
            f"megamoe: rank {buf.rank} in the EP group is vLLM's EP rank {first.ep_rank}; the "
            "buffer needs the group's rank order to match vLLM's expert placement")
    STATE.buffer, STATE.buffer_tokens = buf, tokens
    paths = sorted({_layer_path(i) for i in STATE.layers})
    why = "; ".join(f"{p}: {r}" for p, r in paths)
    logger.info(
        "megamoe: EP rank %d/%d runs the %s path for %d MoE layers (%s); format %s; SymmBuffer "
        "%s on %s: %.2f MiB for max_tokens_per_rank=%d, shape %s",
        buf.rank, buf.num_ranks, "+".join(p for p, _ in paths), len(STATE.layers), why,
        first.format, buf.backend, first.device, buf.layout.total_bytes / 2**20, tokens, shape)
    if any(p == "sm90" for p, _ in paths):
        from ..kernels import sm90_tuning
        builds = sorted({c.label() for i in STATE.layers
                         for c in sm90_tuning.choices(i.shape, first.format, buf.num_ranks)})
        logger.info("megamoe: SM90 kernel builds (mainloop/stages/token tile) for these layers: %s; tuning "
                    "table %s", ", ".join(builds), sm90_tuning.table_path() or "none (heuristic)")
        logger.info("megamoe: to compile them before the server starts (no GPU needed; same VLLM_MEGAMOE_* "
                    "settings and cache_dir): %s", precompile_command(buf))
    return buf


def precompile_command(buf: SymmBuffer) -> str:
    """The `vllm-megamoe precompile` command line that compiles every SM90 build the registered
    layers that run the SM90 path load on `buf` (sm90_mega_moe.layer_kernel_specs)."""
    shapes = sorted({i.shape for i in STATE.layers if _layer_path(i)[0] == "sm90"}, key=MoEShape.spec)
    covering = MoEShape.covering(shapes) if shapes else None
    return ("vllm-megamoe precompile " + " ".join(f"--shape {s.spec()}" for s in shapes)
            + f" --format {buf.layout.format} --ep-size {buf.num_ranks}"
            + (f" --buffer-shape {buf.layout.shape.spec()}" if buf.layout.shape != covering else "")
            + f" --max-tokens-per-rank {buf.layout.max_tokens_per_rank}")


def _layer_path(info: LayerInfo) -> tuple:
    """(path, reason) choose_path gave the registered layer `info`."""
    return STATE.paths[(info.shape, _path_format(info), str(info.device))]


def _path_format(info: LayerInfo) -> str:
    """The checkpoint format the path was chosen for (SM100 layers register their mma type)."""
    return {"fp8xfp4": "fp8-block", "bf16xbf16": "bf16"}.get(info.format, info.format)


def _ensure_sm100_buffers(first: LayerInfo, tokens: int):
    """DeepGEMM SymmBuffers for the SM100 path: one per distinct layer spec, sharing memory."""
    from ..sm100.buffer import BufferSpec, create_worker_buffers
    from ..sm100.discovery import require_deep_gemm
    specs = [BufferSpec.of(i.shape, i.format, tokens) for i in STATE.layers]
    STATE.sm100_buffers = create_worker_buffers(require_deep_gemm(), first.group, specs)
    STATE.buffer_tokens = tokens
    logger.info("megamoe: EP rank %d/%d runs the sm100 path (DeepGEMM) for %d MoE layers; %d buffer "
                "spec(s) for max_tokens_per_rank=%d", first.ep_rank, first.ep_size, len(STATE.layers),
                len(STATE.sm100_buffers), tokens)
    return None


def sm100_buffer(shape: MoEShape, mma_type: str):
    from ..sm100.buffer import BufferSpec
    spec = BufferSpec.of(shape, mma_type, STATE.buffer_tokens)
    if spec not in STATE.sm100_buffers:
        raise RuntimeError(f"megamoe: no SM100 buffer for {spec}; the worker's buffers were made "
                           "before this layer was set up")
    return STATE.sm100_buffers[spec]


def buffer() -> SymmBuffer:
    buf = STATE.buffer if STATE.buffer is not None else ensure_buffer()
    if buf is None:
        raise RuntimeError("megamoe: no MoE layer was set up in this worker")
    return buf


def reset() -> None:
    """Drop the buffer and every registered layer (tests; a worker never needs it)."""
    if STATE.buffer is not None:
        STATE.buffer.destroy()
    for buf in STATE.sm100_buffers.values():
        buf.destroy()
    STATE.sm100_buffers = {}
    STATE.buffer = None
    STATE.layers.clear()
    STATE.paths.clear()
    STATE.settings = None
