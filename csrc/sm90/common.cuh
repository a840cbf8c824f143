// Basic types and macros shared by every SM90 header.
// Self-contained on purpose: NVRTC compiles these sources with no CUDA toolkit headers on the
// include path, so nothing here may include <cstdint>, <cuda.h> or <cuda_bf16.h>.
#pragma once

namespace megamoe {

using u8 = unsigned char;
using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
using i32 = int;
using i64 = long long;

// Raw bit patterns: e4m3 bytes and bf16 halves are moved, never interpreted, outside PTX.
using fp8_e4m3 = u8;
using bf16_bits = u16;

// Same size and alignment as CUtensorMap (64-byte aligned, 128 bytes). The host fills it with
// cuTensorMapEncodeTiled and the kernel receives it by value as a __grid_constant__ parameter.
struct alignas(64) TensorMap {
  u64 opaque[16];
};

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

template <typename T>
__host__ __device__ constexpr T align_up(T a, T b) { return ceil_div(a, b) * b; }

}  // namespace megamoe

// Waits on mbarriers give up after this many SM clock cycles (about 10 s at 1.98 GHz) and trap
// with a message instead of hanging the GPU forever.
#ifndef MEGAMOE_WAIT_TIMEOUT_CYCLES
#define MEGAMOE_WAIT_TIMEOUT_CYCLES 20000000000ll
#endif

#define MEGAMOE_DEVICE __device__ __forceinline__
