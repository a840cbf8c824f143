// Optional per-CTA timestamps of the kernel's phase boundaries (profiling without a profiler:
// the phases of one launch cannot be told apart by kernel-level tools). When Params::phase_clock
// is set, thread 0 of every CTA writes %globaltimer at each mark into phase_clock[cta][mark].
// The Python twin is vllm_megamoe.kernels.phase_clock (same marks, same order).
#pragma once
#include "params.cuh"
#include "sync.cuh"

namespace megamoe::mega {

enum PhaseMark : int {
  kMarkStart = 0,        // the CTA began
  kMarkStaged,           // tokens staged, pairs announced (before the grid sync)
  kMarkDispatched,       // past the dispatch NVLink barrier
  kMarkPulled,           // this CTA's rows pulled (before the grid sync)
  kMarkL1Start,          // past the grid sync: L1 begins
  kMarkL1Done,           // this CTA's L1 tasks done (before the grid sync)
  kMarkL2Start,          // past the grid sync: L2 begins
  kMarkL2Done,           // this CTA's L2 tasks and combine writes done (before the NVLink barrier)
  kMarkCombined,         // past the combine NVLink barrier
  kMarkEnd,              // reduce done
  kNumPhaseMarks
};

MEGAMOE_DEVICE void mark_phase(const Params& p, PhaseMark mark) {
  if (p.phase_clock != nullptr && threadIdx.x == 0)
    p.phase_clock[static_cast<u64>(blockIdx.x) * kNumPhaseMarks + mark] = global_timer_ns();
}

}  // namespace megamoe::mega
