// Dispatch: stage this rank's tokens in its buffer (FP8 + per-128 scales, or BF16), announce
// every token to each rank owning one of its experts (with the positions of its pairs there),
// then pull each announced token once from its source's buffer into the local staging rows of
// all its pairs, grouped by local expert.
#pragma once
#include "block_ready.cuh"
#include "conv.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "sync.cuh"

namespace megamoe::mega {

// x (bf16) -> buffer x (fp8 + scale per 128, or a bf16 copy). One warp per (token, 256 values):
// a lane loads 16 bytes, each half-warp is one 128-value scale group (hidden is a multiple of
// 256), and a warp has kStageBatch items' loads in flight before it converts any. With 8-byte
// loads and 4 items (8 KB in flight per SM) the staging was bound by load latency at prefill:
// the dispatch phase of an 8192-token call took 97 / 185 / 56 us (V4-Flash- / DeepSeek-V3- /
// Qwen3-like, one H200), with 16-byte loads and 8 items 59 / 100 / 35 (docs/kernel_design.md).
constexpr u32 kStageBatch = 8;
constexpr u32 kStageValues = 256;  // bf16 values per warp item
static_assert(kHidden % kStageValues == 0, "staging takes 256 values per warp item");

MEGAMOE_DEVICE void stage_tokens(const Params& p, const Regions& me) {
  const u32 lane = thread_index() % 32;
  const u32 pieces = kHidden / kStageValues, items = p.num_tokens * pieces;
  for (u32 item0 = global_warp(); item0 < items; item0 += kStageBatch * total_warps()) {
    uint4 batch[kStageBatch];
#pragma unroll
    for (u32 b = 0; b < kStageBatch; ++b) {
      const u32 item = item0 + b * total_warps();  // warp-uniform
      if (item < items)
        batch[b] = __ldcs(reinterpret_cast<const uint4*>(p.x + static_cast<u64>(item / pieces) * kHidden +
                                                         (item % pieces) * kStageValues) + lane);
    }
#pragma unroll
    for (u32 b = 0; b < kStageBatch; ++b) {
      const u32 item = item0 + b * total_warps();
      if (item >= items) break;
      const uint4 raw = batch[b];
      const u32 token = item / pieces;
      const u32 col = (item % pieces) * kStageValues + lane * 8;  // this lane's 8 values
      if constexpr (kFP8) {
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
        float v[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[2 * i] = bf16_to_f32(w[i] & 0xffff), v[2 * i + 1] = bf16_to_f32(w[i] >> 16);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
        for (int s = 8; s > 0; s /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));  // within the half-warp
        const float scale = fmaxf(amax, kAmaxFloor) * (1.0f / kFP8Max);
        const float inv = 1.0f / scale;  // one division, eight multiplies
        uint2 packed;
        packed.x = static_cast<u32>(f32x2_to_e4m3x2(v[0] * inv, v[1] * inv)) |
                   (static_cast<u32>(f32x2_to_e4m3x2(v[2] * inv, v[3] * inv)) << 16);
        packed.y = static_cast<u32>(f32x2_to_e4m3x2(v[4] * inv, v[5] * inv)) |
                   (static_cast<u32>(f32x2_to_e4m3x2(v[6] * inv, v[7] * inv)) << 16);
        *reinterpret_cast<uint2*>(me.x() + static_cast<u64>(token) * kRowBytesL1 + col) = packed;
        if (lane % 16 == 0) me.x_scale()[static_cast<u64>(token) * (kBufHidden / kScaleBlock) + col / kScaleBlock] = scale;
      } else {
        *reinterpret_cast<uint4*>(me.x() + static_cast<u64>(token) * kRowBytesL1 + col * 2) = raw;
      }
    }
  }
}

// Copies top-k ids/weights into the buffer and announces each token to every rank owning one of
// its experts, once per rank: recv_tokens[my rank][j] = token, and per top-k slot the
// (local expert, position) of the pair there in recv_token_pairs (-1 for slots routed elsewhere),
// position from a per-expert counter as before. One thread per token, so that the positions of a
// token's pairs are known together. Tokens are dealt from the last CTA down while stage_tokens
// starts at CTA 0: at a few tokens the two chains of round trips (the staging's loads and stores,
// the announce's loads, atomics and peer stores) then run on different SMs side by side instead of
// one after the other in CTA 0's first warp.
MEGAMOE_DEVICE void announce_pairs(const Params& p, const Regions& me) {
  const u32 lane = thread_index() % 32;
  const u32 cta = gridDim.x - 1 - blockIdx.x;
  for (u32 token = cta * kNumThreads + thread_index(); token < static_cast<u32>(p.num_tokens);
       token += gridDim.x * kNumThreads) {
    // Loads first, then every counter atomic (one per slot, one per destination and warp), then
    // the stores: written slot by slot, each slot's load waited for the previous slot's atomic
    // (the stores below may alias the inputs for the compiler), kTopk round trips per token.
    int expert[kTopk];
    float weight[kTopk];
    bool bad = false;
#pragma unroll
    for (u32 slot = 0; slot < kTopk; ++slot) {
      if (p.topk_idx_int64) {  // an id outside int's range becomes -2: refused below with the rest
        const long long id = static_cast<const long long*>(p.topk_idx)[token * kTopk + slot];
        expert[slot] = id == static_cast<int>(id) ? static_cast<int>(id) : -2;
      } else {
        expert[slot] = static_cast<const int*>(p.topk_idx)[token * kTopk + slot];
      }
      weight[slot] = p.topk_weights[token * kTopk + slot];
    }
    u32 dst_mask = 0;
#pragma unroll
    for (u32 slot = 0; slot < kTopk; ++slot) {
      if (expert[slot] < -1 || expert[slot] >= static_cast<int>(kNumExperts)) bad = true, expert[slot] = -1;
      if (expert[slot] >= 0) dst_mask |= 1u << (expert[slot] / kNumLocalExperts);
    }
    u32 position[kTopk];
#pragma unroll
    for (u32 slot = 0; slot < kTopk; ++slot)
      position[slot] = expert[slot] >= 0 ? atomicAdd(me.send_count() + expert[slot], 1) : 0u;
    // The token's place in each destination's list: one atomic per destination for the warp's
    // tokens (ballot), issued before any of the results above is used.
    const u32 warp_mask = __activemask();
    u32 wants[kNumRanks], listed_at[kNumRanks];
#pragma unroll
    for (u32 dst = 0; dst < kNumRanks; ++dst) {
      wants[dst] = __ballot_sync(warp_mask, dst_mask & (1u << dst));
      listed_at[dst] = 0;
      if (wants[dst] && lane == static_cast<u32>(__ffs(wants[dst]) - 1))
        listed_at[dst] = atomicAdd(me.token_send_count() + dst, __popc(wants[dst]));
    }
#pragma unroll
    for (u32 dst = 0; dst < kNumRanks; ++dst)
      if (wants[dst])
        listed_at[dst] = __shfl_sync(warp_mask, listed_at[dst], __ffs(wants[dst]) - 1) +
                         __popc(wants[dst] & ((1u << lane) - 1));
    int entry[kTopk];  // local expert * kMaxTokens + position, or -1
#pragma unroll
    for (u32 slot = 0; slot < kTopk; ++slot) {
      me.topk_weights()[token * kBufTopk + slot] = weight[slot];
      me.topk_idx()[token * kBufTopk + slot] = expert[slot];
      entry[slot] = -1;
      if (expert[slot] < 0) continue;
      if (position[slot] >= kMaxTokens) {  // only possible when a token lists one expert twice
        bad = true;
        continue;
      }
      entry[slot] = static_cast<int>((expert[slot] % kNumLocalExperts) * kMaxTokens + position[slot]);
    }
    if (bad) atomicOr(me.workspace() + kSlotErrorFlag, kErrorBadExpert);  // reported by the host; routes dropped
#pragma unroll
    for (u32 dst = 0; dst < kNumRanks; ++dst) {
      if (!(dst_mask & (1u << dst))) continue;
      const Regions peer{p.peers[dst]};
      const u64 listed = static_cast<u64>(p.rank) * kMaxTokens + listed_at[dst];
      peer.recv_tokens()[listed] = static_cast<int>(token);
#pragma unroll
      for (u32 slot = 0; slot < kTopk; ++slot)
        peer.recv_token_pairs()[listed * kBufTopk + slot] =
            entry[slot] >= 0 && static_cast<u32>(expert[slot]) / kNumLocalExperts == dst ? entry[slot] : -1;
    }
  }
}

// Every CTA builds the same table from the counts each source rank's announce left in its own
// buffer (send_count, token_send_count; read after the dispatch barrier, which every rank
// signals after its announce, and zeroed by their owner only after the combine barrier, which
// no rank reaches before it built this table): one round trip of loads from each peer instead
// of a step in the barrier where the last CTA of each rank writes them to every peer.
MEGAMOE_DEVICE void build_expert_table(ExpertTable& table, const Params& p, const Regions& me) {
  for (u32 i = thread_index(); i < kNumLocalExperts * kNumRanks; i += kNumThreads) {
    const u32 e = i % kNumLocalExperts, r = i / kNumLocalExperts;  // consecutive threads, consecutive words
    const Regions src{p.peers[r]};
    const u32 sent = ld_cg_u32(reinterpret_cast<const u8*>(src.send_count() + p.rank * kNumLocalExperts + e));
    table.src_count[e][r] = sent < kMaxTokens ? sent : kMaxTokens;  // more only when a token lists an expert twice
  }
  if (thread_index() == 0) table.pulled_warps = 0;  // read after pull_rows (its warps meet at the barriers below)
  // In the same round trip as the counts (pull_rows needs them; a load there of its own cost a
  // dependent round trip before the first row load).
  if (thread_index() >= kNumThreads - kNumRanks) {
    const u32 r = thread_index() - (kNumThreads - kNumRanks);
    const Regions src{p.peers[r]};
    table.listed[r] = ld_cg_u32(reinterpret_cast<const u8*>(src.token_send_count() + p.rank));
  }
  __syncthreads();
  // The prefix sums by warp 0: each lane sums a run of experts, a warp scan places the runs. One
  // thread walking the experts waited a shared-memory load per expert (the table's stores may
  // alias its loads): ~50 cycles each, 3 us for 128 local experts on every CTA before the pull.
  if (thread_index() < 32) {
    constexpr u32 kPerLane = (kNumLocalExperts + 31) / 32;
    const u32 lane = thread_index(), first = lane * kPerLane;
    u32 n[kPerLane], rows = 0, blocks = 0;
#pragma unroll
    for (u32 i = 0; i < kPerLane; ++i) {
      n[i] = 0;
      if (first + i < kNumLocalExperts) {
#pragma unroll
        for (u32 r = 0; r < kNumRanks; ++r) n[i] += table.src_count[first + i][r];
      }
      rows += n[i];
      blocks += (n[i] + kTileTokens - 1) / kTileTokens;
    }
    u32 rows_through = rows, blocks_through = blocks;  // inclusive over lanes 0..lane
#pragma unroll
    for (u32 d = 1; d < 32; d *= 2) {
      const u32 r = __shfl_up_sync(0xffffffffu, rows_through, d), b = __shfl_up_sync(0xffffffffu, blocks_through, d);
      if (lane >= d) rows_through += r, blocks_through += b;
    }
    u32 row = rows_through - rows, block = blocks_through - blocks;
#pragma unroll
    for (u32 i = 0; i < kPerLane; ++i) {
      if (first + i < kNumLocalExperts) {
        table.row_start[first + i] = row;
        table.block_start[first + i] = block;
      }
      row += n[i];
      block += (n[i] + kTileTokens - 1) / kTileTokens;
    }
    if (lane == 31) {
      table.row_start[kNumLocalExperts] = rows_through;
      table.block_start[kNumLocalExperts] = blocks_through;
      if (rows_through > kStagingRows) {
        me.workspace()[kSlotErrorFlag] |= kErrorStagingOverflow;
        report_and_trap(p.error_record, kErrorStagingFull, p.rank, kPhasePull, static_cast<int>(rows_through),
                        static_cast<int>(kStagingRows), 0);
      }
    }
  }
  __syncthreads();
}

// Pulls every token a source rank listed for this rank from that rank's buffer, once (over
// NVLink, or from this rank's own x), and stores it into the staging row of each of its pairs
// here, with the row's scales, top-k weight and (src rank, token, slot, e), then releases each row
// to its token block's L1 tasks (block_ready.cuh: no grid barrier between the pull and L1). One
// warp per listed token; a token with three experts here crosses NVLink once instead of three times.
// Pull item `item` (a token some rank listed for this rank, counted over the ranks' lists): its
// source rank, its place in that rank's list here (`at`), and for lane k < kTopk the staging row
// of slot k's pair here (-1: none, or beyond the published count) and the pair's local expert.
struct PullSlot {
  u32 src;
  u64 at;
  int row;
  u32 e;
};

MEGAMOE_DEVICE PullSlot pull_slot(const ExpertTable& table, const Regions& me, const u32 (&listed)[kNumRanks], u32 item,
                                  u32 lane) {
  PullSlot s{0, 0, -1, 0};
  u32 j = item;
#pragma unroll
  for (u32 r = 0; r + 1 < kNumRanks; ++r)  // unrolled: `listed` stays in registers
    if (s.src == r && j >= listed[r]) j -= listed[r], s.src = r + 1;
  s.at = static_cast<u64>(s.src) * kMaxTokens + j;
  if (lane < kTopk) {
    const int entry = static_cast<int>(ld_cg_u32(reinterpret_cast<const u8*>(me.recv_token_pairs() + s.at * kBufTopk + lane)));
    if (entry >= 0) {
      const u32 e = static_cast<u32>(entry) / kMaxTokens, position = static_cast<u32>(entry) % kMaxTokens;
      u32 row = table.row_start[e] + position;
      for (u32 r = 0; r < s.src; ++r) row += table.src_count[e][r];
      s.row = position < table.src_count[e][s.src] ? static_cast<int>(row) : -1;
      s.e = e;
    }
  }
  return s;
}

constexpr u32 kHeldItems = 8;  // pull items per warp whose token blocks pull_rows keeps for the count

MEGAMOE_DEVICE void pull_rows(ExpertTable& table, const Params& p, const Regions& me) {
  const u32 lane = thread_index() % 32;
  u32 listed[kNumRanks], total = 0;
#pragma unroll
  for (u32 r = 0; r < kNumRanks; ++r) {
    listed[r] = table.listed[r];
    total += listed[r];
  }
  static_assert(kTopk <= 32, "one top-k slot per lane");
  // Lane k: the token block of slot k's row for the warp's last kHeldItems items (~0u: none),
  // oldest first; shifted by constant indices, so it stays in registers.
  u32 held[kHeldItems];
#pragma unroll
  for (u32 i = 0; i < kHeldItems; ++i) held[i] = ~0u;
  u32 items = 0;
  for (u32 item = global_warp(); item < total; item += total_warps(), ++items) {
    const PullSlot slot = pull_slot(table, me, listed, item, lane);
#pragma unroll
    for (u32 i = 0; i + 1 < kHeldItems; ++i) held[i] = held[i + 1];
    held[kHeldItems - 1] = slot.row >= 0 ? block_of_row(table, slot.e, static_cast<u32>(slot.row)) : ~0u;
    const u32 src = slot.src;
    const u32 token = ld_cg_u32(reinterpret_cast<const u8*>(me.recv_tokens() + slot.at));
    const int my_row = slot.row;  // lane k < kTopk: the staging row of slot k's pair here, or -1
    const u32 my_e = slot.e;
    int rows[kTopk];
#pragma unroll
    for (u32 k = 0; k < kTopk; ++k) rows[k] = __shfl_sync(0xffffffffu, my_row, k);
    Regions peer{p.peers[src]};
    const uint4* from = reinterpret_cast<const uint4*>(peer.x() + static_cast<u64>(token) * kRowBytesL1);
    // Every load of the token (its row, its FP8 scales, lane k's top-k weight) is issued before the
    // first store: the compiler cannot tell the staging rows from the peer's buffer, so a load
    // after a store waits for it, and each such batch cost one NVLink round trip (at a few tokens
    // per rank the pull is a chain of them). Rows of more than 16 chunks per lane (BF16 with
    // hidden > 8192 bytes) take two batches.
    constexpr u32 kChunks = kHidden * kElemBytes / 16, kPerLane = (kChunks + 31) / 32;
    constexpr u32 kBatch = kPerLane <= 16 ? kPerLane : (kPerLane + 1) / 2;
    constexpr u32 kGroups = kHidden / kScaleBlock, kScalesPerLane = kFP8 ? (kGroups + 31) / 32 : 1;
    float scale[kScalesPerLane];
    if constexpr (kFP8) {
#pragma unroll
      for (u32 s = 0; s < kScalesPerLane; ++s)
        if (const u32 gidx = lane + 32 * s; gidx < kGroups)
          scale[s] = __ldcg(peer.x_scale() + static_cast<u64>(token) * (kBufHidden / kScaleBlock) + gidx);
    }
    const float weight = my_row >= 0 ? __ldcg(peer.topk_weights() + token * kBufTopk + lane) : 0.0f;
#pragma unroll
    for (u32 c0 = 0; c0 < kPerLane; c0 += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (u32 b = 0; b < kBatch; ++b)
        if (const u32 c = lane + 32 * (c0 + b); c0 + b < kPerLane && c < kChunks) v[b] = __ldcg(from + c);
#pragma unroll
      for (u32 k = 0; k < kTopk; ++k) {
        if (rows[k] < 0) continue;  // warp-uniform
        uint4* to = reinterpret_cast<uint4*>(me.staging_l1() + static_cast<u64>(rows[k]) * kRowBytesL1);
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b)
          if (const u32 c = lane + 32 * (c0 + b); c0 + b < kPerLane && c < kChunks) to[c] = v[b];
      }
    }
    if constexpr (kFP8) {
#pragma unroll
      for (u32 s = 0; s < kScalesPerLane; ++s) {
        const u32 gidx = lane + 32 * s;
        if (gidx >= kGroups) break;
#pragma unroll
        for (u32 k = 0; k < kTopk; ++k)
          if (rows[k] >= 0)
            me.staging_l1_scale()[static_cast<u64>(rows[k]) * kL1ScalePitch + gidx] = scale[s];
      }
    }
    if (my_row >= 0) {  // lane k: its slot's weight and row metadata
      me.staging_weight()[my_row] = weight;
      reinterpret_cast<int4*>(me.staging_meta())[my_row] =
          make_int4(static_cast<int>(src), static_cast<int>(token), static_cast<int>(lane), static_cast<int>(my_e));
    }
  }
  // The warp's rows to their token blocks' L1 tasks: one fence after all the warp's stores, then a
  // relaxed add per row (the fence and the add make a release). A release per item drained the
  // warp's stores before it could issue its next token's loads; finding every row again from its
  // pairs (two dependent L2 loads per item) ended the pull 3-7 us later at 8 items per warp
  // (Qwen3-like, 8192 tokens), so the last kHeldItems items' blocks come from registers and only
  // older ones are reloaded.
  __syncwarp();
  __threadfence();
  for (u32 i = 0; i + kHeldItems < items; ++i) {
    const PullSlot slot = pull_slot(table, me, listed, global_warp() + i * total_warps(), lane);
    if (slot.row >= 0) count_pulled_row(me, block_of_row(table, slot.e, static_cast<u32>(slot.row)));
  }
#pragma unroll
  for (u32 i = 0; i < kHeldItems; ++i)
    if (held[i] != ~0u) count_pulled_row(me, held[i]);
  __syncwarp();
  if (lane == 0) count_pulled_warp(table, me);  // the rows' stores were fenced above
}

}  // namespace megamoe::mega
