// How fast the FP8 wgmma patterns of the fused kernel's K loop run on their own: no copies, no
// stage waits, no epilogue (benchmarks/wgmma_probe.py). Shared memory holds kStages stages of
// kARows weight rows (A) and kN token rows (B), 128 bytes of K each in the 128-byte swizzle the
// TMA writes, filled once with finite e4m3 bytes; chunk c reads stage c % kStages, as the K loop
// walks its stages. What a pattern loses against mode 0 is the cost of the pattern itself.
//
// PROBE_N       token columns of each m64nNk32 wgmma (the fused kernel's token tile)
// PROBE_WG      consumer warpgroups (the fused kernel: 2)
// PROBE_GROUPS  m64 weight-row groups per warpgroup and chunk (the fused kernel: 2; a warpgroup
//               covers 64 x PROBE_GROUPS rows)
// PROBE_MODE    0: each group accumulates straight through all chunks (one wait per chunk for
//                  the group before last): the rate ceiling of the shape
//               1: each group into a fresh partial per chunk, waited for and promoted (one FFMA
//                  per accumulator with a per-column scale from shared memory); with two groups the
//                  second is promoted during the next chunk, as in k_loop_lagged_promotion
//               2: mode 1 plus one CTA barrier per chunk (the fused kernel's loop without copies)
//               3: one group per warpgroup into two partials taken in turn, each chunk's promotion
//                  lagged behind the next chunk's issue (the 128-token alternative with a queued group)
//               4: mode 3 plus one CTA barrier per chunk
// PROBE_STAGES  stages cycled through
// PROBE_CHUNKS  K chunks per task (the fused kernel's L1 task: hidden / 128); tasks: a launch argument
#include "../wgmma.cuh"

namespace megamoe::probe {

constexpr u32 kN = PROBE_N, kWarpgroups = PROBE_WG, kGroups = PROBE_GROUPS, kMode = PROBE_MODE;
constexpr u32 kStages = PROBE_STAGES, kChunks = PROBE_CHUNKS;
constexpr u32 kRowBytes = 128;  // K bytes per chunk: one FP8 scale block
constexpr u32 kARows = 64 * kGroups * kWarpgroups;
constexpr u32 kStageBytes = (kARows + kN) * kRowBytes;
constexpr u32 kAccum = kN / 2;
constexpr u32 kScaleSets = 4;  // per-chunk scale tables cycled through (values differ per chunk)
static_assert(kN % 8 == 0 && kN <= 256, "PROBE_N: a multiple of 8 up to 256");
static_assert(kGroups == 1 || kGroups == 2, "PROBE_GROUPS: 1 or 2");
static_assert(kMode <= 4 && kStages >= 1 && kChunks >= 2, "PROBE_MODE 0-4, PROBE_STAGES >= 1, PROBE_CHUNKS >= 2");
static_assert(kMode < 3 || kGroups == 1, "PROBE_MODE 3 and 4 take one group per warpgroup");
static_assert(kStageBytes % 1024 == 0, "stages stay 1024-byte aligned for the swizzle");
using Mma = WgmmaFp8E4M3<kN>;

MEGAMOE_DEVICE const u8* a_rows(const u8* stage, u32 wg, u32 g) { return stage + (wg * kGroups + g) * 64 * kRowBytes; }
MEGAMOE_DEVICE const u8* b_rows(const u8* stage) { return stage + kARows * kRowBytes; }

MEGAMOE_DEVICE void issue(float (&d)[kAccum], const u8* a, const u8* b, bool accumulate) {
  const u64 desc_a = make_smem_desc_k_major_sw128(a), desc_b = make_smem_desc_k_major_sw128(b);
  fence_accumulators(d);
  wgmma_fence();
#pragma unroll
  for (u32 kk = 0; kk < kRowBytes / 32; ++kk) Mma::mma(desc_a + 2 * kk, desc_b + 2 * kk, d, accumulate || kk > 0);
  wgmma_commit_group();
}

template <int kPending>
MEGAMOE_DEVICE void wait_for(float (&d)[kAccum]) {
  fence_accumulators(d);
  wgmma_wait_group<kPending>();
  fence_accumulators(d);
}

// Per n8 tile, the two columns this thread holds (as the fused kernel's PromoteScales, with one
// weight scale): read before the wait, so their latency hides behind the tensor cores.
struct Scales {
  float s[kN / 8][2];
};

MEGAMOE_DEVICE void load_scales(Scales& s, const float* table, u32 chunk) {
  const float* set = table + (chunk % kScaleSets) * kN;
#pragma unroll
  for (u32 nt = 0; nt < kN / 8; ++nt) {
    s.s[nt][0] = set[nt * 8 + 2 * (threadIdx.x % 4)];
    s.s[nt][1] = set[nt * 8 + 2 * (threadIdx.x % 4) + 1];
  }
}

MEGAMOE_DEVICE void promote(float (&acc)[kAccum], const float (&part)[kAccum], const Scales& s) {
#pragma unroll
  for (u32 i = 0; i < kAccum; ++i) acc[i] = fmaf(part[i], s.s[i / 4][i % 2], acc[i]);
}


// One task's K loop of kChunks chunks (a compile-time count, as in the fused kernel: ptxas then
// tracks which wgmma group each wait completes; the two-group lagged pattern peels chunk 0 for
// the same reason). acc += the task.
MEGAMOE_DEVICE void task_k_loop(float (&acc)[kGroups][kAccum], const u8* smem, const float* scale_table, u32 wg) {
  float part0[kAccum], part1[kAccum];  // written by each group's first k step (scale-d 0)
  if constexpr (kMode == 0) {
    for (u32 c = 0; c < kChunks; ++c) {
      const u8* stage = smem + (c % kStages) * kStageBytes;
#pragma unroll
      for (u32 g = 0; g < kGroups; ++g) issue(acc[g], a_rows(stage, wg, g), b_rows(stage), true);
      wait_for<kGroups>(acc[0]);  // the previous chunk's groups are done
    }
    wait_for<0>(acc[0]);
  } else if constexpr (kGroups == 2) {
    Scales scales;  // chunk c's, from its first group's promotion to its second's
    issue(part0, a_rows(smem, wg, 0), b_rows(smem), false);
    if constexpr (kMode == 2) __syncthreads();
    issue(part1, a_rows(smem, wg, 1), b_rows(smem), false);
    load_scales(scales, scale_table, 0);
    wait_for<1>(part0);
    promote(acc[0], part0, scales);
#pragma unroll  // a rolled loop: ptxas lost track of the pending groups and serialized every wgmma (C7514)
    for (u32 c = 1; c < kChunks; ++c) {
      const u8* stage = smem + (c % kStages) * kStageBytes;
      issue(part0, a_rows(stage, wg, 0), b_rows(stage), false);
      wait_for<1>(part1);  // group 1 of chunk c - 1, while group 0 of chunk c runs
      promote(acc[1], part1, scales);
      if constexpr (kMode == 2) __syncthreads();
      issue(part1, a_rows(stage, wg, 1), b_rows(stage), false);
      load_scales(scales, scale_table, c);
      wait_for<1>(part0);
      promote(acc[0], part0, scales);
    }
    wait_for<0>(part1);
    promote(acc[1], part1, scales);
  } else if constexpr (kMode >= 3) {
    // One group, two partials taken in turn: chunk c - 1's promotion runs while chunk c's group
    // is on the tensor cores.
    Scales scales;
    issue(part0, a_rows(smem, wg, 0), b_rows(smem), false);
    load_scales(scales, scale_table, 0);
#pragma unroll  // as above: the partial a chunk uses must be known at compile time
    for (u32 c = 1; c < kChunks; ++c) {
      const u8* stage = smem + (c % kStages) * kStageBytes;
      if constexpr (kMode == 4) __syncthreads();
      if (c % 2) {
        issue(part1, a_rows(stage, wg, 0), b_rows(stage), false);
        wait_for<1>(part0);
        promote(acc[0], part0, scales);
      } else {
        issue(part0, a_rows(stage, wg, 0), b_rows(stage), false);
        wait_for<1>(part1);
        promote(acc[0], part1, scales);
      }
      load_scales(scales, scale_table, c);
    }
    if constexpr (kChunks % 2) {
      wait_for<0>(part0);
      promote(acc[0], part0, scales);
    } else {
      wait_for<0>(part1);
      promote(acc[0], part1, scales);
    }
  } else {
    for (u32 c = 0; c < kChunks; ++c) {
      const u8* stage = smem + (c % kStages) * kStageBytes;
      Scales scales;
      issue(part0, a_rows(stage, wg, 0), b_rows(stage), false);
      load_scales(scales, scale_table, c);
      wait_for<0>(part0);
      promote(acc[0], part0, scales);
      if constexpr (kMode == 2) __syncthreads();
    }
  }
}

}  // namespace megamoe::probe

using namespace megamoe;
using namespace megamoe::probe;

// cycles[cta * kWarpgroups + wg]: SM cycles of warpgroup wg's `tasks` K loops (its thread 0); sink: one sum
// per thread, so that no wgmma is dead code.
extern "C" __global__ void __launch_bounds__(kWarpgroups * 128, 1)
megamoe_wgmma_rate(unsigned long long* cycles, float* sink, int tasks) {
  extern __shared__ u8 smem_raw[];
  u8* smem = reinterpret_cast<u8*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
  float* scale_table = reinterpret_cast<float*>(smem + kStages * kStageBytes);
  for (u32 i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
    u32 h = (i + 1) * 2654435761u ^ (blockIdx.x * 40503u);
    h ^= h >> 15;
    h *= 2246822519u;
    reinterpret_cast<u32*>(smem)[i] = h & 0xBFBFBFBFu;  // top exponent bit clear: finite e4m3, |x| < 2
  }
  for (u32 i = threadIdx.x; i < kScaleSets * kN; i += blockDim.x) scale_table[i] = 1.0f / static_cast<float>(1 + i % 7);
  fence_proxy_async_shared();  // the wgmmas read these bytes through the async proxy
  __syncthreads();

  const u32 wg = threadIdx.x / 128;
  float acc[kGroups][kAccum];
#pragma unroll
  for (u32 g = 0; g < kGroups; ++g)
#pragma unroll
    for (u32 i = 0; i < kAccum; ++i) acc[g][i] = 0.0f;

  const unsigned long long start = clock64();
  // acc is not zeroed between tasks (the fused kernel does): it keeps every task's promotions live.
  for (int task = 0; task < tasks; ++task) task_k_loop(acc, smem, scale_table, wg);
  const unsigned long long stop = clock64();
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * kWarpgroups + wg] = stop - start;
  float sum = 0.0f;
#pragma unroll
  for (u32 g = 0; g < kGroups; ++g)
#pragma unroll
    for (u32 i = 0; i < kAccum; ++i) sum += acc[g][i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
