// Combine reduce: y[t] = sum over unmasked slots k of combine[k][t], in FP32, stored as BF16.
// Peers wrote combine[k][t] (their L2 outputs for our token t) before the combine barrier.
#pragma once
#include "conv.cuh"
#include "dispatch.cuh"
#include "params.cuh"

namespace megamoe::mega {

MEGAMOE_DEVICE void reduce_combine(const Params& p, const Regions& me) {
  const u32 lane = threadIdx.x % 32;
  constexpr u32 kChunks = kHidden / 8;  // 16-byte chunks of 8 bf16 per row
  for (u32 token = global_warp(); token < static_cast<u32>(p.num_tokens); token += total_warps()) {
    const int expert = lane < kTopk ? __ldcg(me.topk_idx() + token * kBufTopk + lane) : -1;
    const u32 live = __ballot_sync(0xffffffffu, expert >= 0);
    for (u32 c = lane; c < kChunks; c += 32) {
      float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (u32 mask = live; mask; mask &= mask - 1) {
        const u32 slot = __ffs(mask) - 1;
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(
            me.combine() + (static_cast<u64>(slot) * kMaxTokens + token) * kBufHidden) + c);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sum[2 * i] += bf16_to_f32(w[i] & 0xffff);
          sum[2 * i + 1] += bf16_to_f32(w[i] >> 16);
        }
      }
      uint4 out;
      u32* o = reinterpret_cast<u32*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        o[i] = static_cast<u32>(f32_to_bf16(sum[2 * i])) | (static_cast<u32>(f32_to_bf16(sum[2 * i + 1])) << 16);
      reinterpret_cast<uint4*>(p.y + static_cast<u64>(token) * kHidden)[c] = out;
    }
  }
}

// Leaves the per-call counters at zero for the next call (this rank's own; peers rewrite theirs).
MEGAMOE_DEVICE void reset_counters(const Regions& me) {
  if (blockIdx.x != 0) return;
  for (u32 e = threadIdx.x; e < kNumExperts; e += kNumThreads) me.send_count()[e] = 0;
  if (threadIdx.x == 0) me.workspace()[kSlotCallCount] += 1;
}

}  // namespace megamoe::mega
