// The CTA-level expert GEMM mainloop: the CTA's 256 weight rows and kTileTokens token rows are
// streamed through shared memory in 128-byte K chunks, kMainloopStages deep, so kMainloopStages - 1
// chunks are in flight while the tensor cores work on one. One thread fills each stage with two TMA
// box copies (tensor maps from the host, 128-byte swizzle: segment s of row r at s ^ (r % 8)) that
// complete on the stage's mbarrier; each warpgroup issues m64nN wgmmas for its 128 rows straight
// from shared memory through descriptors. Token rows past the task's end are whatever follows in
// staging, possibly still being pulled (their columns are never stored); rows past the staging
// region are zero-filled. The FP8 scales a task needs are copied to shared memory once at its start,
// so the per-128-K promotion never waits on a global load inside the loop; FP8 promotes with a lag
// of one wgmma group (k_loop_lagged_promotion).
#pragma once
#include "../tma.cuh"
#include "../wgmma.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "phase_clock.cuh"
#include "sync.cuh"
#include "task_queue.cuh"

#ifndef MEGAMOE_MAINLOOP_STAGES
#define MEGAMOE_MAINLOOP_STAGES 4
#endif

namespace megamoe::mega {

constexpr u32 kChunkBytes = 128;                  // K bytes per stage (FP8: one 128-value scale block)
constexpr u32 kStagedRow = 128;                   // bytes per staged row (128-byte swizzle)
constexpr u32 kStageAlign = 1024;                 // a 128-byte swizzle atom is 8 rows = 1024 bytes
constexpr u32 kMainloopStages = MEGAMOE_MAINLOOP_STAGES;
constexpr u32 kMaxKBlocks = (kHidden > kInter ? kHidden : kInter) / kScaleBlock;

// FP8 with the TMA stages: a chunk's second wgmma group is promoted during the next chunk, after
// that chunk's first group is issued, so a group is queued on the tensor cores while a partial is
// promoted, the CTA barrier waited at and the next group issued (1.03-1.15x on the K loop over
// promoting both groups inside their chunk; one queued m64n64 group is still too short to hide a
// promotion: docs/kernel_design.md).
constexpr bool kLagPromotion = kFP8 && kMainloopStages >= 3;
// FP8 64- and 128-token tiles with the lagged promotion: full tasks run the K loop with the tokens
// in registers (k_loop_register_tokens.cuh), narrow tasks (64-token tiles) the swap-AB one below.
constexpr bool kRegisterTokens = kLagPromotion && (kTileTokens == 64 || kTileTokens == 128);

// TMA builds compiled with MEGAMOE_WEIGHTS_EVICT_FIRST (the host's sm90_tuning.weights_evict_first_build)
// copy the weight boxes with an L2 evict-first policy in the calls that set Params::weights_evict_first
// (sm90_tuning.weights_evict_first_call: a few tokens per rank). There the weight stream, read once,
// passes hundreds of MB through the 50 MB L2 cache and with plain copies pushes out the rows the call
// reads again later (the L1 outputs an expert's L2 tasks read, the combine rows the reduce reads):
// on one H200 Qwen3-like 0.96-0.99x the time at 1-128 tokens per rank, the larger layers 0.97-1.00x
// at 1-16, but every shape 1.01-1.21x with more tokens (docs/kernel_design.md): a per-call choice.
#ifndef MEGAMOE_WEIGHTS_EVICT_FIRST
#define MEGAMOE_WEIGHTS_EVICT_FIRST 0
#endif
constexpr bool kWeightsEvictFirst = MEGAMOE_WEIGHTS_EVICT_FIRST != 0;

// FP8 128-token tiles: the register-token loops only (3 or more stages; sm90_mega_moe refuses 2).
static_assert(!(kFP8 && kTileTokens == 128) || kRegisterTokens, "FP8 128-token tiles need 3 or more stages");
// Weight-scale table copies: one per warp (the swap-AB loops: a warp's rows lie in one 128-row
// scale block, L2's differs by warpgroup), one in the 128-token builds (every warp reads the same
// rows: the table is 3 KB smaller, which fits DeepSeek-V3-like a 4th stage). The host sizes the
// struct with the same rule (sm90_smem.mainloop_smem_bytes).
constexpr u32 kWScaleCopies = kTileTokens == 128 ? 1 : kNumMmaWarps;
MEGAMOE_DEVICE u32 w_scale_copy(u32 warp) { return kWScaleCopies == 1 ? 0 : warp; }

struct MainloopSmem {
  alignas(kStageAlign) u8 a[kMainloopStages][kTileRows * kStagedRow];
  alignas(kStageAlign) u8 b[kMainloopStages][kTileTokens * kStagedRow];
  float tok_scale[kMaxKBlocks][kTileTokens];  // FP8: the task's token scales per 128-K block (tok_scale_col)
  float w_scale[kWScaleCopies][2][kMaxKBlocks];  // FP8: per warp (w_scale_copy), scale rows of fragment rows g | g + 8
  u64 full[kMainloopStages];                  // TMA: stage landed (phase parity = use count & 1)
};
static_assert(kMainloopStages >= 2, "the pipeline needs at least two stages");
// The dynamic shared memory base is only 16-byte aligned: the kernel rounds it up (kStageAlign
// slack requested on top of the struct when it exceeds 16).
constexpr u32 kMainloopSmemSlack = kStageAlign > 16 ? kStageAlign : 0;
#ifdef MEGAMOE_MAINLOOP_SMEM_BYTES
// The host sizes the dynamic shared memory with the same formula (sm90_mega_moe.mainloop_smem_bytes).
static_assert(sizeof(MainloopSmem) + kMainloopSmemSlack == MEGAMOE_MAINLOOP_SMEM_BYTES,
              "host and device disagree on the mainloop smem size");
#endif

// First CTA-tile row of the 16-row slice that accumulators v[mt][*] of warp `warp` hold (rows
// base + g and base + g + 8): 16 rows per warp in each 64-row wgmma of its warpgroup.
MEGAMOE_DEVICE u32 acc_row_base(u32 warp, u32 mt) {
  return (warp / 4) * 128 + mt * 64 + (warp % 4) * 16;
}

#if MEGAMOE_ABLATE & 32
__shared__ u32 ablate_copies_issued;  // ablate=tma_warm: copies thread 0 made so far
#endif
// 16 zero bytes: what the register-token loops load for a token box's padding rows (load_token_fragment).
__shared__ alignas(16) u32 token_zero_line[4];

// FP8 128-token register-token builds, which hold no registers for the next task's scales
// (TaskScaleRegs::kPrefetch) and have no shared memory to spare for a second table (DeepSeek-V3-like:
// 1-3 KB): the next task's scales go straight into MainloopSmem's tables, with 16-byte cp.async.cg
// copies (L2 only: an L1 line may hold rows of a token block not published yet) issued after this
// task's K loop, in place of a round trip to L2 before the next K loop's
// first barrier (ablate=task_scales measures that round trip). The tables are free in between: the
// 128-token L1 epilogue keeps no per-token tables there (expert_gemm.cuh kQuadScales). The staging
// scale rows are padded to 16 bytes (kL1ScalePitch); the table needs whole groups of 4 blocks. Not
// the 64-token builds: at 168 registers (epilogue warpgroup), a prefetch spilled them.
constexpr bool kScalesIntoTables = kFP8 && kRegisterTokens && kTileTokens == 128 &&
                                   !kEpilogueWarpgroup && kMaxKBlocks % 4 == 0;
static_assert(!kScalesIntoTables || (kOffStagingL1Scale % 16 == 0 && kOffStagingL2Scale % 16 == 0),
              "16-byte scale copies need 16-byte aligned token-scale regions");

// TMA mainloop: one arrival (the issuing thread's expect_tx) per stage use. Called by every
// thread at kernel start; the dispatch barrier's __syncthreads follows before first use.
MEGAMOE_DEVICE void init_mainloop(MainloopSmem& sm) {
  if (thread_index() < 4) token_zero_line[thread_index()] = 0;
  if (thread_index() == 0) {
    for (u32 s = 0; s < kMainloopStages; ++s) mbarrier_init(&sm.full[s], 1);
#if MEGAMOE_ABLATE & 32
    ablate_copies_issued = 0;
#endif
    fence_barrier_init();
  }
}

MEGAMOE_DEVICE MainloopSmem* mainloop_smem_at(u8* dynamic_smem) {
  const u64 addr = reinterpret_cast<u64>(dynamic_smem);
  return reinterpret_cast<MainloopSmem*>((addr + kStageAlign - 1) / kStageAlign * kStageAlign);
}

MEGAMOE_DEVICE void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<u32>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
}
MEGAMOE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
MEGAMOE_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The mainloop's shared memory is reached through a pointer computed from the dynamic smem base,
// which the compiler only knows as generic: the scale reads of every promotion say shared.
MEGAMOE_DEVICE float lds_f32(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr(p)));
  return v;
}
MEGAMOE_DEVICE float2 lds_f32x2(const float* p) {  // p 8-byte aligned
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(p)));
  return v;
}

// FP8: the scale-table entries of one task (K / 128 blocks) that this thread loads and stores
// (load_task_scales); held in registers from one task to the next (MainloopState::next_scales).
template <u32 KBlocks>
struct TaskScaleRegs {
  static constexpr u32 kTok = kFP8 ? (kTileTokens * KBlocks + kNumMmaThreads - 1) / kNumMmaThreads : 1;
  static constexpr u32 kW = kFP8 ? (KBlocks + 31) / 32 : 1;
  float tok[kTok];
  float w[2][kW];
  // Held across a K loop only where the registers are there: the DeepSeek-V3-like L1 (56 blocks,
  // 18 values) spills the FP8 64-token build, which then loads its scales at each task's start;
  // the register-token loop keeps a second partial live across its CTA barrier, and with the
  // prefetch the Qwen3-like build spilled.
  static constexpr bool kPrefetch = kFP8 && !kRegisterTokens && kTok + 2 * kW <= 12;
};

// Chunks this CTA has issued in the current phase of K = `K` (a chunk's stage is its sequence
// number modulo the stage count), and whether the previous task's last iterations already issued
// the first stages of the current one (its K loop streams on into the next task instead of
// draining) and loaded its FP8 scales into registers (their load latency then hides behind the
// previous task instead of starting every task: 6 % of a prefill's stall samples).
template <u32 K>
struct MainloopState {
  u32 seq;
  bool prefetched;
  int phase;  // for a stage-wait timeout report (kPhaseL1 / kPhaseL2)
  bool scales_prefetched = false;
  TaskScaleRegs<K / kScaleBlock> next_scales = {};
  u32 handoffs = 0;  // epilogue warpgroup: tiles handed off so far (its mbarriers' phase parity), both phases
  u32 tasks = 0;     // tasks this CTA began in the phase (the task trace's numbering, phase_clock.cuh)
  const AskAfter* ask_after = nullptr;  // the current task's request for the task after next (task_queue.cuh)
  u32 unpublished = ~0u;  // L1, no epilogue warpgroup: the block of the tile stored and not yet published (block_ready.cuh)
};

// Waits for phase `use` of an mbarrier with the call's deadline; past it, reports (kind, rank,
// phase, what, use) through the error record and traps instead of hanging.
MEGAMOE_DEVICE void wait_phase_or_trap(u64* bar, u32 use, const Params& p, int kind, int phase, u32 what) {
  if (mbarrier_try_wait(bar, use & 1)) return;
  const Deadline deadline{global_timer_ns(), p.timeout_ns};
  while (!mbarrier_try_wait(bar, use & 1)) {
    if (deadline.expired()) {
      report_and_trap(p.error_record, kind, p.rank, phase, static_cast<int>(what), static_cast<int>(use), 0);
      return;  // never reached; with the loop's back edge after the trap instead, ptxas allocated the
               // epilogue-warpgroup builds' MMA region at the launch's 168 registers (the K loop spilled)
    }
  }
}

// Waits for a TMA stage; a copy that never lands is reported with its stage and use.
MEGAMOE_DEVICE void wait_stage(u64* bar, u32 stage, u32 use, const Params& p, int phase) {
  wait_phase_or_trap(bar, use, p, kErrorStageTimeout, phase, stage);
}

// TMA: the two box copies of chunk `chunk` into `stage`, completing on its mbarrier (one thread).
MEGAMOE_DEVICE void issue_chunk_tma(MainloopSmem& sm, u32 stage, u32 chunk, const TaskOperands& op, const Params& p) {
  if constexpr (kAblate & kAblateTma) {  // the stage's phase completes with this arrival alone
    mbarrier_arrive(&sm.full[stage]);
    return;
  }
#if MEGAMOE_ABLATE & 32
  if (ablate_copies_issued >= kMainloopStages) {  // every stage holds real operands already
    mbarrier_arrive(&sm.full[stage]);
    return;
  }
  ++ablate_copies_issued;
#endif
  const int k = static_cast<int>(chunk * kChunkBytes / kElemBytes);  // in elements
  mbarrier_arrive_expect_tx(&sm.full[stage], (kTileRows + kTileTokens) * kChunkBytes);
  const int expert = (kAblate & kAblateWeightRows) ? 0 : static_cast<int>(op.rows.expert);
  if (kWeightsEvictFirst && p.weights_evict_first)
    tma_load_3d_hint(op.a_map, sm.a[stage], &sm.full[stage], k, static_cast<int>(op.a_row0), expert,
                     l2_policy_evict_first());
  else
    tma_load_3d(op.a_map, sm.a[stage], &sm.full[stage], k, static_cast<int>(op.a_row0), expert);
  tma_load_2d(op.b_map, sm.b[stage], &sm.full[stage], k,
              (kAblate & kAblateTokenRows) ? 0 : static_cast<int>(op.rows.first_row));
}

// `tid`: the thread's index, read once at the K loop's entry (common.cuh thread_index); so below.
template <u32 K>
MEGAMOE_DEVICE void load_chunk(MainloopSmem& sm, u32 stage, u32 chunk, const TaskOperands& op, const Params& p, u32 tid) {
  if (tid == 0) issue_chunk_tma(sm, stage, chunk, op, p);
}

// Chunk `ahead` of the current task or, past its end, chunk ahead - K-chunks of the next task (when
// the loop streams on into it; nothing otherwise), into the stage its sequence number selects.
template <u32 K>
MEGAMOE_DEVICE void load_chunk_ahead(MainloopSmem& sm, const MainloopState<K>& st, u32 ahead, const TaskOperands& cur,
                                     const TaskOperands* next, const Params& p, u32 tid) {
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  const u32 stage = (st.seq + ahead) % kMainloopStages;
  if (ahead < kChunks)
    load_chunk<K>(sm, stage, ahead, cur, p, tid);
  else if (next != nullptr)
    load_chunk<K>(sm, stage, ahead - kChunks, *next, p, tid);
}

// part (+)= this warpgroup's 128 rows x kTileTokens tokens over one staged K chunk with wgmma: two m64nN
// instructions (rows wg*128 + mt*64) per k-step, 4 k-steps of 32 bytes, operands read from the
// swizzled stage through descriptors. The accumulator layout of an m64n32 wgmma is that of
// WarpAcc::v[mt] (see accum_row / accum_col in wgmma.cuh) with rows acc_row_base(warp, mt) + ...
template <bool kCond, class A, class B>
struct Select { using type = A; };
template <class A, class B>
struct Select<false, A, B> { using type = B; };

template <u32 kN>
using ChunkMmaN = typename Select<kFP8, WgmmaFp8E4M3<kN>, WgmmaBf16<kN>>::type;
constexpr u32 kAccum = kTileTokens / 2;  // m64nN: N/2 accumulators per thread

// Issues the 4 k-steps (32 bytes of K each) of one m64nN wgmma over a staged chunk (N = kN, the
// first kN token rows of the stage: its accumulators are the first kN / 8 n8 tiles of a full
// tile's); the caller fences, commits and waits.
template <u32 kN = kTileTokens>
MEGAMOE_DEVICE void wgmma_k_steps(u64 desc_a, u64 desc_b, float (&d)[kN / 2], bool accumulate) {
  constexpr u32 kDescStep = 32 / 16;  // descriptors count 16-byte units
  if constexpr (kAblate & kAblateMma) return;
#pragma unroll
  for (u32 kk = 0; kk < kChunkBytes / 32; ++kk)
    ChunkMmaN<kN>::mma(desc_a + kDescStep * kk, desc_b + kDescStep * kk, d, accumulate || kk > 0);
}

MEGAMOE_DEVICE u64 stage_desc_a(const MainloopSmem& sm, u32 stage, u32 mt, u32 tid) {
  return make_smem_desc_k_major_sw128(sm.a[stage] + ((tid / 128) * 128 + mt * 64) * kStagedRow);
}

// BF16 with the TMA stages: a chunk's wgmmas are left in flight while the next chunk's are
// issued (wait_group 1), so the tensor cores never drain between chunks (k_loop_deferred_wait).
constexpr bool kDeferWgmmaWait = !kFP8 && kMainloopStages >= 3;

// acc += one staged chunk (BF16), the chunk's wgmmas one commit group; returns with at most
// kPending groups of this warpgroup still in flight.
template <int kPending>
MEGAMOE_DEVICE void wgmma_chunk(WarpAcc& acc, const MainloopSmem& sm, u32 stage, u32 tid) {
  const u64 desc_b = make_smem_desc_k_major_sw128(sm.b[stage]);
  float(&d0)[kAccum] = *reinterpret_cast<float(*)[kAccum]>(&acc.v[0][0][0]);
  float(&d1)[kAccum] = *reinterpret_cast<float(*)[kAccum]>(&acc.v[1][0][0]);
  fence_accumulators(d0);
  fence_accumulators(d1);
  wgmma_fence();
  wgmma_k_steps(stage_desc_a(sm, stage, 0, tid), desc_b, d0, true);
  wgmma_k_steps(stage_desc_a(sm, stage, 1, tid), desc_b, d1, true);
  wgmma_commit_group();
  fence_accumulators(d0);
  fence_accumulators(d1);
  wgmma_wait_group<kPending>();
  fence_accumulators(d0);
  fence_accumulators(d1);
}

// The BF16 K loop of one task (acc zeroed, the first S - 1 chunks issued). Per chunk c: wait for
// its stage, issue its wgmmas, wait for chunk c - 1's (c's stay queued on the tensor cores), CTA
// barrier, refill chunk c - 1's stage with chunk c + S - 1. Refilling after the barrier that
// follows the issue keeps S - 1 chunks streaming; the barrier before the issue (the other loops)
// could only refill the stage of chunk c - 2 and kept S - 2 in flight, which bound the BF16
// prefill tasks: without any wgmma they took 0.87-0.92 of their time (docs/kernel_design.md).
// Chunk 0 refills the previous task's last stage (its epilogue tile, which that task's end
// barrier released).
template <u32 K>
MEGAMOE_DEVICE void k_loop_deferred_wait(WarpAcc& acc, MainloopSmem& sm, const MainloopState<K>& st,
                                         const TaskOperands& cur, const TaskOperands* next, const Params& p, u32 tid) {
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  constexpr u32 S = kMainloopStages;
  for (u32 c = 0; c < kChunks; ++c) {
    const u32 stage = (st.seq + c) % S;
    wait_stage(&sm.full[stage], stage, (st.seq + c) / S, p, st.phase);
    wgmma_chunk<1>(acc, sm, stage, tid);
    mma_barrier();  // every warp is done with chunk c - 1's stage
    load_chunk_ahead<K>(sm, st, c + S - 1, cur, next, p, tid);  // into it
  }
  wgmma_wait_group<0>();  // the last chunk's wgmmas, before the epilogue reads acc
  fence_accumulators(*reinterpret_cast<float(*)[kAccum]>(&acc.v[0][0][0]));
  fence_accumulators(*reinterpret_cast<float(*)[kAccum]>(&acc.v[1][0][0]));
}

// Column of token `tok` in row `kb` of MainloopSmem::tok_scale: XOR-swizzled by an even number,
// so a promotion's reads (8 consecutive tokens of one block) stay conflict-free and pairwise
// adjacent, while the fill (consecutive blocks of one token) spreads over the banks instead of
// hitting one (rows are kTileTokens floats apart, a multiple of 32 banks).
MEGAMOE_DEVICE u32 tok_scale_col(u32 kb, u32 tok) { return tok ^ ((2 * kb) & (kTileTokens - 1)); }

// Token scale (K-block kb, token tok) of the table. kScalesIntoTables builds keep it in groups of
// 4 blocks, [kb / 4][tok][kb % 4] from the table's start: a token's 4 blocks are the 16 bytes one
// cp.async copies from its row as stored, and a promotion's reads (8 consecutive tokens of one
// block) still fall in 8 different banks. The other builds: row kb, column tok_scale_col.
MEGAMOE_DEVICE float& tok_scale_at(MainloopSmem& sm, u32 kb, u32 tok) {
  if constexpr (kScalesIntoTables) return (&sm.tok_scale[0][0])[(kb / 4) * (4 * kTileTokens) + 4 * tok + kb % 4];
  else return sm.tok_scale[kb][tok_scale_col(kb, tok)];
}
MEGAMOE_DEVICE const float& tok_scale_at(const MainloopSmem& sm, u32 kb, u32 tok) {
  return tok_scale_at(const_cast<MainloopSmem&>(sm), kb, tok);
}

// The FP8 scales of one task into shared memory: token scales of its rows (past-the-end tokens
// read the last valid row) and each warp's two weight-scale rows. Visible to every thread after
// the first barrier of the K loop; the previous task finished reading them before its end.
// Three ways: into registers during the previous task (load_task_scale_regs) and from there into
// shared memory (store_task_scale_regs), or straight through (load_task_scales).
template <u32 KBlocks>
MEGAMOE_DEVICE void load_task_scale_regs(TaskScaleRegs<KBlocks>& r, const TaskOperands& op, u32 tid) {
  const u32 first_row = op.rows.first_row, num_rows = op.rows.num_rows;
#pragma unroll
  for (u32 j = 0; j < r.kTok; ++j) {
    const u32 i = tid + j * kNumMmaThreads;
    const u32 tok = i / KBlocks, kb = i % KBlocks;  // consecutive lanes: one row's blocks (coalesced)
    const u32 row = first_row + (tok < num_rows ? tok : num_rows - 1);
    if (i < kTileTokens * KBlocks) r.tok[j] = ld_cg_f32(op.tok_scale + static_cast<u64>(row) * op.tok_scale_pitch + kb);
  }
  const u32 lane = tid % 32;
#pragma unroll
  for (u32 j = 0; j < r.kW; ++j) {
    const u32 kb = lane + 32 * j;
    if (kb < KBlocks) {
      r.w[0][j] = __ldg(op.w_scale[0] + kb);
      r.w[1][j] = __ldg(op.w_scale[1] + kb);
    }
  }
}

template <u32 KBlocks>
MEGAMOE_DEVICE void store_task_scale_regs(MainloopSmem& sm, const TaskScaleRegs<KBlocks>& r, u32 tid) {
#pragma unroll
  for (u32 j = 0; j < r.kTok; ++j) {
    const u32 i = tid + j * kNumMmaThreads;
    const u32 tok = i / KBlocks, kb = i % KBlocks;
    if (i < kTileTokens * KBlocks) sm.tok_scale[kb][tok_scale_col(kb, tok)] = r.tok[j];
  }
  const u32 warp = tid / 32, lane = tid % 32;
  if (kWScaleCopies > 1 || warp == 0) {
#pragma unroll
    for (u32 j = 0; j < r.kW; ++j) {
      const u32 kb = lane + 32 * j;
      if (kb < KBlocks) {
        sm.w_scale[w_scale_copy(warp)][0][kb] = r.w[0][j];
        sm.w_scale[w_scale_copy(warp)][1][kb] = r.w[1][j];
      }
    }
  }
}

// cp.async of 4 bytes (the .ca form: .cg copies 16 only); for the weight scales, which a call never writes.
MEGAMOE_DEVICE void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(static_cast<u32>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
}

// kScalesIntoTables: after this task's K loop (every thread past its last barrier, done with the
// tables), the next task's scales straight into them: 16-byte cp.async.cg copies of 4 K-blocks of
// a token row as stored (L2 only: an L1 line may hold rows of a token block published later),
// past-the-end tokens copying the last valid row, and warp 0's weight-scale entries by 4-byte
// cp.async (a call never writes them). Waited for at the next task's start (stage_task_scales, which
// also copies a phase's first task's this way); the K loop's first barrier shows them to every thread.
template <u32 KBlocks>
MEGAMOE_DEVICE void fetch_scales_into_tables(MainloopSmem& sm, const TaskOperands& op, u32 tid) {
  if constexpr (kScalesIntoTables) {
    // The last group may end in the row's padding (kL1ScalePitch): table entries no K loop reads.
    constexpr u32 kGroups = (KBlocks + 3) / 4;
    constexpr u32 kThreadsPerToken = kNumMmaThreads / kTileTokens;  // taking alternate groups
    static_assert(4 * kGroups <= kMaxKBlocks && kNumMmaThreads % kTileTokens == 0, "whole groups of the table");
    const u32 tok = tid % kTileTokens, last = op.rows.num_rows - 1;  // the same token in every copy of the thread
    const float* row = op.tok_scale + static_cast<u64>(op.rows.first_row + (tok < last ? tok : last)) * op.tok_scale_pitch;
#pragma unroll
    for (u32 j = 0; j < (kGroups + kThreadsPerToken - 1) / kThreadsPerToken; ++j) {
      const u32 group = tid / kTileTokens + kThreadsPerToken * j;
      if (kGroups % kThreadsPerToken == 0 || group < kGroups) cp_async_16(&tok_scale_at(sm, 4 * group, tok), row + 4 * group);
    }
    if (tid < 32) {
      for (u32 kb = tid; kb < KBlocks; kb += 32) {
        cp_async_4(&sm.w_scale[0][0][kb], op.w_scale[0] + kb);
        cp_async_4(&sm.w_scale[0][1][kb], op.w_scale[1] + kb);
      }
    }
    cp_async_commit();
  }
  (void)sm, (void)op, (void)tid;
}

// The same entries loaded and stored one by one (no registers held: the builds without a
// prefetch; routing this through TaskScaleRegs spilled the DeepSeek-V3-like FP8 cp.async builds).
template <u32 KBlocks>
MEGAMOE_DEVICE void load_task_scales(MainloopSmem& sm, const TaskOperands& op, u32 tid) {
  const u32 first_row = op.rows.first_row, num_rows = op.rows.num_rows;
  for (u32 i = tid; i < kTileTokens * KBlocks; i += kNumMmaThreads) {
    const u32 tok = i / KBlocks, kb = i % KBlocks;
    const u32 row = first_row + (tok < num_rows ? tok : num_rows - 1);
    tok_scale_at(sm, kb, tok) = ld_cg_f32(op.tok_scale + static_cast<u64>(row) * op.tok_scale_pitch + kb);
  }
  const u32 warp = tid / 32, lane = tid % 32;
  if (kWScaleCopies > 1 || warp == 0) {
    for (u32 kb = lane; kb < KBlocks; kb += 32) {
      sm.w_scale[w_scale_copy(warp)][0][kb] = __ldg(op.w_scale[0] + kb);
      sm.w_scale[w_scale_copy(warp)][1][kb] = __ldg(op.w_scale[1] + kb);
    }
  }
}

// The scales of one 128-K block's promotion, weight x token combined per accumulator slot (one
// FFMA per element instead of FMUL + FFMA; the products are shared by both row groups): slot
// [nt][i] of acc.v[mt][nt][i] is row g (i < 2) or g + 8 (this warp's two weight-scale rows), token
// nt * 8 + 2 * t4 + i % 2. Read from shared memory before the wgmma wait, so their latency hides
// behind the tensor cores (read after it they were a third of the kernel's stall samples).
// kTiles: the n8 token tiles a K loop computes (all of them, or the first ones of a narrow task).
template <u32 kTiles = kTokenTiles>
struct PromoteScales {
  float s[kTiles][4];
};

template <u32 kTiles>
MEGAMOE_DEVICE void load_promote_scales(PromoteScales<kTiles>& s, const MainloopSmem& sm, u32 kb, u32 tid) {
  const u32 warp = tid / 32, t4 = tid % 4;
  const float w_lo = lds_f32(&sm.w_scale[w_scale_copy(warp)][0][kb]);
  const float w_hi = lds_f32(&sm.w_scale[w_scale_copy(warp)][1][kb]);
#pragma unroll
  for (u32 nt = 0; nt < kTiles; ++nt) {
    const float2 tok = lds_f32x2(&sm.tok_scale[kb][tok_scale_col(kb, nt * 8 + 2 * t4)]);
    s.s[nt][0] = w_lo * tok.x;
    s.s[nt][1] = w_lo * tok.y;
    s.s[nt][2] = w_hi * tok.x;
    s.s[nt][3] = w_hi * tok.y;
  }
}

// acc_mt += part_mt x (weight x token scale), one row group (acc.v[mt] / the same layout of an
// m64nN partial). Every token column, those past the task's rows included: whatever those hold
// (staging rows of other experts) stays in its own column, which no epilogue stores.
template <u32 kTiles>
MEGAMOE_DEVICE void promote_tile(float (&acc_mt)[kTokenTiles][4], const float* part_mt, const PromoteScales<kTiles>& s) {
  if constexpr (kAblate & kAblatePromotion) {  // one value read: ptxas drops a wgmma whose results all go unused
    acc_mt[0][0] += part_mt[0];
    return;
  }
#pragma unroll
  for (u32 nt = 0; nt < kTiles; ++nt)
#pragma unroll
    for (u32 i = 0; i < 4; ++i) acc_mt[nt][i] = fmaf(part_mt[nt * 4 + i], s.s[nt][i], acc_mt[nt][i]);
}

// FP8 wgmma: both m64 wgmmas of a chunk issued as two commit groups into two partials, so the
// first one's promotion runs while the tensor cores still work on the second (one wait per chunk
// left the tensor cores idle during every promotion).
MEGAMOE_DEVICE void wgmma_chunk_promote_overlapped(WarpAcc& acc, const MainloopSmem& sm, u32 stage, u32 kb, u32 tid) {
  const u64 desc_b = make_smem_desc_k_major_sw128(sm.b[stage]);
  float part0[kAccum], part1[kAccum];
  fence_accumulators(part0);
  fence_accumulators(part1);
  wgmma_fence();
  wgmma_k_steps(stage_desc_a(sm, stage, 0, tid), desc_b, part0, false);
  wgmma_commit_group();
  wgmma_k_steps(stage_desc_a(sm, stage, 1, tid), desc_b, part1, false);
  wgmma_commit_group();
  PromoteScales<> scales;
  load_promote_scales(scales, sm, kb, tid);
  fence_accumulators(part0);
  fence_accumulators(part1);
  wgmma_wait_group<1>();
  fence_accumulators(part0);
  promote_tile(acc.v[0], part0, scales);
  wgmma_wait_group<0>();
  fence_accumulators(part1);
  promote_tile(acc.v[1], part1, scales);
}

// A task whose token block holds at most half a tile of rows (an expert's last, partly filled
// block; every block at low tokens per expert) runs the lagged loop with m64n(kTileTokens / 2)
// wgmmas and promotes only those columns (half the wgmma and promotion work; the loop's fixed
// per-chunk chain stays, so it takes ~0.64x the time: docs/kernel_design.md); its epilogue
// covers those columns only.
// The choice is made per task, around K loop and epilogue together (expert_gemm.cuh): a branch
// around the K loop alone left two allocations of acc live at the join, and the 64-token builds spilled.
// Only the 64-token builds: in the 32-token ones (n16 narrow tasks, decode) the L1 / L2 phases
// measured 1-6 % slower with it at 8 tokens per rank (benchmarks/results/decode_ab/).
constexpr u32 kNarrowTokens = kTileTokens / 2;
constexpr bool kNarrowTasks = kLagPromotion && kTileTokens == 64;

// One m64nN group (N = kN) of a staged chunk into `part` (overwritten), committed.
template <u32 kN>
MEGAMOE_DEVICE void issue_group(float (&part)[kN / 2], const MainloopSmem& sm, u32 stage, u32 mt, u32 tid) {
  fence_accumulators(part);
  wgmma_fence();  // part was read by the last promotion
  if (!((kAblate & kAblateHalfRows) && mt == 1))
    wgmma_k_steps<kN>(stage_desc_a(sm, stage, mt, tid), make_smem_desc_k_major_sw128(sm.b[stage]), part, false);
  wgmma_commit_group();
}

// Waits until at most kPending groups are in flight; `part` (not among them) is then readable.
template <int kPending, u32 kN>
MEGAMOE_DEVICE void wait_for_part(float (&part)[kN / 2]) {
  fence_accumulators(part);
  wgmma_wait_group<kPending>();
  fence_accumulators(part);
}

// wait_for_part, then promotes `part`.
template <int kPending, u32 kN>
MEGAMOE_DEVICE void promote_after(float (&acc_mt)[kTokenTiles][4], float (&part)[kN / 2], const PromoteScales<kN / 8>& s) {
  wait_for_part<kPending, kN>(part);
  promote_tile(acc_mt, part, s);
}

// The K loop of one task with lagged promotion (acc zeroed, the first S - 1 chunks issued): per
// chunk c, g0(c) -> part0, promote g1(c - 1), CTA barrier and refill of chunk c - 1's stage,
// g1(c) -> part1, promote g0(c). The barrier comes after g1(c - 1) is waited for, so the loop
// still streams S - 1 chunks ahead, and g0(c) keeps the tensor cores busy through it. Chunk 0 is
// peeled off so that no branch inside the loop hides from ptxas which group a wait completes.
// kN: the token columns computed, kTileTokens or (narrow task) fewer; acc's other n8 tiles are
// left alone (a narrow task's epilogue does not read them).
template <u32 K, u32 kN>
MEGAMOE_DEVICE void k_loop_lagged_promotion(WarpAcc& acc, MainloopSmem& sm, const MainloopState<K>& st,
                                            const TaskOperands& cur, const TaskOperands* next, const Params& p, u32 tid) {
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  constexpr u32 S = kMainloopStages;
  float part0[kN / 2], part1[kN / 2];
  PromoteScales<kN / 8> scales;  // chunk c's, from its first group's promotion to its second's
  acc.zero_tiles<0, kN / 8>();
  u32 stage = st.seq % S;
  wait_stage(&sm.full[stage], stage, st.seq / S, p, st.phase);
  issue_group<kN>(part0, sm, stage, 0, tid);
  mma_barrier();  // also: the task's scale tables are stored
  load_chunk_ahead<K>(sm, st, S - 1, cur, next, p, tid);  // into the last task's last stage: its epilogue is done
  issue_group<kN>(part1, sm, stage, 1, tid);
  load_promote_scales(scales, sm, 0, tid);
  promote_after<1, kN>(acc.v[0], part0, scales);
  u64* trace = trace_row(p, st.phase == kPhaseL1 && st.seq == kTraceTask * kChunks, tid);  // chunk trace builds only
  for (u32 c = 1; c < kChunks; ++c) {
    trace_point(trace, c, 0);
    stage = (st.seq + c) % S;
    wait_stage(&sm.full[stage], stage, (st.seq + c) / S, p, st.phase);
    trace_point(trace, c, 1);
    issue_group<kN>(part0, sm, stage, 0, tid);
    trace_point(trace, c, 2);
    wait_for_part<1, kN>(part1);  // g1(c - 1), while g0(c) runs
    trace_point(trace, c, 3);
    promote_tile(acc.v[1], part1, scales);
    trace_point(trace, c, 4);
    mma_barrier();  // every warpgroup is done with chunk c - 1's stage
    trace_point(trace, c, 5);
    load_chunk_ahead<K>(sm, st, c + S - 1, cur, next, p, tid);  // into it
    trace_point(trace, c, 6);
    issue_group<kN>(part1, sm, stage, 1, tid);
    trace_point(trace, c, 7);
    load_promote_scales(scales, sm, c, tid);
    wait_for_part<1, kN>(part0);  // g0(c), while g1(c) runs
    trace_point(trace, c, 8);
    promote_tile(acc.v[0], part0, scales);
  }
  promote_after<0, kN>(acc.v[1], part1, scales);
}

}  // namespace megamoe::mega
