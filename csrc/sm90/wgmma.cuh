// Warpgroup MMA: shared-memory matrix descriptors and the async fence/commit/wait protocol.
// The per-shape instruction wrappers are generated into wgmma_ops.cuh.
#pragma once
#include "ptx.cuh"
#include "wgmma_ops.cuh"

namespace megamoe {

// Descriptor for a K-major operand tile stored with the 128-byte swizzle that TMA writes:
// each row holds 128 bytes of K, 8-row groups are 1024 bytes apart (stride byte offset), the
// tile base is 1024-byte aligned (base offset 0) and the leading byte offset is unused.
// Moving along K inside the 128-byte row is done by adding bytes/16 to the start address.
MEGAMOE_DEVICE u64 make_smem_desc_k_major_sw128(const void* smem_tile) {
  const u64 start = static_cast<u64>((smem_addr(smem_tile) & 0x3FFFF) >> 4);
  const u64 leading_byte_offset = 0;
  const u64 stride_byte_offset = 1024 >> 4;
  const u64 layout_swizzle_128b = 1;
  return start | (leading_byte_offset << 16) | (stride_byte_offset << 32) | (layout_swizzle_128b << 62);
}

// Must precede the first wgmma that reads registers/shared memory written by ordinary code.
MEGAMOE_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

MEGAMOE_DEVICE void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int kPendingGroups>
MEGAMOE_DEVICE void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPendingGroups) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the async MMA boundary.
template <int kCount>
MEGAMOE_DEVICE void fence_accumulators(float (&regs)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}

// Where accumulator element i of an m64nN fragment lives, for thread `lane` of warp
// `warp_in_wg`: row in [0, 64) on the M side, column in [0, N) on the N side.
// Per 8-column chunk j, elements 4j..4j+3 are (row r, col c), (r, c+1), (r+8, c), (r+8, c+1)
// with r = 16*warp + lane/4 and c = 8j + 2*(lane%4).
MEGAMOE_DEVICE int accum_row(int i, int warp_in_wg, int lane) {
  return 16 * warp_in_wg + lane / 4 + 8 * ((i >> 1) & 1);
}
MEGAMOE_DEVICE int accum_col(int i, int lane) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }

// For load_a_fragment_fp8_sw128 below: the tile row whose 16 bytes this lane hands ldmatrix (the
// lanes holding that row's values receive them), and that address for k-step kk. `tid`: the
// thread's index (a K loop passes the one it read at its entry, common.cuh thread_index).
MEGAMOE_DEVICE u32 a_fragment_lane_row(u32 tid = thread_index()) {
  const u32 lane = tid % 32, matrix = lane / 8;
  return 16 * (tid / 32 % 4) + (matrix % 2) * 8 + lane % 8;
}
// The lane's ldmatrix address when its fragment row a_fragment_lane_row() is read from tile row `row`.
MEGAMOE_DEVICE u32 a_fragment_row_address_fp8_sw128(u32 tile_smem_address, u32 row, u32 kk, u32 tid = thread_index()) {
  const u32 segment = 2 * kk + (tid % 32) / 16;
  return tile_smem_address + row * 128 + ((segment ^ (row % 8)) * 16);
}
MEGAMOE_DEVICE u32 a_fragment_lane_address_fp8_sw128(u32 tile_smem_address, u32 kk) {
  return a_fragment_row_address_fp8_sw128(tile_smem_address, a_fragment_lane_row(), kk);
}

// The A operand of an FP8 m64nNk32 wgmma from registers, for k-step kk (bytes 32 kk .. 32 kk + 31
// of each row) of a 64-row, 128-byte-per-row K-major tile stored with the 128-byte swizzle that
// TMA writes (16-byte segment s of row r at s ^ (r % 8)). Warp w of the warpgroup holds rows
// 16 w .. 16 w + 15: register 0 row lane / 4, K bytes 4 (lane % 4) .. +3; register 1 the same
// 8 rows further; registers 2 / 3 those rows 16 K bytes further. That is ldmatrix's fragment of
// the four 8 x 16-byte matrices (rows +0 / +8) x (segments 2 kk / 2 kk + 1): one ldmatrix.x4,
// its 8 rows per matrix in 8 distinct swizzled segments (no bank conflict).
MEGAMOE_DEVICE void load_a_fragment_fp8_sw128(u32 (&a)[4], u32 tile_smem_address, u32 kk) {
  ldmatrix_x4(a, a_fragment_lane_address_fp8_sw128(tile_smem_address, kk));
}

}  // namespace megamoe
