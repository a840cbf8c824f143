// Thin wrappers over Hopper PTX: mbarriers, fences, named barriers, register reallocation,
// conversions. Each one maps to one or two instructions; no policy lives here.
#pragma once
#include "common.cuh"

namespace megamoe {

MEGAMOE_DEVICE u32 smem_addr(const void* ptr) {
  return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

MEGAMOE_DEVICE u32 lane_id() {
  u32 lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Warp index made warp-uniform so the compiler can branch on it without divergence.
MEGAMOE_DEVICE int warp_uniform_warp_idx() {
  return __shfl_sync(0xffffffffu, static_cast<int>(thread_index()) / 32, 0);
}

// ---------------------------------------------------------------- mbarrier
MEGAMOE_DEVICE void mbarrier_init(u64* bar, u32 arrival_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrival_count));
}

// Makes barrier initialisation visible to the async proxy (TMA) and to other threads.
MEGAMOE_DEVICE void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

MEGAMOE_DEVICE void mbarrier_arrive(u64* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(smem_addr(bar))
               : "memory");
}

// Counts one arrival and announces `bytes` of transactions (TMA completions) for this phase.
MEGAMOE_DEVICE void mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}" ::"r"(
                   smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

MEGAMOE_DEVICE bool mbarrier_try_wait(u64* bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase with the given parity has completed. Traps after
// MEGAMOE_WAIT_TIMEOUT_CYCLES so a protocol bug shows up as an error, not a hung GPU.
// kReport prints which wait gave up first; only warps that issue no wgmma may use it, because
// any function call (printf) in a kernel makes ptxas serialise every wgmma (C7510).
template <bool kReport = false>
MEGAMOE_DEVICE void mbarrier_wait(u64* bar, u32 parity, int tag) {
  if (mbarrier_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbarrier_try_wait(bar, parity)) {
    if (clock64() - start > MEGAMOE_WAIT_TIMEOUT_CYCLES) {
      if constexpr (kReport) {
        printf("megamoe: mbarrier wait timed out (tag %d, block %d, thread %d, parity %u)\n", tag,
               static_cast<int>(blockIdx.x), static_cast<int>(thread_index()), parity);
      }
      asm volatile("trap;");
    }
  }
}

// ---------------------------------------------------------------- clusters
MEGAMOE_DEVICE u32 cluster_cta_rank() {
  u32 rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of the cluster's CTAs (warp-converged) arrives and waits for all: shared-memory
// writes and mbarrier initialisations before it are visible cluster-wide after it.
MEGAMOE_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// One arrival on the mbarrier at `bar`'s shared-memory offset in the cluster's CTA `cta` (this
// CTA included): a stage's release to the producers that write into it. The default .release.cta
// form, as the stage releases within a CTA: .release.cluster put two GPU-scope fences before
// every arrival (MEMBAR.ALL.GPU in the SASS), which no stage release needs.
MEGAMOE_DEVICE void mbarrier_arrive_cluster(u64* bar, u32 cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// ---------------------------------------------------------------- fences and barriers
// Orders global-memory writes seen through the generic proxy (other CTAs' stores, acquired)
// before this thread's later async-proxy (TMA) reads of the same memory.
MEGAMOE_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
// (wgmma / TMA store reading data written with st.shared).
MEGAMOE_DEVICE void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

MEGAMOE_DEVICE void named_barrier_sync(u32 id, u32 num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// ---------------------------------------------------------------- register reallocation
template <u32 kRegs>
MEGAMOE_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <u32 kRegs>
MEGAMOE_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---------------------------------------------------------------- conversions
// Two floats to packed bf16x2 (round to nearest even); `lo` lands in the low 16 bits.
MEGAMOE_DEVICE u32 pack_bf16x2(float lo, float hi) {
  u32 out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

MEGAMOE_DEVICE bf16_bits float_to_bf16(float x) {
  u16 out;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(x));
  return out;
}

// ---------------------------------------------------------------- loads
// Read-only, L1-cached global load for small metadata (scales, offsets).
MEGAMOE_DEVICE float ldg_float(const float* ptr) { return __ldg(ptr); }
MEGAMOE_DEVICE int ldg_int(const int* ptr) { return __ldg(ptr); }

// Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix.x4): lane l gives the address
// of row l % 8 of matrix l / 8 (16 bytes); thread t receives, in r[m], bytes 4 (t % 4) .. +3 of
// row t / 4 of matrix m. A memory clobber: it must not move above the wait for the bytes it reads.
MEGAMOE_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 smem_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address)
               : "memory");
}

// Four 8x8 matrices of 16-bit elements into shared memory, transposed (stmatrix.x4.trans): thread
// t gives, in r[m], elements (row t / 4, columns 2 (t % 4) and + 1) of matrix m (an MMA
// accumulator fragment, low half first); lane l gives the address of memory row l % 8 of matrix
// l / 8 (16 bytes), which receives column l % 8 of the matrix.
MEGAMOE_DEVICE void stmatrix_x4_trans(u32 smem_address, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               :
               : "r"(smem_address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

}  // namespace megamoe
