// Standalone grouped GEMM, swap AB, rows grouped by expert:
//   out[rows of e, :] = x[rows of e] @ w[e]^T        (BF16 out, FP32 accumulate)
// FP8 flavour: x [M, K] e4m3 with x_scale [M, K/128] float, w [E, N, K] e4m3 with
//   w_scale [E, ceil(N/128), K/128] float; products are dequantized per 128-K block.
// BF16 flavour: x [M, K] bf16, w [E, N, K] bf16, no scales.
// Rows of x are grouped by expert through expert_offsets[E+1] (device memory, read by the kernel).
// Persistent grid over (expert, n_block, token_block) tasks; see gemm_mainloop.cuh for the roles.
#pragma once
#include "epilogue.cuh"

namespace megamoe {

template <class Cfg>
MEGAMOE_DEVICE void grouped_gemm_body(const TensorMap* w_map, const TensorMap* x_map, const float* w_scale,
                                      const float* x_scale, const int* expert_offsets, bf16_bits* out,
                                      int num_experts, int n, int k) {
  extern __shared__ u8 smem_raw[];
  const GemmSmem<Cfg> smem(smem_raw);
  const int warp_idx = warp_uniform_warp_idx();
  const int wg = warp_idx / 4;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbarrier_init(smem.full_barrier(s), Cfg::kFullArrivals);
      mbarrier_init(smem.empty_barrier(s), Cfg::kEmptyArrivals);
    }
    fence_barrier_init();
  }
  if (threadIdx.x == Cfg::kNumConsumerWG * 128) {
    tma_prefetch_descriptor(w_map);
    tma_prefetch_descriptor(x_map);
  }
  __syncthreads();

  // Everything a role needs is rebuilt after setmaxnreg: values kept live across the register
  // reallocation get spilled to local memory by ptxas.
  const int num_n_blocks = ceil_div(n, Cfg::kBlockW);
  if (wg == Cfg::kNumConsumerWG) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    const GemmSmem<Cfg> producer_smem(smem_raw);
    const GemmProblem prob{w_map, x_map, w_scale, x_scale, n, k};
    gemm_producer<Cfg>(producer_smem, prob,
                       GroupedTaskScheduler<Cfg::kBlockTokens>(expert_offsets, num_experts, num_n_blocks), warp_idx % 4);
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const GemmSmem<Cfg> consumer_smem(smem_raw);
    const GemmProblem prob{w_map, x_map, w_scale, x_scale, n, k};
    GroupedTaskScheduler<Cfg::kBlockTokens> scheduler(expert_offsets, num_experts, num_n_blocks);
    const Bf16StoreEpilogue<Cfg> epilogue{out, n};
    PipelineState pipe;
    GroupedTask task;
    float acc[Cfg::kNumAccum];
    while (scheduler.next(task)) {
      gemm_mainloop<Cfg>(consumer_smem, prob, pipe, wg, acc);
      epilogue(consumer_smem, task, wg, acc);
    }
  }
}

}  // namespace megamoe
