"""Python side of the fused SM90 mega MoE kernel (csrc/sm90/mega_moe_kernel.cu).

One launch per layer and rank does staging, dispatch over NVLink, both expert GEMMs with
SwiGLU, and the combine. Shapes, top-k, ranks and the buffer layout are compile-time constants
(`-D` defines from BufferLayout.c_defines()), so each layer shape compiles once and is cached.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..buffer import SymmBuffer
from ..layout import NVL_ARRIVED_RANKS
from ..shape import MoEShape, check_tensor, require
from ..weights import ExpertWeights, derived, transform_weights_for_mega_moe
from . import error_record, jit, sm90_tuning
from .phase_clock import TRACE_TASK as DEFAULT_TRACE_TASK
from .sm90_smem import (SMEM_PER_BLOCK, TILE_ROWS, _smem_bytes, epilogue_tables_in_mainloop, has_epilogue_warpgroup,
                        mainloop_smem_bytes, static_smem_bytes)
from .sm90_tuning import Choice

SOURCE = "sm90/mega_moe_kernel.cu"

ENTRY = "megamoe_sm90_fused"
NUM_THREADS = 256  # two MMA warpgroups; builds with an epilogue warpgroup: EPILOGUE_WARPGROUP_THREADS
EPILOGUE_WARPGROUP_THREADS = 384
MAX_RANKS = NVL_ARRIVED_RANKS  # one arrival word per source rank and NVLink barrier (layout)
MAX_LOCAL_EXPERTS = 512
# One mainloop (csrc/sm90/mega/mainloop_smem.cuh): wgmma stages filled by TMA box copies on
# per-stage mbarriers. Which stages and token tile a call runs: sm90_tuning.choose.
logger = logging.getLogger(__name__)


class _Params(ctypes.Structure):
    """Mirror of megamoe::mega::Params (csrc/sm90/mega/params.cuh), field for field."""

    _fields_ = [("x", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p), ("topk_weights", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("w13", ctypes.c_void_p), ("w13_scale", ctypes.c_void_p),
                ("w2", ctypes.c_void_p), ("w2_scale", ctypes.c_void_p), ("error_record", ctypes.c_void_p),
                ("phase_clock", ctypes.c_void_p),
                ("peers", ctypes.c_void_p * MAX_RANKS), ("timeout_ns", ctypes.c_uint64),
                ("num_tokens", ctypes.c_int), ("rank", ctypes.c_int), ("has_clamp", ctypes.c_int),
                ("clamp", ctypes.c_float), ("topk_idx_int64", ctypes.c_int), ("weights_evict_first", ctypes.c_int)]


def supports(shape: MoEShape, fmt: str, num_ranks: int) -> tuple[bool, str]:
    """Whether this kernel handles the layer, and if not, why (for the path oracle's log line)."""
    ok, why = supports_layer(shape, fmt, num_ranks)
    if not ok:
        return ok, why
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False, "cuda-python is not installed (pip install 'vllm-megamoe[cuda]')"
    return True, "supported"


def supports_layer(shape: MoEShape, fmt: str, num_ranks: int) -> tuple[bool, str]:
    """supports() without the driver bindings: whether the kernel builds for this layer."""
    el = shape.num_experts // max(num_ranks, 1)
    checks = [
        (shape.hidden % TILE_ROWS == 0, f"hidden={shape.hidden} is not a multiple of {TILE_ROWS}"),
        (shape.intermediate % 128 == 0, f"intermediate={shape.intermediate} is not a multiple of 128"),
        (num_ranks <= MAX_RANKS, f"{num_ranks} ranks (the kernel addresses at most {MAX_RANKS})"),
        (el <= MAX_LOCAL_EXPERTS, f"{el} local experts (at most {MAX_LOCAL_EXPERTS})"),
        (fmt in ("fp8-block", "bf16"), f"format {fmt!r}"),
    ]
    for ok, why in checks:
        if not ok:
            return False, why
    return True, "supported"


# Profiling only: BuildOptions.ablate is a '+'-joined subset of these names (benchmarks/kernel_probe.py
# `ablate=`), a build that drops that part of the GEMM mainloop (MEGAMOE_ABLATE,
# csrc/sm90/mega/config.cuh) so the probe can time what is left: token_rows: every token box reads
# the first staging rows; weight_rows: every weight box reads expert 0's rows; tma: no copies at
# all, the math runs on stale stages; tma_warm: only each CTA's first S chunks are copied, later
# chunks compute on those real bytes; narrow: every task of an FP8 64-token build computes only its
# first 32 token columns; half_rows: each warpgroup's second m64 wgmma group is never issued;
# epilogue: the epilogue warpgroup takes each hand-off and computes and stores nothing, builds
# without one skip their epilogues; keep_padding: the FP8 register-token loops compute the token
# box's padding rows on the bytes it read instead of zeros (outputs right, the A/B of the zeroing);
# stores / transpose: the FP8 128-token epilogues that store from the registers compute every value
# but store no row / store without their quad transposes (what the stores and the shuffles cost);
# task_scales: FP8 tasks past a CTA's first of a phase skip loading their scale tables (what that
# load costs at each task's start). Its outputs are wrong (but with keep_padding alone); the op logs
# a warning with every such build.
ABLATIONS = {"promotion": 1, "mma": 2, "token_rows": 4, "weight_rows": 8, "tma": 16, "tma_warm": 32, "narrow": 64,
             "half_rows": 128, "epilogue": 256, "keep_padding": 512, "stores": 1024, "transpose": 2048,
             "task_scales": 4096}
ABLATIONS_WITH_RIGHT_OUTPUTS = ABLATIONS["keep_padding"]


def parse_ablation(raw: str) -> int:
    """'mma+tma' -> the MEGAMOE_ABLATE bits of those ablations ('' -> 0)."""
    if not raw:
        return 0
    parts = raw.split("+")
    require(all(part in ABLATIONS for part in parts),
            f"ablate={raw!r} must be empty or a '+'-joined subset of {sorted(ABLATIONS)}")
    return sum(ABLATIONS[part] for part in set(parts))


@dataclass(frozen=True)
class BuildOptions:
    """Development switches of a build, chosen by the caller (benchmarks/kernel_probe.py and the
    GPU tests pass them to mega_moe / kernel_spec / load_kernel / grid_size); the serving path
    always runs SERVING, the defaults, and no environment variable changes them.

    ablate: MEGAMOE_ABLATE bits (parse_ablation; profiling, outputs wrong but for keep_padding).
    chunk_trace: the FP8 K loop records clock values inside a few K chunks of one L1 task per CTA,
      and the task trace, into the phase clock (kernels.phase_clock.chunk_trace / task_trace;
      MEGAMOE_CHUNK_TRACE in csrc/sm90/mega/phase_clock.cuh); outputs right, the traced chunks a
      little slower. trace_task: which of a CTA's L1 tasks it traces, counted from 0 (default
      phase_clock.TRACE_TASK, 2: past the first tasks' start-up at prefill; 0 at a few tokens per
      rank, where a CTA runs one L1 task).
    epilogue_warpgroup: False builds the 32- and 64-token tiles without their epilogue warpgroup
      (the epilogues on the MMA warpgroups; an A/B, and what a source tree from before it needs).
    epilogue_warpgroup_128: True gives the 128-token builds an epilogue warpgroup where its 64 KB
      tile fits beside 3 stages (Qwen3-30B-A3B-like layers; an A/B: 1.01-1.06x the time on one H200).
    weights_evict_first: None (serving: the 32-token builds, calls of a few tokens per rank,
      sm90_tuning.weights_evict_first_*), True / False: every build and call copies the weights with
      an L2 evict-first policy / none does (an A/B).
    """
    ablate: int = 0
    chunk_trace: bool = False
    trace_task: int = DEFAULT_TRACE_TASK
    epilogue_warpgroup: bool = True
    epilogue_warpgroup_128: bool = False
    weights_evict_first: Optional[bool] = None

    def __post_init__(self):
        require(0 <= self.ablate < 2 * max(ABLATIONS.values()), f"ablate={self.ablate} is not a set of ABLATIONS bits")
        require(self.trace_task >= 0, f"trace_task={self.trace_task} must be 0 or more")

    def epilogue_wg(self, tile: int, shape: MoEShape, num_ranks: int) -> bool:
        return has_epilogue_warpgroup(tile, shape, num_ranks, enabled=self.epilogue_warpgroup,
                                      enabled_128=self.epilogue_warpgroup_128)


SERVING = BuildOptions()


def _fitted(shape: MoEShape, num_ranks: int, choice: Choice, options: BuildOptions) -> Choice:
    """`choice` for a development build whose epilogue warpgroup differs from the serving build's:
    as many stages as fit with it (sm90_tuning sizes the serving builds), unless
    VLLM_MEGAMOE_SM90_STAGES forces the depth (then the op's shared-memory error says why)."""
    if options == SERVING or "stages" in sm90_tuning.env_overrides():
        return choice
    wg = options.epilogue_wg(choice.tile, shape, num_ranks)
    stages = choice.stages
    while stages > 2 and (_smem_bytes(shape, num_ranks, stages, choice.tile, wg) > SMEM_PER_BLOCK):
        stages -= 1
    return Choice(stages, choice.tile)


def kernel_spec(shape: MoEShape, buffer: SymmBuffer, choice: Optional[Choice] = None,
                options: BuildOptions = SERVING) -> jit.KernelSpec:
    """The compiled build of `choice` (default: the layer's first, sm90_tuning.choices) for
    `shape` on `buffer` with the development `options` (cached on the buffer: the op asks for it
    on every call)."""
    fmt, ranks = buffer.layout.format, buffer.layout.num_ranks
    choice = _fitted(shape, ranks, choice or sm90_tuning.choices(shape, fmt, ranks)[0], options)
    # VLLM_MEGAMOE_CSRC_DIR: another source tree is another build (the raw value keys the cache,
    # so the per-call lookup resolves no path)
    key = (shape, choice, options, os.environ.get("VLLM_MEGAMOE_CSRC_DIR"))
    cache = buffer.__dict__.setdefault("_sm90_specs", {})
    if key not in cache:
        cache[key] = _make_spec(shape, buffer.layout, choice, options, jit.csrc_override())
    return cache[key]


def layer_kernel_specs(shapes, fmt: str, num_ranks: int, max_tokens_per_rank: int,
                       buffer_shape: Optional[MoEShape] = None, options: BuildOptions = SERVING) -> list[jit.KernelSpec]:
    """Every build the op may load for layers of `shapes` served by one buffer of `num_ranks` ranks
    and `max_tokens_per_rank` (of `buffer_shape`, by default the smallest that covers every shape, as
    the plugin's worker buffer does): what `load_kernel` compiles at each layer's first call, under
    the same VLLM_MEGAMOE_* settings (`options`: a probe's development builds). Needs no GPU;
    `vllm-megamoe precompile` compiles them."""
    from ..layout import BufferLayout
    shapes = list(dict.fromkeys(shapes))
    buffer_shape = buffer_shape or MoEShape.covering(shapes)
    for shape in shapes:  # what the op refuses at a call (portable.validate_call)
        mismatch = shape.buffer_mismatch(buffer_shape, num_ranks)
        require(mismatch is None, mismatch)
    layout = BufferLayout(buffer_shape, num_ranks, max_tokens_per_rank, fmt)
    specs = []
    for shape in shapes:
        shape.validate(num_ranks)
        ok, why = supports_layer(shape, fmt, num_ranks)
        require(ok, f"the SM90 kernel does not run layer {shape.spec()}: {why}")
        specs += [_make_spec(shape, layout, _fitted(shape, num_ranks, choice, options), options, jit.csrc_override())
                  for choice in sm90_tuning.choices(shape, fmt, num_ranks)]
    return list(dict.fromkeys(specs))


def _make_spec(shape: MoEShape, layout, choice: Choice, options: BuildOptions = SERVING,
               csrc: str = "") -> jit.KernelSpec:
    """The build of `choice` for layer `shape` on a buffer of `layout` (layout.BufferLayout)."""
    fmt, ranks = layout.format, layout.num_ranks
    require(sm90_tuning.tile_supported(fmt, choice.tile, choice.stages),
            f"FP8 128-token tiles need {sm90_tuning.FP8_TILE128_MIN_STAGES} or more stages (not {choice.stages}: "
            "the register-token K loop keeps one chunk's wgmmas in flight); set VLLM_MEGAMOE_SM90_STAGES to "
            f"{sm90_tuning.FP8_TILE128_MIN_STAGES} or more, or VLLM_MEGAMOE_SM90_TOKEN_TILE to 32, 64 or auto")
    defines = layout.c_defines()
    defines.update(MEGAMOE_NUM_EXPERTS=shape.num_experts, MEGAMOE_HIDDEN=shape.hidden,
                   MEGAMOE_INTERMEDIATE=shape.intermediate, MEGAMOE_TOPK=shape.topk,
                   MEGAMOE_FP8=int(fmt == "fp8-block"),
                   MEGAMOE_TILE_TOKENS=choice.tile)
    epilogue_wg = options.epilogue_wg(choice.tile, shape, ranks)
    smem = mainloop_smem_bytes(shape, choice.stages, choice.tile)
    static = static_smem_bytes(shape.experts_per_rank(ranks), ranks, choice.tile,
                               epilogue_tables_in_mainloop(shape, choice.tile), epilogue_wg)
    require(smem + static <= SMEM_PER_BLOCK,
            f"{choice.stages} stages need {smem} + {static} bytes of shared memory for hidden={shape.hidden} at "
            f"{choice.tile}-token tiles (an SM90 CTA has {SMEM_PER_BLOCK}); use fewer stages "
            "(VLLM_MEGAMOE_SM90_STAGES or the tuning table), or with a forced stage count a smaller token tile "
            "(VLLM_MEGAMOE_SM90_TOKEN_TILE: a layer loads every tile it may run)")
    defines.update(MEGAMOE_MAINLOOP_STAGES=choice.stages, MEGAMOE_MAINLOOP_SMEM_BYTES=smem)
    if epilogue_wg:
        defines.update(MEGAMOE_EPILOGUE_WARPGROUP=1)
    if sm90_tuning.weights_evict_first_build(choice.tile, options.weights_evict_first):
        defines.update(MEGAMOE_WEIGHTS_EVICT_FIRST=1)
    if options.ablate:
        logger.warning("ablate=%s: profiling build, %s", options.ablate,
                       "its outputs are right (an A/B build)" if not options.ablate & ~ABLATIONS_WITH_RIGHT_OUTPUTS
                       else "its outputs are wrong")
        defines.update(MEGAMOE_ABLATE=options.ablate)
    if options.chunk_trace:
        logger.warning("chunk trace: profiling build, it writes clock values inside the K loop "
                       "when called with a phase clock")
        defines.update(MEGAMOE_CHUNK_TRACE=1, MEGAMOE_TRACE_TASK=options.trace_task)
    return jit.KernelSpec.make(SOURCE, ENTRY, defines, csrc=csrc)


def describe_spec(spec: jit.KernelSpec) -> str:
    """One line naming a build of this kernel: layer shape, format, EP size, buffer tokens per rank,
    mainloop / stages / token tile (sm90_tuning.Choice.label) and its other switches."""
    d = spec.define
    extras = [name for name, define in (("epilogue warpgroup", "MEGAMOE_EPILOGUE_WARPGROUP"),
                                        ("evict-first weights", "MEGAMOE_WEIGHTS_EVICT_FIRST"),
                                        ("chunk trace", "MEGAMOE_CHUNK_TRACE")) if d(define) == "1"]
    if d("MEGAMOE_ABLATE"):
        extras.append(f"ablate={d('MEGAMOE_ABLATE')}")
    return (f"{d('MEGAMOE_HIDDEN')}x{d('MEGAMOE_INTERMEDIATE')}x{d('MEGAMOE_NUM_EXPERTS')}x{d('MEGAMOE_TOPK')} "
            f"{'fp8-block' if d('MEGAMOE_FP8') == '1' else 'bf16'} EP{d('MEGAMOE_NUM_RANKS')} "
            f"T={d('MEGAMOE_MAX_TOKENS')} {sm90_tuning.MAINLOOP}/{d('MEGAMOE_MAINLOOP_STAGES', '-')}/{d('MEGAMOE_TILE_TOKENS')}"
            + "".join(f", {e}" for e in extras))


def dynamic_smem_bytes(spec: jit.KernelSpec) -> int:
    return int(spec.define("MEGAMOE_MAINLOOP_SMEM_BYTES", "0"))


def threads_per_cta(spec: jit.KernelSpec) -> int:
    """The build's CTA size: 384 with an epilogue warpgroup, else 256 (its __launch_bounds__)."""
    return EPILOGUE_WARPGROUP_THREADS if spec.define("MEGAMOE_EPILOGUE_WARPGROUP") == "1" else NUM_THREADS


def _grid_size(device_index: int, spec: jit.KernelSpec) -> int:
    """CTAs that are guaranteed co-resident: SMs x resident CTAs per SM, capped by the user."""
    return _grid_size_for(device_index, spec, os.environ.get("VLLM_MEGAMOE_NUM_SMS"))


@functools.lru_cache(maxsize=None)
def _grid_size_for(device_index: int, spec: jit.KernelSpec, num_sms: Optional[str]) -> int:
    kernel = jit.get_kernel(spec, device_index)
    driver = jit._driver()
    smem = dynamic_smem_bytes(spec)
    if smem:
        jit.check_driver(driver.cuFuncSetAttribute(
            kernel.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
            "cuFuncSetAttribute(max dynamic shared memory)")
    per_sm = jit.check_driver(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, threads_per_cta(spec), smem),
                              "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    if per_sm < 1:
        raise RuntimeError("the SM90 mega kernel cannot fit one CTA on an SM (registers or shared memory)")
    require(num_sms is None or num_sms.isdigit(), f"VLLM_MEGAMOE_NUM_SMS={num_sms!r} must be a positive integer")
    wanted = int(num_sms) if num_sms is not None else sms
    require(1 <= wanted <= sms * per_sm,
            f"VLLM_MEGAMOE_NUM_SMS={wanted} must be in [1, {sms * per_sm}] (co-resident CTAs on this GPU)")
    return wanted


def load_kernel(shape: MoEShape, buffer: SymmBuffer, options: BuildOptions = SERVING) -> None:
    """Compile (or load from the disk cache) every build a call of `shape` on `buffer` may run
    (sm90_tuning.choices) and wait until every rank of the buffer's group has them: a collective,
    like the first call of mega_moe, which does the same. The wait keeps compile-time skew between
    ranks out of the kernel's barrier timeout; all builds come first because ranks with different
    token counts may pick different ones. Call it on every rank before capturing a CUDA graph."""
    choices = tuple(sm90_tuning.choices(shape, buffer.layout.format, buffer.layout.num_ranks))
    loaded = buffer.__dict__.setdefault("_sm90_loaded", set())
    if (shape, choices, options) in loaded:
        return
    for choice in choices:
        jit.get_kernel(kernel_spec(shape, buffer, choice, options), buffer.device.index or 0)
    if buffer.group is not None and buffer.num_ranks > 1:
        require(not torch.cuda.is_current_stream_capturing(),
                "warm up the SM90 mega kernel (one call per shape) before capturing a CUDA graph")
        torch.distributed.barrier(group=buffer.group)
    loaded.add((shape, choices, options))


def grid_size(shape: MoEShape, buffer: SymmBuffer, options: BuildOptions = SERVING) -> int:
    """CTAs of one launch for this layer on this buffer (compiles the variant if needed; the
    same for every tile choice: one CTA per SM)."""
    return _grid_size(buffer.device.index or 0, kernel_spec(shape, buffer, None, options))


def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
    """Kernel-layout weights (gate/up interleaved), cached on the weights object."""
    if weights.layout == "interleaved":
        return weights
    return derived(weights, "sm90_layout", lambda: transform_weights_for_mega_moe(weights, "sm90"))


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
             buffer: SymmBuffer, *, activation_clamp: Optional[float] = None,
             y: Optional[torch.Tensor] = None, phase_clock: Optional[torch.Tensor] = None,
             options: BuildOptions = SERVING) -> torch.Tensor:
    """The fused kernel for one layer on this rank (a collective; see ops.mega_moe).

    phase_clock: optional int64 [CTAs, phase_clock.columns(trace)] tensor (kernels.phase_clock)
    that receives every CTA's phase timestamps (trace: an options.chunk_trace build, whose rows
    also hold the chunk trace); grid_size(shape, buffer, options) gives the CTA count.
    options: development builds (BuildOptions; benchmarks/kernel_probe.py), SERVING otherwise."""
    from ..portable import validate_call
    shape = validate_call(x, topk_idx, topk_weights, weights, buffer, activation_clamp)
    ok, why = supports(shape, weights.format, buffer.num_ranks)
    require(ok, f"the SM90 mega kernel does not support this layer: {why}")
    require(x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9,
            f"the SM90 mega kernel needs a Hopper GPU; x is on {x.device}")
    require(buffer.backend in ("cuda", "cuda-ipc", "local") and buffer.device == x.device,
            f"the SymmBuffer must live on {x.device} (it is a {buffer.backend!r} buffer on {buffer.device})")
    kw = prepare_weights(weights)
    x = x.to(torch.bfloat16).contiguous()
    if x.data_ptr() % 16:  # the kernel loads x in 16-byte vectors; a view at an odd offset is copied
        x = x.clone()
    # int32 and int64 ids are read as they come (no conversion kernel before the launch)
    idx = topk_idx.contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    t = x.shape[0]
    if y is None:
        y = torch.empty(t, shape.hidden, dtype=torch.bfloat16, device=x.device)
    check_tensor("y", y, dtype=torch.bfloat16, shape=(t, shape.hidden), contiguous=True)
    require(y.data_ptr() % 16 == 0, f"y must start on a 16-byte boundary (the kernel stores 16-byte vectors); "
            f"its address is {y.data_ptr():#x}: pass a freshly allocated tensor or a view at a multiple of 8 elements")
    load_kernel(shape, buffer, options)  # once per shape and set of builds: compile all, then one collective
    choice = sm90_tuning.choose(shape, buffer.layout.format, buffer.num_ranks, t)
    spec = kernel_spec(shape, buffer, choice, options)
    dev = x.device.index
    kernel = jit.get_kernel(spec, dev)
    params = _Params()
    params.x, params.topk_idx, params.topk_weights, params.y = (
        x.data_ptr(), idx.data_ptr(), tw.data_ptr(), y.data_ptr())
    params.w13, params.w2 = kw.w13.data_ptr(), kw.w2.data_ptr()
    if kw.format == "fp8-block":
        params.w13_scale, params.w2_scale = kw.w13_scale.data_ptr(), kw.w2_scale.data_ptr()
    params.error_record = error_record.record_for(x.device).data_ptr()
    if phase_clock is not None:
        from .phase_clock import columns
        grid = _grid_size(dev, spec)
        traced = spec.define("MEGAMOE_CHUNK_TRACE") == "1"
        check_tensor("phase_clock", phase_clock, dtype=torch.int64, shape=(grid, columns(traced)), contiguous=True)
        require(phase_clock.device == x.device, f"phase_clock must be on {x.device}")
        params.phase_clock = phase_clock.data_ptr()
    for r, ptr in enumerate(buffer.buffer_ptrs):
        params.peers[r] = ptr
    params.timeout_ns = int(buffer.timeout_s * 1e9)
    params.num_tokens, params.rank = t, buffer.rank
    params.topk_idx_int64 = int(idx.dtype == torch.int64)
    params.weights_evict_first = int(spec.define("MEGAMOE_WEIGHTS_EVICT_FIRST") == "1"
                                     and sm90_tuning.weights_evict_first_call(t, shape, buffer.layout.format, buffer.num_ranks,
                                                                              options.weights_evict_first))
    params.has_clamp = int(activation_clamp is not None)
    params.clamp = float(activation_clamp) if activation_clamp is not None else 0.0
    maps = tma_maps(kw, buffer, choice.tile)
    kernel.launch(_grid_size(dev, spec), threads_per_cta(spec), dynamic_smem_bytes(spec),
                  torch.cuda.current_stream(x.device).cuda_stream, [params, *maps])
    return y


def tma_maps(weights: ExpertWeights, buffer: SymmBuffer, tile: int) -> list:
    """TMA tensor maps of the mainloop (kernel parameters after Params): w13 [El, 2I, H] and w2 [El, H, I] with 128-byte x
    256-row boxes (cached on the weights), staging_l1 [S, H] and staging_l2 [S, I] with 128-byte x
    `tile`-row boxes (cached on the buffer); all with the 128-byte swizzle of the wgmma stages."""
    from .tma import make_tensor_map

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    per_row = 128 // weights.w13.element_size()
    wcache = weights.__dict__.setdefault("_sm90_tma", {})
    if "w" not in wcache:
        wcache["w"] = (make_tensor_map(raw(weights.w13), (per_row, TILE_ROWS, 1)),
                       make_tensor_map(raw(weights.w2), (per_row, TILE_ROWS, 1)))
    bcache = buffer.__dict__.setdefault("_sm90_tma", {})
    if tile not in bcache:
        bcache[tile] = (make_tensor_map(raw(buffer.view("staging_l1")), (per_row, tile)),
                        make_tensor_map(raw(buffer.view("staging_l2")), (per_row, tile)))
    return [*wcache["w"], *bcache[tile]]
