// The FP8 K loops of the 64- and 128-token prefill tiles with the tokens on the wgmma's M side,
// loaded from the stage into registers once per chunk and warpgroup (ldmatrix), and the weight
// rows on N through descriptors: m64n64 register-A wgmmas, two (64 tokens) or four (128 tokens)
// weight-row groups per warpgroup.
// Why: the swap-AB loop (weights on M, k_loop_lagged_promotion) makes every m64 group re-read the
// whole token tile from shared memory, 64 KB of operand reads per chunk, which is all of an SM's
// shared-memory bandwidth for the tensor work; the TMA refills and the promotion's scale loads
// then queue behind them. Here a chunk reads 48 KB, and the promotion needs 4 scale products per
// thread instead of 32 (docs/kernel_design.md: the probe's fused pattern with refill copies,
// 921 -> 719 cycles per chunk).
//
// Accumulator map, 64-token tiles (group g of warpgroup w, thread lane l of warp q in the
// warpgroup): element i of the m64n64 fragment is token 16 q + l / 4 + 8 ((i / 2) % 2) and weight
// row 128 w + 64 g + 8 (i / 4) + 2 (l % 4) + i % 2 of the tile (accum_row / accum_col in
// wgmma.cuh, with M = tokens). 128-token tiles: warpgroup w takes the tokens of alternate 8-row
// groups, M row m being token 16 (m / 8) + 8 w + m % 8 (register_tokens_tile_row), and all 256
// weight rows as four groups: row 64 g + ... Group g's 32 floats are
// WarpAcc's flattened floats 32 g .. 32 g + 31 (the swap-AB fragments' registers, another meaning):
// register_tokens_token / _row / rt_group below say which.
#pragma once
#include "mainloop_smem.cuh"

namespace megamoe::mega {

// kRegisterTokens (mainloop_smem.cuh): full tasks (more than kNarrowTokens rows) run this loop;
// narrow tasks of the 64-token builds keep the swap-AB loop with n32 wgmmas (M is 64 tokens here,
// it cannot shrink); the 128-token builds have no narrow tasks.
constexpr u32 kRegisterTokensGroupRows = 64;  // weight rows (the wgmma N) per group
constexpr bool kRegisterTokens128 = kRegisterTokens && kTileTokens == 128;
constexpr u32 kRtGroups = kRegisterTokens128 ? 4 : 2;  // 64-row groups per warpgroup

// The token (tile row) of M row m of the calling thread's warpgroup. 128-token tiles: the two
// warpgroups take alternate 8-row groups, so a block whose rows fill only the tile's first half
// (~64 rows per expert, where the padding model starts to pick 128-token tiles) still splits them,
// and the epilogue's stores, between both; with warpgroup w on rows 64 w .. 64 w + 63, warpgroup
// 0 stored all of such a block's L2 rows while warpgroup 1 waited (docs/kernel_design.md). An
// 8-row group is one swizzle atom: ldmatrix's 8 rows per matrix stay contiguous.
// `tid`: the thread's index (a K loop passes the one it read at its entry, common.cuh thread_index).
MEGAMOE_DEVICE u32 register_tokens_tile_row(u32 m, u32 tid = thread_index()) {
  return kRegisterTokens128 ? 16 * (m / 8) + 8 * (tid / 128) + m % 8 : m;
}

// Element i of group g's fragment: its token (0..kTileTokens - 1) and weight row (0..255) in the CTA tile.
MEGAMOE_DEVICE u32 register_tokens_token(u32 i, u32 tid = thread_index()) {
  return register_tokens_tile_row(16 * (tid / 32 % 4) + tid % 32 / 4 + 8 * ((i / 2) % 2), tid);
}
MEGAMOE_DEVICE u32 register_tokens_row(u32 g, u32 i, u32 tid = thread_index()) {
  const u32 base = kRegisterTokens128 ? 0 : 128 * (tid / 128);
  return base + kRegisterTokensGroupRows * g + 8 * (i / 4) + 2 * (tid % 4) + i % 2;
}
// Group g's 32 accumulators.
MEGAMOE_DEVICE float (&rt_group(WarpAcc& acc, u32 g))[32] {
  return *reinterpret_cast<float(*)[32]>(&acc.v[0][0][0] + 32 * g);
}
MEGAMOE_DEVICE const float (&rt_group(const WarpAcc& acc, u32 g))[32] {
  return *reinterpret_cast<const float(*)[32]>(&acc.v[0][0][0] + 32 * g);
}
static_assert(sizeof(WarpAcc) == kRtGroups * 32 * sizeof(float) || !kRegisterTokens, "one 32-float fragment per group");

// A chunk's 64 token rows x 128 K bytes as wgmma A fragments: one ldmatrix.x4 per k32 step.
struct TokenFragment {
  u32 r[kChunkBytes / 32][4];
};

// `rows`: the task's token rows. The lanes addressing the box's rows past them (the next expert's
// tokens, or the buffer's end) point ldmatrix at a line of zeros instead: those products are
// dropped by the epilogue anyway, and at prefill the SM clock is what the power cap leaves, which
// zero operands raise (docs/kernel_design.md). A select on each address, before the loads, so the
// fragment goes from ldmatrix to the wgmma as before.
MEGAMOE_DEVICE void load_token_fragment(TokenFragment& a, const MainloopSmem& sm, u32 stage, u32 rows, u32 tid) {
  const u32 tile = smem_addr(sm.b[stage]);
  const u32 row = register_tokens_tile_row(a_fragment_lane_row(tid), tid);  // 128-token tiles: the warpgroup's 8-row groups
  const bool padding = !(kAblate & kAblateKeepPadding) && row >= rows;
  const u32 zeros = smem_addr(token_zero_line);
#pragma unroll
  for (u32 kk = 0; kk < kChunkBytes / 32; ++kk)
    ldmatrix_x4(a.r[kk], padding ? zeros : a_fragment_row_address_fp8_sw128(tile, row, kk, tid));
}

// Group g (weight rows register_tokens_row(g, 0) ..) of a staged chunk into `part` (overwritten), committed.
MEGAMOE_DEVICE void issue_register_tokens_group(float (&part)[kRegisterTokensGroupRows / 2], const MainloopSmem& sm,
                                                u32 stage, u32 g, const TokenFragment& a, u32 tid) {
  constexpr u32 kDescStep = 32 / 16;  // descriptors count 16-byte units
  fence_accumulators(part);
  wgmma_fence();  // part was read by the last promotion; a's ldmatrix results are in place
  if (!(kAblate & kAblateMma) && !((kAblate & kAblateHalfRows) && g % 2 == 1)) {
    const u64 desc = kRegisterTokens128
                         ? make_smem_desc_k_major_sw128(sm.a[stage] + g * kRegisterTokensGroupRows * kStagedRow)
                         : stage_desc_a(sm, stage, g, tid);
#pragma unroll
    for (u32 kk = 0; kk < kChunkBytes / 32; ++kk)
      WgmmaFp8E4M3Rs<kRegisterTokensGroupRows>::mma(a.r[kk], desc + kDescStep * kk, part, kk > 0);
  }
  wgmma_commit_group();
}

// A chunk's promotion scales: [weight rows of even / odd n8 column blocks][the thread's token row
// lo / hi]. L1: even blocks are gate rows, odd ones up rows (gate / up interleaved by 8 rows,
// transforms.py), w_scale[warp][0 / 1] their scale blocks; L2, 64-token tiles: both entries are
// the warpgroup's 128-row scale block; L2, 128-token tiles: w_scale[warp][0 / 1] are the blocks of
// rows 0-127 / 128-255, so groups 0-1 take entry 0 and groups 2-3 entry 1 for both parities
// (RegisterTokenScales128).
struct RegisterTokenScales {
  float s[2][2];
};

MEGAMOE_DEVICE void load_register_token_scales(RegisterTokenScales& s, const MainloopSmem& sm, u32 kb, u32 tid) {
  const u32 warp = tid / 32, tok = register_tokens_token(0, tid);
  const float w_even = lds_f32(&sm.w_scale[w_scale_copy(warp)][0][kb]), w_odd = lds_f32(&sm.w_scale[w_scale_copy(warp)][1][kb]);
  const float t_lo = lds_f32(&sm.tok_scale[kb][tok_scale_col(kb, tok)]);
  const float t_hi = lds_f32(&sm.tok_scale[kb][tok_scale_col(kb, tok + 8)]);
  s.s[0][0] = w_even * t_lo, s.s[0][1] = w_even * t_hi;
  s.s[1][0] = w_odd * t_lo, s.s[1][1] = w_odd * t_hi;
}

MEGAMOE_DEVICE void promote_register_tokens(float (&acc_g)[kRegisterTokensGroupRows / 2],
                                            const float (&part)[kRegisterTokensGroupRows / 2], const RegisterTokenScales& s) {
  if constexpr (kAblate & kAblatePromotion) {  // one value read: ptxas drops a wgmma whose results all go unused
    acc_g[0] += part[0];
    return;
  }
#pragma unroll
  for (u32 i = 0; i < kRegisterTokensGroupRows / 2; ++i) acc_g[i] = fmaf(part[i], s.s[(i / 4) % 2][(i / 2) % 2], acc_g[i]);
}

// A task's first chunk: wait for stage st.seq % S, its tokens into a, g0 -> part, the CTA barrier
// (which also publishes the task's scale tables), then the refill of the previous task's last
// stage (its epilogue is done) with chunk S - 1. Returns the stage.
template <u32 K>
MEGAMOE_DEVICE u32 begin_register_tokens_task(float (&part)[kRegisterTokensGroupRows / 2], TokenFragment& a, MainloopSmem& sm,
                                              const MainloopState<K>& st, const TaskOperands& cur,
                                              const TaskOperands* next, const Params& p, u32 tid) {
  constexpr u32 S = kMainloopStages;
  const u32 stage = st.seq % S;
  wait_stage(&sm.full[stage], stage, st.seq / S, p, st.phase);
  load_token_fragment(a, sm, stage, cur.rows.num_rows, tid);
  issue_register_tokens_group(part, sm, stage, 0, a, tid);
  mma_barrier();
  load_chunk_ahead<K>(sm, st, S - 1, cur, next, p, tid);
  return stage;
}

// The K loop of one full 64-token task (acc zeroed here, the first S - 1 chunks issued). Per chunk
// c: wait for its stage and for g1(c - 1), its tokens into a, g0(c) -> part0, CTA barrier and
// refill of chunk c - 1's stage, promote g1(c - 1) (while g0(c) runs), g1(c) -> part1, promote
// g0(c). The fragment is reloaded only with no wgmma group that reads it in flight (the PTX ISA's
// rule; a queued group whose registers were reloaded came out wrong on an H200, one reading a copy
// in other registers right: tests/gpu/test_wgmma_rs.py, docs/kernel_design.md). The
// promotion of g1(c - 1) sits after the CTA barrier: before it, ptxas hoisted it above g0(c)'s
// issue. One loop body: unrolled by two, ptxas serialised every wgmma (C7515). Chunk 0 is peeled
// off so that no branch inside the loop hides from ptxas which group a wait completes. Trace
// intervals (chunk trace builds): 0-1 stage and g1(c - 1) waits, 1-2 reload and g0(c) issue,
// 2-3 barrier, 3-4 refill, 4-5 promotion of g1(c - 1), 6-7 g1(c) issue, 7-8 wait for g0(c).
template <u32 K>
MEGAMOE_DEVICE void k_loop_register_tokens(WarpAcc& acc, MainloopSmem& sm, const MainloopState<K>& st,
                                           const TaskOperands& cur, const TaskOperands* next, const Params& p, u32 tid) {
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  constexpr u32 S = kMainloopStages;
  static_assert(kRegisterTokens && kTileTokens == 64 && 2 * kRegisterTokensGroupRows * 2 == kTileRows,
                "the register-token loop covers 256 weight rows x 64 tokens");
  float(&acc0)[32] = *reinterpret_cast<float(*)[32]>(&acc.v[0][0][0]);
  float(&acc1)[32] = *reinterpret_cast<float(*)[32]>(&acc.v[1][0][0]);
  float part0[32], part1[32];
  TokenFragment a;             // the chunk's tokens
  RegisterTokenScales scales;  // chunk c's, from its first group's promotion to its second's
  acc.zero();
  u32 stage = begin_register_tokens_task<K>(part0, a, sm, st, cur, next, p, tid);
  issue_register_tokens_group(part1, sm, stage, 1, a, tid);
  load_register_token_scales(scales, sm, 0, tid);
  wait_for_part<1, 64>(part0);
  promote_register_tokens(acc0, part0, scales);
  u64* trace = trace_row(p, st.phase == kPhaseL1 && st.seq == kTraceTask * kChunks, tid);  // chunk trace builds only
  for (u32 c = 1; c < kChunks; ++c) {
    trace_point(trace, c, 0);
    stage = (st.seq + c) % S;
    wait_stage(&sm.full[stage], stage, (st.seq + c) / S, p, st.phase);
    wait_for_part<0, 64>(part1);  // g1(c - 1): nothing in flight while a is reloaded
    trace_point(trace, c, 1);
    load_token_fragment(a, sm, stage, cur.rows.num_rows, tid);
    issue_register_tokens_group(part0, sm, stage, 0, a, tid);
    trace_point(trace, c, 2);
    mma_barrier();  // every warpgroup is done with chunk c - 1's stage
    trace_point(trace, c, 3);
    load_chunk_ahead<K>(sm, st, c + S - 1, cur, next, p, tid);  // into it
    trace_point(trace, c, 4);
    fence_accumulators(part1);
    promote_register_tokens(acc1, part1, scales);  // g1(c - 1), while g0(c) runs
    trace_point(trace, c, 5);
    trace_point(trace, c, 6);
    issue_register_tokens_group(part1, sm, stage, 1, a, tid);
    trace_point(trace, c, 7);
    load_register_token_scales(scales, sm, c, tid);
    wait_for_part<1, 64>(part0);  // g0(c), while g1(c) runs
    trace_point(trace, c, 8);
    promote_register_tokens(acc0, part0, scales);
  }
  wait_for_part<0, 64>(part1);
  promote_register_tokens(acc1, part1, scales);
}

// The 128-token tiles' scales: group g's products, [parity][token row lo / hi] (see above).
struct RegisterTokenScales128 {
  float w[2], t[2];
  bool l2;
  MEGAMOE_DEVICE RegisterTokenScales group(u32 g) const {
    const float we = l2 ? w[g / 2] : w[0], wo = l2 ? w[g / 2] : w[1];
    return {{{we * t[0], we * t[1]}, {wo * t[0], wo * t[1]}}};
  }
};

MEGAMOE_DEVICE void load_register_token_scales_128(RegisterTokenScales128& s, const MainloopSmem& sm, u32 kb, u32 tid) {
  const u32 warp = tid / 32;
  s.w[0] = lds_f32(&sm.w_scale[w_scale_copy(warp)][0][kb]), s.w[1] = lds_f32(&sm.w_scale[w_scale_copy(warp)][1][kb]);
  if constexpr (kScalesIntoTables) {
    // Token row hi is 16 tokens past lo (register_tokens_tile_row): in the grouped table one address
    // and an immediate offset (through tok_scale_at for both, the loop's wgmma descriptors left the
    // uniform registers: 309 -> 397 instructions, docs/kernel_design.md).
    constexpr u32 kHiBytes = 16 * 4 * sizeof(float);
    const float* lo = &tok_scale_at(sm, kb, register_tokens_token(0, tid));
    asm volatile("ld.shared.f32 %0, [%2];\n\tld.shared.f32 %1, [%2+%3];"
                 : "=f"(s.t[0]), "=f"(s.t[1])
                 : "r"(smem_addr(lo)), "n"(kHiBytes));
  } else {
    s.t[0] = lds_f32(&tok_scale_at(sm, kb, register_tokens_token(0, tid)));  // token row lo
    s.t[1] = lds_f32(&tok_scale_at(sm, kb, register_tokens_token(2, tid)));  // hi
  }
}

// The K loop of one 128-token task: each warpgroup its own 64 tokens x the 256 weight rows in four
// 64-row groups, two partials taken in turn with a lag of one group (a group is queued on the
// tensor cores while the one before it is promoted); acc zeroed here, the first S - 1 chunks
// issued. Per chunk c: wait for its stage, its tokens into a (nothing in flight), g0 -> pa, CTA
// barrier and refill of chunk c - 1's stage, g1 -> pb, wait g0 and promote it, g2 -> pa, wait g1,
// promote, g3 -> pb, wait g2, promote, wait g3, promote. Per thread 128 accumulators, two 32-float
// partials and a 16-register fragment; 4 scale values per chunk (the tokens on M: one token scale
// per row). Carrying g3's promotion into the next chunk (as the 64-token loop does with its second
// group) kept one more partial live across the barrier: 255 registers and 196 bytes spilled in the
// loop (V4-Flash-like); this form uses 253-255 and spills nothing.
template <u32 K>
MEGAMOE_DEVICE void k_loop_register_tokens_128(WarpAcc& acc, MainloopSmem& sm, const MainloopState<K>& st,
                                               const TaskOperands& cur, const TaskOperands* next, const Params& p, u32 tid) {
  constexpr u32 kChunks = K * kElemBytes / kChunkBytes;
  constexpr u32 S = kMainloopStages;
  static_assert(kRegisterTokens128 && kRtGroups == 4, "the 128-token register-token loop");
  float pa[32], pb[32];
  TokenFragment a;
  RegisterTokenScales128 scales;
  scales.l2 = st.phase == kPhaseL2;
  acc.zero();
  // g1..g3 of chunk c, each issued once the group two before it is waited for and promoted.
  const auto rest_of_chunk = [&](u32 stage, u32 c) {
    issue_register_tokens_group(pb, sm, stage, 1, a, tid);
    load_register_token_scales_128(scales, sm, c, tid);
    wait_for_part<1, 64>(pa);  // g0(c), while g1(c) runs
    promote_register_tokens(rt_group(acc, 0), pa, scales.group(0));
    issue_register_tokens_group(pa, sm, stage, 2, a, tid);
    wait_for_part<1, 64>(pb);  // g1(c), while g2(c) runs
    promote_register_tokens(rt_group(acc, 1), pb, scales.group(1));
    issue_register_tokens_group(pb, sm, stage, 3, a, tid);
    wait_for_part<1, 64>(pa);  // g2(c), while g3(c) runs
    promote_register_tokens(rt_group(acc, 2), pa, scales.group(2));
    wait_for_part<0, 64>(pb);  // g3(c)
    promote_register_tokens(rt_group(acc, 3), pb, scales.group(3));
  };
  u32 stage = begin_register_tokens_task<K>(pa, a, sm, st, cur, next, p, tid);
  rest_of_chunk(stage, 0);
  for (u32 c = 1; c < kChunks; ++c) {
    stage = (st.seq + c) % S;
    wait_stage(&sm.full[stage], stage, (st.seq + c) / S, p, st.phase);
    load_token_fragment(a, sm, stage, cur.rows.num_rows, tid);
    issue_register_tokens_group(pa, sm, stage, 0, a, tid);
    mma_barrier();  // every warpgroup is done with chunk c - 1's stage
    load_chunk_ahead<K>(sm, st, c + S - 1, cur, next, p, tid);  // into it
    rest_of_chunk(stage, c);
  }
}

}  // namespace megamoe::mega
