// Grid-wide and cross-rank (NVLink) barriers. Every wait has a deadline on the global timer and,
// when it passes, prints which rank and phase stalled with the counter values, then traps:
// a lost peer or a starved grid becomes an error, never a hung GPU.
#pragma once
#include "config.cuh"

namespace megamoe::mega {

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

MEGAMOE_DEVICE u32 atom_add_release_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

MEGAMOE_DEVICE void red_add_release_sys(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Names of the phases a wait can stall in (printed on timeout).
enum Phase : int {
  kPhaseAnnounce = 0, kPhaseDispatchBarrier, kPhasePull, kPhaseL1, kPhaseL2, kPhaseCombineBarrier,
};

MEGAMOE_DEVICE const char* phase_name(int phase) {
  switch (phase) {
    case kPhaseAnnounce: return "announce (grid sync)";
    case kPhaseDispatchBarrier: return "dispatch (NVLink barrier)";
    case kPhasePull: return "pull (grid sync)";
    case kPhaseL1: return "L1 -> L2 (token block ready)";
    case kPhaseL2: return "L2 / combine (NVLink barrier)";
    default: return "combine reduce";
  }
}

// What went wrong, written into host-mapped memory the host can read after the trap (device
// printf output is not guaranteed to reach the host when a kernel traps). Layout, shared with
// vllm_megamoe/kernels/error_record.py: {kind, rank, phase, cta, a, b, c, 0}.
enum ErrorKind : int {
  kErrorGridTimeout = 1, kErrorNvlinkTimeout = 2, kErrorStagingFull = 3, kErrorBlockTimeout = 4, kErrorStageTimeout = 5
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

// All CTAs of this launch meet. SM 0 adds (0x80000000 - (n - 1)), the others add 1, so each
// barrier flips the top bit exactly once: waiters watch for the flip and the counter never needs
// resetting between barriers or calls.
MEGAMOE_DEVICE void grid_sync(u32* counter, u32 num_ctas, int rank, int phase, u64 timeout_ns, int* record) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // peer-memory writes of this CTA are visible before we arrive
    const u32 add = blockIdx.x == 0 ? 0x80000000u - (num_ctas - 1) : 1u;
    const u32 old = atom_add_release_gpu(counter, add);
    const Deadline deadline{global_timer_ns(), timeout_ns};
    while (((ld_acquire_gpu(counter) ^ old) & 0x80000000u) == 0) {
      if (deadline.expired()) {
#if MEGAMOE_TRAP_PRINTF
        printf("megamoe: rank %d CTA %d timed out in %s waiting for the other CTAs of its grid "
               "(counter 0x%08x, arrived at 0x%08x); were all %u CTAs resident? Lower "
               "VLLM_MEGAMOE_NUM_SMS if other kernels occupy SMs.\n",
               rank, blockIdx.x, phase_name(phase), ld_acquire_gpu(counter), old, num_ctas);
#endif
        report_and_trap(record, kErrorGridTimeout, rank, phase, static_cast<int>(ld_acquire_gpu(counter)),
                        static_cast<int>(old), static_cast<int>(num_ctas));
      }
    }
  }
  __syncthreads();
}

// All ranks meet (after all CTAs of this rank did). Two signal words alternate and the sign of
// the increment flips every second barrier, so the signals never need resetting either.
MEGAMOE_DEVICE void nvlink_barrier(u8* const* peers, int rank, u32 num_ctas, int phase, u64 timeout_ns, int* record) {
  int* ws_local = reinterpret_cast<int*>(peers[rank] + kOffWorkspace);
  grid_sync(reinterpret_cast<u32*>(ws_local + kSlotGridSync), num_ctas, rank, phase, timeout_ns, record);
  if (blockIdx.x == 0) {
    const int status = ws_local[kSlotNvlCounter] & 3;
    const int signal_slot = kSlotNvlSignal0 + (status & 1);
    const bool negative = (status >> 1) != 0;
    if (threadIdx.x < kNumRanks) {
      int* remote = reinterpret_cast<int*>(peers[threadIdx.x] + kOffWorkspace) + signal_slot;
      red_add_release_sys(remote, negative ? -1 : 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      ws_local[kSlotNvlCounter] += 1;
      const int target = negative ? 0 : static_cast<int>(kNumRanks);
      const Deadline deadline{global_timer_ns(), timeout_ns};
      int seen;
      while ((seen = ld_acquire_sys(ws_local + signal_slot)) != target) {
        if (deadline.expired()) {
#if MEGAMOE_TRAP_PRINTF
          printf("megamoe: rank %d timed out in %s: %d of %u ranks arrived (signal %d, target %d); "
                 "a peer rank did not launch this call or died.\n",
                 rank, phase_name(phase), negative ? static_cast<int>(kNumRanks) - seen : seen, kNumRanks,
                 seen, target);
#endif
          report_and_trap(record, kErrorNvlinkTimeout, rank, phase,
                          negative ? static_cast<int>(kNumRanks) - seen : seen, seen, target);
        }
      }
    }
  }
  // The other CTAs wait here while CTA 0 waits for the peers: give them twice the time, so a
  // missing peer is reported by CTA 0 as what it is (an NVLink timeout naming the ranks that
  // arrived), not as a grid timeout of some CTA that merely waited for CTA 0.
  grid_sync(reinterpret_cast<u32*>(ws_local + kSlotGridSync), num_ctas, rank, phase, 2 * timeout_ns, record);
}

}  // namespace megamoe::mega
