"""The symmetric buffer layout: one source of truth for Python and CUDA.

Every rank allocates one buffer of `BufferLayout.total_bytes` bytes with this layout; peers
address each other's regions at the same offsets. Python views regions with `view()`; the CUDA
kernels receive the same offsets through `c_header()` (generated, never hand-written).

Regions, in order (each 128-byte aligned):
  workspace           int32 [96]        counters and flags, see WORKSPACE_SLOTS
  expert_send_count   int32 [E]         tokens this rank sends to each global expert (per call)
  expert_recv_count   int32 [R, El]     unused (older SM90 kernel trees: what rank r sent to my local experts)
  token_send_count    int32 [R]         SM90 kernel: tokens this rank sends to each rank (per call);
                                        with expert_send_count, read by the destinations
  recv_token_count    int32 [R]         unused (older SM90 kernel trees: how many tokens rank r listed here)
  recv_tokens         int32 [R, T]      SM90 kernel, written by rank r: those tokens, each once
  recv_token_pairs    int32 [R, T, K]   SM90 kernel, written by rank r: per listed token and top-k slot,
                                        local expert * T + position of the pair here, or -1
  x                   fp8/bf16 [T, H]   this rank's tokens; peers read them (dispatch pull)
  x_scale             f32 [T, H/128]    per-128 scales of x (fp8-block only)
  topk_idx            int32 [T, K]      global expert ids, -1 masked
  topk_weights        f32 [T, K]
  staging_meta        int32 [S, 4]      received rows: (src rank, src token, topk slot, expert)
  staging_weight      f32 [S]           received rows' top-k weights
  staging_l1          fp8/bf16 [S, H]   received token rows (L1 input)
  staging_l1_scale    f32 [S, P(H)]     (fp8-block only; P(n) = n/128 rounded up to a multiple
                                        of 4: 16-byte rows, which the SM90 kernel copies in 16-byte
                                        groups of 4 blocks; the padding is never written or used)
  staging_l2          fp8/bf16 [S, I]   SwiGLU outputs (L2 input)
  staging_l2_scale    f32 [S, P(I)]     (fp8-block only)
  l1_block_done       int32 [S/32 + El] SM90 kernel: per token block, rows pulled + L1 tiles finished
  combine             bf16 [C, T, H]    expert outputs written by peers, C = K (+1 shared slot)
  combine_trash       bf16 [1, H]       directly after combine: target of masked writes
with E experts, R ranks, El = E/R local experts, T = max tokens per rank, H hidden,
I intermediate, K top-k, S staging rows.

How memory grows: combine (2*K*T*H bytes) dominates, linear in T, K and H. x is T*H (fp8) or
2*T*H (bf16). Staging is S*(H+I) (x2 for bf16):
S defaults to the worst case of every received pair, R*T*min(K, El); a kernel that recycles
staging as a ring of live blocks passes `ring_rows` (live blocks x block rows) instead, which
caps S independently of T. Nothing grows with the number of layers: one buffer serves all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .shape import MoEShape, check_format, check_int, require

ALIGN_BYTES = 128
TOKEN_ALIGN = 8  # max tokens per rank is rounded up to this
SCALE_GROUP = 128
KERNEL_TOKEN_BLOCK = 32  # rows per token block of the SM90 kernel's GEMM tasks (l1_block_done)

NVL_ARRIVED_RANKS = 8  # ranks the nvl_arrived_* slots serve: the SM90 kernel's rank limit
LINE_INTS = ALIGN_BYTES // 4  # int32 slots per 128-byte line


def scale_row_pitch(n: int) -> int:
    """Floats per row of a staging scale region for rows of `n` values (one scale per 128), padded
    to 16 bytes: the SM90 kernel copies a row's scales in 16-byte groups of 4 blocks."""
    return _align(n // SCALE_GROUP, 4)


def _line(*slots) -> tuple:
    """`slots` padded with unused slots (None) to a whole number of 128-byte lines."""
    return slots + (None,) * (-len(slots) % LINE_INTS)


# Slots of the int32 workspace region; the names are shared with csrc/ through c_header(). None
# marks an unused slot (padding).
WORKSPACE_SLOTS = _line(
    "grid_sync_0", "grid_sync_1", "grid_sync_2", "grid_sync_3",  # older kernel trees' grid barriers (A/B runs)
    "nvl_barrier_signal_0", "nvl_barrier_signal_1",  # SM90 kernel: arrivals of all ranks, growing
    "l1_task_counter", "l2_task_counter",
    "num_tokens",      # tokens this rank holds in the current call (peers read it)
    "error_flag",      # non-zero when a device-side check failed (see buffer.check_errors)
    "call_count",      # calls completed on this buffer (the SM90 kernel's NVLink barrier targets)
    "rank_arrivals",   # SM90 kernel: CTAs of this rank at the current NVLink barrier (back to 0 after)
    # SM90 kernel: per NVLink barrier b and source rank r, the arrivals of r's CTAs here, growing
    # by the same amount every call (csrc/sm90/mega/sync.cuh); nvl_barrier_signal_* are what older
    # kernel trees used, kept so that they still build under this layout for A/B runs
    *(f"nvl_arrived_{b}_{r}" for b in range(2) for r in range(NVL_ARRIVED_RANKS)),
) + (
    # SM90 kernel, this call (back to 0 after): warps done pulling, and L1 tiles published; once a
    # count is complete, a CTA's GEMM tasks stop checking their token blocks (block_ready.cuh).
    # Each on a line of its own: every CTA adds to them while others take tasks from the counters
    # above (the pulled_warps adds on the task counters' line slowed the first L1 task at 1 token).
    _line("pulled_warps") + _line("l1_tiles_done"))
WORKSPACE_INTS = len(WORKSPACE_SLOTS)  # 96: three lines


def _named_slots() -> list:
    """(index, name) of every workspace slot but the padding."""
    return [(i, slot) for i, slot in enumerate(WORKSPACE_SLOTS) if slot is not None]

_DTYPE_NAMES = {
    torch.int32: "int32", torch.float32: "float32", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3",
}


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class BufferLayout:
    """Offsets of every region for one set of parameters; see the module docstring."""

    shape: MoEShape
    num_ranks: int
    max_tokens_per_rank: int
    format: str = "fp8-block"
    shared_expert: bool = False
    ring_rows: Optional[int] = None
    regions: dict = field(init=False, repr=False, compare=False)
    total_bytes: int = field(init=False, compare=False)

    def __post_init__(self):
        self.shape.validate(self.num_ranks)
        check_format(self.format)
        check_int("max_tokens_per_rank", self.max_tokens_per_rank)
        require(self.max_tokens_per_rank >= 1,
                f"max_tokens_per_rank={self.max_tokens_per_rank} must be at least 1")
        require(self.ring_rows is None or self.ring_rows >= 1,
                f"ring_rows={self.ring_rows} must be positive or None")
        s, r, t = self.shape, self.num_ranks, self.tokens
        el = s.experts_per_rank(r)
        act = torch.float8_e4m3fn if self.format == "fp8-block" else torch.bfloat16
        scaled = self.format == "fp8-block"
        rows = self.staging_rows
        specs = [
            ("workspace", torch.int32, (WORKSPACE_INTS,)),
            ("expert_send_count", torch.int32, (s.num_experts,)),
            ("expert_recv_count", torch.int32, (r, el)),
            # The SM90 kernel pulls each token once per destination rank (not once per pair) and
            # copies it into the staging row of each of its pairs there.
            ("token_send_count", torch.int32, (r,)),
            ("recv_token_count", torch.int32, (r,)),
            ("recv_tokens", torch.int32, (r, t)),
            ("recv_token_pairs", torch.int32, (r, t, s.topk)),
            ("x", act, (t, s.hidden)),
            ("x_scale", torch.float32, (t, s.hidden // SCALE_GROUP) if scaled else (0,)),
            ("topk_idx", torch.int32, (t, s.topk)),
            ("topk_weights", torch.float32, (t, s.topk)),
            ("staging_meta", torch.int32, (rows, 4)),
            ("staging_weight", torch.float32, (rows,)),
            ("staging_l1", act, (rows, s.hidden)),
            ("staging_l1_scale", torch.float32, (rows, scale_row_pitch(s.hidden)) if scaled else (0,)),
            ("staging_l2", act, (rows, s.intermediate)),
            ("staging_l2_scale", torch.float32, (rows, scale_row_pitch(s.intermediate)) if scaled else (0,)),
            # Each expert's rows start a new token block: at most S/32 + El blocks per call.
            ("l1_block_done", torch.int32, (rows // KERNEL_TOKEN_BLOCK + el + 1,)),
            ("combine", torch.bfloat16, (self.combine_slots, t, s.hidden)),
            # One row directly after combine: padded (graph-capturable) writers aim the rows of
            # masked pairs here, so every write has a harmless target.
            ("combine_trash", torch.bfloat16, (1, s.hidden)),
        ]
        regions, offset = {}, 0
        for name, dtype, shp in specs:
            region = Region(name, offset, dtype, tuple(shp))
            regions[name] = region
            offset = _align(offset + region.nbytes, ALIGN_BYTES)
        trash, combine = regions["combine_trash"], regions["combine"]
        assert trash.offset == combine.offset + combine.nbytes, "combine_trash must follow combine"
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "total_bytes", offset)

    # -- derived sizes -----------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """max_tokens_per_rank rounded up to TOKEN_ALIGN."""
        return _align(self.max_tokens_per_rank, TOKEN_ALIGN)

    @property
    def combine_slots(self) -> int:
        return self.shape.topk + (1 if self.shared_expert else 0)

    @property
    def max_received_pairs(self) -> int:
        """Worst case of (token, slot) pairs one rank receives: every peer's tokens all land here."""
        el = self.shape.experts_per_rank(self.num_ranks)
        return self.num_ranks * self.tokens * min(self.shape.topk, el)

    @property
    def staging_rows(self) -> int:
        worst = _align(self.max_received_pairs, TOKEN_ALIGN)
        return worst if self.ring_rows is None else min(worst, _align(self.ring_rows, TOKEN_ALIGN))

    # -- access ------------------------------------------------------------------------------
    def region(self, name: str) -> Region:
        require(name in self.regions, f"unknown buffer region {name!r}; known: {list(self.regions)}")
        return self.regions[name]

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of region `name` over a uint8 buffer laid out by this layout."""
        require(buffer.dtype == torch.uint8 and buffer.dim() == 1,
                f"buffer must be a 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
        require(buffer.numel() >= self.total_bytes,
                f"buffer has {buffer.numel()} bytes, layout needs {self.total_bytes}")
        reg = self.region(name)
        raw = buffer[reg.offset:reg.offset + reg.nbytes]
        return raw.view(reg.dtype).view(reg.shape)

    def workspace_slot(self, name: str) -> int:
        require(name is not None and name in WORKSPACE_SLOTS, f"unknown workspace slot {name!r}")
        return WORKSPACE_SLOTS.index(name)

    def describe(self) -> str:
        """Human-readable table of regions (for logs and `vllm-megamoe doctor`)."""
        lines = [f"{'region':<18} {'offset':>14} {'bytes':>14}  dtype      shape"]
        for reg in self.regions.values():
            lines.append(f"{reg.name:<18} {reg.offset:>14} {reg.nbytes:>14}  "
                         f"{_DTYPE_NAMES[reg.dtype]:<10} {list(reg.shape)}")
        lines.append(f"{'total':<18} {'':>14} {self.total_bytes:>14}  "
                     f"({self.total_bytes / 2**20:.1f} MiB)")
        return "\n".join(lines)

    def c_defines(self) -> dict:
        """The layout as -D defines (MEGAMOE_*) for the JIT-compiled kernels."""
        s = self.shape
        out = {"MEGAMOE_NUM_RANKS": self.num_ranks,
               "MEGAMOE_NUM_LOCAL_EXPERTS": s.experts_per_rank(self.num_ranks),
               "MEGAMOE_MAX_TOKENS": self.tokens,
               "MEGAMOE_BUF_HIDDEN": s.hidden, "MEGAMOE_BUF_INTERMEDIATE": s.intermediate,
               "MEGAMOE_BUF_TOPK": s.topk, "MEGAMOE_STAGING_ROWS": self.staging_rows,
               "MEGAMOE_L1_SCALE_PITCH": scale_row_pitch(s.hidden),
               "MEGAMOE_L2_SCALE_PITCH": scale_row_pitch(s.intermediate)}
        for reg in self.regions.values():
            out[f"MEGAMOE_OFF_{reg.name}"] = f"{reg.offset}ull"
        for i, slot in _named_slots():
            out[f"MEGAMOE_SLOT_{slot}"] = i
        return out

    def c_header(self) -> str:
        """A C++ header with every region's offset and shape, for the kernels."""
        s = self.shape
        out = ["// Generated by vllm_megamoe.layout.BufferLayout.c_header(); do not edit.",
               "#pragma once", "#include <cstdint>", "namespace megamoe::layout {",
               f"constexpr uint32_t kNumRanks = {self.num_ranks};",
               f"constexpr uint32_t kNumExperts = {s.num_experts};",
               f"constexpr uint32_t kNumLocalExperts = {s.experts_per_rank(self.num_ranks)};",
               f"constexpr uint32_t kMaxTokens = {self.tokens};",
               f"constexpr uint32_t kHidden = {s.hidden};",
               f"constexpr uint32_t kIntermediate = {s.intermediate};",
               f"constexpr uint32_t kTopk = {s.topk};",
               f"constexpr uint32_t kCombineSlots = {self.combine_slots};",
               f"constexpr uint32_t kStagingRows = {self.staging_rows};",
               f"constexpr uint32_t kL1ScalePitch = {scale_row_pitch(s.hidden)};",
               f"constexpr uint32_t kL2ScalePitch = {scale_row_pitch(s.intermediate)};",
               f"constexpr uint64_t kTotalBytes = {self.total_bytes}ull;"]
        for i, slot in _named_slots():
            out.append(f"constexpr uint32_t kSlot_{slot} = {i};")
        for reg in self.regions.values():
            out.append(f"constexpr uint64_t kOffset_{reg.name} = {reg.offset}ull;  "
                       f"// {_DTYPE_NAMES[reg.dtype]} {list(reg.shape)}")
        out.append("}  // namespace megamoe::layout")
        return "\n".join(out) + "\n"
