// A warp's FP32 accumulators of the CTA tile (WarpAcc: the layout of the wgmma m64nN
// accumulators, rows from mainloop_smem.cuh acc_row_base) and the L1-bypassing global loads.
#pragma once
#include "config.cuh"

namespace megamoe::mega {

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

}  // namespace megamoe::mega
