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

namespace megamoe {

// The thread's index in its CTA. NVVM reads the builtin threadIdx.x once at the kernel's start and
// keeps it live through every phase. In the builds with an epilogue warpgroup (168 registers) ptxas
// spilled it and refilled it from local memory on every task's path (docs/kernel_design.md):
// there it is read anew at each call, a volatile asm that is never merged with another read or
// hoisted. The K loops read it once at their entry and hand it to their helpers (their `tid`
// argument): read at each use inside them it lengthened the FP8 128-token loops by 11-14 %. The
// builds without the warpgroup (128-token tiles, 242-255 registers) spill nothing and keep the
// builtin: read once per K loop it still cost them 7-11 % of their loops' instructions.
MEGAMOE_DEVICE u32 thread_index() {
#if defined(MEGAMOE_EPILOGUE_WARPGROUP) && MEGAMOE_EPILOGUE_WARPGROUP
  u32 tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  __builtin_assume(tid < 1024);  // what NVVM knows of the builtin (tid / 128 and the like stay small)
  return tid;
#else
  return threadIdx.x;
#endif
}

}  // namespace megamoe
