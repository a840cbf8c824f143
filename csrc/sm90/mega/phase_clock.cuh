// Optional per-CTA timestamps of the kernel's phase boundaries (profiling without a profiler:
// the phases of one launch cannot be told apart by kernel-level tools). When Params::phase_clock
// is set, thread 0 of every CTA writes %globaltimer at each mark into phase_clock[cta][mark], and
// at the end the SM cycles it spent in each span of its GEMM tasks (mainloop, epilogue, waits)
// into phase_clock[cta][kNumPhaseMarks + span]: where a task's time goes, which the marks cannot
// say because a CTA's tasks interleave K loops and epilogues.
// The Python twin is vllm_megamoe.kernels.phase_clock (same marks and spans, same order, same
// chunk-trace constants).
#pragma once
#include "params.cuh"
#include "sync.cuh"

namespace megamoe::mega {

enum PhaseMark : int {
  kMarkStart = 0,        // the CTA began
  kMarkStaged,           // tokens staged, pairs announced (before the dispatch barrier)
  kMarkDispatched,       // past the dispatch NVLink barrier
  kMarkPulled,           // this CTA's rows pulled
  kMarkL1Start,          // L1 begins (no barrier: each L1 task waits for its token block's rows)
  kMarkL1Done,           // this CTA's L1 tasks done
  kMarkL2Start,          // L2 begins (no barrier: each L2 task waits for its token block's L1 tiles)
  kMarkL2Done,           // this CTA's L2 tasks and combine writes done (before the NVLink barrier)
  kMarkCombined,         // past the combine NVLink barrier
  kMarkEnd,              // reduce done
  kNumPhaseMarks
};

// SM cycles (clock64) summed over the CTA's tasks; *Tasks count tasks instead.
enum TaskSpan : int {
  kSpanL1Loop = 0,   // the whole L1 task loop
  kSpanL1Tasks,      // L1 tasks run
  kSpanL1Gemm,       // task start (lookup, operands) to the end of its K loop
  kSpanL1Epilogue,   // SwiGLU, requantization, stores and the block's release
  kSpanL2Loop,       // the whole L2 task loop
  kSpanL2Tasks,
  kSpanL2Wait,       // task start to its token block's L1 tiles being ready
  kSpanL2Gemm,       // to the end of the K loop
  kSpanL2Epilogue,   // BF16 rows to the source ranks' combine buffers
  kNumTaskSpans
};
constexpr int kPhaseClockColumns = kNumPhaseMarks + kNumTaskSpans;

// Chunk trace (MEGAMOE_CHUNK_TRACE builds, profiling; sm90_mega_moe.BuildOptions.chunk_trace): lane 0 of
// every warp writes clock64 at kTracePoints points of K chunks kTraceFirstChunk.. of its CTA's
// L1 task number kTraceTask (counted from 0, MEGAMOE_TRACE_TASK: 0 at a few tokens per rank, where
// a CTA runs one L1 task; the lagged FP8 loop only), after the marks and spans:
// where in a chunk each warp waits, which the spans (whole K loops) and the ablations (whole
// parts of the loop removed) cannot say. Points, in loop order: chunk start, stage landed, g0(c)
// issued, g1(c - 1) waited for, g1(c - 1) promoted, past the CTA barrier, refill issued, g1(c)
// issued, g0(c) waited for (g0(c)'s promotion ends at the next chunk's start).
#ifndef MEGAMOE_CHUNK_TRACE
#define MEGAMOE_CHUNK_TRACE 0
#endif
#ifndef MEGAMOE_TRACE_TASK
#define MEGAMOE_TRACE_TASK 2
#endif
constexpr u32 kTraceTask = MEGAMOE_TRACE_TASK, kTraceFirstChunk = 8, kTraceChunks = 5, kTracePoints = 9;
constexpr int kChunkTraceColumns = MEGAMOE_CHUNK_TRACE ? kNumMmaWarps * kTraceChunks * kTracePoints : 0;
// Task trace (the same builds): lane 0 of every MMA warp writes clock64 at kTaskTracePoints points
// of its CTA's tasks number kTraceTask and kTraceTask + 1 of each GEMM phase, after the chunk
// trace, as [phase L1 / L2][warp][task][point]: where the time between two K loops goes (the
// spans' l*_between and l2_wait are thread 0's view; this shows which warp the barriers wait for).
// Points: task entry, coordinates and operands known, at wait_block's CTA barrier (warp 0: after
// thread 0's block checks), token block ready (past that barrier), K loop done, epilogue started
// (hand-off tile empty, or at once without an epilogue warpgroup), task done, at the task queue's
// barrier (thread 0 has written the task after next; the next task's entry ends that interval).
enum TaskTracePoint : u32 {
  kTaskEntry = 0, kTaskOperands, kTaskBarrierArrive, kTaskBlockReady, kTaskGemmDone, kTaskEpilogueStart, kTaskDone,
  kTaskQueued, kTaskTracePoints
};
constexpr u32 kTaskTraceTasks = 2;
constexpr int kTaskTraceColumns = MEGAMOE_CHUNK_TRACE ? 2 * kNumMmaWarps * kTaskTraceTasks * kTaskTracePoints : 0;
constexpr int kPhaseClockStride = kPhaseClockColumns + kChunkTraceColumns + kTaskTraceColumns;  // int64 columns per CTA row

// This warp's trace row for a task: the [chunk][point] clock slots of lane 0 when the build
// traces and `traced` (the CTA's task number kTraceTask of L1), else nullptr. `tid`: the K loop's.
MEGAMOE_DEVICE u64* trace_row(const Params& p, bool traced, u32 tid) {
  if constexpr (MEGAMOE_CHUNK_TRACE != 0) {
    if (traced && p.phase_clock != nullptr && tid % 32 == 0)
      return p.phase_clock + static_cast<u64>(blockIdx.x) * kPhaseClockStride + kPhaseClockColumns +
             (tid / 32) * kTraceChunks * kTracePoints;
  }
  (void)p, (void)traced, (void)tid;
  return nullptr;
}

// One trace point of chunk `c` (nothing unless the row is set and c is in the window).
MEGAMOE_DEVICE void trace_point(u64* row, u32 c, u32 point) {
  if constexpr (MEGAMOE_CHUNK_TRACE != 0) {
    if (row != nullptr && c - kTraceFirstChunk < kTraceChunks)
      row[(c - kTraceFirstChunk) * kTracePoints + point] = static_cast<u64>(clock64());
  }
  (void)row, (void)c, (void)point;
}

// One task-trace point of the CTA's task number `task` of a GEMM phase (l2: the L2 phase), by
// lane 0 of each MMA warp; nothing outside trace builds or the traced tasks.
MEGAMOE_DEVICE void task_trace_point(const Params& p, bool l2, u32 task, TaskTracePoint point) {
  if constexpr (MEGAMOE_CHUNK_TRACE != 0) {
    const u32 i = task - kTraceTask, warp = thread_index() / 32;
    if (p.phase_clock != nullptr && thread_index() % 32 == 0 && warp < kNumMmaWarps && i < kTaskTraceTasks)
      p.phase_clock[static_cast<u64>(blockIdx.x) * kPhaseClockStride + kPhaseClockColumns + kChunkTraceColumns +
                    ((static_cast<u32>(l2) * kNumMmaWarps + warp) * kTaskTraceTasks + i) * kTaskTracePoints + point] =
          static_cast<u64>(clock64());
  }
  (void)p, (void)l2, (void)task, (void)point;
}

MEGAMOE_DEVICE void mark_phase(const Params& p, PhaseMark mark) {
  if (p.phase_clock != nullptr && thread_index() == 0)
    p.phase_clock[static_cast<u64>(blockIdx.x) * kPhaseClockStride + mark] = global_timer_ns();
}

// Thread 0's running sums, in shared memory (no registers held across the K loops).
struct TaskClock {
  u64 since;       // clock64 at the end of the previous span
  u64 loop_since;  // clock64 at the start of the current task loop
  u64 sum[kNumTaskSpans];
};

MEGAMOE_DEVICE u64 sm_clock() { return static_cast<u64>(clock64()); }

MEGAMOE_DEVICE void task_clock_init(const Params& p, TaskClock& c) {
  if (p.phase_clock != nullptr && thread_index() == 0)
    for (int s = 0; s < kNumTaskSpans; ++s) c.sum[s] = 0;
}

// Starts timing: the next span_end measures from here.
MEGAMOE_DEVICE void span_start(const Params& p, TaskClock& c) {
  if (p.phase_clock != nullptr && thread_index() == 0) c.since = sm_clock();
}

// Adds the cycles since the last span_start / span_end to `span` and starts the next span.
MEGAMOE_DEVICE void span_end(const Params& p, TaskClock& c, TaskSpan span) {
  if (p.phase_clock != nullptr && thread_index() == 0) {
    const u64 now = sm_clock();
    c.sum[span] += now - c.since;
    c.since = now;
  }
}

MEGAMOE_DEVICE void span_count(const Params& p, TaskClock& c, TaskSpan span) {
  if (p.phase_clock != nullptr && thread_index() == 0) c.sum[span] += 1;
}

// A whole task loop: loop_start before it, loop_end(kSpanL1Loop / kSpanL2Loop) after it.
MEGAMOE_DEVICE void loop_start(const Params& p, TaskClock& c) {
  if (p.phase_clock != nullptr && thread_index() == 0) c.loop_since = sm_clock();
}

MEGAMOE_DEVICE void loop_end(const Params& p, TaskClock& c, TaskSpan span) {
  if (p.phase_clock != nullptr && thread_index() == 0) c.sum[span] += sm_clock() - c.loop_since;
}

MEGAMOE_DEVICE void write_task_clock(const Params& p, const TaskClock& c) {
  if (p.phase_clock != nullptr && thread_index() == 0)
    for (int s = 0; s < kNumTaskSpans; ++s)
      p.phase_clock[static_cast<u64>(blockIdx.x) * kPhaseClockStride + kNumPhaseMarks + s] = c.sum[s];
}

}  // namespace megamoe::mega
