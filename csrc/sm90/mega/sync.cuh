// Cross-rank (NVLink) barriers and the kernel's shared waits (the per-token-block waits are in
// block_ready.cuh). Every wait has a deadline on the global timer and,
// when it passes, prints which rank and phase stalled with the counter values, then traps:
// a lost peer or a starved grid becomes an error, never a hung GPU.
#pragma once
#include "../ptx.cuh"
#include "config.cuh"

namespace megamoe::mega {

// Named barriers of a CTA (0 is __syncthreads'): with an epilogue warpgroup the GEMM phases'
// barriers leave it out (its hand-off with the MMA warpgroups goes through mbarriers).
constexpr u32 kBarrierMma = 1;         // the MMA warpgroups' CTA barrier (kNumMmaThreads)
constexpr u32 kBarrierEpilogue = 2;    // the epilogue warpgroup alone (128)

// The GEMM phases' CTA barrier: every thread, or the MMA warpgroups beside an epilogue warpgroup.
MEGAMOE_DEVICE void mma_barrier() {
  if constexpr (kEpilogueWarpgroup) named_barrier_sync(kBarrierMma, kNumMmaThreads);
  else __syncthreads();
}

MEGAMOE_DEVICE u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

MEGAMOE_DEVICE u32 ld_acquire_gpu(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

MEGAMOE_DEVICE int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

MEGAMOE_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

MEGAMOE_DEVICE void red_add_release_sys(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Names of the phases a wait can stall in (printed on timeout).
enum Phase : int {
  kPhaseAnnounce = 0, kPhaseDispatchBarrier, kPhasePull, kPhaseL1, kPhaseL2, kPhaseCombineBarrier,
};

MEGAMOE_DEVICE const char* phase_name(int phase) {
  switch (phase) {
    case kPhaseAnnounce: return "announce";  // (no wait reports it since the grid barriers went; older trees did)
    case kPhaseDispatchBarrier: return "dispatch (NVLink barrier)";
    case kPhasePull: return "pull -> L1 (token block pulled)";
    case kPhaseL1: return "L1 -> L2 (token block ready)";
    case kPhaseL2: return "L2 / combine (NVLink barrier)";
    default: return "combine reduce";
  }
}

// What went wrong, written into host-mapped memory the host can read after the trap (device
// printf output is not guaranteed to reach the host when a kernel traps). Layout, shared with
// vllm_megamoe/kernels/error_record.py: {kind, rank, phase, cta, a, b, c, 0}.
enum ErrorKind : int {
  kErrorGridTimeout = 1, kErrorNvlinkTimeout = 2, kErrorStagingFull = 3, kErrorBlockTimeout = 4, kErrorStageTimeout = 5,
  kErrorHandoffTimeout = 6
};

MEGAMOE_DEVICE void report_and_trap(int* record, int kind, int rank, int phase, int a, int b, int c) {
  if (record != nullptr && atomicCAS(record, 0, kind) == 0) {
    volatile int* r = record;
    r[1] = rank;
    r[2] = phase;
    r[3] = static_cast<int>(blockIdx.x);
    r[4] = a;
    r[5] = b;
    r[6] = c;
    __threadfence_system();
  }
  __trap();
}

struct Deadline {
  u64 start_ns, timeout_ns;
  MEGAMOE_DEVICE bool expired() const { return global_timer_ns() - start_ns > timeout_ns; }
};

MEGAMOE_DEVICE void red_add_relaxed_gpu(u32* p, u32 v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A counter's old value, +1 (it wraps at 2^31, which no counter reaches). An add of 1, from
// atomicAdd or from PTX, ptxas turns into a warp-aggregated atomic whose result shuffle follows it
// at once, so the issuing warp stalled for the whole round trip right there; an inc with a limit
// is not aggregated, and its result is waited for where it is first used.
MEGAMOE_DEVICE u32 atom_inc_relaxed_gpu(int* p) {
  u32 old;
  asm volatile("atom.relaxed.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(0x7fffffffu) : "memory");
  return old;
}

MEGAMOE_DEVICE void red_inc_relaxed_gpu(u32* p, u32 limit) {  // old >= limit: back to 0
  asm volatile("red.relaxed.gpu.global.inc.u32 [%0], %1;" ::"l"(p), "r"(limit) : "memory");
}

// What one rank's CTAs add to a rank's arrival word per barrier and call, whatever the grid size:
// CTA 0 adds kArrivedPerCall - (CTAs - 1), every other CTA 1. Each partial sum stays below it.
constexpr u32 kArrivedPerCall = 0x10000;

// All ranks meet. Every CTA signals every rank itself (a release at system scope per rank, after
// the __syncthreads that orders the CTA's writes, to peers too, before it), into the word that
// rank keeps for this barrier and this source rank; then thread r < kNumRanks of every CTA waits
// for source rank r's word. No CTA waits for another CTA of its own rank first: one hop, not the
// two of an arrival counter whose last CTA signals.
// The words only grow: barrier `barrier` of call `calls` (the call count, bumped at the end of
// every call; the same on every rank, since every rank makes every call) is complete when each
// source's word reaches kArrivedPerCall * (calls + 1), compared modulo 2^32. A wait that times out
// reports a grid timeout while CTAs of its own rank are missing (`rank_arrivals`, a counter for
// that alone, back to 0 once the whole grid arrived), else the NVLink timeout naming a rank that
// did not arrive.
MEGAMOE_DEVICE void nvlink_barrier(u8* const* peers, int rank, u32 num_ctas, u32 calls, u32 barrier, int phase,
                                   u64 timeout_ns, int* record) {
  int* ws = reinterpret_cast<int*>(peers[rank] + kOffWorkspace);
  u32* arrivals = reinterpret_cast<u32*>(ws + kSlotRankArrivals);
  const u32 word = kSlotNvlArrived + barrier * kNvlArrivedRanks;  // + source rank
  __syncthreads();
  if (thread_index() < kNumRanks) {
    const u32 add = blockIdx.x == 0 ? kArrivedPerCall - (num_ctas - 1) : 1u;
    red_add_release_sys(reinterpret_cast<int*>(peers[thread_index()] + kOffWorkspace) + word + rank,
                        static_cast<int>(add));
  } else if (thread_index() == kNumRanks) {
    red_inc_relaxed_gpu(arrivals, num_ctas - 1);  // for the timeout's report only
  }
  if (thread_index() < kNumRanks) {
    const int* signal = ws + word + thread_index();
    const u32 target = kArrivedPerCall * (calls + 1);
    const Deadline deadline{global_timer_ns(), timeout_ns};
    while (static_cast<int>(static_cast<u32>(ld_acquire_sys(signal)) - target) < 0) {
      if (deadline.expired()) {
        const u32 arrived = ld_acquire_gpu(arrivals);
        if (arrived != 0) {
          report_and_trap(record, kErrorGridTimeout, rank, phase, static_cast<int>(arrived),
                          static_cast<int>(arrived), static_cast<int>(num_ctas));
        }
        int ranks_in = 0;
        for (u32 r = 0; r < kNumRanks; ++r)
          ranks_in += static_cast<int>(static_cast<u32>(ld_acquire_sys(ws + word + r)) - target) >= 0;
        report_and_trap(record, kErrorNvlinkTimeout, rank, phase, ranks_in, static_cast<int>(thread_index()),
                        static_cast<int>(kNumRanks));
      }
    }
  }
  __syncthreads();
}

}  // namespace megamoe::mega
