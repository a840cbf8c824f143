// Checks the FP8 wgmma with its A operand in registers, the building block of a K loop that keeps
// the token tile in registers (docs/kernel_design.md): one warpgroup computes
// D[64][N] = A[64][128] x B[N][128]^T (e4m3, FP32 accumulation) from tiles stored the way TMA
// stores them (128-byte rows, 16-byte segment s of row r at s ^ (r % 8)), A loaded into registers
// per k-step by load_a_fragment_fp8_sw128 (ldmatrix), B read through a descriptor
// (tests/gpu/test_wgmma_rs.py compares D with a float32 reference).
//
// CHECK_N      the wgmma N: rows of B and columns of D (a multiple of 8 up to 256)
// CHECK_REUSE  two wgmma groups per A fragment in a loop that is not unrolled (so a fragment
//              variable has one set of registers), the pattern of a K loop with the tokens in
//              registers (docs/kernel_design.md): per rep r the tile A (r even) or A2 (r odd)
//              is loaded, group 0 (D) and group 1 (D2) read it, and D = D2 = 2 (A + A2) x B^T
//              if nothing a group reads changes under it.
//              1: both groups read the one fragment
//              2: group 1 reads a copy in other registers, made once the previous group 1 is done
// CHECK_SERIAL 0: only group 0 is waited for before the next rep reloads the fragment (group 1
//              may still be queued); 1: both are (nothing in flight during the reload).
//              Measured on H200 (tests/gpu/test_wgmma_rs.py): with 0, D2 is wrong in the rows of
//              the fragment's registers 0 and 2 in form 1 and right in form 2 (a real copy: the
//              XOR below, which ptxas 13.0 cannot fold back into frag as it folded an earlier build's mov); with
//              1, both are right in both forms. The hazard is the register overlap the PTX ISA
//              names (docs/kernel_design.md). tests/test_wgmma_probe.py checks each build's SASS.
// CHECK_RELOAD 0: the fragment is loaded at the first rep only (D = D2 = 4 A x B^T): with
//              nothing reloaded, a queued group 1 is right.
// CHECK_WARPGROUPS 2: two warpgroups run the same check side by side (a fused K loop has two:
//              warps w and w + 4 share an SM sub-partition), the second started CHECK_WG1_DELAY
//              clocks late; D and D2 hold one copy per warpgroup.
// CHECK_DELAY  N > 0: a spin of N SM clocks between a rep's closing wait and the next reload
//              (diagnostic only). Measured: 200 or more and both groups are right in both forms
//              (the queued group has finished before its registers are reloaded), 0 and form 1's
//              group 1 is wrong.
#include "../wgmma.cuh"

#ifndef CHECK_N
#define CHECK_N 64
#endif
#ifndef CHECK_REUSE
#define CHECK_REUSE 0
#endif
#ifndef CHECK_SERIAL
#define CHECK_SERIAL 0
#endif
#ifndef CHECK_RELOAD
#define CHECK_RELOAD 1
#endif
#ifndef CHECK_DELAY
#define CHECK_DELAY 0
#endif
#ifndef CHECK_WARPGROUPS
#define CHECK_WARPGROUPS 1
#endif
#ifndef CHECK_WG1_DELAY
#define CHECK_WG1_DELAY 0
#endif

namespace megamoe::probe {

constexpr u32 kN = CHECK_N;
constexpr u32 kRowBytes = 128, kRowsA = 64;
static_assert(kN % 8 == 0 && kN <= 256, "CHECK_N: a multiple of 8 up to 256");

}  // namespace megamoe::probe

using namespace megamoe;
using namespace megamoe::probe;

MEGAMOE_DEVICE void store_d(float* d, const float (&acc)[kN / 2]) {
  const int warp = static_cast<int>(threadIdx.x / 32 % 4), lane = static_cast<int>(threadIdx.x % 32);
  d += threadIdx.x / 128 * kRowsA * kN;  // CHECK_WARPGROUPS: each warpgroup its own copy
#pragma unroll
  for (u32 i = 0; i < kN / 2; ++i) d[accum_row(static_cast<int>(i), warp, lane) * kN + accum_col(static_cast<int>(i), lane)] = acc[i];
}

// a, a2: [64][128] bytes, b: [kN][128] bytes (row-major e4m3), d, d2: [64][kN] float (a2 and d2:
// CHECK_REUSE only). One CTA of 128 threads.
extern "C" __global__ void __launch_bounds__(128 * CHECK_WARPGROUPS, 1)
megamoe_wgmma_rs_check(const u8* __restrict__ a, const u8* __restrict__ b, float* __restrict__ d,
                       const u8* __restrict__ a2, float* __restrict__ d2) {
  extern __shared__ u8 smem_raw[];
  u8* smem = reinterpret_cast<u8*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
  // The tiles in the TMA's 128-byte swizzle: A, B, then A2 (8 KB each for A: B stays 1024-byte aligned).
  constexpr u32 kRows = kRowsA + kN + (CHECK_REUSE ? kRowsA : 0);
  for (u32 i = threadIdx.x; i < kRows * 8; i += blockDim.x) {
    const u32 row = i / 8, segment = i % 8;
    const u8* src = row < kRowsA ? a + row * kRowBytes
                    : row < kRowsA + kN ? b + (row - kRowsA) * kRowBytes
                                        : a2 + (row - kRowsA - kN) * kRowBytes;
    *reinterpret_cast<uint4*>(smem + row * kRowBytes + (segment ^ (row % 8)) * 16) =
        *reinterpret_cast<const uint4*>(src + segment * 16);
  }
  fence_proxy_async_shared();  // B is read through the async proxy
  __syncthreads();

  u32 frag[kRowBytes / 32][4];
  const u64 desc_b = make_smem_desc_k_major_sw128(smem + kRowsA * kRowBytes);
  float acc[kN / 2];
#pragma unroll
  for (u32 i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
#if CHECK_REUSE
  constexpr u32 kReps = 4;
  u32 frag1[kRowBytes / 32][4];  // CHECK_REUSE 2: group 1's copy
  float acc2[kN / 2];
#pragma unroll
  for (u32 i = 0; i < kN / 2; ++i) acc2[i] = 0.0f;
  if (CHECK_WG1_DELAY > 0 && threadIdx.x >= 128) {  // the second warpgroup's reps shifted against the first's
    const long long t0 = clock64();
    while (clock64() - t0 < CHECK_WG1_DELAY) {
    }
  }
#pragma unroll 1
  for (u32 r = 0; r < kReps; ++r) {
#if CHECK_DELAY
    if (r > 0) {  // diagnostic: a spin between the last rep's wait and this rep's reload
      const long long t0 = clock64();
      while (clock64() - t0 < CHECK_DELAY) {
      }
    }
#endif
    const u32 tile = smem_addr(smem + (r % 2 ? (kRowsA + kN) * kRowBytes : 0));
    if (CHECK_RELOAD || r == 0) {
#pragma unroll
      for (u32 kk = 0; kk < kRowBytes / 32; ++kk) load_a_fragment_fp8_sw128(frag[kk], tile, kk);
    }
    fence_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (u32 kk = 0; kk < kRowBytes / 32; ++kk) WgmmaFp8E4M3Rs<kN>::mma(frag[kk], desc_b + 2 * kk, acc, true);
    wgmma_commit_group();
#if CHECK_REUSE == 2
    wgmma_wait_group<1>();  // the previous rep's group 1: its copy may be rewritten
    fence_accumulators(acc2);
    // A copy ptxas cannot fold back into frag: XOR with blockIdx.x, 0 in this one-CTA launch but
    // not known to be (NVRTC 13.0's ptxas folded an inline-asm mov, 13.5's did not).
    const u32 zero = blockIdx.x;
#pragma unroll
    for (u32 kk = 0; kk < kRowBytes / 32; ++kk)
#pragma unroll
      for (u32 j = 0; j < 4; ++j) frag1[kk][j] = frag[kk][j] ^ zero;
#else
    fence_accumulators(acc2);
#endif
    wgmma_fence();
#pragma unroll
    for (u32 kk = 0; kk < kRowBytes / 32; ++kk) WgmmaFp8E4M3Rs<kN>::mma(CHECK_REUSE == 2 ? frag1[kk] : frag[kk], desc_b + 2 * kk, acc2, true);
    wgmma_commit_group();
#if CHECK_SERIAL
    wgmma_wait_group<0>();  // diagnostic: nothing left in flight across reps
#else
    wgmma_wait_group<1>();  // group 0 only: group 1 may still be queued when the next rep reloads frag
#endif
    fence_accumulators(acc);
  }
  wgmma_wait_group<0>();
  fence_accumulators(acc2);
  store_d(d2, acc2);
#else
  (void)a2, (void)d2;
#pragma unroll
  for (u32 kk = 0; kk < kRowBytes / 32; ++kk) load_a_fragment_fp8_sw128(frag[kk], smem_addr(smem), kk);
  fence_accumulators(acc);
  wgmma_fence();  // also orders the fragments' loads before the wgmmas that read them
#pragma unroll
  for (u32 kk = 0; kk < kRowBytes / 32; ++kk) WgmmaFp8E4M3Rs<kN>::mma(frag[kk], desc_b + 2 * kk, acc, kk > 0);
  wgmma_commit_group();
  wgmma_wait_group<0>();
#endif
  fence_accumulators(acc);
  store_d(d, acc);
}
