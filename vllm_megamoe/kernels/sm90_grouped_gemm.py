"""Grouped GEMMs on SM90 (swap AB), the first stage of the mega kernel: FP8 with block scales
(grouped_gemm_fp8_block) and BF16 (grouped_gemm_bf16).

    out[rows of e, :] = (x[rows of e] * x_scale) @ (w[e] * w_scale)^T

x: [M, K] float8_e4m3fn, x_scale: [M, K/128] float32 (one scale per token per 128 K);
w: [E, N, K] float8_e4m3fn (K-major), w_scale: [E, ceil(N/128), K/128] float32 (128x128 blocks,
multiply to dequantize); out: [M, N] bfloat16. Rows of x are grouped by expert through the device
tensor expert_offsets (int32 [E+1]): expert e owns rows [offsets[e], offsets[e+1]). The kernel
reads the offsets itself, so there is no host sync and the call can be captured in a CUDA graph.
Rows outside [offsets[0], offsets[E]) are left untouched in `out`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from . import jit
from .tma import make_tensor_map

KERNEL_SOURCE = "sm90/grouped_gemm_kernel.cu"
KERNEL_NAME = "megamoe_grouped_gemm"
SMEM_SYMBOL = "megamoe_grouped_gemm_smem_bytes"

BLOCK_K = 128  # FP8 scale block along K; both flavours need K % 128 == 0
ROW_BYTES = 128  # K bytes per tile row and pipeline stage (the 128B swizzle span)
SM90_MAX_DYNAMIC_SMEM = 232448  # 227 KB per block on H100/H200
MAX_STAGES = 12
# FP8 keeps two accumulator sets (2 x tokens/2 FP32 per thread) in the consumers' 232 registers.
MAX_BLOCK_TOKENS = 192
BLOCK_TOKEN_CHOICES = (8, 16, 32, 64, 96, 128, 192)


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    block_tokens: int = 128
    num_consumer_wg: int = 2
    stages: int = 0  # 0: as many as fit
    interleaved_gate_up: bool = False
    bf16: bool = False

    @property
    def block_w(self) -> int:
        return 64 * self.num_consumer_wg

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_consumer_wg + 1)


def smem_bytes(block_tokens: int, num_consumer_wg: int, stages: int, bf16: bool = False) -> int:
    """Mirror of GemmConfig::kSmemBytes in csrc/sm90/gemm_mainloop.cuh (checked in GPU tests)."""
    w_tile = 64 * num_consumer_wg * ROW_BYTES
    x_tile = block_tokens * ROW_BYTES
    scale = 0 if bf16 else 16 + block_tokens * 4
    scale_offset = stages * (w_tile + x_tile)
    epilogue_offset = -(-(scale_offset + stages * scale) // 128) * 128
    barrier_offset = epilogue_offset + num_consumer_wg * block_tokens * (64 + 8) * 2
    return barrier_offset + 2 * stages * 8 + 1024


def max_stages(block_tokens: int, num_consumer_wg: int, bf16: bool = False) -> int:
    stages = 1
    while stages < MAX_STAGES and smem_bytes(block_tokens, num_consumer_wg, stages + 1, bf16) <= SM90_MAX_DYNAMIC_SMEM:
        stages += 1
    return stages


def resolve_config(config: GroupedGemmConfig) -> GroupedGemmConfig:
    if config.block_tokens % 8 or not 8 <= config.block_tokens <= MAX_BLOCK_TOKENS:
        raise ValueError(f"block_n_tokens must be a multiple of 8 in [8, {MAX_BLOCK_TOKENS}], got {config.block_tokens}")
    if config.num_consumer_wg not in (1, 2):
        raise ValueError(f"num_consumer_wg must be 1 or 2, got {config.num_consumer_wg}")
    if config.bf16 and config.interleaved_gate_up:
        raise ValueError("interleaved_gate_up only changes the FP8 scale lookup; BF16 needs no flag")
    stages = config.stages or max_stages(config.block_tokens, config.num_consumer_wg, config.bf16)
    if smem_bytes(config.block_tokens, config.num_consumer_wg, stages, config.bf16) > SM90_MAX_DYNAMIC_SMEM:
        raise ValueError(f"{stages} stages do not fit in shared memory for {config}")
    return dataclasses.replace(config, stages=stages)


def kernel_spec(config: GroupedGemmConfig) -> jit.KernelSpec:
    config = resolve_config(config)
    return jit.KernelSpec.make(
        KERNEL_SOURCE,
        KERNEL_NAME,
        {
            "MEGAMOE_BLOCK_TOKENS": config.block_tokens,
            "MEGAMOE_NUM_CONSUMER_WG": config.num_consumer_wg,
            "MEGAMOE_STAGES": config.stages,
            "MEGAMOE_INTERLEAVED_GATE_UP": config.interleaved_gate_up,
            "MEGAMOE_BF16": config.bf16,
        },
    )


def default_block_tokens(num_rows: int, num_experts: int) -> int:
    """Smallest token tile that holds the average rows per expert (rows are not read on the host)."""
    expected = -(-num_rows // max(1, num_experts))
    for choice in BLOCK_TOKEN_CHOICES:
        if choice >= expected:
            return choice
    return BLOCK_TOKEN_CHOICES[-1]


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _validate_common(x, w, expert_offsets, out, extra: dict, dtype: torch.dtype, x_name: str, w_name: str):
    tensors = {x_name: x, w_name: w, "expert_offsets": expert_offsets, **extra}
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        _need(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor")
        _need(tensor.is_cuda, f"{name} must be on a CUDA device, got {tensor.device}")
        _need(tensor.is_contiguous(), f"{name} must be contiguous")
    device = x.device
    for name, tensor in tensors.items():
        _need(tensor.device == device, f"{name} is on {tensor.device}, {x_name} on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    _need(major == 9, f"the SM90 grouped GEMM needs a Hopper GPU (compute capability 9.x), got {major}.{minor}")
    _need(x.dtype == dtype, f"{x_name} must be {dtype}, got {x.dtype}")
    _need(w.dtype == dtype, f"{w_name} must be {dtype}, got {w.dtype}")
    _need(expert_offsets.dtype == torch.int32, f"expert_offsets must be int32, got {expert_offsets.dtype}")
    _need(x.dim() == 2, f"{x_name} must be [M, K], got shape {tuple(x.shape)}")
    _need(w.dim() == 3, f"{w_name} must be [E, N, K], got shape {tuple(w.shape)}")
    m, k = x.shape
    e, n, kw = w.shape
    _need(kw == k, f"K mismatch: {x_name} has K={k}, {w_name} has K={kw}")
    _need(k % BLOCK_K == 0 and k > 0, f"K must be a positive multiple of 128, got {k}")
    _need(n % 64 == 0 and n > 0, f"N must be a positive multiple of 64, got {n}")
    _need(e > 0, f"{w_name} must hold at least one expert")
    _need(tuple(expert_offsets.shape) == (e + 1,), f"expert_offsets must be [{e + 1}], got {tuple(expert_offsets.shape)}")
    _need(m < 2**30, f"M={m} too large for 32-bit TMA coordinates")
    if out is not None:
        _need(out.dtype == torch.bfloat16, f"out must be bfloat16, got {out.dtype}")
        _need(tuple(out.shape) == (m, n), f"out must be [{m}, {n}], got {tuple(out.shape)}")
    return m, n, k, e


def _launch(config: GroupedGemmConfig, x, w, x_scale, w_scale, expert_offsets, out, m, n, k, e, num_ctas):
    config = resolve_config(config)
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = jit.get_kernel(kernel_spec(config), device_index)
    k_per_stage = ROW_BYTES // x.element_size()
    raw = (lambda t: t) if config.bf16 else (lambda t: t.view(torch.uint8))
    w_map = make_tensor_map(raw(w), (k_per_stage, config.block_w, 1))
    x_map = make_tensor_map(raw(x), (k_per_stage, config.block_tokens))
    n_blocks = -(-n // config.block_w)
    max_tasks = (-(-m // config.block_tokens) + e) * n_blocks  # bound on sum_e ceil(rows_e / tile) * n_blocks
    grid = max(1, min(num_ctas or _sm_count(device_index), max_tasks))
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        kernel.launch(
            grid,
            config.num_threads,
            smem_bytes(config.block_tokens, config.num_consumer_wg, config.stages, config.bf16),
            stream,
            [
                w_map,
                x_map,
                ctypes.c_void_p(w_scale.data_ptr() if w_scale is not None else 0),
                ctypes.c_void_p(x_scale.data_ptr() if x_scale is not None else 0),
                ctypes.c_void_p(expert_offsets.data_ptr()),
                ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int32(e),
                ctypes.c_int32(n),
                ctypes.c_int32(k),
            ],
        )
    return out


def grouped_gemm_fp8_block(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_n_tokens: int | None = None,
    num_consumer_wg: int = 2,
    stages: int = 0,
    interleaved_gate_up: bool = False,
    num_ctas: int | None = None,
) -> torch.Tensor:
    """Grouped FP8 x FP8 -> BF16 GEMM with 128-K block scales; see the module docstring.

    block_n_tokens: tokens per tile (wgmma N; multiple of 8 in [8, 192]); default from M / E.
    num_consumer_wg: 2 (128 weight rows per tile) or 1 (64 rows).
    interleaved_gate_up: weight rows are gate/up interleaved by 8 (L1 layout) while w_scale keeps
      the [gate blocks | up blocks] layout; out then holds the interleaved columns.
    num_ctas: persistent grid size (default: one CTA per SM, fewer when there is less work).
    """
    m, n, k, e = _validate_common(
        x_fp8, w_fp8, expert_offsets, out, {"x_scale": x_scale, "w_scale": w_scale},
        torch.float8_e4m3fn, "x_fp8", "w_fp8",
    )  # fmt: skip
    _need(x_scale.dtype == torch.float32, f"x_scale must be float32, got {x_scale.dtype}")
    _need(w_scale.dtype == torch.float32, f"w_scale must be float32, got {w_scale.dtype}")
    _need(tuple(x_scale.shape) == (m, k // BLOCK_K), f"x_scale must be [{m}, {k // BLOCK_K}], got {tuple(x_scale.shape)}")
    _need(
        tuple(w_scale.shape) == (e, -(-n // 128), k // BLOCK_K),
        f"w_scale must be [{e}, {-(-n // 128)}, {k // BLOCK_K}], got {tuple(w_scale.shape)}",
    )
    if interleaved_gate_up:
        _need(n % 128 == 0, f"interleaved gate/up needs N % 128 == 0 (two halves of 64-multiples), got {n}")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x_fp8.device)
    if m == 0:
        return out
    config = GroupedGemmConfig(
        block_tokens=block_n_tokens or default_block_tokens(m, e),
        num_consumer_wg=num_consumer_wg,
        stages=stages,
        interleaved_gate_up=interleaved_gate_up,
    )
    return _launch(config, x_fp8, w_fp8, x_scale, w_scale, expert_offsets, out, m, n, k, e, num_ctas)


def grouped_gemm_bf16(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_n_tokens: int | None = None,
    num_consumer_wg: int = 2,
    stages: int = 0,
    num_ctas: int | None = None,
) -> torch.Tensor:
    """Grouped BF16 GEMM: out[rows of e] = x[rows of e] @ w[e]^T, x [M, K], w [E, N, K] (K-major),
    FP32 accumulation, BF16 out; same grouping, tiling and options as grouped_gemm_fp8_block."""
    m, n, k, e = _validate_common(x, w, expert_offsets, out, {}, torch.bfloat16, "x", "w")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    config = GroupedGemmConfig(
        block_tokens=block_n_tokens or default_block_tokens(m, e),
        num_consumer_wg=num_consumer_wg,
        stages=stages,
        bf16=True,
    )
    return _launch(config, x, w, None, None, expert_offsets, out, m, n, k, e, num_ctas)
