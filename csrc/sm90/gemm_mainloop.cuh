// The swap-AB GEMM machinery: tile configuration, shared-memory layout, the TMA producer and the
// wgmma consumer mainloop. Reused by the standalone grouped GEMMs and, later, by the fused mega-MoE
// kernel (L1 and L2), which supplies its own scheduler and epilogue.
//
// Two flavours share everything but the inner loop:
//   FP8 (e4m3, 128x128 weight / 1x128 token block scales): K stage = 128 values = one scale block;
//     FP32 accumulators promoted per stage: acc += partial * w_scale(row block) * x_scale(token)
//   BF16 (no scales): K stage = 64 values (the same 128 bytes per row); wgmma accumulates directly.
//
// Roles per CTA (kNumConsumerWG + 1 warpgroups):
//   consumer warpgroups 0..kNumConsumerWG-1: each owns 64 weight rows of the tile (wgmma M side)
//     times kBlockTokens tokens (wgmma N side).
//   producer warpgroup (the last one): warp 0 lane 0 issues the TMA copies of the weight and token
//     tiles; warp 1 (FP8 only) stages the scales in shared memory; the other warps return.
// Pipeline: kStages shared-memory stages, each guarded by a "full" mbarrier (FP8: 33 arrivals, the
// TMA issuer with its transaction bytes plus the 32 lanes of the scale warp; BF16: 1) and an
// "empty" mbarrier (one arrival per consumer warp).
#pragma once
#include "ptx.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "scheduler.cuh"

namespace megamoe {

template <int kBlockTokens_, int kNumConsumerWG_, int kStages_, bool kInterleavedGateUp_, bool kBf16_ = false>
struct GemmConfig {
  static constexpr int kBlockTokens = kBlockTokens_;  // tokens per tile: wgmma N
  static constexpr int kNumConsumerWG = kNumConsumerWG_;
  static constexpr int kStages = kStages_;
  // L1 weights with gate/up rows interleaved by 8 ([g0..g7, u0..u7, g8..]) while the weight
  // scales keep the [gate blocks | up blocks] layout: the scale of a row depends on its 8-group.
  static constexpr bool kInterleavedGateUp = kInterleavedGateUp_;

  static constexpr bool kBf16 = kBf16_;               // BF16 operands, no scales
  static constexpr bool kHasScales = !kBf16;
  static constexpr int kRowBytes = 128;               // K bytes per tile row and stage (the 128B swizzle span)
  static constexpr int kBlockK = kRowBytes / (kBf16 ? 2 : 1);  // K values per stage (FP8: one scale block)
  static constexpr int kRowsPerConsumer = 64;         // wgmma M
  static constexpr int kBlockW = 64 * kNumConsumerWG; // weight rows per tile
  static constexpr int kNumThreads = 128 * (kNumConsumerWG + 1);
  static constexpr int kMmaK = kBf16 ? 16 : 32;
  static constexpr int kMmaKBytes = kMmaK * (kBf16 ? 2 : 1);  // 32 bytes for both flavours
  static constexpr int kNumAccum = kBlockTokens / 2;  // FP32 accumulators per consumer thread

  // Shared-memory layout of one stage, then the epilogue staging tile, then the barriers.
  static constexpr int kWTileBytes = kBlockW * kRowBytes;
  static constexpr int kXTileBytes = kBlockTokens * kRowBytes;
  // w_scale of even/odd 8-row groups (+pad to 16 B), then x_scale[tokens]
  static constexpr int kScaleBytes = kHasScales ? 16 + kBlockTokens * 4 : 0;
  static constexpr int kEpilogueRowElems = kRowsPerConsumer + 8;  // +16 B per row: no bank conflicts
  static constexpr int kEpilogueBytesPerWG = kBlockTokens * kEpilogueRowElems * 2;

  static constexpr int kWOffset = 0;
  static constexpr int kXOffset = kWOffset + kStages * kWTileBytes;
  static constexpr int kScaleOffset = kXOffset + kStages * kXTileBytes;
  static constexpr int kEpilogueOffset = align_up(kScaleOffset + kStages * kScaleBytes, 128);
  static constexpr int kBarrierOffset = kEpilogueOffset + kNumConsumerWG * kEpilogueBytesPerWG;
  static constexpr int kUsedBytes = kBarrierOffset + 2 * kStages * 8;
  // +1024: the dynamic shared window is only guaranteed 16-byte aligned; TMA 128B swizzle needs 1024.
  static constexpr int kSmemBytes = kUsedBytes + 1024;

  static constexpr int kFullArrivals = kHasScales ? 1 + 32 : 1;
  static constexpr int kEmptyArrivals = 4 * kNumConsumerWG;
  // Up to 64 tokens the consumers read their x scales while the wgmmas run; bigger tiles read
  // them after, to keep 2 x kNumAccum accumulators plus scales under the register cap.
  static constexpr bool kPreloadTokenScales = kBlockTokens <= 64;

  // Register split after setmaxnreg: the producer gives registers to the consumers. The CTA's
  // pool is what it was launched with (__launch_bounds__(kNumThreads, 1) caps each thread at
  // 65536 / kNumThreads rounded down to 8: 168 for 384 threads), and setmaxnreg.inc blocks until
  // the pool can serve it, so a split over the pool deadlocks (seen: 48/232 with 384 threads).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kLaunchRegCap = (65536 / kNumThreads) / 8 * 8 > 255 ? 248 : (65536 / kNumThreads) / 8 * 8;
  static_assert(128 * kProducerRegs + 128 * kNumConsumerWG * kConsumerRegs <= kLaunchRegCap * kNumThreads,
                "setmaxnreg split exceeds the CTA register pool: the consumers would wait forever");

  static_assert(kBlockTokens % 8 == 0 && kBlockTokens >= 8 && kBlockTokens <= 256, "wgmma N is 8..256 step 8");
  static_assert(!(kBf16 && kInterleavedGateUp), "gate/up interleaving only changes scale lookup: FP8 only");
  static_assert(kNumConsumerWG == 1 || kNumConsumerWG == 2, "one or two consumer warpgroups");
  static_assert(kWTileBytes % 1024 == 0 && kXTileBytes % 1024 == 0, "tiles must keep 1024-byte alignment");
  static_assert(kSmemBytes <= 232448, "shared memory over the SM90 limit (227 KB)");
};

// Pipeline position: stage index and the phase parity of that stage's barriers.
struct PipelineState {
  int stage = 0;
  u32 phase = 0;
  template <int kStages>
  MEGAMOE_DEVICE void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <class Cfg>
struct GemmSmem {
  u8* base;  // 1024-byte aligned
  MEGAMOE_DEVICE explicit GemmSmem(u8* raw) {
    const u32 addr = smem_addr(raw);
    base = raw + (align_up<u32>(addr, 1024) - addr);
  }
  MEGAMOE_DEVICE u8* w_tile(int stage) const { return base + Cfg::kWOffset + stage * Cfg::kWTileBytes; }
  MEGAMOE_DEVICE u8* x_tile(int stage) const { return base + Cfg::kXOffset + stage * Cfg::kXTileBytes; }
  MEGAMOE_DEVICE float* scales(int stage) const {
    return reinterpret_cast<float*>(base + Cfg::kScaleOffset + stage * Cfg::kScaleBytes);
  }
  MEGAMOE_DEVICE bf16_bits* epilogue_tile(int consumer_wg) const {
    return reinterpret_cast<bf16_bits*>(base + Cfg::kEpilogueOffset + consumer_wg * Cfg::kEpilogueBytesPerWG);
  }
  MEGAMOE_DEVICE u64* full_barrier(int stage) const {
    return reinterpret_cast<u64*>(base + Cfg::kBarrierOffset) + stage;
  }
  MEGAMOE_DEVICE u64* empty_barrier(int stage) const {
    return reinterpret_cast<u64*>(base + Cfg::kBarrierOffset) + Cfg::kStages + stage;
  }
};

// Problem description shared by the producer and the consumers.
struct GemmProblem {
  const TensorMap* w_map;  // 3-D [E][N][K] e4m3 or bf16, box {kBlockK, kBlockW, 1}
  const TensorMap* x_map;  // 2-D [M][K] e4m3 or bf16, box {kBlockK, kBlockTokens}
  const float* w_scale;    // FP8: [E][ceil(N/128)][K/128] float (scale_inv: multiply to dequantize)
  const float* x_scale;    // FP8: [M][K/128] float
  int n;                   // weight rows per expert (interleaved rows when kInterleavedGateUp)
  int k;                   // reduction size, multiple of 128
};

// Index of the 128-row scale block holding weight row `row` (in the stored, possibly
// interleaved, order) of an expert with `n` rows.
template <bool kInterleavedGateUp>
MEGAMOE_DEVICE int weight_scale_block(int row, int n) {
  if (!kInterleavedGateUp) return row / 128;
  const int original_row = (row / 16) * 8 + (row % 8) + ((row / 8) % 2) * (n / 2);
  return original_row / 128;
}

// Producer, TMA half: one thread issues the weight and token tile copies of every stage.
template <class Cfg>
MEGAMOE_DEVICE void gemm_tma_producer(const GemmSmem<Cfg>& smem, const GemmProblem& prob,
                                      GroupedTaskScheduler<Cfg::kBlockTokens> scheduler) {
  const int num_k_blocks = prob.k / Cfg::kBlockK;
  PipelineState pipe;
  GroupedTask task;
  while (scheduler.next(task)) {
    const int n0 = task.n_block * Cfg::kBlockW;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      mbarrier_wait(smem.empty_barrier(pipe.stage), pipe.phase ^ 1, 1);
      u64* full = smem.full_barrier(pipe.stage);
      mbarrier_arrive_expect_tx(full, Cfg::kWTileBytes + Cfg::kXTileBytes);
      tma_load_3d(prob.w_map, smem.w_tile(pipe.stage), full, kb * Cfg::kBlockK, n0, task.expert);
      tma_load_2d(prob.x_map, smem.x_tile(pipe.stage), full, kb * Cfg::kBlockK, task.row_begin);
      pipe.advance<Cfg::kStages>();
    }
  }
}

// Producer, scale half (FP8): one warp writes each stage's weight scales (even/odd 8-row groups)
// and the tile's token scales into shared memory, then arrives on the stage's full barrier.
template <class Cfg>
MEGAMOE_DEVICE void gemm_scale_producer(const GemmSmem<Cfg>& smem, const GemmProblem& prob,
                                        GroupedTaskScheduler<Cfg::kBlockTokens> scheduler) {
  const int lane = static_cast<int>(lane_id());
  const int num_k_blocks = prob.k / Cfg::kBlockK;
  const int num_scale_rows = ceil_div(prob.n, 128);
  PipelineState pipe;
  GroupedTask task;
  while (scheduler.next(task)) {
    // Every row of the tile in an even 8-row group shares one scale block, every odd one another
    // (identical unless gate/up are interleaved); lane 0 fetches the even one, lane 1 the odd one.
    const int n0 = task.n_block * Cfg::kBlockW;
    const int my_w_row = weight_scale_block<Cfg::kInterleavedGateUp>(n0 + 8 * (lane & 1), prob.n);
    const float* w_scale_row = prob.w_scale + (static_cast<i64>(task.expert) * num_scale_rows + my_w_row) * num_k_blocks;
    const float* x_scale_rows = prob.x_scale + static_cast<i64>(task.row_begin) * num_k_blocks;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      mbarrier_wait(smem.empty_barrier(pipe.stage), pipe.phase ^ 1, 1);
      float* scales = smem.scales(pipe.stage);
      if (lane < 2) scales[lane] = ldg_float(w_scale_row + kb);
      // Rows past the task's tokens (next expert's rows or past M) get scale 0: their columns are
      // never stored, this only keeps them finite.
#pragma unroll
      for (int t = lane; t < Cfg::kBlockTokens; t += 32)
        scales[4 + t] = t < task.num_rows ? ldg_float(x_scale_rows + t * num_k_blocks + kb) : 0.0f;
      mbarrier_arrive(smem.full_barrier(pipe.stage));
      pipe.advance<Cfg::kStages>();
    }
  }
}

// Producer warpgroup body: warp 0 lane 0 runs the TMA loop, warp 1 the scale loop (FP8).
template <class Cfg>
MEGAMOE_DEVICE void gemm_producer(const GemmSmem<Cfg>& smem, const GemmProblem& prob,
                                  GroupedTaskScheduler<Cfg::kBlockTokens> scheduler, int warp_in_wg) {
  if (warp_in_wg == 0) {
    if (lane_id() == 0) gemm_tma_producer<Cfg>(smem, prob, scheduler);
  } else if (warp_in_wg == 1) {
    if constexpr (Cfg::kHasScales) gemm_scale_producer<Cfg>(smem, prob, scheduler);
  }
}

// Hands a consumed stage back to the producer: one arrival per warp, after every lane of the warp
// has finished its wgmma reads (wait_group) and shared-memory scale reads (syncwarp orders them).
MEGAMOE_DEVICE void release_stage(u64* empty_barrier) {
  __syncwarp();
  if (lane_id() == 0) mbarrier_arrive(empty_barrier);
}

// Consumer mainloop for one task: fills `acc` (this thread's m64 x kBlockTokens fragment of
// consumer warpgroup `consumer_wg`) with sum_k w[row, k] * x[token, k] in FP32 (after block scales
// for FP8). Fragment layout: see accum_row / accum_col in wgmma.cuh.
template <class Cfg>
MEGAMOE_DEVICE void gemm_mainloop(const GemmSmem<Cfg>& smem, const GemmProblem& prob, PipelineState& pipe,
                                  int consumer_wg, float (&acc)[Cfg::kNumAccum]) {
  const int num_k_blocks = prob.k / Cfg::kBlockK;
  constexpr int kMmaPerStage = Cfg::kBlockK / Cfg::kMmaK;
  constexpr int kDescStep = Cfg::kMmaKBytes / 16;  // descriptor addresses count 16-byte units

  if constexpr (Cfg::kBf16) {
    using Mma = WgmmaBf16<Cfg::kBlockTokens>;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      mbarrier_wait(smem.full_barrier(pipe.stage), pipe.phase, 2);
      const u64 desc_w = make_smem_desc_k_major_sw128(smem.w_tile(pipe.stage) + consumer_wg * 64 * Cfg::kRowBytes);
      const u64 desc_x = make_smem_desc_k_major_sw128(smem.x_tile(pipe.stage));
      fence_accumulators(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kMmaPerStage; ++kk) Mma::mma(desc_w + kDescStep * kk, desc_x + kDescStep * kk, acc, kb > 0 || kk > 0);
      wgmma_commit_group();
      fence_accumulators(acc);
      wgmma_wait_group<0>();
      fence_accumulators(acc);
      release_stage(smem.empty_barrier(pipe.stage));
      pipe.advance<Cfg::kStages>();
    }
  } else {
    using Mma = WgmmaFp8E4M3<Cfg::kBlockTokens>;
    const int lane = static_cast<int>(lane_id());
    float partial[Cfg::kNumAccum];
#pragma unroll
    for (int i = 0; i < Cfg::kNumAccum; ++i) acc[i] = 0.0f;

    for (int kb = 0; kb < num_k_blocks; ++kb) {
      mbarrier_wait(smem.full_barrier(pipe.stage), pipe.phase, 2);
      const u64 desc_w = make_smem_desc_k_major_sw128(smem.w_tile(pipe.stage) + consumer_wg * 64 * Cfg::kRowBytes);
      const u64 desc_x = make_smem_desc_k_major_sw128(smem.x_tile(pipe.stage));

      fence_accumulators(partial);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kMmaPerStage; ++kk) {
        Mma::mma(desc_w + kDescStep * kk, desc_x + kDescStep * kk, partial, kk > 0);
      }
      wgmma_commit_group();
      fence_accumulators(partial);

      const float* scales = smem.scales(pipe.stage);
      const float w_even = scales[0];
      const float w_odd = scales[1];
      const float* token_scales = scales + 4 + 2 * (lane % 4);
      float2 x_pair[Cfg::kPreloadTokenScales ? Cfg::kBlockTokens / 8 : 1];
      if constexpr (Cfg::kPreloadTokenScales) {  // read while the tensor cores run
#pragma unroll
        for (int j = 0; j < Cfg::kBlockTokens / 8; ++j) x_pair[j] = *reinterpret_cast<const float2*>(token_scales + 8 * j);
      }

      wgmma_wait_group<0>();
      fence_accumulators(partial);
      // With the scales in registers the stage can go back before the promotion math.
      if constexpr (Cfg::kPreloadTokenScales) release_stage(smem.empty_barrier(pipe.stage));

#pragma unroll
      for (int j = 0; j < Cfg::kBlockTokens / 8; ++j) {
        float2 xs;
        if constexpr (Cfg::kPreloadTokenScales) {
          xs = x_pair[j];
        } else {
          xs = *reinterpret_cast<const float2*>(token_scales + 8 * j);
        }
        acc[4 * j + 0] += partial[4 * j + 0] * (w_even * xs.x);
        acc[4 * j + 1] += partial[4 * j + 1] * (w_even * xs.y);
        acc[4 * j + 2] += partial[4 * j + 2] * (w_odd * xs.x);
        acc[4 * j + 3] += partial[4 * j + 3] * (w_odd * xs.y);
      }
      if constexpr (!Cfg::kPreloadTokenScales) release_stage(smem.empty_barrier(pipe.stage));
      pipe.advance<Cfg::kStages>();
    }
  }
}

}  // namespace megamoe
