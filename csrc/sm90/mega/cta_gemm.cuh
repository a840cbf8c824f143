// The whole K loop of one task: the FP8 scale tables staged, the first chunks issued, the loop
// that fits the build (mainloop_smem.cuh's swap-AB loops, or the register-token loops of the 64-
// and 128-token FP8 prefill tiles), and the stream into the next task.
#pragma once
#include "k_loop_register_tokens.cuh"
#include "mainloop_smem.cuh"

namespace megamoe::mega {

// acc (+)= chunk c of the task, staged in `stage` (the 2-stage builds' loop: no lag, no deferred wait).
MEGAMOE_DEVICE void chunk_mma(WarpAcc& acc, const MainloopSmem& sm, u32 stage, u32 c, u32 tid) {
  if constexpr (!kFP8) wgmma_chunk<0>(acc, sm, stage, tid);
  else wgmma_chunk_promote_overlapped(acc, sm, stage, c, tid);
}

// FP8: the task's scale tables into shared memory (from the registers, or loaded now;
// kScalesIntoTables builds: copied straight into the tables by the previous task, or now), and the
// next task's into registers while this one's K loop runs (kScalesIntoTables builds copy theirs after
// the K loop, in cta_gemm).
template <u32 K>
MEGAMOE_DEVICE void stage_task_scales(MainloopSmem& sm, MainloopState<K>& st, const TaskOperands& cur,
                                      const TaskOperands* next, u32 tid) {
  constexpr u32 KB = K / kScaleBlock;
  if constexpr (kAblate & kAblateTaskScales) {  // profiling: what loading them at a task's start costs
    if (st.tasks > 1) return;
  }
  if constexpr (kScalesIntoTables) {  // copied into the tables after the previous K loop (cta_gemm), or now
    if (!st.scales_prefetched) fetch_scales_into_tables<KB>(sm, cur, tid);
    cp_async_wait<0>();  // this thread's copies
    return;
  }
  if (TaskScaleRegs<KB>::kPrefetch && st.scales_prefetched) store_task_scale_regs<KB>(sm, st.next_scales, tid);
  else load_task_scales<KB>(sm, cur, tid);
  st.scales_prefetched = TaskScaleRegs<KB>::kPrefetch && next != nullptr;
  if (st.scales_prefetched) load_task_scale_regs<KB>(st.next_scales, *next, tid);  // in flight through the K loop
}

// The whole K loop of one task: acc = sum over chunks [x scales per 128-K block for FP8].
// `next` (or nullptr): the CTA's next task of the same phase; its first kAhead chunks are issued
// during this task's last iterations, so the weight stream never drains between tasks (the
// epilogue runs while they are in flight).
// kN: the token columns computed (kTileTokens, or kNarrowTokens for a narrow task).
template <u32 K, u32 kN = kTileTokens>
MEGAMOE_DEVICE void cta_gemm(WarpAcc& acc, MainloopSmem& sm, MainloopState<K>& st, const TaskOperands& cur,
                             const TaskOperands* next, const Params& p) {
  static_assert(K / kScaleBlock <= kMaxKBlocks, "scale table too small");
  static_assert(kN == kTileTokens || kNarrowTasks, "only the lagged FP8 loop computes narrow tasks");
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  constexpr u32 S = kMainloopStages;
  constexpr u32 kAhead = S - 1;  // chunks in flight past the one computed
  if (kChunks < kAhead) next = nullptr;  // too short to stream on: every task fills its own stages
  const u32 tid = thread_index();  // once for the whole K loop (common.cuh thread_index)
  __builtin_assume(tid < kNumMmaThreads);
  if constexpr (!kLagPromotion) acc.zero();
  if (!st.prefetched) {
#pragma unroll
    for (u32 s = 0; s < kAhead; ++s) {
      if (s < kChunks) load_chunk<K>(sm, (st.seq + s) % S, s, cur, p, tid);
      cp_async_commit();
    }
  }
  if constexpr (kFP8) stage_task_scales<K>(sm, st, cur, next, tid);  // visible to every thread after the first chunk's barrier
  if constexpr (kRegisterTokens128) k_loop_register_tokens_128<K>(acc, sm, st, cur, next, p, tid);  // zeroes acc
  else if constexpr (kRegisterTokens && kN == kTileTokens) k_loop_register_tokens<K>(acc, sm, st, cur, next, p, tid);  // zeroes acc
  else if constexpr (kLagPromotion) k_loop_lagged_promotion<K, kN>(acc, sm, st, cur, next, p, tid);  // zeroes acc itself
  else if constexpr (kDeferWgmmaWait) k_loop_deferred_wait<K>(acc, sm, st, cur, next, p, tid);
  else
  for (u32 c = 0; c < kChunks; ++c) {
    wait_stage(&sm.full[(st.seq + c) % S], (st.seq + c) % S, (st.seq + c) / S, p, st.phase);
    mma_barrier();  // chunk c landed for every thread; chunk c + kAhead - S's stage is free again
    load_chunk_ahead<K>(sm, st, c + kAhead, cur, next, p, tid);
    cp_async_commit();
    chunk_mma(acc, sm, (st.seq + c) % S, c, tid);
  }
  st.seq += kChunks;
  st.prefetched = next != nullptr;
  if (!st.prefetched) cp_async_wait<0>();  // only empty groups are left; nothing stays in flight
  mma_barrier();  // every warp is done with this task's stages and scale tables
  if constexpr (kScalesIntoTables && !(kAblate & kAblateTaskScales)) {
    st.scales_prefetched = next != nullptr;
    if (next != nullptr) fetch_scales_into_tables<K / kScaleBlock>(sm, *next, tid);
  }
}

}  // namespace megamoe::mega
