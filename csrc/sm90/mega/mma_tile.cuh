// Warp-level tensor-core tile: 32 weight rows x 32 tokens, both operands K-contiguous in global
// memory, FP32 accumulators. FP8 uses mma.m16n8k32.e4m3, BF16 mma.m16n8k16.bf16; both read
// their fragments as 4-byte words at the same byte offsets, so one loader serves both.
// (The TMA + wgmma mainloop in ../gemm_mainloop.cuh replaces this in the tuned kernel.)
#pragma once
#include "config.cuh"

namespace megamoe::mega {

MEGAMOE_DEVICE u32 ld_nc_u32(const u8* p) {  // read-only for the whole launch (weights)
  u32 v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

MEGAMOE_DEVICE u32 ld_cg_u32(const u8* p) {  // written earlier in this launch: bypass L1
  u32 v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

MEGAMOE_DEVICE float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

MEGAMOE_DEVICE void mma_k32_bytes(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  if constexpr (kFP8) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Accumulators of one warp: [m16 tile][n8 tile][fragment]. Fragment j of (mt, nt) holds
// row mt*16 + g + (j >= 2 ? 8 : 0) and token nt*8 + 2*t4 + (j & 1), g = lane / 4, t4 = lane % 4.
struct WarpAcc {
  float v[2][kTokenTiles][4];
  MEGAMOE_DEVICE void zero() { zero_tiles<0, kTokenTiles>(); }
  MEGAMOE_DEVICE float sum() const {  // profiling builds that drop the epilogue keep the K loop's results live
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < static_cast<int>(kTokenTiles); ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) s += v[i][j][k];
    return s;
  }
  template <u32 kFrom, u32 kTo>  // n8 tiles [kFrom, kTo)
  MEGAMOE_DEVICE void zero_tiles() {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = kFrom; j < static_cast<int>(kTo); ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) v[i][j][k] = 0.0f;
  }
};

// (The ldg mainloop below handles 32-token tiles only; config.cuh enforces it.)
// part += A[32 rows, k_bytes) x B[32 tokens, k_bytes) for k_bytes = [k0, k0 + len) (len % 32 == 0).
// a_rows: this warp's first weight row; token_rows[nt]: row of token nt*8 + g (already clamped
// to a valid row for tokens past the block's end).
MEGAMOE_DEVICE void warp_mma_k_range(WarpAcc& part, const u8* a_rows, u64 a_pitch, const u8* const (&token_rows)[4],
                                     u32 k0, u32 len) {
  const u32 lane = thread_index() % 32, g = lane / 4, t4 = lane % 4;
  const u8* a_lo[2] = {a_rows + (g)*a_pitch + t4 * 4, a_rows + (16 + g) * a_pitch + t4 * 4};
#pragma unroll 2
  for (u32 k = k0; k < k0 + len; k += 32) {
    u32 a[2][4], b[4][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      a[mt][0] = ld_nc_u32(a_lo[mt] + k);
      a[mt][1] = ld_nc_u32(a_lo[mt] + 8 * a_pitch + k);
      a[mt][2] = ld_nc_u32(a_lo[mt] + k + 16);
      a[mt][3] = ld_nc_u32(a_lo[mt] + 8 * a_pitch + k + 16);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      b[nt][0] = ld_cg_u32(token_rows[nt] + t4 * 4 + k);
      b[nt][1] = ld_cg_u32(token_rows[nt] + t4 * 4 + k + 16);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_k32_bytes(part.v[mt][nt], a[mt], b[nt]);
  }
}

// acc += part x weight scale ([0] rows g, [1] rows g + 8 of both m16 tiles) x token scale, for
// 128-K block kb (FP8 promotion). Tokens past num_rows read the last valid row's scale.
MEGAMOE_DEVICE void promote_block(WarpAcc& acc, const WarpAcc& part, const float* const (&w_scale)[2],
                                  const float* tok_scale, u32 tok_scale_pitch, u32 first_row, u32 num_rows, u32 kb) {
  const u32 t4 = thread_index() % 4;
  float tsc[4][2];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const u32 tok = nt * 8 + 2 * t4 + j;
      const u32 row = first_row + (tok < num_rows ? tok : num_rows - 1);
      tsc[nt][j] = ld_cg_f32(tok_scale + static_cast<u64>(row) * tok_scale_pitch + kb);
    }
  const float w_lo = __ldg(w_scale[0] + kb), w_hi = __ldg(w_scale[1] + kb);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      acc.v[mt][nt][0] += part.v[mt][nt][0] * w_lo * tsc[nt][0];
      acc.v[mt][nt][1] += part.v[mt][nt][1] * w_lo * tsc[nt][1];
      acc.v[mt][nt][2] += part.v[mt][nt][2] * w_hi * tsc[nt][0];
      acc.v[mt][nt][3] += part.v[mt][nt][3] * w_hi * tsc[nt][1];
    }
  }
}

}  // namespace megamoe::mega
