// Epilogues: what a consumer warpgroup does with its finished FP32 fragment.
//
// An epilogue is a type with
//   MEGAMOE_DEVICE void operator()(const GemmSmem<Cfg>&, const GroupedTask&, int consumer_wg,
//                                  float (&acc)[Cfg::kNumAccum]) const;
// Fragment layout (swap AB): element i of thread (warp w, lane l) of consumer warpgroup g is
// weight row n0 + 64*g + accum_row(i, w, l) and token task.row_begin + accum_col(i, l).
// With interleaved gate/up weights a thread's rows r and r+8 are gate and up of the same output
// channel (elements 4j+{0,1} vs 4j+{2,3}), so a SwiGLU epilogue needs no data exchange.
#pragma once
#include "gemm_mainloop.cuh"

namespace megamoe {

// Stores the tile as BF16 into out[token][n] (row-major [M, N]). The fragment is transposed
// through shared memory so that global stores are whole 16-byte pieces of token rows.
template <class Cfg>
struct Bf16StoreEpilogue {
  bf16_bits* out;
  int n;

  MEGAMOE_DEVICE void operator()(const GemmSmem<Cfg>& smem, const GroupedTask& task, int consumer_wg,
                                 float (&acc)[Cfg::kNumAccum]) const {
    constexpr int kRow = Cfg::kEpilogueRowElems;
    const int thread_in_wg = static_cast<int>(threadIdx.x) % 128;
    const int warp_in_wg = thread_in_wg / 32;
    const int lane = thread_in_wg % 32;
    const int col0 = task.n_block * Cfg::kBlockW + consumer_wg * Cfg::kRowsPerConsumer;
    if (col0 >= n) return;  // N % 64 == 0: a warpgroup's 64 rows are all in range or all out
    bf16_bits* tile = smem.epilogue_tile(consumer_wg);
    const u32 barrier_id = 1 + consumer_wg;

    // The previous task's global stores read this tile: wait until the whole warpgroup is past them.
    named_barrier_sync(barrier_id, 128);
#pragma unroll
    for (int i = 0; i < Cfg::kNumAccum; ++i) {
      tile[accum_col(i, lane) * kRow + accum_row(i, warp_in_wg, lane)] = float_to_bf16(acc[i]);
    }
    named_barrier_sync(barrier_id, 128);

    // Each token row of this warpgroup is 64 bf16 = 8 pieces of 16 bytes.
    for (int piece = thread_in_wg; piece < task.num_rows * 8; piece += 128) {
      const int row = piece / 8;
      const int chunk = piece % 8;
      const uint4 value = *reinterpret_cast<const uint4*>(tile + row * kRow + chunk * 8);
      *reinterpret_cast<uint4*>(out + static_cast<i64>(task.row_begin + row) * n + col0 + chunk * 8) = value;
    }
  }
};

}  // namespace megamoe
