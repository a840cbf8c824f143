// Which CTA runs which GEMM task of a phase. Each CTA starts on task blockIdx.x; after that,
// tasks go out in index order from a per-phase counter in the workspace, to whichever CTA asks
// next. Tasks with neighbouring indices (the token blocks of one weight tile, task_order.cuh)
// then start within a fraction of a task of each other, so the tile comes from HBM once and
// from L2 for the others; with tasks dealt out grid-strided up front, CTAs drifted apart by
// whole tasks over a prefill and every token block re-read its weight tile from HBM.
// A CTA asks for the task after next during a task (AskAfter, called by the task), and the next
// task is known early enough for the mainloop to stream into it. Asked at the task's start, the
// atomic waited behind the previous task's epilogue stores (combine rows, staging rows) in thread
// 0's memory pipeline while every MMA warp waited at the task's first barrier for thread 0
// (docs/kernel_design.md: the task trace). So the builds whose MMA warps store their own
// epilogues ask between the K loop and those stores (the epilogue hides the round trip), and the
// epilogue-warpgroup builds, whose hand-off is too short for that, once the token block is ready;
// and the ask does not wait for its answer (atom_inc_relaxed_gpu): thread 0 reads it at the task's
// end (docs/kernel_design.md).
#pragma once
#include "params.cuh"
#include "sync.cuh"

namespace megamoe::mega {

// Thread 0 asks the phase's counter for the task after next (when there is a next task) into
// `after`, as the counter's old value (the task is gridDim.x more; added where it is read, so that
// the atomic's round trip is waited for only there); every MMA thread of a task calls it once, at
// the same point of the task.
struct AskAfter {
  int* counter;
  u32 next, num_tasks;
  u32* after;  // thread 0's
  MEGAMOE_DEVICE void operator()() const {
    if (thread_index() == 0 && next < num_tasks) *after = atom_inc_relaxed_gpu(counter);
  }
};

// Runs run_task(task, next_task, ask_after) for every task this CTA gets (next_task >= num_tasks:
// none); run_task calls ask_after() once (AskAfter).
// `slot`: one shared word. run_task must contain an mma_barrier (every task's K loop does),
// which orders every thread's read of `slot` before thread 0 rewrites it. queued(): after each
// task, at the barrier that publishes the task after next (the task trace's point).
template <class RunTask, class Queued>
MEGAMOE_DEVICE void for_each_task(int* counter, u32 num_tasks, u32* slot, RunTask&& run_task, Queued&& queued) {
  // Tasks [0, gridDim.x) are the CTAs' first ones; the counter hands out the rest (thread 0 asks).
  const auto ask = [&] { return gridDim.x + static_cast<u32>(atomicAdd(counter, 1)); };
  if (thread_index() == 0) *slot = ask();
  mma_barrier();
  u32 task = blockIdx.x, next = *slot;
  while (task < num_tasks) {
    u32 after = num_tasks - gridDim.x;  // the counter's value for the task after next (wraps: none)
    run_task(task, next, AskAfter{counter, next, num_tasks, &after});
    if (thread_index() == 0) *slot = gridDim.x + after;
    queued();
    mma_barrier();
    task = next;
    next = *slot;
  }
}

// After the combine barrier (no CTA asks for a task any more): zero both phases' counters.
MEGAMOE_DEVICE void reset_task_counters(const Regions& me) {
  if (blockIdx.x == 0 && thread_index() == 0) {
    me.workspace()[kSlotL1TaskCounter] = 0;
    me.workspace()[kSlotL2TaskCounter] = 0;
  }
}

}  // namespace megamoe::mega
