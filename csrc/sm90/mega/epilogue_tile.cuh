// The GEMM epilogues' shared-memory tile: where it lives, how its rows are laid out, and what the
// other shared values of an epilogue are.
#pragma once
#include "mainloop_smem.cuh"

namespace megamoe::mega {

// The L2 epilogue goes through shared memory in passes of up to 64 tokens (a 128-token tile's
// [128][256] BF16 rows would take 64 KB); L1's [tokens][128] FP8 / BF16 tile fits the same bytes.
// An epilogue warpgroup's hand-off tile holds a whole task: one pass (64 KB at 128 tokens).
constexpr u32 kL2PassTokens = kTileTokens < 64 || kEpilogueWarpgroup ? kTileTokens : 64;
constexpr u32 kEpilogueTileBytes = kL2PassTokens * kTileRows * 2;  // L1: [tokens][128] fp8/bf16; L2: [pass tokens][256] bf16
static_assert(kTileTokens * 128 * kElemBytes <= kEpilogueTileBytes, "the L1 epilogue tile does not fit");
// The TMA mainloop leaves the stage of a task's last chunk untouched until the next task's first
// CTA barrier (the copies streaming into the next task go to the other stages): the epilogue
// tile lives there instead of in its own 16-32 KB, which buys the prefill builds a fifth stage.
// (Not with an epilogue warpgroup: its tile is read while the next task's K loop fills the stages.)
#define MEGAMOE_EPILOGUE_IN_STAGE (!MEGAMOE_EPILOGUE_WARPGROUP)

// What the MMA warpgroups tell the epilogue warpgroup about the tile they hand off
// (epilogue_warpgroup.cuh): which task it holds, or that the GEMM phases are over.
enum HandoffKind : u32 { kHandoffL1 = 0, kHandoffL2 = 1, kHandoffDone = 2 };
struct HandoffHeader {
  u32 kind;       // HandoffKind
  u32 block;      // token block (L1: the block whose L2 tasks wait for it)
  u32 tile;       // weight tile of the phase (L1: 128 SwiGLU channels; L2: 256 hidden channels)
  u32 first_row;  // the block's first staging row
  u32 num_rows;   // its rows (<= kTileTokens)
};

// The L1 epilogue's per-token tables (EpilogueTables below). 128-token builds: in the finished
// task's token-scale table of the mainloop (read by its K loop only; the next task stores into it
// after the epilogue's last barrier), 5 KB of static shared memory that buy the DeepSeek-V3-like
// 128-token build a 4th stage, when that table has the 4 rows they take (a layer of hidden or
// intermediate size >= 512; sm90_smem.epilogue_tables_in_mainloop says the same to the host).
// amax has two rows in every 128-token build (FP8 128-token builds compute their scales in the
// lanes holding the token, expert_gemm.cuh kQuadScales, and leave it unused; host formulas keep it).
#define MEGAMOE_EPILOGUE_TABLES_IN_MAINLOOP \
  (MEGAMOE_TILE_TOKENS == 128 && (MEGAMOE_HIDDEN >= 512 || MEGAMOE_INTERMEDIATE >= 512))
constexpr u32 kAmaxRows = kTileTokens == 128 ? 2 : kNumMmaWarps;

struct EpilogueSmem {
#if !MEGAMOE_EPILOGUE_TABLES_IN_MAINLOOP
  float amax[kAmaxRows][kTileTokens];  // L1 FP8: each warp's amax per token (before the top-k weight)
  float weight[kTileTokens];           // L1: the top-k weight of each token row
  float inv_scale[kTileTokens];        // L1 FP8: 1 / the token's requantization scale
#endif
#if !MEGAMOE_EPILOGUE_IN_STAGE
  alignas(16) u8 tile[kEpilogueTileBytes];
#endif
  HandoffHeader handoff;  // epilogue-warpgroup builds only, as are the two mbarriers:
  u64 tile_full;          // the MMA warpgroups' threads arrive once the tile and header are written
  u64 tile_empty;         // the epilogue warpgroup's threads arrive once they are done reading it
};

struct EpilogueTables {
  float (*amax)[kTileTokens];  // [kAmaxRows][kTileTokens]: L1 FP8, a warp's (warpgroup's) amax per token
  float* weight;               // [kTileTokens]: L1, the top-k weight of each token row
  float* inv_scale;            // [kTileTokens]: L1 FP8, 1 / the token's requantization scale
};

MEGAMOE_DEVICE EpilogueTables epilogue_tables(EpilogueSmem& smem, MainloopSmem* mainloop) {
#if MEGAMOE_EPILOGUE_TABLES_IN_MAINLOOP
  static_assert((kAmaxRows + 2) * kTileTokens <= sizeof(MainloopSmem::tok_scale) / sizeof(float),
                "the epilogue's tables do not fit the token-scale table");
  (void)smem;
  float* t = &mainloop->tok_scale[0][0];
  return {reinterpret_cast<float(*)[kTileTokens]>(t), t + kAmaxRows * kTileTokens, t + (kAmaxRows + 1) * kTileTokens};
#else
  (void)mainloop;
  return {smem.amax, smem.weight, smem.inv_scale};
#endif
}

// The epilogue warpgroup's hand-off tile (epilogue_warpgroup.cuh; other builds never hand off).
MEGAMOE_DEVICE u8* handoff_tile(EpilogueSmem& smem) {
#if MEGAMOE_EPILOGUE_WARPGROUP
  return smem.tile;
#else
  (void)smem;
  return nullptr;
#endif
}

// The epilogue tile of the task whose K loop just ended (state `st`).
template <class State>
MEGAMOE_DEVICE u8* epilogue_tile(EpilogueSmem& smem, MainloopSmem* mainloop, const State& st) {
#if MEGAMOE_EPILOGUE_IN_STAGE
  static_assert(kEpilogueTileBytes <= sizeof(MainloopSmem::a[0]), "the epilogue tile does not fit a stage");
  (void)smem;
  return mainloop->a[(st.seq - 1) % kMainloopStages];
#else
  (void)mainloop, (void)st;
  return smem.tile;
#endif
}

// Byte offset of byte `byte` of row `row` in an epilogue tile of `row_bytes`-byte rows: each row's
// 16-byte chunks are XOR-permuted by the row's low three bits. A warp's fragment stores touch
// rows 2 apart in the same columns: unpermuted, those rows are a multiple of 128 bytes apart and
// the stores of its 4 row groups went to the same banks (4-way conflicts); permuted, they land in
// 4 different chunks, and a row still leaves the tile as whole 16-byte chunks.
MEGAMOE_DEVICE u32 epilogue_offset(u32 row, u32 byte, u32 row_bytes) {
  return row * row_bytes + (((byte / 16) ^ (row & 7)) * 16) + byte % 16;
}

// Before the barrier that ends the epilogue's use of the tile: with the TMA mainloop the next
// write to that stage is a TMA copy (async proxy), ordered after this thread's generic accesses.
MEGAMOE_DEVICE void release_epilogue_tile() {
#if MEGAMOE_EPILOGUE_IN_STAGE
  fence_proxy_async_shared();
#endif
}

}  // namespace megamoe::mega
