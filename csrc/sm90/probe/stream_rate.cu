// How fast an SM's stages fill with the fused kernel's operand boxes (TMA, no math), alone or in
// 2-CTA clusters whose CTAs multicast one operand to both: is the prefill K loop's operand stream
// (0.73-0.83 of an FP8 L1 task without any wgmma) bound by what the L2 cache hands out, which a
// shared weight box halves, or by what an SM takes in, which it does not change?
// (benchmarks/stream_probe.py)
//
// A chunk is the fused kernel's stage: 256 weight rows and PROBE_TOKENS token rows of 128 K bytes,
// 128-byte swizzled. Task g (counted over the grid, g = task x grid + CTA, as the persistent task
// queue hands them out) reads weight tile tile(g) and token block block(g) over PROBE_CHUNKS chunks.
//
// PROBE_TOKENS   token rows per chunk (the task's token tile: 32, 64 or 128)
// PROBE_STAGES   stages cycled through
// PROBE_CHUNKS   K chunks per task (hidden / 128)
// PROBE_CLUSTER  CTAs per cluster: 1 or 2 (compile-time cluster dims, so a plain launch)
// PROBE_SHARE    0: each CTA loads both boxes itself, tasks in the fused kernel's weight-tile-major
//                   order (`blocks` consecutive tasks share a tile)
//                1 (cluster 2): the pair's tasks share a weight tile (same order, blocks even); each
//                   CTA loads half of its rows, multicast into both CTAs' stage
//                2 (cluster 2): the pair's tasks share a token block over two weight tiles; each
//                   CTA loads half of the token rows, multicast
// PROBE_CHECKSUM 1: the consumer warp adds up every stage's 32-bit words (tests/gpu: the bytes
//                   arrived where they should); 0 for timing
// PROBE_SPIN     SM clocks the consumer holds each stage before releasing it (the K loop's math on
//                   the chunk, ~1600 for an FP8 128-token chunk): does the stream keep up with a
//                   consumer at that pace, or does a chunk still wait for its stage?
// PROBE_TILED    0: weights as the fused kernel keeps them, rows of kChunks x 128 bytes (a box is 256
//                   pieces of 128 bytes, one per row, a row pitch apart); 1: each box stored whole,
//                   [tile][chunk][256 rows][128 bytes] (a box is 32 KB in a row): does HBM serve a
//                   decode task's stream faster when a box is contiguous (docs/kernel_design.md)?
#include "../tma.cuh"

#ifndef PROBE_CHECKSUM
#define PROBE_CHECKSUM 0
#endif
#ifndef PROBE_SPIN
#define PROBE_SPIN 0
#endif
#ifndef PROBE_TILED
#define PROBE_TILED 0
#endif
#if PROBE_CLUSTER > 1
#define PROBE_CLUSTER_DIMS __cluster_dims__(PROBE_CLUSTER, 1, 1)
#else
#define PROBE_CLUSTER_DIMS
#endif

namespace megamoe::probe {

constexpr u32 kTokens = PROBE_TOKENS, kStages = PROBE_STAGES, kChunks = PROBE_CHUNKS;
constexpr u32 kCluster = PROBE_CLUSTER, kShare = PROBE_SHARE;
constexpr bool kChecksum = PROBE_CHECKSUM != 0;
constexpr long long kSpin = PROBE_SPIN;
constexpr bool kTiled = PROBE_TILED != 0;
constexpr u32 kWeightRows = 256, kRowBytes = 128;
constexpr u32 kWeightBytes = kWeightRows * kRowBytes, kTokenBytes = kTokens * kRowBytes;
constexpr u32 kStageBytes = kWeightBytes + kTokenBytes;
// Rows of the boxes this CTA loads (a multicast half, or the whole box).
constexpr u32 kWeightBoxRows = kShare == 1 ? kWeightRows / 2 : kWeightRows;
constexpr u32 kTokenBoxRows = kShare == 2 ? kTokens / 2 : kTokens;
static_assert(kTokens == 32 || kTokens == 64 || kTokens == 128, "PROBE_TOKENS: 32, 64 or 128");
static_assert(kCluster == 1 || kCluster == 2, "PROBE_CLUSTER: 1 or 2");
static_assert(kShare <= 2 && (kShare == 0 || kCluster == 2), "PROBE_SHARE 1 / 2 take a cluster of 2");
static_assert(kStages >= 2 && kChunks >= 1, "PROBE_STAGES >= 2, PROBE_CHUNKS >= 1");
// 128-byte swizzle: every box lands on a 1024-byte boundary (halves included).
static_assert(kTokenBoxRows * kRowBytes % 1024 == 0 && kStageBytes % 1024 == 0, "boxes on 1024-byte boundaries");

struct Task {
  u32 tile, block;
};

MEGAMOE_DEVICE Task task_of(u32 g, u32 tiles, u32 blocks) {
  if constexpr (kShare == 2) return {(2 * (g / (2 * blocks)) + g % 2) % tiles, (g / 2) % blocks};
  return {(g / blocks) % tiles, g % blocks};
}

MEGAMOE_DEVICE u32 cta_rank() { return kCluster > 1 ? cluster_cta_rank() : 0; }

MEGAMOE_DEVICE void cta_group_sync() {
  if constexpr (kCluster > 1) cluster_sync();
  else __syncthreads();
}

// Thread 0: every chunk's boxes into stage seq % kStages once the CTAs it writes to released it.
MEGAMOE_DEVICE void produce(const TensorMap* weights, const TensorMap* tokens, u8* stages, u64* full, u64* empty,
                            u32 tasks, u32 tiles, u32 blocks) {
  const u32 rank = cta_rank();
  u32 seq = 0;
  for (u32 t = 0; t < tasks; ++t) {
    const Task task = task_of(t * gridDim.x + blockIdx.x, tiles, blocks);
    for (u32 c = 0; c < kChunks; ++c, ++seq) {
      const u32 s = seq % kStages;
      if (seq >= kStages) mbarrier_wait<true>(&empty[s], (seq / kStages - 1) & 1, 1000 + s);
      u8* stage = stages + s * kStageBytes;
      mbarrier_arrive_expect_tx(&full[s], kStageBytes);  // both boxes whole, whoever loads them
      const int k = static_cast<int>(c * kRowBytes);
      // Tiled: the box is rows (tile x kChunks + c) x 256 of a tensor 128 bytes wide, at K offset 0.
      const u32 w_box = kTiled ? (task.tile * kChunks + c) * kWeightRows : task.tile * kWeightRows;
      const int w_k = kTiled ? 0 : k;
      const int w_row = static_cast<int>(w_box + (kShare == 1 ? rank * kWeightBoxRows : 0));
      const int t_row = static_cast<int>(task.block * kTokens + (kShare == 2 ? rank * kTokenBoxRows : 0));
      u8* w_dst = stage + (kShare == 1 ? rank * kWeightBoxRows * kRowBytes : 0);
      u8* t_dst = stage + kWeightBytes + (kShare == 2 ? rank * kTokenBoxRows * kRowBytes : 0);
      if constexpr (kShare == 1) tma_load_2d_multicast(weights, w_dst, &full[s], w_k, w_row, 0x3);
      else tma_load_2d(weights, w_dst, &full[s], w_k, w_row);
      if constexpr (kShare == 2) tma_load_2d_multicast(tokens, t_dst, &full[s], k, t_row, 0x3);
      else tma_load_2d(tokens, t_dst, &full[s], k, t_row);
    }
  }
}

// Warp 1: waits for each stage, optionally adds up its words, and releases it to every CTA whose
// producer writes into it. Returns the warp's checksum (0 without PROBE_CHECKSUM).
MEGAMOE_DEVICE u32 consume(const u8* stages, u64* full, u64* empty, u32 tasks) {
  const u32 lane = threadIdx.x % 32;
  u32 sum = 0;
  for (u32 seq = 0; seq < tasks * kChunks; ++seq) {
    const u32 s = seq % kStages;
    mbarrier_wait<true>(&full[s], (seq / kStages) & 1, 2000 + s);
    if constexpr (kChecksum) {
      const uint4* words = reinterpret_cast<const uint4*>(stages + s * kStageBytes);
      for (u32 i = lane; i < kStageBytes / 16; i += 32) {
        const uint4 v = words[i];
        sum += v.x + v.y + v.z + v.w;
      }
    }
    if constexpr (kSpin > 0) {  // the chunk's math, as a wait of the SM clock
      const long long t0 = clock64();
      while (clock64() - t0 < kSpin) {
      }
    }
    __syncwarp();
    if (lane == 0) {
      if constexpr (kShare > 0) {
        for (u32 cta = 0; cta < kCluster; ++cta) mbarrier_arrive_cluster(&empty[s], cta);
      } else {
        mbarrier_arrive(&empty[s]);
      }
    }
  }
  for (u32 off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  return sum;
}

}  // namespace megamoe::probe

using namespace megamoe;
using namespace megamoe::probe;

// Read back by the host to check its byte arithmetic (stream_probe.stage_bytes).
extern "C" __device__ int megamoe_stream_rate_stage_bytes = kStageBytes;

// weights: [tiles x 256][chunks x 128] bytes (tiled: [tiles x chunks x 256][128]), box 128 x kWeightBoxRows; tokens: [blocks x
// kTokens][chunks x 128], box 128 x kTokenBoxRows. Per CTA: cycles[b] (the consumer's SM clock
// from its first wait to its last release), ns[2 b], ns[2 b + 1] (global timer at those points:
// whether all CTAs ran at once), checksum[b].
extern "C" __global__ void __launch_bounds__(64, 1) PROBE_CLUSTER_DIMS
    megamoe_stream_rate(const __grid_constant__ TensorMap weights, const __grid_constant__ TensorMap tokens, int tasks,
                        int tiles, int blocks, unsigned long long* cycles, unsigned long long* ns, u32* checksum) {
  extern __shared__ u8 smem_raw[];
  __shared__ alignas(8) u64 full[kStages];
  __shared__ alignas(8) u64 empty[kStages];
  // The same offset in every CTA of the cluster (multicast writes and remote arrivals use it).
  u8* stages = reinterpret_cast<u8*>((reinterpret_cast<u64>(smem_raw) + 1023) & ~static_cast<u64>(1023));
  if (threadIdx.x == 0) {
    tma_prefetch_descriptor(&weights);
    tma_prefetch_descriptor(&tokens);
    for (u32 s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kShare > 0 ? kCluster : 1);  // the consumers of every CTA the stage is written in
    }
    fence_barrier_init();
  }
  __syncwarp();
  cta_group_sync();  // the cluster's barriers initialised before any multicast or remote arrival
  if (threadIdx.x == 0) {
    produce(&weights, &tokens, stages, full, empty, tasks, tiles, blocks);
  } else if (threadIdx.x / 32 == 1) {
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const long long c0 = clock64();
    const u32 sum = consume(stages, full, empty, tasks);
    const long long c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 32) {
      cycles[blockIdx.x] = static_cast<unsigned long long>(c1 - c0);
      ns[2 * blockIdx.x] = t0, ns[2 * blockIdx.x + 1] = t1;
      checksum[blockIdx.x] = sum;
    }
  }
  __syncwarp();
  cta_group_sync();  // no CTA leaves while a peer may still write into it or arrive on its barriers
}
