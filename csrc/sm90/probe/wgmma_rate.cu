// How fast the FP8 wgmma patterns of the fused kernel's K loop run on their own: no copies, no
// stage waits, no epilogue (benchmarks/wgmma_probe.py). Shared memory holds kStages stages of
// weight rows and token rows, 128 bytes of K each in the 128-byte swizzle the TMA writes, filled
// once with finite e4m3 bytes; chunk c reads stage c % kStages, as the K loop walks its stages.
// What a pattern loses against mode 0 is the cost of the pattern itself.
//
// PROBE_A_REGS  0: the fused kernel's swap-AB form: weight rows are the M side (A, descriptors),
//                  the token tile the N side (B, descriptors), re-read by every m64 group
//               1: tokens are the M side, 64 rows shared by the warpgroups and loaded into
//                  registers every chunk (load_a_fragment_fp8_sw128: one ldmatrix.x4 per k-step,
//                  checked by tests/gpu/test_wgmma_rs.py); weight rows the N side (descriptors)
// PROBE_N       the wgmma N: token columns (A_REGS 0, the fused kernel's token tile) or weight
//               rows per group (A_REGS 1)
// PROBE_WG      consumer warpgroups (the fused kernel: 2)
// PROBE_GROUPS  weight-row groups per warpgroup and chunk: m64 groups (A_REGS 0; the fused kernel:
//               2, a warpgroup covers 64 x PROBE_GROUPS rows) or nN groups (A_REGS 1, both groups
//               on the chunk's token registers)
// PROBE_MODE    0: each group accumulates straight through all chunks (one wait per chunk for
//                  the group before last): the rate ceiling of the shape
//               1: each group into a fresh partial per chunk, waited for and promoted (one FFMA
//                  per accumulator with a scale from shared memory); with two groups the second
//                  is promoted during the next chunk, as in k_loop_lagged_promotion
//               2: mode 1 plus one CTA barrier per chunk (the fused kernel's loop without copies)
//               3: one group per warpgroup into two partials taken in turn, each chunk's promotion
//                  lagged behind the next chunk's issue
//               4: mode 3 plus one CTA barrier per chunk
// PROBE_PRODUCTS 1 (modes 1 and 2, two groups): the promotion's scale per accumulator is a
//               weight x token product made per chunk: A_REGS 0 two weight scales per thread, 32
//               FMULs for n64, as the fused kernel's load_promote_scales does; A_REGS 1 one weight
//               scale per group and the thread's two token rows, 4 FMULs
// PROBE_STAGE_WAIT 1 (mode 2): a stage mbarrier per stage as the TMA loop has; every chunk waits for
//               its stage's phase, and thread 0 arrives on the stage of chunk c + S - 1 after the
//               CTA barrier (the fused kernel's refill with ablate=tma: no copies)
// PROBE_COPY 1 (with PROBE_STAGE_WAIT): the refill is a real copy, as the TMA loop's: thread 0
//               loads the stage's bytes from global memory (a small L2-resident buffer cycled
//               through) with one bulk copy that completes the stage's phase
// PROBE_STAGES  stages cycled through
// PROBE_CHUNKS  K chunks per task (the fused kernel's L1 task: hidden / 128); tasks: a launch argument
#include "../tma.cuh"
#include "../wgmma.cuh"

#ifndef PROBE_A_REGS
#define PROBE_A_REGS 0
#endif
#ifndef PROBE_PRODUCTS
#define PROBE_PRODUCTS 0
#endif
#ifndef PROBE_STAGE_WAIT
#define PROBE_STAGE_WAIT 0
#endif
#ifndef PROBE_COPY
#define PROBE_COPY 0
#endif

namespace megamoe::probe {

constexpr bool kARegs = PROBE_A_REGS != 0;
constexpr bool kProducts = PROBE_PRODUCTS != 0, kStageWait = PROBE_STAGE_WAIT != 0, kCopy = PROBE_COPY != 0;
constexpr u32 kCopySources = 8;  // stages' worth of bytes in the copy source buffer
constexpr u32 kN = PROBE_N, kWarpgroups = PROBE_WG, kGroups = PROBE_GROUPS, kMode = PROBE_MODE;
constexpr u32 kStages = PROBE_STAGES, kChunks = PROBE_CHUNKS;
constexpr u32 kRowBytes = 128;  // K bytes per chunk: one FP8 scale block
constexpr u32 kWeightRows = (kARegs ? kN : 64) * kGroups * kWarpgroups;
constexpr u32 kTokenRows = kARegs ? 64 : kN;
constexpr u32 kStageBytes = (kWeightRows + kTokenRows) * kRowBytes;
constexpr u32 kAccum = kN / 2;
constexpr u32 kScaleSets = 4;  // per-chunk scale tables cycled through (values differ per chunk)
constexpr u32 kScaleCols = (kN > 64 ? kN : 64) + 2 * kWarpgroups;  // token columns or rows (+ rs prod's weight scales)
static_assert(kN % 8 == 0 && kN <= 256, "PROBE_N: a multiple of 8 up to 256");
static_assert(kGroups == 1 || kGroups == 2, "PROBE_GROUPS: 1 or 2");
static_assert(kMode <= 4 && kStages >= 1 && kChunks >= 2, "PROBE_MODE 0-4, PROBE_STAGES >= 1, PROBE_CHUNKS >= 2");
static_assert(kMode < 3 || kGroups == 1, "PROBE_MODE 3 and 4 take one group per warpgroup");
static_assert(!kProducts || (kGroups == 2 && (kMode == 1 || kMode == 2)), "PROBE_PRODUCTS: modes 1 / 2, two groups");
static_assert(!kStageWait || (kGroups == 2 && kMode == 2), "PROBE_STAGE_WAIT: mode 2 (its CTA barrier orders the arrivals)");
static_assert(!kCopy || kStageWait, "PROBE_COPY refills through the stage waits (PROBE_STAGE_WAIT)");
static_assert(kStageBytes % 1024 == 0, "stages stay 1024-byte aligned for the swizzle");

MEGAMOE_DEVICE const u8* weight_rows(const u8* stage, u32 wg, u32 g) {
  return stage + (wg * kGroups + g) * (kARegs ? kN : 64) * kRowBytes;
}
MEGAMOE_DEVICE const u8* token_rows(const u8* stage) { return stage + kWeightRows * kRowBytes; }

// A_REGS 1: the token operand of one chunk, 4 registers per k32 step.
struct AFrag {
  u32 r[kRowBytes / 32][4];
};

MEGAMOE_DEVICE void load_a(AFrag& a, const u8* stage) {
#pragma unroll
  for (u32 kk = 0; kk < kRowBytes / 32; ++kk) load_a_fragment_fp8_sw128(a.r[kk], smem_addr(token_rows(stage)), kk);
}

// One m64nN group of a staged chunk into d, committed: weight-row group g of warpgroup wg.
MEGAMOE_DEVICE void issue(float (&d)[kAccum], const u8* stage, u32 wg, u32 g, const AFrag& a, bool accumulate) {
  const u64 desc_w = make_smem_desc_k_major_sw128(weight_rows(stage, wg, g));
  const u64 desc_t = make_smem_desc_k_major_sw128(token_rows(stage));
  fence_accumulators(d);
  wgmma_fence();  // also orders the A registers' loads before the wgmmas that read them
#pragma unroll
  for (u32 kk = 0; kk < kRowBytes / 32; ++kk) {
    if constexpr (kARegs) WgmmaFp8E4M3Rs<kN>::mma(a.r[kk], desc_w + 2 * kk, d, accumulate || kk > 0);
    else WgmmaFp8E4M3<kN>::mma(desc_w + 2 * kk, desc_t + 2 * kk, d, accumulate || kk > 0);
  }
  wgmma_commit_group();
}

template <int kPending>
MEGAMOE_DEVICE void wait_for(float (&d)[kAccum]) {
  fence_accumulators(d);
  wgmma_wait_group<kPending>();
  fence_accumulators(d);
}

// The promotion's scales, read before the wait so their latency hides behind the tensor cores.
// A_REGS 0: per n8 tile the two token columns this thread holds (the fused kernel's
// PromoteScales with one weight scale). A_REGS 1: the thread's two token rows (the weight
// scale is one value per chunk for a warpgroup's <= 128 rows, folded in; with PROBE_PRODUCTS one
// weight scale per group: slots [0][2 g + 0 / 1], group g's products with the two token rows).
struct Scales {
  float s[kARegs ? 1 : kN / 8][kProducts ? 4 : 2];
};

MEGAMOE_DEVICE void load_scales(Scales& s, const float* table, u32 chunk) {
  const float* set = table + (chunk % kScaleSets) * kScaleCols;
  if constexpr (kProducts && kARegs) {
    const u32 row = (threadIdx.x % 128) / 32 * 16 + (threadIdx.x % 32) / 4;
    const u32 wg = threadIdx.x / 128;
    const float t_lo = set[row], t_hi = set[row + 8];
    const float w0 = set[64 + 2 * wg], w1 = set[65 + 2 * wg];  // past the 64 token rows
    s.s[0][0] = w0 * t_lo, s.s[0][1] = w0 * t_hi, s.s[0][2] = w1 * t_lo, s.s[0][3] = w1 * t_hi;
  } else if constexpr (kProducts) {  // slots [nt][0..3]: rows g, g (tokens 2 t4, + 1), rows g + 8, g + 8
    const u32 warp = threadIdx.x / 32;
    const float w_lo = set[warp], w_hi = set[warp + 8];
#pragma unroll
    for (u32 nt = 0; nt < kN / 8; ++nt) {
      const float2 tok = *reinterpret_cast<const float2*>(set + nt * 8 + 2 * (threadIdx.x % 4));
      s.s[nt][0] = w_lo * tok.x, s.s[nt][1] = w_lo * tok.y;
      s.s[nt][2] = w_hi * tok.x, s.s[nt][3] = w_hi * tok.y;
    }
  } else if constexpr (kARegs) {
    const u32 row = (threadIdx.x % 128) / 32 * 16 + (threadIdx.x % 32) / 4;
    s.s[0][0] = set[row];
    s.s[0][1] = set[row + 8];
  } else {
#pragma unroll
    for (u32 nt = 0; nt < kN / 8; ++nt) {
      s.s[nt][0] = set[nt * 8 + 2 * (threadIdx.x % 4)];
      s.s[nt][1] = set[nt * 8 + 2 * (threadIdx.x % 4) + 1];
    }
  }
}

// Accumulator element i of an m64nN fragment: row (i % 4) / 2 (+8), column 8 (i / 4) + i % 2.
// g: the group (A_REGS with PROBE_PRODUCTS picks its weight scale's products).
MEGAMOE_DEVICE void promote(float (&acc)[kAccum], const float (&part)[kAccum], const Scales& s, u32 g = 0) {
#pragma unroll
  for (u32 i = 0; i < kAccum; ++i)
    acc[i] = fmaf(part[i],
                  kARegs ? s.s[0][(kProducts ? 2 * g : 0) + (i % 4) / 2] : kProducts ? s.s[i / 4][i % 4] : s.s[i / 4][i % 2],
                  acc[i]);
}

// PROBE_STAGE_WAIT: chunk `seq` (counted over the launch) waits for its stage's phase (a copy that
// never lands traps instead of hanging the device); after the CTA barrier of chunk seq, thread 0
// completes the phase of chunk seq + S - 1 (the refill's arrival).
MEGAMOE_DEVICE void wait_stage(u64* full, u32 seq) {
  if constexpr (kStageWait) mbarrier_wait(&full[seq % kStages], (seq / kStages) & 1, 0);
}
MEGAMOE_DEVICE void refill_stage(u64* full, u32 seq, u8* smem, const u8* copy_src) {
  if constexpr (kStageWait) {
    if (threadIdx.x != 0) return;
    const u32 stage = (seq + kStages - 1) % kStages;
    if constexpr (kCopy) {  // the stage's bytes land from global memory, as the TMA refill's
      mbarrier_arrive_expect_tx(&full[stage], kStageBytes);
      bulk_load(smem + stage * kStageBytes, copy_src + (seq % kCopySources) * kStageBytes, kStageBytes, &full[stage]);
    } else {
      mbarrier_arrive(&full[stage]);
    }
  }
}

// One task's K loop of kChunks chunks, fully unrolled: rolled, ptxas lost track of which group a
// wait completes across the back edge of the two-group pattern and serialized every wgmma
// (C7514), and the A_REGS and two-partial patterns pick their register set by the chunk's
// parity. acc += the task.
MEGAMOE_DEVICE void task_k_loop(float (&acc)[kGroups][kAccum], u8* smem, const float* scale_table, u32 wg,
                                u64* full, u32 seq, const u8* copy_src) {
  float part0[kAccum], part1[kAccum];  // written by each group's first k step (scale-d 0)
  AFrag a[2];                           // A_REGS: chunk c's token operand in a[c % 2]
  Scales scales;
  const auto stage_of = [&](u32 c) { return smem + (c % kStages) * kStageBytes; };
  if constexpr (kMode == 0) {
#pragma unroll
    for (u32 c = 0; c < kChunks; ++c) {
      if constexpr (kARegs) load_a(a[c % 2], stage_of(c));  // chunk c - 2's wgmmas are done
#pragma unroll
      for (u32 g = 0; g < kGroups; ++g) issue(acc[g], stage_of(c), wg, g, a[c % 2], true);
      wait_for<kGroups>(acc[0]);  // the previous chunk's groups are done
    }
    wait_for<0>(acc[0]);
  } else if constexpr (kMode <= 2 && kGroups == 2) {
    // A_REGS: chunk c's tokens in a[c % 2], loaded before its first group; the buffer last fed
    // g1(c - 2), which chunk c - 1 waited for.
    wait_stage(full, seq);
    if constexpr (kARegs) load_a(a[0], stage_of(0));
    issue(part0, stage_of(0), wg, 0, a[0], false);
    if constexpr (kMode == 2) __syncthreads();
    refill_stage(full, seq, smem, copy_src);
    issue(part1, stage_of(0), wg, 1, a[0], false);
    load_scales(scales, scale_table, 0);
    wait_for<1>(part0);
    promote(acc[0], part0, scales);
#pragma unroll
    for (u32 c = 1; c < kChunks; ++c) {
      wait_stage(full, seq + c);
      if constexpr (kARegs) load_a(a[c % 2], stage_of(c));
      issue(part0, stage_of(c), wg, 0, a[c % 2], false);
      wait_for<1>(part1);  // group 1 of chunk c - 1, while group 0 of chunk c runs
      promote(acc[1], part1, scales, 1);
      if constexpr (kMode == 2) __syncthreads();
      refill_stage(full, seq + c, smem, copy_src);
      issue(part1, stage_of(c), wg, 1, a[c % 2], false);
      load_scales(scales, scale_table, c);
      wait_for<1>(part0);
      promote(acc[0], part0, scales);
    }
    wait_for<0>(part1);
    promote(acc[1], part1, scales, 1);
  } else if constexpr (kMode <= 2) {
#pragma unroll
    for (u32 c = 0; c < kChunks; ++c) {
      if constexpr (kARegs) load_a(a[0], stage_of(c));  // the last chunk's group was waited for
      issue(part0, stage_of(c), wg, 0, a[0], false);
      load_scales(scales, scale_table, c);
      wait_for<0>(part0);
      promote(acc[0], part0, scales);
      if constexpr (kMode == 2) __syncthreads();
    }
  } else {
    // One group, two partials taken in turn: chunk c - 1's promotion runs while chunk c's group
    // is on the tensor cores.
    if constexpr (kARegs) load_a(a[0], stage_of(0));
    issue(part0, stage_of(0), wg, 0, a[0], false);
    load_scales(scales, scale_table, 0);
#pragma unroll
    for (u32 c = 1; c < kChunks; ++c) {
      if constexpr (kMode == 4) __syncthreads();
      if constexpr (kARegs) load_a(a[c % 2], stage_of(c));  // chunk c - 2's group is done
      if (c % 2) {
        issue(part1, stage_of(c), wg, 0, a[1], false);
        wait_for<1>(part0);
        promote(acc[0], part0, scales);
      } else {
        issue(part0, stage_of(c), wg, 0, a[0], false);
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
  }
}

}  // namespace megamoe::probe

using namespace megamoe;
using namespace megamoe::probe;

// copy_src (PROBE_COPY): kCopySources stages' worth of finite e4m3 bytes, 16-byte aligned.
// cycles[cta * kWarpgroups + wg]: SM cycles of warpgroup wg's `tasks` K loops (its thread 0); sink: one sum
// per thread, so that no wgmma is dead code.
extern "C" __global__ void __launch_bounds__(kWarpgroups * 128, 1)
megamoe_wgmma_rate(unsigned long long* cycles, float* sink, int tasks, const u8* copy_src) {
  extern __shared__ u8 smem_raw[];
  u8* smem = reinterpret_cast<u8*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
  float* scale_table = reinterpret_cast<float*>(smem + kStages * kStageBytes);
  u64* full = reinterpret_cast<u64*>(scale_table + kScaleSets * kScaleCols);  // PROBE_STAGE_WAIT
  if (kStageWait && threadIdx.x == 0) {
    for (u32 s = 0; s < kStages; ++s) mbarrier_init(&full[s], 1);
    fence_barrier_init();
    for (u32 s = 0; s + 1 < kStages; ++s) mbarrier_arrive(&full[s]);  // chunks 0 .. S - 2 "landed"
  }
  for (u32 i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
    u32 h = (i + 1) * 2654435761u ^ (blockIdx.x * 40503u);
    h ^= h >> 15;
    h *= 2246822519u;
    reinterpret_cast<u32*>(smem)[i] = h & 0xBFBFBFBFu;  // top exponent bit clear: finite e4m3, |x| < 2
  }
  for (u32 i = threadIdx.x; i < kScaleSets * kScaleCols; i += blockDim.x) scale_table[i] = 1.0f / static_cast<float>(1 + i % 7);
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
  for (int task = 0; task < tasks; ++task) task_k_loop(acc, smem, scale_table, wg, full, static_cast<u32>(task) * kChunks, copy_src);
  const unsigned long long stop = clock64();
  // The last chunks' refills (PROBE_COPY: copies) must land before the CTA exits.
  for (u32 i = 0; kStageWait && i + 1 < kStages; ++i) wait_stage(full, static_cast<u32>(tasks) * kChunks + i);
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * kWarpgroups + wg] = stop - start;
  float sum = 0.0f;
#pragma unroll
  for (u32 g = 0; g < kGroups; ++g)
#pragma unroll
    for (u32 i = 0; i < kAccum; ++i) sum += acc[g][i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
