// Number conversions through PTX (NVRTC compiles without cuda_bf16.h / cuda_fp8.h).
// Rounding matches the Python reference: round to nearest even everywhere.
#pragma once
#include "../ptx.cuh"

namespace megamoe::mega {

MEGAMOE_DEVICE float bf16_to_f32(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

// Both values rounded to BF16 (nearest even) by one packed cvt (F2FP): single cvts ran on the
// conversion pipe, 128 per thread in the 128-token L1 epilogue, beside silu's MUFU.
MEGAMOE_DEVICE void round_bf16x2(float& lo, float& hi) {
  const u32 packed = pack_bf16x2(lo, hi);
  lo = __uint_as_float(packed << 16), hi = __uint_as_float(packed & 0xffff0000u);
}

// Two floats -> two e4m3 bytes (lo in the low byte), saturating to +-448.
MEGAMOE_DEVICE u16 f32x2_to_e4m3x2(float lo, float hi) {
  u16 packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// silu(x) = x sigmoid(x) = h + h tanh(h), h = x / 2: one MUFU (tanh.approx) where the fast exp
// and reciprocal took two (IEEE expf and division had been 3 % of a prefill's stall samples).
// tanh.approx's relative error <= 2^-10.99 makes silu's absolute error <= |x| 2^-12: ~2.4e-4 of
// silu(x) for x > 0, below the BF16 rounding of the L1 output; for x << 0, where silu is ~0, the
// same absolute error (e.g. 2e-3 at x = -8, whose silu is -2.7e-3).
MEGAMOE_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
MEGAMOE_DEVICE float silu(float x) {
  const float h = 0.5f * x;
  return fmaf(h, tanh_approx(h), h);
}

constexpr float kFP8Max = 448.0f;
constexpr float kAmaxFloor = 1e-10f;

}  // namespace megamoe::mega
