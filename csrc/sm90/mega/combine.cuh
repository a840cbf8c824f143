// Combine reduce: y[t] = sum over unmasked slots k of combine[k][t], in FP32, stored as BF16.
// Peers wrote combine[k][t] (their L2 outputs for our token t) before the combine barrier.
#pragma once
#include "conv.cuh"
#include "dispatch.cuh"
#include "params.cuh"

namespace megamoe::mega {

// One thread per (token, 16-byte chunk) over the whole grid, so a handful of decode tokens is
// spread over every SM. A group of slots' rows is loaded together with the slots' expert ids, and
// a masked slot's (stale, in-bounds) row is loaded and then left out of the sum: waiting for the
// ids before issuing the row loads cost a second memory round trip per group (the reduce ran at
// 0.6-0.7 of HBM bandwidth). Slot order is kept in the sum.
MEGAMOE_DEVICE void reduce_combine(const Params& p, const Regions& me) {
  constexpr u32 kChunks = kHidden / 8;  // 16-byte chunks of 8 bf16 per row
  constexpr u32 kSlotGroup = kTopk < 8 ? kTopk : 8;
  const u32 total = static_cast<u32>(p.num_tokens) * kChunks;
  for (u32 i = blockIdx.x * kNumThreads + thread_index(); i < total; i += gridDim.x * kNumThreads) {
    const u32 token = i / kChunks, c = i % kChunks;
    float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (u32 k0 = 0; k0 < kTopk; k0 += kSlotGroup) {
      uint4 v[kSlotGroup];
      int expert[kSlotGroup];
#pragma unroll
      for (u32 j = 0; j < kSlotGroup; ++j) {
        const u32 slot = k0 + j;
        expert[j] = slot < kTopk ? __ldcg(me.topk_idx() + token * kBufTopk + slot) : -1;
        if (slot < kTopk)
          v[j] = __ldcg(reinterpret_cast<const uint4*>(
                            me.combine() + (static_cast<u64>(slot) * kMaxTokens + token) * kBufHidden) + c);
      }
#pragma unroll
      for (u32 j = 0; j < kSlotGroup; ++j) {
        if (expert[j] < 0) continue;  // masked (or past kTopk): its row was not written this call
        const u32 w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sum[2 * e] += bf16_to_f32(w[e] & 0xffff);
          sum[2 * e + 1] += bf16_to_f32(w[e] >> 16);
        }
      }
    }
    uint4 out;
    u32* o = reinterpret_cast<u32*>(&out);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o[e] = pack_bf16x2(sum[2 * e], sum[2 * e + 1]);
    reinterpret_cast<uint4*>(p.y + static_cast<u64>(token) * kHidden)[c] = out;
  }
}

// Leaves the per-call counters at zero for the next call (this rank's own; peers rewrite theirs).
MEGAMOE_DEVICE void reset_counters(const Regions& me) {
  if (blockIdx.x != 0) return;
  for (u32 e = thread_index(); e < kNumExperts; e += kNumThreads) me.send_count()[e] = 0;
  if (thread_index() < kNumRanks) me.token_send_count()[thread_index()] = 0;
  if (thread_index() == 0) me.workspace()[kSlotCallCount] += 1;
}

}  // namespace megamoe::mega
