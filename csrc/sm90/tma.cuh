// Bulk tensor copies (TMA) from global to shared memory, completing on an mbarrier.
// The tensor maps are encoded on the host (vllm_megamoe/kernels/tma.py) with 128-byte swizzle,
// which matches the wgmma K-major SWIZZLE_128B descriptors built in wgmma.cuh.
#pragma once
#include "ptx.cuh"

namespace megamoe {

MEGAMOE_DEVICE void tma_prefetch_descriptor(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// Box at coordinates (c0 innermost, c1) of a 2-D tensor map.
MEGAMOE_DEVICE void tma_load_2d(const TensorMap* map, void* smem_dst, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// An L2 cache policy under which the lines a copy brings in are the first to be evicted: for data
// a call reads once, so that it does not push out what the call reads again.
MEGAMOE_DEVICE u64 l2_policy_evict_first() {
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// tma_load_2d's box written at `smem_dst`'s offset in every CTA of the cluster named in `cta_mask`
// (a bit per rank), each completing the bytes on its own mbarrier at `bar`'s offset.
MEGAMOE_DEVICE void tma_load_2d_multicast(const TensorMap* map, void* smem_dst, u64* bar, int c0, int c1, u16 cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// Box at coordinates (c0 innermost, c1, c2) of a 3-D tensor map.
MEGAMOE_DEVICE void tma_load_3d(const TensorMap* map, void* smem_dst, u64* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// tma_load_3d under an L2 cache policy (l2_policy_evict_first).
MEGAMOE_DEVICE void tma_load_3d_hint(const TensorMap* map, void* smem_dst, u64* bar, int c0, int c1, int c2, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
      : "memory");
}

// `bytes` contiguous bytes (a multiple of 16; both addresses 16-byte aligned), no tensor map.
MEGAMOE_DEVICE void bulk_load(void* smem_dst, const void* gmem_src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(smem_dst)), "l"(reinterpret_cast<u64>(gmem_src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

}  // namespace megamoe
