// Dependencies per token block instead of grid-wide barriers between the phases. Block b's
// counter (l1_block_done) counts what has been done for it in this call, in the order it happens:
// first its rows pulled into staging (one per row, by the warps that pulled them, once each warp's
// pulls are done), then its kL1Tiles L1 tasks (one each, after their staging_l2 stores). An L1
// task of block b waits until the counter reaches the block's rows, an L2 task until it reaches
// rows + kL1Tiles. CTAs that finish their share of the pull start L1 work at once, and those that
// run out of L1 tasks start L2 work, instead of idling at a barrier until the slowest CTA is done.
// No deadlock: every CTA pulls its share before its first L1 task and runs all its L1 tasks
// before its first L2 task, and all CTAs are co-resident. The counters are zeroed at the end of
// the call.
// Two phase-wide counts sit beside them (workspace slots pulled_warps and l1_tiles_done): once a
// CTA sees one complete, its later tasks of that phase skip their blocks' loads (an acquire per
// task sits on the critical path, before the barrier every MMA thread waits at).
#pragma once
#include "../ptx.cuh"
#include "params.cuh"
#include "phase_clock.cuh"
#include "sync.cuh"

namespace megamoe::mega {

constexpr u32 kL1Tiles = 2 * kInter / kTileRows;  // L1 tasks per token block
constexpr u32 kL2Tiles = kHidden / kTileRows;     // L2 tasks per token block

// The token block of staging row `row` of local expert `e` (rows are laid out expert by expert,
// each expert's rows in blocks of kTileTokens).
MEGAMOE_DEVICE u32 block_of_row(const ExpertTable& table, u32 e, u32 row) {
  return table.block_start[e] + (row - table.row_start[e]) / kTileTokens;
}

// One lane per pulled row, after a __syncwarp and a fence over its warp's stores of every row it
// pulled (pull_rows): count the row on `block` (with that fence, a release to its L1 tasks).
MEGAMOE_DEVICE void count_pulled_row(const Regions& me, u32 block) { red_add_relaxed_gpu(me.l1_block_done() + block, 1); }

// One thread, after the L1 task's stores and a barrier over the threads that made them: release
// them to the L2 tasks of `block`, and count the tile for the whole phase (every_block_ready).
// One fence makes both adds releases (a second release waited for the first add's round trip).
MEGAMOE_DEVICE void publish_l1_tile(const Regions& me, u32 block) {
  fence_acq_rel_gpu();
  red_add_relaxed_gpu(me.l1_block_done() + block, 1);
  red_add_relaxed_gpu(reinterpret_cast<u32*>(me.workspace()) + kSlotL1TilesDone, 1);
}

// Builds without an epilogue warpgroup publish an L1 task's tile one task late: after the CTA's
// next L1 task's K loop (publish_unpublished), or after its last L1 task. Published at the task's
// end, thread 0's fence waited for the rows just stored (0.4-0.7 us per task at prefill) while
// every MMA warp waited for thread 0 at the next task's first barrier (docs/kernel_design.md);
// a K loop later those stores are done, and the publisher is lane 0 of warp 1, whose fence has
// nothing else in flight to wait for (thread 0's ask is, task_queue.cuh). Late by one task costs
// the L2 tasks next to nothing: a CTA takes L2 tasks only once the L1 queue is empty, and the L2
// queue starts with the experts whose L1 tiles were done first (task_order.cuh). Ordering: a CTA
// barrier (the task queue's, the next task's block check) lies between every thread's stores and
// the publisher's fence.
constexpr u32 kLatePublisher = 32;
MEGAMOE_DEVICE void publish_unpublished(const Regions& me, u32& unpublished) {
  if (thread_index() == kLatePublisher && unpublished != ~0u) publish_l1_tile(me, unpublished);
  unpublished = ~0u;
}

// One lane per warp, after a fence over its warp's pulled rows (pull_rows): the warp is done. The
// CTA's last warp to get here adds all kNumWarps to the phase count, one add per CTA: an add per
// warp (1056-1584 per call) slowed the task counters' loads beside it. Each warp's fence, then its
// shared-memory add, read by the last warp's add, then that warp's fence and add: a release chain
// from every warp's rows to whoever acquires the complete count.
MEGAMOE_DEVICE void count_pulled_warp(ExpertTable& table, const Regions& me) {
  if (atomicAdd(&table.pulled_warps, 1) == kNumWarps - 1) {
    fence_acq_rel_gpu();
    red_add_relaxed_gpu(reinterpret_cast<u32*>(me.workspace()) + kSlotPulledWarps, kNumWarps);
  }
}

// Thread 0: whether `block`'s counter reached `need` (acquire; counts only grow within a call).
MEGAMOE_DEVICE bool block_reached(const Regions& me, u32 block, u32 need) {
  return ld_acquire_gpu(me.l1_block_done() + block) >= need;
}

// What a CTA knows between its tasks' block checks in one phase: `known_ready` (thread 0: a block
// it has acquired as ready already, ~0u: none) and two shared flags used in turn, so that the flag
// of one task is never rewritten while a thread may still read it (no second barrier per task).
// `every_ready` (thread 0): the phase's count was seen complete, so every block of the phase is
// ready and no later task checks; `fenced_every`: the proxy fence after that acquire is done.
struct BlockReadyState {
  u32* flags;  // two shared words
  u32 turn;
  u32 known_ready;
  bool every_ready;
  bool fenced_every;
};

// A phase-wide count (thread 0): whether `counter` reached `need` (acquire).
MEGAMOE_DEVICE bool every_block_ready(const Regions& me, u32 slot, u32 need) {
  return ld_acquire_gpu(reinterpret_cast<const u32*>(me.workspace()) + slot) >= need;
}

// Before a task of `block` reads what its phase waits for: wait (thread 0, with the call's
// deadline) until the block's counter reaches `need`. Also tells the CTA whether `next_block` (or
// ~0u: none) has reached `next_need` already, the condition for streaming the next task's first
// stages in during this one (mainloop_smem.cuh). A block found ready by the previous task's look at
// its next block is not loaded again: tasks run one weight tile's token blocks in order, so the
// common case is one acquire per task, until the phase count (workspace slot `every_slot`) is seen
// at `every_need`: from then on thread 0 loads nothing. Ends with an mma_barrier either way (the
// FP8 register epilogues count on it before the task's scale tables are rewritten), after which
// every MMA thread may read the block's rows. `phase`: kPhasePull (an L1 task waiting for its
// rows) or kPhaseL1 (an L2 task waiting for its block's L1 tiles), for the timeout's report.
MEGAMOE_DEVICE bool wait_block(const Params& p, const Regions& me, u32 block, u32 need, u32 next_block, u32 next_need,
                               u32 every_slot, u32 every_need, BlockReadyState& rs, int phase, u32 traced_task) {
  if (thread_index() == 0) {
    bool next_ready = next_block != ~0u;
    if (!rs.every_ready && !(rs.every_ready = every_block_ready(me, every_slot, every_need))) {
      if (block != rs.known_ready && !block_reached(me, block, need)) {
        const Deadline deadline{global_timer_ns(), p.timeout_ns};
        while (!block_reached(me, block, need)) {
          if (deadline.expired()) {
            report_and_trap(p.error_record, kErrorBlockTimeout, p.rank, phase, static_cast<int>(block),
                            static_cast<int>(ld_acquire_gpu(me.l1_block_done() + block)), static_cast<int>(need));
            break;  // never reached (see wait_stage)
          }
        }
      }
      next_ready = next_ready && (next_block == block || block_reached(me, next_block, next_need));
      rs.known_ready = next_ready ? next_block : block;
      fence_proxy_async_global();  // the block's staging rows were stored by other CTAs; TMA reads them
    }
    else if (!rs.fenced_every) {
      rs.fenced_every = true;
      fence_proxy_async_global();  // once after the phase count's acquire: every block's rows, for TMA
    }
    rs.flags[rs.turn] = next_ready;
  }
  task_trace_point(p, phase == kPhaseL1, traced_task, kTaskBarrierArrive);
  mma_barrier();
  const bool next_ready = rs.flags[rs.turn] != 0;
  rs.turn ^= 1;  // the other flag next time: this one may still be read until that task's barrier
  return next_ready;
}

// The rows of token block `block` of local expert `e` (task_rows' count).
MEGAMOE_DEVICE u32 block_rows(const ExpertTable& table, u32 block, u32 e) { return task_rows(table, block, e).num_rows; }

// An L1 task of `block` (expert e): wait until its rows are pulled. next_block / next_e: the CTA's
// next L1 task's, or ~0u.
MEGAMOE_DEVICE bool wait_pulled_block(const Params& p, const Regions& me, const ExpertTable& table, u32 block, u32 e,
                                      u32 next_block, u32 next_e, BlockReadyState& rs, u32 traced_task) {
  return wait_block(p, me, block, block_rows(table, block, e), next_block,
                    next_block == ~0u ? 0 : block_rows(table, next_block, next_e), kSlotPulledWarps, total_warps(), rs,
                    kPhasePull, traced_task);
}

// An L2 task of `block` (expert e): wait until its rows are pulled and its L1 tiles done.
MEGAMOE_DEVICE bool wait_l1_block(const Params& p, const Regions& me, const ExpertTable& table, u32 block, u32 e,
                                  u32 next_block, u32 next_e, BlockReadyState& rs, u32 traced_task) {
  return wait_block(p, me, block, block_rows(table, block, e) + kL1Tiles, next_block,
                    next_block == ~0u ? 0 : block_rows(table, next_block, next_e) + kL1Tiles, kSlotL1TilesDone,
                    table.block_start[kNumLocalExperts] * kL1Tiles, rs, kPhaseL1, traced_task);
}

// After the combine barrier (every L2 task of this rank is done): zero the counters of the
// call's `blocks` token blocks and the two phase counts for the next call.
MEGAMOE_DEVICE void reset_l1_blocks(const Regions& me, u32 blocks) {
  for (u32 b = blockIdx.x * kNumThreads + thread_index(); b < blocks; b += gridDim.x * kNumThreads)
    me.l1_block_done()[b] = 0;
  if (blockIdx.x == 0 && thread_index() == 0) {  // and the phase counts
    me.workspace()[kSlotPulledWarps] = 0;
    me.workspace()[kSlotL1TilesDone] = 0;
  }
}

}  // namespace megamoe::mega
