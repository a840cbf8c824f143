// Kernel parameters (one struct passed by value) and typed access to the regions of a rank's
// symmetric buffer. The Python twin of Params is vllm_megamoe.kernels.sm90_mega_moe._Params.
#pragma once
#include "config.cuh"

namespace megamoe::mega {

// The launch's warps, counted across CTAs (the staging and pull phases share items out by them).
MEGAMOE_DEVICE u32 global_warp() { return blockIdx.x * kNumWarps + thread_index() / 32; }
MEGAMOE_DEVICE u32 total_warps() { return gridDim.x * kNumWarps; }

struct Params {
  const u16* x;               // [T, H] bf16: this rank's tokens
  const void* topk_idx;       // [T, K] global expert ids, -1 masked: int32, or int64 when topk_idx_int64
  const float* topk_weights;  // [T, K]
  u16* y;                     // [T, H] bf16 output
  const u8* w13;              // [El, 2I, H] fp8 or bf16, gate/up interleaved by 8
  const float* w13_scale;     // [El, 2I/128, H/128] (fp8 only), checkpoint row order
  const u8* w2;               // [El, H, I]
  const float* w2_scale;      // [El, H/128, I/128]
  int* error_record;          // host-mapped int32[8]: filled before a trap (see sync.cuh)
  u64* phase_clock;           // optional [grid][kNumPhaseMarks] timestamps (phase_clock.cuh), or null
  u8* peers[8];               // base address of every rank's buffer in this process
  u64 timeout_ns;             // every wait gives up after this long
  int num_tokens;
  int rank;
  int has_clamp;
  float clamp;
  // Whether topk_idx holds int64 (torch.topk's dtype): read as it comes, so that a call does not
  // start with a conversion kernel. Last, so that older kernel trees still read the fields above.
  int topk_idx_int64;
  // Whether this call's weight copies take an L2 evict-first policy (builds compiled with
  // MEGAMOE_WEIGHTS_EVICT_FIRST only; mainloop_smem.cuh kWeightsEvictFirst).
  int weights_evict_first;
};

// Region pointers of one rank's buffer.
struct Regions {
  u8* base;
  MEGAMOE_DEVICE int* workspace() const { return reinterpret_cast<int*>(base + kOffWorkspace); }
  // [E]: pairs this rank sends to each global expert (the destinations read them; zeroed again at
  // the end of the call).
  MEGAMOE_DEVICE int* send_count() const { return reinterpret_cast<int*>(base + kOffSendCount); }
  // [R]: tokens this rank lists for each rank (the same).
  MEGAMOE_DEVICE int* token_send_count() const { return reinterpret_cast<int*>(base + kOffTokenSendCount); }
  // [R, kMaxTokens]: written by source rank r: the tokens with at least one pair here, each once.
  MEGAMOE_DEVICE int* recv_tokens() const { return reinterpret_cast<int*>(base + kOffRecvTokens); }
  // [R, kMaxTokens, kBufTopk]: per listed token and top-k slot, local expert * kMaxTokens + the
  // pair's position among rank r's pairs for that expert, or -1 (the slot's expert is elsewhere).
  MEGAMOE_DEVICE int* recv_token_pairs() const { return reinterpret_cast<int*>(base + kOffRecvTokenPairs); }
  MEGAMOE_DEVICE u8* x() const { return base + kOffX; }
  MEGAMOE_DEVICE float* x_scale() const { return reinterpret_cast<float*>(base + kOffXScale); }
  MEGAMOE_DEVICE int* topk_idx() const { return reinterpret_cast<int*>(base + kOffTopkIdx); }
  MEGAMOE_DEVICE float* topk_weights() const { return reinterpret_cast<float*>(base + kOffTopkWeights); }
  MEGAMOE_DEVICE int* staging_meta() const { return reinterpret_cast<int*>(base + kOffStagingMeta); }
  MEGAMOE_DEVICE float* staging_weight() const { return reinterpret_cast<float*>(base + kOffStagingWeight); }
  MEGAMOE_DEVICE u8* staging_l1() const { return base + kOffStagingL1; }
  MEGAMOE_DEVICE float* staging_l1_scale() const { return reinterpret_cast<float*>(base + kOffStagingL1Scale); }
  MEGAMOE_DEVICE u8* staging_l2() const { return base + kOffStagingL2; }
  MEGAMOE_DEVICE float* staging_l2_scale() const { return reinterpret_cast<float*>(base + kOffStagingL2Scale); }
  // [blocks]: per token block this call, rows pulled + L1 tiles finished (block_ready.cuh; zeroed
  // again at the end of the call).
  MEGAMOE_DEVICE u32* l1_block_done() const { return reinterpret_cast<u32*>(base + kOffL1BlockDone); }
  MEGAMOE_DEVICE u16* combine() const { return reinterpret_cast<u16*>(base + kOffCombine); }
};

// Per-CTA copy of who sends how many rows to each local expert, and where they land in staging.
struct ExpertTable {
  u32 src_count[kNumLocalExperts][kNumRanks];  // rows from rank r for local expert e
  u32 row_start[kNumLocalExperts + 1];         // first staging row of expert e (prefix sum)
  u32 block_start[kNumLocalExperts + 1];       // first token block (kTileTokens rows) of expert e
  u32 listed[kNumRanks];                       // tokens rank r listed for this rank (recv_tokens)
  u32 pulled_warps;                            // this CTA's warps done with the pull (count_pulled_warp)
};

// The largest e < kNumLocalExperts with table[e] <= value (table ascending, table[0] == 0), by a
// whole converged warp (every lane passes the same value): two rounds of 32 compares side by side
// instead of log2(n) dependent shared-memory reads (the binary searches of a task's lookup were
// 5 % of a prefill's stall samples).
MEGAMOE_DEVICE u32 upper_bound_expert_warp(const u32* table, u32 value) {
  constexpr u32 kStride = (kNumLocalExperts + 31) / 32;  // entries per lane's coarse probe (<= 32)
  static_assert(kStride <= 32, "two rounds of 32 compares cover at most 1024 experts");
  const u32 lane = thread_index() % 32;
  const u32 probe = lane * kStride;
  const u32 coarse = __ballot_sync(0xffffffffu, probe < kNumLocalExperts && table[probe] <= value);
  const u32 base = (31 - __clz(coarse)) * kStride;  // coarse != 0: table[0] == 0 <= value
  const u32 e = base + lane;
  const u32 fine = __ballot_sync(0xffffffffu, lane < kStride && e < kNumLocalExperts && table[e] <= value);
  return base + 31 - __clz(fine);
}

// The staging rows one GEMM task covers: rows [first_row, first_row + num_rows) of `expert`.
struct TaskRows {
  u32 expert, first_row, num_rows;
};

// `e`: the expert that owns `block`.
MEGAMOE_DEVICE TaskRows task_rows(const ExpertTable& table, u32 block, u32 e) {
  const u32 local_block = block - table.block_start[e];
  const u32 first = table.row_start[e] + local_block * kTileTokens;
  const u32 count = table.row_start[e + 1] - table.row_start[e];
  const u32 left = count - local_block * kTileTokens;
  return {e, first, left < kTileTokens ? left : kTileTokens};
}

// The TMA tensor maps of the TMA mainloop (kernel parameters; zero-filled and unused otherwise).
struct TmaMaps {
  const TensorMap* w13;  // [experts][2I][H], box 128 bytes x 256 rows x 1
  const TensorMap* w2;   // [experts][H][I]
  const TensorMap* l1;   // staging_l1 [rows][H], box 128 bytes x kTileTokens rows
  const TensorMap* l2;   // staging_l2 [rows][I]
};

// The operands of one GEMM task as a mainloop reads them.
struct TaskOperands {
  TaskRows rows;
  const u8* a;               // the CTA's first weight row (rows K * kElemBytes bytes apart)
  const TensorMap* a_map;    // TMA mainloop: the weights' map [experts][rows][K] ...
  u32 a_row0;                // ... and the tile's first row within the expert
  const TensorMap* b_map;    // TMA mainloop: the phase's token rows [staging rows][K]
  const u8* tok;             // token rows of the phase (staging_l1 or staging_l2)
  u32 tok_pitch;             // bytes between token rows
  const float* w_scale[2];   // FP8: this warp's weight-scale rows (by 128-K block) of fragment rows g | g + 8
  const float* tok_scale;    // FP8: token-scale rows, tok_scale_pitch floats apart
  u32 tok_scale_pitch;
};

}  // namespace megamoe::mega
