// CTA-level variant of the expert GEMM mainloop: the CTA's 256 weight rows and 32 token rows are
// streamed through shared memory in 128-byte K chunks with cp.async (16-byte copies, kStages
// deep), so every thread keeps ~8 x 16 B of HBM traffic in flight instead of one 4-byte load per
// fragment. Fragments are then read from shared memory with the same byte pattern as
// mma_tile.cuh (rows padded to 144 B: the 8 rows of a fragment hit 8 different bank groups).
// Selected with MEGAMOE_SMEM_MAINLOOP=1 (VLLM_MEGAMOE_SM90_MAINLOOP=smem).
#pragma once
#include "mma_tile.cuh"

namespace megamoe::mega {

constexpr u32 kChunkBytes = 128;      // K bytes per stage (FP8: one 128-value scale block)
constexpr u32 kPaddedRow = 144;       // 128 + 16 bytes
constexpr u32 kMainloopStages = 3;

struct MainloopSmem {
  alignas(16) u8 a[kMainloopStages][kTileRows * kPaddedRow];
  alignas(16) u8 b[kMainloopStages][kTileTokens * kPaddedRow];
};

MEGAMOE_DEVICE void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<u32>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
}
MEGAMOE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
MEGAMOE_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

MEGAMOE_DEVICE u32 lds_u32(const u8* p) { return *reinterpret_cast<const u32*>(p); }

// Issues the copies of K chunk `chunk` into `stage`: 256 weight rows (8 x 16 B each) and the 32
// token rows (clamped to the last valid row, like mma_tile.cuh).
MEGAMOE_DEVICE void load_chunk(MainloopSmem& sm, u32 stage, u32 chunk, const u8* a_base, u64 a_pitch,
                               const u8* tok_base, u64 tok_pitch, u32 first_row, u32 num_rows) {
  const u32 k0 = chunk * kChunkBytes;
#pragma unroll
  for (u32 j = 0; j < kTileRows * 8 / kNumThreads; ++j) {
    const u32 i = threadIdx.x + j * kNumThreads, row = i / 8, seg = i % 8;
    cp_async_16(sm.a[stage] + row * kPaddedRow + seg * 16, a_base + row * a_pitch + k0 + seg * 16);
  }
  const u32 tok = threadIdx.x / 8, seg = threadIdx.x % 8;  // kTileTokens * 8 == kNumThreads
  const u32 row = first_row + (tok < num_rows ? tok : num_rows - 1);
  cp_async_16(sm.b[stage] + tok * kPaddedRow + seg * 16, tok_base + row * tok_pitch + k0 + seg * 16);
}

// part += this warp's 32 rows x 32 tokens over one staged K chunk (4 MMA k-steps of 32 bytes).
MEGAMOE_DEVICE void mma_chunk(WarpAcc& part, const MainloopSmem& sm, u32 stage) {
  const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const u8* a = sm.a[stage] + (warp * 32 + g) * kPaddedRow + t4 * 4;
  const u8* b = sm.b[stage] + g * kPaddedRow + t4 * 4;
#pragma unroll 2  // fully unrolled, the fragments of 4 k-steps stay live and spill (FP8)
  for (u32 ks = 0; ks < kChunkBytes; ks += 32) {
    u32 af[2][4], bf[4][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const u8* row = a + mt * 16 * kPaddedRow + ks;
      af[mt][0] = lds_u32(row);
      af[mt][1] = lds_u32(row + 8 * kPaddedRow);
      af[mt][2] = lds_u32(row + 16);
      af[mt][3] = lds_u32(row + 8 * kPaddedRow + 16);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const u8* row = b + nt * 8 * kPaddedRow + ks;
      bf[nt][0] = lds_u32(row);
      bf[nt][1] = lds_u32(row + 16);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_k32_bytes(part.v[mt][nt], af[mt], bf[nt]);
  }
}

// The whole K loop of one task: acc = sum over chunks [x scales per 128-K block for FP8].
// a_base: the CTA's first weight row; rows are a_pitch bytes apart; tokens likewise.
template <u32 K>
MEGAMOE_DEVICE void cta_gemm(WarpAcc& acc, MainloopSmem& sm, const u8* a_base, const u8* tok_base, u64 tok_pitch,
                             u32 first_row, u32 num_rows, const float* const (&w_scale_gate_up)[2][2],
                             const float* tok_scale, u32 tok_scale_pitch) {
  constexpr u64 kAPitch = static_cast<u64>(K) * kElemBytes;
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  acc.zero();
#pragma unroll
  for (u32 s = 0; s + 1 < kMainloopStages; ++s) {
    if (s < kChunks) load_chunk(sm, s, s, a_base, kAPitch, tok_base, tok_pitch, first_row, num_rows);
    cp_async_commit();
  }
  for (u32 c = 0; c < kChunks; ++c) {
    cp_async_wait<kMainloopStages - 2>();
    __syncthreads();  // chunk c landed for every thread; chunk c-1's stage is free again
    const u32 next = c + kMainloopStages - 1;
    if (next < kChunks)
      load_chunk(sm, next % kMainloopStages, next, a_base, kAPitch, tok_base, tok_pitch, first_row, num_rows);
    cp_async_commit();
    if constexpr (!kFP8) {
      mma_chunk(acc, sm, c % kMainloopStages);
    } else {
      WarpAcc part;
      part.zero();
      mma_chunk(part, sm, c % kMainloopStages);
      promote_block(acc, part, w_scale_gate_up, tok_scale, tok_scale_pitch, first_row, num_rows, c);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages before the next task refills them
}

}  // namespace megamoe::mega
