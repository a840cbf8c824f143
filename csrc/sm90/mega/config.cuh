// Compile-time configuration of the fused SM90 mega MoE kernel. Every value arrives as a -D
// define generated from vllm_megamoe.layout.BufferLayout.c_defines() (the one source of truth
// for the buffer layout) plus the kernel's own tile choices; nothing here is typed by hand.
#pragma once
#include "../common.cuh"

#ifndef MEGAMOE_NUM_RANKS
#error "compile through vllm_megamoe.kernels.sm90_mega_moe: layout defines are missing"
#endif

namespace megamoe::mega {

constexpr u32 kNumRanks = MEGAMOE_NUM_RANKS;
constexpr u32 kNumExperts = MEGAMOE_NUM_EXPERTS;
constexpr u32 kNumLocalExperts = MEGAMOE_NUM_LOCAL_EXPERTS;
constexpr u32 kMaxTokens = MEGAMOE_MAX_TOKENS;       // per rank, rows of x and combine
constexpr u32 kHidden = MEGAMOE_HIDDEN;               // of this layer (<= the buffer's)
constexpr u32 kInter = MEGAMOE_INTERMEDIATE;          // of this layer
constexpr u32 kTopk = MEGAMOE_TOPK;
constexpr u32 kBufHidden = MEGAMOE_BUF_HIDDEN;        // row pitch of x / staging_l1 / combine
constexpr u32 kBufInter = MEGAMOE_BUF_INTERMEDIATE;   // row pitch of staging_l2
constexpr u32 kBufTopk = MEGAMOE_BUF_TOPK;            // row pitch of topk_idx / topk_weights
constexpr u32 kStagingRows = MEGAMOE_STAGING_ROWS;
// Floats per row of staging_l1_scale / staging_l2_scale: the buffer's H/128 and I/128 rounded up to
// 16 bytes (layout.scale_row_pitch), so the 128-token builds copy them in 16-byte groups.
constexpr u32 kL1ScalePitch = MEGAMOE_L1_SCALE_PITCH;
constexpr u32 kL2ScalePitch = MEGAMOE_L2_SCALE_PITCH;
static_assert(kL1ScalePitch % 4 == 0 && kL2ScalePitch % 4 == 0, "staging scale rows are whole 16-byte groups");
constexpr bool kFP8 = MEGAMOE_FP8 != 0;               // fp8-block, else bf16

// Region offsets in bytes from the start of a rank's buffer.
constexpr u64 kOffWorkspace = MEGAMOE_OFF_workspace;
constexpr u64 kOffSendCount = MEGAMOE_OFF_expert_send_count;
constexpr u64 kOffTokenSendCount = MEGAMOE_OFF_token_send_count;
constexpr u64 kOffRecvTokens = MEGAMOE_OFF_recv_tokens;
constexpr u64 kOffRecvTokenPairs = MEGAMOE_OFF_recv_token_pairs;
constexpr u64 kOffX = MEGAMOE_OFF_x;
constexpr u64 kOffXScale = MEGAMOE_OFF_x_scale;
constexpr u64 kOffTopkIdx = MEGAMOE_OFF_topk_idx;
constexpr u64 kOffTopkWeights = MEGAMOE_OFF_topk_weights;
constexpr u64 kOffStagingMeta = MEGAMOE_OFF_staging_meta;
constexpr u64 kOffStagingWeight = MEGAMOE_OFF_staging_weight;
constexpr u64 kOffStagingL1 = MEGAMOE_OFF_staging_l1;
constexpr u64 kOffStagingL1Scale = MEGAMOE_OFF_staging_l1_scale;
constexpr u64 kOffStagingL2 = MEGAMOE_OFF_staging_l2;
constexpr u64 kOffStagingL2Scale = MEGAMOE_OFF_staging_l2_scale;
constexpr u64 kOffL1BlockDone = MEGAMOE_OFF_l1_block_done;
constexpr u64 kOffCombine = MEGAMOE_OFF_combine;

// Workspace slots (int32 indices into the workspace region).
constexpr u32 kSlotRankArrivals = MEGAMOE_SLOT_rank_arrivals;
constexpr u32 kSlotNvlArrived = MEGAMOE_SLOT_nvl_arrived_0_0;  // [barrier][source rank], kNvlArrivedRanks per barrier
constexpr u32 kNvlArrivedRanks = MEGAMOE_SLOT_nvl_arrived_1_0 - MEGAMOE_SLOT_nvl_arrived_0_0;
constexpr u32 kSlotL1TaskCounter = MEGAMOE_SLOT_l1_task_counter;
constexpr u32 kSlotL2TaskCounter = MEGAMOE_SLOT_l2_task_counter;
constexpr u32 kSlotPulledWarps = MEGAMOE_SLOT_pulled_warps;
constexpr u32 kSlotL1TilesDone = MEGAMOE_SLOT_l1_tiles_done;
constexpr u32 kSlotNumTokens = MEGAMOE_SLOT_num_tokens;
constexpr u32 kSlotErrorFlag = MEGAMOE_SLOT_error_flag;
constexpr u32 kSlotCallCount = MEGAMOE_SLOT_call_count;

// Tiles: the CTA's 8 MMA warps (two warpgroups) compute 256 weight rows x 32 tokens (weights on
// the MMA M side, tokens on N: "swap AB", so a handful of tokens per expert still fills the MMA's M).
constexpr u32 kTileRows = 256;                  // weight rows per task
#ifndef MEGAMOE_TILE_TOKENS
#define MEGAMOE_TILE_TOKENS 32
#endif
constexpr u32 kTileTokens = MEGAMOE_TILE_TOKENS; // tokens per task (a token block)
// The 32- and 64-token TMA builds, and the 128-token ones whose 64 KB hand-off tile fits beside
// 3 stages (sm90_smem.has_epilogue_warpgroup), add a third warpgroup that runs the GEMM tasks'
// epilogues (SwiGLU, requantization, the stores, the L1 block's release) while the MMA warpgroups
// run the next task's K loop (epilogue_warpgroup.cuh); every other build has the two MMA
// warpgroups only.
#ifndef MEGAMOE_EPILOGUE_WARPGROUP
#define MEGAMOE_EPILOGUE_WARPGROUP 0
#endif
constexpr bool kEpilogueWarpgroup = MEGAMOE_EPILOGUE_WARPGROUP != 0;
constexpr u32 kNumMmaWarps = 8;                 // the GEMM phases' warps (warpgroups 0-1)
constexpr u32 kNumMmaThreads = kNumMmaWarps * 32;
constexpr u32 kEpilogueWarps = 4;               // an epilogue warpgroup's
constexpr u32 kNumWarps = kNumMmaWarps + (kEpilogueWarpgroup ? kEpilogueWarps : 0);  // the CTA's (every other phase's)
constexpr u32 kNumThreads = kNumWarps * 32;
constexpr u32 kTokenTiles = kTileTokens / 8;     // n8 tiles per task
constexpr u32 kScaleBlock = 128;
constexpr u32 kElemBytes = kFP8 ? 1 : 2;
constexpr u32 kRowBytesL1 = kBufHidden * kElemBytes;   // staging_l1 / x row pitch in bytes
constexpr u32 kRowBytesL2 = kBufInter * kElemBytes;    // staging_l2 row pitch in bytes

static_assert(kHidden % kScaleBlock == 0 && kInter % kScaleBlock == 0, "H and I must be multiples of 128");
static_assert(kHidden % kTileRows == 0, "hidden must be a multiple of 256 for the L2 tile");
static_assert(kNumRanks <= kNvlArrivedRanks, "this kernel addresses at most 8 ranks (an arrival word each)");
static_assert(kTileTokens == 32 || kTileTokens == 64 || kTileTokens == 128, "token tiles are 32, 64 or 128 rows");
static_assert(kTopk <= 32, "top-k above 32 is not supported");
static_assert(kNumLocalExperts <= 512, "too many local experts for the shared-memory tables");

// Profiling only (benchmarks/kernel_probe.py `ablate=`): builds that drop one part of the GEMM
// mainloop to time what is left; their output is wrong. 0 in every build the op runs on its own.
#ifndef MEGAMOE_ABLATE
#define MEGAMOE_ABLATE 0
#endif
constexpr u32 kAblate = MEGAMOE_ABLATE;
constexpr u32 kAblatePromotion = 1;  // FP8: partial sums never scaled into the accumulators (one value added)
constexpr u32 kAblateMma = 2;        // wgmma never issued (TMA stages still stream and are waited for)
constexpr u32 kAblateTokenRows = 4;  // TMA token boxes always read staging rows 0.. (hot in L2)
constexpr u32 kAblateWeightRows = 8; // TMA weight boxes always read expert 0's rows (hot in L2)
constexpr u32 kAblateTma = 16;       // no TMA copies: stages complete at once and hold stale bytes (math alone)
constexpr u32 kAblateTmaWarm = 32;   // only the CTA's first S chunks are copied; later chunks reuse those bytes
constexpr u32 kAblateNarrow = 64;    // FP8 64-token tiles: every task runs the narrow path (its first 32 token columns)
constexpr u32 kAblateHalfRows = 128; // FP8: each warpgroup's second m64 wgmma group is never issued (empty commit)
constexpr u32 kAblateEpilogue = 256; // epilogue warpgroup: the hand-off runs, the rows are neither computed nor stored;
                                     // inline epilogues (128-token builds): skipped, the L1 tile published unwritten
constexpr u32 kAblateKeepPadding = 512;  // FP8 register-token loops: padding token rows keep the bytes the box read
constexpr u32 kAblateStores = 1024;     // FP8 128-token epilogues from the registers: every value computed, no row stored
constexpr u32 kAblateTranspose = 2048;  // FP8 128-token epilogues from the registers: stored without the quad transposes
constexpr u32 kAblateTaskScales = 4096; // FP8: only a CTA's first task of a phase loads its scale tables; later
                                        // tasks promote with what the tables hold (cta_gemm.cuh stage_task_scales)

// Error codes written to the workspace error flag before trapping.
constexpr int kErrorStagingOverflow = 2;
constexpr int kErrorBadExpert = 4;

}  // namespace megamoe::mega
