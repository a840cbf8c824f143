// Kernel entry for the standalone grouped GEMM (FP8 block-scaled or BF16). Compiled at run time by
// vllm_megamoe/kernels/jit.py with the tile configuration given as -D defines (part of the cache
// key). extern "C" keeps the symbol name identical under NVRTC and nvcc.
#include "grouped_gemm.cuh"

#ifndef MEGAMOE_BLOCK_TOKENS
#error "MEGAMOE_BLOCK_TOKENS must be defined (tokens per tile, 8..256 step 8)"
#endif
#ifndef MEGAMOE_STAGES
#error "MEGAMOE_STAGES must be defined"
#endif
#ifndef MEGAMOE_NUM_CONSUMER_WG
#define MEGAMOE_NUM_CONSUMER_WG 2
#endif
#ifndef MEGAMOE_INTERLEAVED_GATE_UP
#define MEGAMOE_INTERLEAVED_GATE_UP 0
#endif
#ifndef MEGAMOE_BF16
#define MEGAMOE_BF16 0
#endif

using GroupedGemmCfg = megamoe::GemmConfig<MEGAMOE_BLOCK_TOKENS, MEGAMOE_NUM_CONSUMER_WG, MEGAMOE_STAGES,
                                           MEGAMOE_INTERLEAVED_GATE_UP != 0, MEGAMOE_BF16 != 0>;

// Read back by the host to check its shared-memory arithmetic against the kernel's.
extern "C" __device__ int megamoe_grouped_gemm_smem_bytes = GroupedGemmCfg::kSmemBytes;

// w_scale / x_scale are ignored (may be null) in the BF16 flavour.
extern "C" __global__ void __launch_bounds__(GroupedGemmCfg::kNumThreads, 1)
    megamoe_grouped_gemm(const __grid_constant__ megamoe::TensorMap w_map,
                         const __grid_constant__ megamoe::TensorMap x_map, const float* __restrict__ w_scale,
                         const float* __restrict__ x_scale, const int* __restrict__ expert_offsets,
                         megamoe::bf16_bits* __restrict__ out, int num_experts, int n, int k) {
  megamoe::grouped_gemm_body<GroupedGemmCfg>(&w_map, &x_map, w_scale, x_scale, expert_offsets, out, num_experts,
                                             n, k);
}
