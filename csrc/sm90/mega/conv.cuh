// Number conversions through PTX (NVRTC compiles without cuda_bf16.h / cuda_fp8.h).
// Rounding matches the Python reference: round to nearest even everywhere.
#pragma once
#include "../common.cuh"

namespace megamoe::mega {

MEGAMOE_DEVICE u16 f32_to_bf16(float v) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

MEGAMOE_DEVICE float bf16_to_f32(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

MEGAMOE_DEVICE float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Two floats -> two e4m3 bytes (lo in the low byte), saturating to +-448.
MEGAMOE_DEVICE u16 f32x2_to_e4m3x2(float lo, float hi) {
  u16 packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// x * sigmoid(x) = x / (1 + exp(-x)) with the fast exp and division (MUFU): a few ulp from
// torch's float32 result, far below the BF16 / FP8 rounding the L1 epilogue applies next; the IEEE
// expf + division were 3 % of a prefill's stall samples. x < -87: 1 + exp(-x) is inf, the result 0.
MEGAMOE_DEVICE float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

constexpr float kFP8Max = 448.0f;
constexpr float kAmaxFloor = 1e-10f;

}  // namespace megamoe::mega
