"""Shared memory of the fused SM90 kernel's builds, computed on the host: the same formulas the
kernel static_asserts (csrc/sm90/mega/mainloop_smem.cuh MainloopSmem, expert_gemm.cuh
EpilogueSmem, params.cuh ExpertTable), so a build that cannot fit is refused or avoided before
it is compiled. Free of torch: the tuning rules (sm90_tuning) use it too."""
from __future__ import annotations

from typing import Optional

from ..shape import MoEShape

TILE_ROWS = 256                 # weight rows per GEMM task
SMEM_PER_BLOCK = 227 * 1024     # an SM90 CTA's shared memory (static + dynamic)
# Builds with an epilogue warpgroup (csrc/sm90/mega/epilogue_warpgroup.cuh): 384 threads, the
# epilogues run beside the next task's K loop; their tile (a whole task: tile tokens x 512 bytes)
# is static shared memory of its own. The 32- and 64-token builds always (unless a probe's
# BuildOptions turns it off); the 128-token ones only where a probe asks for it
# (BuildOptions.epilogue_warpgroup_128: slower on one H200) and the 64 KB tile fits beside
# EPILOGUE_WARPGROUP_128_STAGES stages (Qwen3-30B-A3B-like layers, not hidden 4096 or 7168).
# Without one, the epilogue tile lives in the stage of a task's last K chunk
# (epilogue_tile.cuh MEGAMOE_EPILOGUE_IN_STAGE) instead of static shared memory.
EPILOGUE_WARPGROUP_TILES = (32, 64)
EPILOGUE_WARPGROUP_128_STAGES = 3  # the register-token loop's least (sm90_tuning.FP8_TILE128_MIN_STAGES)


def handoff_tile_bytes(tile_tokens: int) -> int:
    """An epilogue warpgroup's hand-off tile: a whole task's [tokens][256] BF16 values."""
    return tile_tokens * TILE_ROWS * 2


def has_epilogue_warpgroup(tile_tokens: int, shape: Optional[MoEShape] = None, num_ranks: int = 1, *,
                           enabled: bool = True, enabled_128: bool = False) -> bool:
    """Whether the build of `tile_tokens` for `shape` at `num_ranks` runs an epilogue warpgroup (a
    128-token build needs the shape: whether its tile fits). `enabled` / `enabled_128`: the
    build's BuildOptions (sm90_mega_moe; the serving builds: True / False)."""
    if not enabled:
        return False
    if tile_tokens in EPILOGUE_WARPGROUP_TILES:
        return True
    return (tile_tokens == 128 and shape is not None and enabled_128
            and _smem_bytes(shape, num_ranks, EPILOGUE_WARPGROUP_128_STAGES, 128, True) <= SMEM_PER_BLOCK)


def epilogue_tables_in_mainloop(shape: MoEShape, tile_tokens: int) -> bool:
    """Whether the build keeps the L1 epilogue's per-token tables in the mainloop's token-scale
    table (csrc/sm90/mega/epilogue_tile.cuh): 128-token tiles whose table has the 4 K-block rows
    they take."""
    return tile_tokens == 128 and max(shape.hidden, shape.intermediate) >= 4 * 128


def static_smem_bytes(num_local_experts: int, num_ranks: int, tile_tokens: int = 32,
                      tables_in_mainloop: bool = False, epilogue_warpgroup: Optional[bool] = None) -> int:
    """An upper bound of the kernel's static shared memory: the expert table (params.cuh
    ExpertTable), the epilogue's per-token tables (8 warps' amax, the top-k weight, 1 / scale;
    none when tables_in_mainloop, see epilogue_tables_in_mainloop)
    and, unless it lives in a mainloop stage, its tile (epilogue_tile.cuh EpilogueSmem), and 1 KB
    of headroom (the task queue's, the hand-off header's and the phase clock's few words, and the
    register-token loops' 16-byte zero line, among it). `epilogue_warpgroup`: whether the build has
    one (None: has_epilogue_warpgroup of the serving builds without a shape, right for every tile
    but 128)."""
    # src_count, row_start and block_start, listed, pulled_warps
    table = (num_local_experts * num_ranks + 2 * (num_local_experts + 1) + num_ranks + 1) * 4
    # (epilogue_tables_in_mainloop: the per-token tables live in the mainloop's token-scale table)
    epilogue = 0 if tables_in_mainloop else (8 + 2) * tile_tokens * 4
    if epilogue_warpgroup is None:
        epilogue_warpgroup = has_epilogue_warpgroup(tile_tokens)
    if epilogue_warpgroup:
        epilogue += handoff_tile_bytes(tile_tokens)
    return table + epilogue + 1024


def mainloop_smem_bytes(shape: MoEShape, stages: int, tile_tokens: int = 32) -> int:
    """sizeof(MainloopSmem) plus alignment slack: the stages (128-byte swizzled rows, 1024-byte
    aligned), the FP8 scale tables of one task (the weight scales once per warp, once in all in the
    128-token builds) and one mbarrier per stage. The kernel static_asserts the same number."""
    max_kblocks = max(shape.hidden, shape.intermediate) // 128
    row, align = 128, 1024
    w_scale_copies = 1 if tile_tokens == 128 else 8  # one per warp but in the 128-token builds
    struct = stages * (TILE_ROWS + tile_tokens) * row + (tile_tokens + w_scale_copies * 2) * max_kblocks * 4
    struct += 8 * stages  # one mbarrier per stage
    struct = -(-struct // align) * align        # sizeof rounds up to the struct's alignment
    return struct + align  # slack to align the dynamic smem base


def _smem_bytes(shape: MoEShape, num_ranks: int, stages: int, tile_tokens: int, epilogue_warpgroup: bool) -> int:
    return (mainloop_smem_bytes(shape, stages, tile_tokens)
            + static_smem_bytes(shape.experts_per_rank(num_ranks), num_ranks, tile_tokens,
                                epilogue_tables_in_mainloop(shape, tile_tokens), epilogue_warpgroup))


def build_smem_bytes(shape: MoEShape, num_ranks: int, stages: int, tile_tokens: int) -> int:
    """The serving build's dynamic and static shared memory."""
    return _smem_bytes(shape, num_ranks, stages, tile_tokens, has_epilogue_warpgroup(tile_tokens, shape, num_ranks))


def fits(shape: MoEShape, num_ranks: int, stages: int, tile_tokens: int) -> bool:
    """Whether the serving build's dynamic and static shared memory fit one CTA."""
    return build_smem_bytes(shape, num_ranks, stages, tile_tokens) <= SMEM_PER_BLOCK
