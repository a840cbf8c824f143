// L1 -> L2 dependencies per token block instead of a grid-wide barrier between the phases: the
// L2 tasks of token block b read the staging_l2 rows that the kL1Tiles L1 tasks of block b write,
// so each L1 task counts itself done on its block and each L2 task waits for its block alone.
// CTAs that run out of L1 tasks start L2 work at once instead of idling at a barrier until the
// slowest CTA's last L1 task ends. No deadlock: every CTA runs all its L1 tasks before its first
// L2 task, and all CTAs are co-resident. The counters are zeroed at the end of the call.
#pragma once
#include "../ptx.cuh"
#include "params.cuh"
#include "sync.cuh"

namespace megamoe::mega {

constexpr u32 kL1Tiles = 2 * kInter / kTileRows;  // L1 tasks per token block
constexpr u32 kL2Tiles = kHidden / kTileRows;     // L2 tasks per token block

// One thread, after the L1 task's stores and a barrier over the threads that made them: release
// them to the L2 tasks of `block`.
MEGAMOE_DEVICE void publish_l1_tile(const Regions& me, u32 block) { atom_add_release_gpu(me.l1_block_done() + block, 1); }

// Thread 0: whether every L1 tile of `block` is done (acquire; counts only grow within a call).
MEGAMOE_DEVICE bool l1_block_ready(const Regions& me, u32 block) {
  return ld_acquire_gpu(me.l1_block_done() + block) >= kL1Tiles;
}

// What a CTA knows between its L2 tasks' block checks: `known_ready` (thread 0: a block it has
// acquired as ready already, ~0u: none) and two shared flags used in turn, so that the flag of
// one task is never rewritten while a thread may still read it (no second barrier per task).
struct BlockReadyState {
  u32* flags;  // two shared words
  u32 turn;
  u32 known_ready;
};

// Before an L2 task of `block` reads staging_l2: wait (thread 0, with the call's deadline) until
// its L1 tiles are done. Also tells the CTA whether `next_block` (or ~0u: none) is ready already,
// the condition for streaming the next task's first stages in during this one (mainloop_smem.cuh).
// A block found ready by the previous task's look at its next block is not loaded again: tasks
// run one weight tile's token blocks in order, so the common case is one acquire per task.
// Ends with an mma_barrier, after which every MMA thread may read the block's rows.
MEGAMOE_DEVICE bool wait_l1_block(const Params& p, const Regions& me, u32 block, u32 next_block, BlockReadyState& rs) {
  if (threadIdx.x == 0) {
    if (block != rs.known_ready && !l1_block_ready(me, block)) {
      const Deadline deadline{global_timer_ns(), p.timeout_ns};
      while (!l1_block_ready(me, block)) {
        if (deadline.expired()) {
          report_and_trap(p.error_record, kErrorBlockTimeout, p.rank, kPhaseL1, static_cast<int>(block),
                          static_cast<int>(ld_acquire_gpu(me.l1_block_done() + block)), static_cast<int>(kL1Tiles));
          break;  // never reached (see wait_stage)
        }
      }
    }
    const bool next_ready = next_block != ~0u && (next_block == block || l1_block_ready(me, next_block));
    rs.known_ready = next_ready ? next_block : block;
    rs.flags[rs.turn] = next_ready;
#if MEGAMOE_SMEM_MAINLOOP >= 3
    fence_proxy_async_global();  // the block's staging_l2 rows were stored by other CTAs; TMA reads them
#endif
  }
  mma_barrier();
  const bool next_ready = rs.flags[rs.turn] != 0;
  rs.turn ^= 1;  // the other flag next time: this one may still be read until that task's barrier
  return next_ready;
}

// After the combine barrier (every L2 task of this rank is done): zero the counters of the
// call's `blocks` token blocks for the next call.
MEGAMOE_DEVICE void reset_l1_blocks(const Regions& me, u32 blocks) {
  for (u32 b = blockIdx.x * kNumThreads + threadIdx.x; b < blocks; b += gridDim.x * kNumThreads)
    me.l1_block_done()[b] = 0;
}

}  // namespace megamoe::mega
