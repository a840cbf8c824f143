// The epilogue warpgroup of the 32- and 64-token TMA builds, and of the 128-token ones where a 64 KB
// tile fits beside 3 stages (kEpilogueWarpgroup; sm90_smem.has_epilogue_warpgroup): a third warpgroup runs
// the GEMM tasks' epilogues while the two MMA warpgroups run the next task's K loop. Without it a
// CTA's tensor cores idled through every epilogue: 11-22 % of the GEMM phases at prefill
// (docs/kernel_design.md: the task spans: SwiGLU's MUFU work, two CTA barriers, the stores and the
// L1 block's release, whose fence stalled warp 0, the TMA issuer).
//
// Hand-off per task through one 16 / 32 / 64 KB shared-memory tile ([tokens][512 bytes], rows permuted
// by epilogue_offset) and two mbarriers:
//   MMA warpgroups: wait for tile_empty, store the accumulators as BF16 (L1: each channel's (gate,
//     up) pair, both rounded to BF16 as SwiGLU rounds them; L2: the 256 output channels) and the
//     task's header, arrive on tile_full (every thread), start the next task's K loop;
//   epilogue warpgroup: wait for tile_full, one warp per token row (8 / 16 / 32 rows each): L1 SwiGLU x
//     top-k weight, the row's FP8 scale (warp amax) or BF16, one row store to staging_l2; L2 the
//     row to the source rank's combine buffer; arrive on tile_empty (every thread); L1: then the
//     block's release (its fence stalls this warpgroup, not the K loop).
// (Named barriers did the same: bar.arrive / bar.sync, or bar.sync on both sides; compute-
// sanitizer's racecheck reported every hand-off as a race with either, docs/kernel_design.md.)
// The epilogue warpgroup arrives on tile_empty once before its first wait, so the MMA side
// always waits before it writes (use n of tile_empty waits for the epilogue's n-th arrival), and a
// kHandoffDone header after the last L2 task ends its loop.
// The values and their rounding are those of the two-warpgroup epilogue (expert_gemm.cuh): both
// builds' outputs are equal bit for bit (tests/gpu/test_sm90_mega_moe.py).
// Registers: the launch gives 384 threads 168 each; the MMA warpgroups take kMmaRegs, the
// epilogue warpgroup keeps kEpilogueRegs (setmaxnreg), back to 168 after the GEMM phases.
#pragma once
#include "block_ready.cuh"
#include "conv.cuh"
#include "epilogue_tile.cuh"
#include "k_loop_register_tokens.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "../ptx.cuh"
#include "sync.cuh"

namespace megamoe::mega {

constexpr u32 kHandoffRowBytes = kTileRows * 2;  // [token][256 bf16]: L2 channels, or L1's 128 (gate, up) pairs
constexpr u32 kLaunchRegs = (65536 / kNumThreads) / 8 * 8;
constexpr u32 kMmaRegs = 232, kEpilogueRegs = 40;
static_assert(!kEpilogueWarpgroup || kEpilogueTileBytes == kTileTokens * kHandoffRowBytes,
              "the hand-off tile holds a whole task");
static_assert(!kEpilogueWarpgroup || kNumMmaThreads * kMmaRegs + kEpilogueWarps * 32 * kEpilogueRegs <= kLaunchRegs * kNumThreads,
              "setmaxnreg split exceeds the CTA's register pool: a warpgroup would wait forever");

// Kernel start, thread 0 (a __syncthreads follows before any use).
MEGAMOE_DEVICE void init_handoff(EpilogueSmem& smem) {
  if constexpr (kEpilogueWarpgroup) {
    mbarrier_init(&smem.tile_full, kNumMmaThreads);
    mbarrier_init(&smem.tile_empty, kEpilogueWarps * 32);
    fence_barrier_init();
  }
}

// ---------------------------------------------------------------- MMA warpgroups' side
// Before the tile is written: the epilogue warpgroup is done with the previous one (a timeout is
// reported as a hand-off one, "which" 1: tile_empty).
MEGAMOE_DEVICE void handoff_wait_empty(EpilogueSmem& smem, u32 handoffs, const Params& p, int phase) {
  wait_phase_or_trap(&smem.tile_empty, handoffs, p, kErrorHandoffTimeout, phase, 1);
}

// After the tile is written: the header (thread 0), then every MMA thread arrives.
MEGAMOE_DEVICE void handoff_publish(EpilogueSmem& smem, HandoffKind kind, u32 block, u32 tile, const TaskRows& t,
                                    u32& handoffs) {
  if (thread_index() == 0) smem.handoff = HandoffHeader{static_cast<u32>(kind), block, tile, t.first_row, t.num_rows};
  mbarrier_arrive(&smem.tile_full);
  ++handoffs;
}

// L1: acc's (gate, up) pairs as BF16 into the tile: pair of channel c of token row r at byte
// 4 c of row r (gate in the low half). kN: the token columns the K loop computed; kRegTok: acc in
// the register-token map (k_loop_register_tokens.cuh), else the swap-AB one (mma_tile.cuh).
template <u32 kN, bool kRegTok>
MEGAMOE_DEVICE void handoff_l1_pairs(u8* tile, const WarpAcc& acc) {
  if constexpr (kRegTok) {
    // Elements 8 m + k (gate rows) and 8 m + 4 + k (their up rows), k = 2 h + {0, 1}: token row
    // register_tokens_token(2 h), adjacent channels: one 8-byte store per (group, m, h).
#pragma unroll
    for (u32 mt = 0; mt < kRtGroups; ++mt) {
      const float(&v)[32] = rt_group(acc, mt);
#pragma unroll
      for (u32 m = 0; m < 4; ++m)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
          const u32 row = register_tokens_row(mt, 8 * m + 2 * h);  // a gate row: channel = row / 16 x 8 + row % 8
          const u32 channel = row / 16 * 8 + row % 8;
          const uint2 pairs = make_uint2(pack_bf16x2(v[8 * m + 2 * h], v[8 * m + 4 + 2 * h]),
                                         pack_bf16x2(v[8 * m + 2 * h + 1], v[8 * m + 4 + 2 * h + 1]));
          *reinterpret_cast<uint2*>(tile + epilogue_offset(register_tokens_token(2 * h), channel * 4, kHandoffRowBytes)) = pairs;
        }
    }
  } else {
    const u32 warp = thread_index() / 32, lane = thread_index() % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
    for (u32 nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (u32 j = 0; j < 2; ++j)
#pragma unroll
        for (u32 mt = 0; mt < 2; ++mt) {
          const u32 channel = acc_row_base(warp, mt) / 2 + g;  // rows base + g (gate) and base + g + 8 (up)
          *reinterpret_cast<u32*>(tile + epilogue_offset(nt * 8 + 2 * t4 + j, channel * 4, kHandoffRowBytes)) =
              pack_bf16x2(acc.v[mt][nt][j], acc.v[mt][nt][2 + j]);
        }
  }
}

// After the L2 phase's last task: tells the epilogue warpgroup to leave its loop.
MEGAMOE_DEVICE void handoff_done(EpilogueSmem& smem, u32 handoffs, const Params& p) {
  handoff_wait_empty(smem, handoffs, p, kPhaseL2);
  handoff_publish(smem, kHandoffDone, 0, 0, TaskRows{}, handoffs);
}

// ---------------------------------------------------------------- the epilogue warpgroup
MEGAMOE_DEVICE float warp_max(float v) {
#pragma unroll
  for (u32 s = 16; s > 0; s /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
  return v;
}

// L1: rows warp, warp + 4, .. of the tile: SwiGLU (optional clamp) of a lane's 4 channels, the
// top-k weight, FP8 with the row's scale over its 128 channels (or BF16) into staging_l2.
MEGAMOE_DEVICE void epilogue_l1_rows(const u8* tile, const HandoffHeader& h, const Params& p, const Regions& me) {
  const u32 warp = thread_index() / 32 - kNumMmaWarps, lane = thread_index() % 32;
  const u32 my_tok = warp + kEpilogueWarps * lane;  // lane i: the top-k weight of the warp's i-th row
  const float my_weight = my_tok < h.num_rows ? ld_cg_f32(me.staging_weight() + h.first_row + my_tok) : 0.0f;
#pragma unroll 1
  for (u32 i = 0, tok = warp; tok < h.num_rows; ++i, tok += kEpilogueWarps) {
    const float w = __shfl_sync(0xffffffffu, my_weight, i);
    const uint4 raw = *reinterpret_cast<const uint4*>(tile + epilogue_offset(tok, lane * 16, kHandoffRowBytes));
    const u32 pairs[4] = {raw.x, raw.y, raw.z, raw.w};
    float s[4], amax = 0.0f;
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
      float gate = bf16_to_f32(pairs[j] & 0xffff), up = bf16_to_f32(pairs[j] >> 16);
      if (p.has_clamp) {
        gate = fminf(gate, p.clamp);
        up = fminf(fmaxf(up, -p.clamp), p.clamp);
      }
      s[j] = silu(gate) * up;
      amax = fmaxf(amax, fabsf(s[j]));
    }
    const u64 row = h.first_row + tok;
    if constexpr (kFP8) {
      // |s x w| rounds monotonically: the row's amax of s x w is its amax of s times |w|, exactly.
      const float scale = fmaxf(warp_max(amax) * fabsf(w), kAmaxFloor) * (1.0f / kFP8Max);
      const float inv_scale = 1.0f / scale;
      const u32 out = static_cast<u32>(f32x2_to_e4m3x2(s[0] * w * inv_scale, s[1] * w * inv_scale)) |
                      (static_cast<u32>(f32x2_to_e4m3x2(s[2] * w * inv_scale, s[3] * w * inv_scale)) << 16);
      reinterpret_cast<u32*>(me.staging_l2() + row * kRowBytesL2 + h.tile * 128)[lane] = out;
      if (lane == 0) me.staging_l2_scale()[row * kL2ScalePitch + h.tile] = scale;
    } else {
      reinterpret_cast<uint2*>(me.staging_l2() + row * kRowBytesL2 + h.tile * 256)[lane] =
          make_uint2(pack_bf16x2(s[0] * w, s[1] * w), pack_bf16x2(s[2] * w, s[3] * w));
    }
  }
}

// L2: rows warp, warp + 4, .. of the tile (512 bytes each) to combine[slot][token] of their source rank.
MEGAMOE_DEVICE void epilogue_l2_rows(const u8* tile, const HandoffHeader& h, const Params& p, const Regions& me) {
  const u32 warp = thread_index() / 32 - kNumMmaWarps, lane = thread_index() % 32;
  const u32 my_tok = warp + kEpilogueWarps * lane;  // lane i: the (rank, token, slot) of the warp's i-th row
  const int4 my_meta = my_tok < h.num_rows ? __ldcg(reinterpret_cast<const int4*>(me.staging_meta()) + h.first_row + my_tok)
                                           : make_int4(0, 0, 0, 0);
#pragma unroll 1
  for (u32 i = 0, tok = warp; tok < h.num_rows; ++i, tok += kEpilogueWarps) {
    const int rank = __shfl_sync(0xffffffffu, my_meta.x, i), token = __shfl_sync(0xffffffffu, my_meta.y, i);
    const int slot = __shfl_sync(0xffffffffu, my_meta.z, i);
    const Regions src{p.peers[rank]};
    u16* dst = src.combine() + (static_cast<u64>(slot) * kMaxTokens + token) * kBufHidden + h.tile * kTileRows;
    reinterpret_cast<uint4*>(dst)[lane] = *reinterpret_cast<const uint4*>(tile + epilogue_offset(tok, lane * 16, kHandoffRowBytes));
  }
}

// The epilogue warpgroup's whole part of the GEMM phases: one handed-off tile after another
// until the kHandoffDone header.
MEGAMOE_DEVICE void run_epilogue_warpgroup(EpilogueSmem& smem, const Params& p) {
  const Regions me{p.peers[p.rank]};
  mbarrier_arrive(&smem.tile_empty);  // the tile is free for the first task
  for (u32 use = 0;; ++use) {
    // No deadline of its own: the MMA warpgroups hand off or trap at one of theirs (stage, token
    // block, tile_empty), and a trap ends the grid. A deadline's trap here made ptxas allocate every
    // setmaxnreg region at the launch's 168 registers (3-5 KB of spills, serialised wgmmas), even
    // with the loop left after it; so did exit.
    while (!mbarrier_try_wait(&smem.tile_full, use & 1)) {
    }
    const HandoffHeader h = smem.handoff;
    if (h.kind == kHandoffDone) break;
    if (h.kind == kHandoffL1) {
      if constexpr (!(kAblate & kAblateEpilogue)) epilogue_l1_rows(handoff_tile(smem), h, p, me);
      mbarrier_arrive(&smem.tile_empty);
      named_barrier_sync(kBarrierEpilogue, kEpilogueWarps * 32);  // every row of the tile stored
      if (thread_index() == kNumMmaThreads) publish_l1_tile(me, h.block);
    } else {
      if constexpr (!(kAblate & kAblateEpilogue)) epilogue_l2_rows(handoff_tile(smem), h, p, me);
      mbarrier_arrive(&smem.tile_empty);
    }
  }
}

}  // namespace megamoe::mega
