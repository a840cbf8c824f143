// The two expert GEMMs over the staged rows, task by task:
//   L1: 256 interleaved w13 rows (128 SwiGLU channels) x 32 rows of one expert, K = hidden;
//       epilogue: SwiGLU (gate/up rounded to BF16, optional clamp) x top-k weight, then FP8
//       with one scale per 128 channels (or BF16) into staging_l2.
//   L2: 256 w2 rows (hidden channels) x 32 rows, K = intermediate; epilogue: BF16 rows written
//       straight into the source rank's combine[slot][token] (16-byte stores over NVLink).
// FP8 partial sums are promoted to FP32 once per 128-K block with weight x token scales.
#pragma once
#include "block_ready.cuh"
#include "conv.cuh"
#include "dispatch.cuh"
#include "cta_gemm.cuh"
#include "epilogue_tile.cuh"
#include "epilogue_warpgroup.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "phase_clock.cuh"
#include "task_order.cuh"
#include "task_queue.cuh"

namespace megamoe::mega {

// acc = this warp's share of the task's GEMM over K (cta_gemm.cuh).
// `next`: the CTA's next task of this phase or nullptr (the K loop streams into it).
template <u32 K, u32 kN = kTileTokens>
MEGAMOE_DEVICE void task_gemm(WarpAcc& acc, MainloopSmem* sm, MainloopState<K>& st, const TaskOperands& op,
                              const TaskOperands* next, const Params& p) {
  cta_gemm<K, kN>(acc, *sm, st, op, next, p);
}

// Profiling builds that drop the epilogue (ablate=epilogue): a store that never happens but
// depends on every accumulator, so the compiler keeps the K loop's wgmmas.
MEGAMOE_DEVICE void keep_results_live(const WarpAcc& acc, const Regions& me) {
  if (acc.sum() == 1.0e30f) me.staging_l2_scale()[thread_index()] = 0.0f;
}

// L1 task (token block, w13 tile wt): 256 interleaved rows = 128 gate + 128 up channels, so the
// tile's gate rows use scale block wt and its up rows block I/128 + wt (checkpoint row order).
MEGAMOE_DEVICE TaskOperands l1_operands(const ExpertTable& table, const Params& p, const Regions& me,
                                        const TmaMaps& maps, const TaskCoord& at) {
  const u32 wt = at.tile;
  const TaskRows t = task_rows(table, at.block, at.expert);
  const u64 w_row0 = static_cast<u64>(t.expert) * 2 * kInter + wt * kTileRows;
  const float* gate_sc = nullptr;
  const float* up_sc = nullptr;
  if constexpr (kFP8) {
    gate_sc = p.w13_scale + (static_cast<u64>(t.expert) * (2 * kInter / kScaleBlock) + wt) * (kHidden / kScaleBlock);
    up_sc = gate_sc + (kInter / kScaleBlock) * (kHidden / kScaleBlock);
  }
  return {t, p.w13 + w_row0 * kHidden * kElemBytes, maps.w13, wt * kTileRows, maps.l1, me.staging_l1(), kRowBytesL1,
          {gate_sc, up_sc},
          me.staging_l1_scale(), kL1ScalePitch};
}

// L2 task (token block, w2 tile ht): a warp's rows lie in one 128-row scale block (both row
// mappings of acc_row_base keep a warp inside an aligned 128-row block).
MEGAMOE_DEVICE TaskOperands l2_operands(const ExpertTable& table, const Params& p, const Regions& me,
                                        const TmaMaps& maps, const TaskCoord& at) {
  const u32 ht = at.tile;
  const TaskRows t = task_rows(table, at.block, at.expert);
  const u64 w_row0 = static_cast<u64>(t.expert) * kHidden + ht * kTileRows;
  const float* sc = nullptr;
  // The 128-token register-token tiles: every thread's rows span both 128-row scale blocks.
  const u32 first_row = kRegisterTokens128 ? 0 : acc_row_base(thread_index() / 32, 0);
  if constexpr (kFP8)
    sc = p.w2_scale + (static_cast<u64>(t.expert) * (kHidden / kScaleBlock) + (ht * kTileRows + first_row) / kScaleBlock) *
                          (kInter / kScaleBlock);
  return {t, p.w2 + w_row0 * kInter * kElemBytes, maps.w2, ht * kTileRows, maps.l2, me.staging_l2(), kRowBytesL2,
          {sc, kRegisterTokens128 ? sc + kInter / kScaleBlock : sc},
          me.staging_l2_scale(), kL2ScalePitch};
}

// One step of a 4 x 4 transpose within a quad of lanes (slot j of lane t -> slot t of lane j after
// the steps for bits 0 and 1): the slot pairs that differ in `bit`, each lane giving away the one
// whose bit differs from its own and taking its partner's.
template <u32 kBit>
MEGAMOE_DEVICE void quad_transpose_step(u32 (&a)[4]) {
  constexpr u32 m = 1u << kBit;
  const bool mine_high = (thread_index() >> kBit) & 1u;
#pragma unroll
  for (u32 j0 = 0; j0 < 4; ++j0) {
    if (j0 & m) continue;
    const u32 j1 = j0 | m;
    const u32 got = __shfl_xor_sync(0xffffffffu, mine_high ? a[j0] : a[j1], m);
    if (mine_high) a[j0] = got;
    else a[j1] = got;
  }
}

// Profiling builds without the register epilogues' row stores (ablate=stores): a store still
// happens when its values hash to one word, so the compiler keeps every value it would store.
MEGAMOE_DEVICE bool stores_kept(u32 hash) {
  return !(kAblate & kAblateStores) || hash == 0x9e3779b9u;
}

// FP8 128-token builds' L1 output rows straight from the registers (no tile, no barrier before
// the stores). The quad holding a token holds its 128 channels, lane t4 the FP8 pair at channels
// 32 mt + 8 m + 2 t4 (mt: row group, m: gate block, register_tokens_row); packed as 16-channel
// chunks j (mt = j / 2, m = 2 (j % 2) + {0, 1}) and j + 4, a 4 x 4 transpose within the quad
// gives lane t4 chunks t4 and t4 + 4: a warp's two stores write 64 contiguous bytes of each of
// its 8 token rows. Values as the tile path computes them ((v w) / scale, e4m3 pairs).
MEGAMOE_DEVICE void l1_rows_from_registers(const WarpAcc& acc, const TaskRows& t, u32 wt, const float (&weight)[2],
                                           const float (&inv_scale)[2], const Regions& me) {
  const u32 t4 = thread_index() % 4;
#pragma unroll
  for (u32 h = 0; h < 2; ++h) {  // the thread's token rows lo / hi
    u32 pairs[kRtGroups][4];      // [mt][m]: e4m3 pairs in the low 16 bits
#pragma unroll
    for (u32 mt = 0; mt < kRtGroups; ++mt) {
      const float(&v)[32] = rt_group(acc, mt);
#pragma unroll
      for (u32 m = 0; m < 4; ++m) {
        const float v0 = v[8 * m + 2 * h] * weight[h], v1 = v[8 * m + 2 * h + 1] * weight[h];
        pairs[mt][m] = f32x2_to_e4m3x2(v0 * inv_scale[h], v1 * inv_scale[h]);
      }
    }
    u32 lo[4], hi[4];  // chunks j and j + 4 of the row, two pairs each (m even | m odd << 16)
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
      lo[j] = pairs[j / 2][2 * (j % 2)] | (pairs[j / 2][2 * (j % 2) + 1] << 16);
      hi[j] = pairs[2 + j / 2][2 * (j % 2)] | (pairs[2 + j / 2][2 * (j % 2) + 1] << 16);
    }
    if constexpr (!(kAblate & kAblateTranspose)) {
      quad_transpose_step<0>(lo), quad_transpose_step<1>(lo);  // lo[k]: lane k's part of chunk t4
      quad_transpose_step<0>(hi), quad_transpose_step<1>(hi);
    }
    const u32 tok = register_tokens_token(2 * h);
    if (tok < t.num_rows && stores_kept(lo[0] ^ lo[1] ^ lo[2] ^ lo[3] ^ hi[0] ^ hi[1] ^ hi[2] ^ hi[3])) {  // chunk bytes 2 k: lane k's even-m pair, 8 + 2 k: its odd-m pair
      u8* row = me.staging_l2() + static_cast<u64>(t.first_row + tok) * kRowBytesL2 + wt * 128;
      *reinterpret_cast<uint4*>(row + 16 * t4) =
          make_uint4(__byte_perm(lo[0], lo[1], 0x5410), __byte_perm(lo[2], lo[3], 0x5410),
                     __byte_perm(lo[0], lo[1], 0x7632), __byte_perm(lo[2], lo[3], 0x7632));
      *reinterpret_cast<uint4*>(row + 64 + 16 * t4) =
          make_uint4(__byte_perm(hi[0], hi[1], 0x5410), __byte_perm(hi[2], hi[3], 0x5410),
                     __byte_perm(hi[0], hi[1], 0x7632), __byte_perm(hi[2], hi[3], 0x7632));
    }
  }
}

// SwiGLU in place: the activation replaces each channel's gate value in acc (a separate array
// spills with 128-token tiles); tok_amax gets the thread's per-token max |activation| (register
// tokens: [0][token row lo / hi]; swap-AB: [n8 tile][column j]). The gate and up rows of a channel
// sit in the same thread (swap-AB: fragment rows g and g + 8 of each m16 tile; register tokens:
// n8 column blocks 2 m and 2 m + 1). A template on kClamp, not a generic lambda: NVRTC 13.0 takes
// a generic lambda's call operator for host code.
template <bool kClamp, bool kRegTok, u32 kNTiles>
MEGAMOE_DEVICE void swiglu_in_place(WarpAcc& acc, float clamp, float (&tok_amax)[kRegTok ? 1 : kNTiles][2]) {
  const auto swiglu = [&](float& gate_io, float up_in) {
    float gate = gate_io, up = up_in;
    round_bf16x2(gate, up);
    if constexpr (kClamp) {
      gate = fminf(gate, clamp);
      up = fminf(fmaxf(up, -clamp), clamp);
    }
    gate_io = silu(gate) * up;
    return fabsf(gate_io);
  };
  if constexpr (kRegTok) {
    tok_amax[0][0] = tok_amax[0][1] = 0.0f;
#pragma unroll
    for (u32 mt = 0; mt < kRtGroups; ++mt) {
      float(&v)[32] = rt_group(acc, mt);
#pragma unroll
      for (u32 m = 0; m < 4; ++m)
#pragma unroll
        for (u32 k = 0; k < 4; ++k) tok_amax[0][k / 2] = fmaxf(tok_amax[0][k / 2], swiglu(v[8 * m + k], v[8 * m + 4 + k]));
    }
  } else {
#pragma unroll
    for (u32 nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (u32 j = 0; j < 2; ++j) {
        tok_amax[nt][j] = 0.0f;
#pragma unroll
        for (u32 mt = 0; mt < 2; ++mt) tok_amax[nt][j] = fmaxf(tok_amax[nt][j], swiglu(acc.v[mt][nt][j], acc.v[mt][nt][2 + j]));
      }
  }
}

// One L1 task from its coordinate and operands on: the K loop and epilogue over the first kN
// token columns (kTileTokens, or kNarrowTokens when the block holds no more rows).
template <u32 kN>
MEGAMOE_DEVICE void l1_task_columns(const ExpertTable& table, EpilogueSmem& smem, MainloopSmem* mainloop,
                                    MainloopState<kHidden>& st, const Params& p, const Regions& me, const TmaMaps& maps,
                                    const TaskCoord& at, const TaskOperands& op, const TaskCoord& next_at,
                                    bool stream_next, TaskClock& clock) {
  constexpr u32 kNTiles = kN / 8;  // n8 token tiles computed
  constexpr bool kRegTok = kRegisterTokens && kN == kTileTokens;  // acc in the register-token map
  // 128-token register-token builds: all 128 channels of a token sit in one quad of lanes, so each
  // lane gets the token's amax from two shuffles and computes its scale itself (no per-token
  // tables in shared memory, no barrier and no one-thread-per-token pass for them).
  constexpr bool kQuadScales = kRegTok && kRegisterTokens128;
  const u32 wt = at.tile;
  const TaskRows& t = op.rows;
  const u32 warp = thread_index() / 32, lane = thread_index() % 32, g = lane / 4, t4 = lane % 4;
  // Thread i < tokens: token i's top-k weight, loaded now so its latency hides behind the K loop.
  const float my_weight = !kEpilogueWarpgroup && !kQuadScales && thread_index() < t.num_rows
                              ? ld_cg_f32(me.staging_weight() + t.first_row + thread_index())
                              : 0.0f;
  WarpAcc acc;
  if (stream_next) {
    const TaskOperands next = l1_operands(table, p, me, maps, next_at);
    task_gemm<kHidden, kN>(acc, mainloop, st, op, &next, p);
  } else {
    task_gemm<kHidden, kN>(acc, mainloop, st, op, nullptr, p);
  }
  span_end(p, clock, kSpanL1Gemm);
  if constexpr (!kEpilogueWarpgroup) {
    (*st.ask_after)();  // before this task's stores (task_queue.cuh)
    publish_unpublished(me, st.unpublished);  // the previous task's tile (block_ready.cuh)
  }
  task_trace_point(p, false, st.tasks - 1, kTaskGemmDone);
  if constexpr (!kEpilogueWarpgroup) task_trace_point(p, false, st.tasks - 1, kTaskEpilogueStart);
  if constexpr (kEpilogueWarpgroup) {  // the epilogue warpgroup does the rest (epilogue_warpgroup.cuh)
    handoff_wait_empty(smem, st.handoffs, p, kPhaseL1);
    task_trace_point(p, false, st.tasks - 1, kTaskEpilogueStart);
    handoff_l1_pairs<kN, kRegTok>(handoff_tile(smem), acc);
    handoff_publish(smem, kHandoffL1, at.block, wt, t, st.handoffs);
    task_trace_point(p, false, st.tasks - 1, kTaskDone);
    span_end(p, clock, kSpanL1Epilogue);
    span_count(p, clock, kSpanL1Tasks);
    return;
  }
  if constexpr (kAblate & kAblateEpilogue) {  // profiling: no inline epilogue, the tile published unwritten
    keep_results_live(acc, me);
    __syncthreads();
    if (thread_index() == 0) publish_l1_tile(me, at.block);
    task_trace_point(p, false, st.tasks - 1, kTaskDone);
    span_end(p, clock, kSpanL1Epilogue);
    span_count(p, clock, kSpanL1Tasks);
    return;
  }

  // SwiGLU in place (swiglu_in_place). The top-k weight multiplies in after the amax: |s x w|
  // rounds monotonically, so the token's amax of s x w is its amax of s times |w|, exactly.
  const EpilogueTables tables = epilogue_tables(smem, mainloop);
  if (!kQuadScales && thread_index() < kN) tables.weight[thread_index()] = my_weight;
  // kQuadScales: the top-k weights of the thread's token rows lo / hi, loaded before the SwiGLU
  // pass hides their latency (not before the K loop: two more registers live through it).
  float quad_weight[2] = {0.0f, 0.0f}, quad_amax[2] = {0.0f, 0.0f};
  if constexpr (kQuadScales) {
#pragma unroll
    for (u32 h = 0; h < 2; ++h)
      if (register_tokens_token(2 * h) < t.num_rows)
        quad_weight[h] = ld_cg_f32(me.staging_weight() + t.first_row + register_tokens_token(2 * h));
  }
  // The clamp is the same for the whole call: one branch around the pass instead of a predicate
  // on each of its min / max and clamp loads (3 per channel, issued also when off).
  float tok_amax[kRegTok ? 1 : kNTiles][2];
  if (p.has_clamp) swiglu_in_place<true, kRegTok, kNTiles>(acc, p.clamp, tok_amax);
  else swiglu_in_place<false, kRegTok, kNTiles>(acc, 0.0f, tok_amax);
  if constexpr (kFP8 && kRegTok) {
    // Per-token amax over the tile's 128 channels: the quad's 4 lanes, then (below, 64-token
    // tiles) the two warpgroups; with 128 tokens a warpgroup holds all channels of its tokens.
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
      float m = tok_amax[0][h];
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if constexpr (kQuadScales) quad_amax[h] = m;  // every lane of the quad
      else if (t4 == 0) tables.amax[warp / 4][register_tokens_token(2 * h)] = m;
    }
  } else if constexpr (kFP8) {
    // Per-token amax over the tile's 128 channels: across g in the warp, then (below) across warps.
#pragma unroll
    for (u32 nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (u32 j = 0; j < 2; ++j) {
        float m = tok_amax[nt][j];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if (g == 0) tables.amax[warp][nt * 8 + 2 * t4 + j] = m;
      }
  }
  float quad_inv_scale[2] = {0.0f, 0.0f};
  if constexpr (kQuadScales) {  // the scale as the one-thread-per-token pass below computes it
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
      const u32 tok = register_tokens_token(2 * h);
      const float scale = fmaxf(quad_amax[h] * fabsf(quad_weight[h]), kAmaxFloor) * (1.0f / kFP8Max);
      quad_inv_scale[h] = 1.0f / scale;
      if (t4 == 0 && tok < t.num_rows)
        me.staging_l2_scale()[static_cast<u64>(t.first_row + tok) * kL2ScalePitch + wt] = scale;
    }
  }
  if constexpr (kQuadScales) {  // FP8 128-token builds: the rows straight from the registers
    l1_rows_from_registers(acc, t, wt, quad_weight, quad_inv_scale, me);
    st.unpublished = at.block;  // published after the next task's K loop (block_ready.cuh)
    task_trace_point(p, false, st.tasks - 1, kTaskDone);
    span_end(p, clock, kSpanL1Epilogue);
    span_count(p, clock, kSpanL1Tasks);
    return;
  }
  __syncthreads();  // every warp's K loop done with the stage the tile below overwrites
  if constexpr (kFP8 && !kQuadScales) {
    // One thread per token: the scale (one division per token) for every thread's values.
    if (thread_index() < kN) {
      const u32 tok = thread_index();
      float m = 0.0f;
#pragma unroll
      for (u32 w = 0; w < (kRegTok ? 2 : kNumMmaWarps); ++w)  // warpgroups or warps
        m = fmaxf(m, tables.amax[w][tok]);
      const float scale = fmaxf(m * fabsf(my_weight), kAmaxFloor) * (1.0f / kFP8Max);
      tables.inv_scale[tok] = 1.0f / scale;
      if (tok < t.num_rows)
        me.staging_l2_scale()[static_cast<u64>(t.first_row + tok) * kL2ScalePitch + wt] = scale;
    }
    __syncthreads();
  }
  u8* tile = epilogue_tile(smem, mainloop, st);  // [tokens][128] fp8 / bf16, chunks permuted (epilogue_offset)
  if constexpr (kRegTok) {
    // A thread's gate columns come in pairs of adjacent channels: one 2-byte store per pair.
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
      const u32 tok = register_tokens_token(2 * h);
      const float w = tables.weight[tok];
      const float inv_scale = tables.inv_scale[tok];  // (the 64-token register-token loop is FP8 only)
#pragma unroll
      for (u32 mt = 0; mt < kRtGroups; ++mt) {
        const float(&v)[32] = rt_group(acc, mt);
#pragma unroll
        for (u32 m = 0; m < 4; ++m) {
          const u32 row = register_tokens_row(mt, 8 * m + 2 * h);  // a gate row: channel = row / 16 x 8 + row % 8
          const u32 channel = row / 16 * 8 + row % 8;
          const float v0 = v[8 * m + 2 * h] * w, v1 = v[8 * m + 2 * h + 1] * w;
          *reinterpret_cast<u16*>(tile + epilogue_offset(tok, channel, 128)) = f32x2_to_e4m3x2(v0 * inv_scale, v1 * inv_scale);
        }
      }
    }
  } else if constexpr (!kFP8) {
    // BF16: matrix (mt, nt) of the fragment is 8 channels (acc_row_base / 2 + g) x 8 tokens, thread
    // (g, t4) holding tokens 2 t4 and + 1 of channel g: one transposed stmatrix writes 8 channels
    // (16 bytes) of each of 8 token rows, for 4 such matrices (two n8 tiles x two m16 tiles).
    static_assert(kNTiles % 2 == 0, "the matrices go out in pairs of n8 tiles");
#pragma unroll
    for (u32 nt0 = 0; nt0 < kNTiles; nt0 += 2) {
      u32 r[4];  // matrix m: n8 tile nt0 + m / 2, m16 tile m % 2
#pragma unroll
      for (u32 dn = 0; dn < 2; ++dn) {
        const u32 tok = (nt0 + dn) * 8 + 2 * t4;
        const float w0 = tables.weight[tok], w1 = tables.weight[tok + 1];
#pragma unroll
        for (u32 mt = 0; mt < 2; ++mt) r[2 * dn + mt] = pack_bf16x2(acc.v[mt][nt0 + dn][0] * w0, acc.v[mt][nt0 + dn][1] * w1);
      }
      const u32 m = lane / 8;  // the matrix whose row (token) this lane addresses
      const u32 tok = (nt0 + m / 2) * 8 + lane % 8, channel = acc_row_base(warp, m % 2) / 2;
      stmatrix_x4_trans(smem_addr(tile + epilogue_offset(tok, channel * 2, 128 * 2)), r);
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < static_cast<int>(kNTiles); ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const u32 tok = nt * 8 + 2 * t4 + j;
        const float w = tables.weight[tok];
        const float inv_scale = tables.inv_scale[tok];  // read before the tile stores (may alias)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const u32 channel = acc_row_base(warp, mt) / 2 + g;  // rows base+g (gate) and base+g+8 (up)
          const float v = acc.v[mt][nt][j] * w;
          tile[epilogue_offset(tok, channel, 128)] = static_cast<u8>(f32x2_to_e4m3x2(v * inv_scale, 0.0f) & 0xff);
        }
      }
  }
  __syncthreads();
  // Coalesced 16-byte stores of the valid token rows.
  constexpr u32 kRowBytes = 128 * kElemBytes, kChunksPerRow = kRowBytes / 16;
  for (u32 c = thread_index(); c < kN * kChunksPerRow; c += kNumMmaThreads) {
    const u32 tok = c / kChunksPerRow, chunk = c % kChunksPerRow;
    if (tok >= t.num_rows) continue;
    u8* dst = me.staging_l2() + static_cast<u64>(t.first_row + tok) * kRowBytesL2 + wt * kRowBytes + chunk * 16;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(tile + epilogue_offset(tok, chunk * 16, kRowBytes));
  }
  release_epilogue_tile();
  __syncthreads();
  st.unpublished = at.block;  // published after the next task's K loop (block_ready.cuh)
  task_trace_point(p, false, st.tasks - 1, kTaskDone);
  span_end(p, clock, kSpanL1Epilogue);
  span_count(p, clock, kSpanL1Tasks);
}

// task / next_task: task indices of this phase (task_order.cuh); next_task >= num_tasks: none.
// pulled: the CTA's block-check state for this phase (wait_pulled_block): a task starts once its
// token block's rows are pulled (the time it waits counts in its l1_gemm span), and the next
// task's first stages are streamed in during this one only when its block is pulled already.
MEGAMOE_DEVICE void l1_task(const ExpertTable& table, EpilogueSmem& smem, MainloopSmem* mainloop, MainloopState<kHidden>& st,
                            const Params& p, const Regions& me, const TmaMaps& maps, u32 task, u32 next_task,
                            u32 num_tasks, BlockReadyState& pulled, TaskClock& clock, const AskAfter& ask_after,
                            KnownCoord& known) {
  constexpr u32 kTiles = 2 * kInter / kTileRows;
  span_start(p, clock);
  const u32 number = st.tasks++;
  task_trace_point(p, false, number, kTaskEntry);
  const TaskCoord at = task_coord_known<kTiles>(table, task, known);
  const TaskCoord next_at = next_task < num_tasks ? task_coord<kTiles>(table, next_task) : TaskCoord{~0u, 0, 0};
  known = {next_task, next_at};
  const TaskOperands op = l1_operands(table, p, me, maps, at);
  task_trace_point(p, false, number, kTaskOperands);
  const bool next_pulled = wait_pulled_block(p, me, table, at.block, at.expert, next_at.block, next_at.expert, pulled, number);
  task_trace_point(p, false, number, kTaskBlockReady);
  st.ask_after = &ask_after;  // asked here or after the K loop (task_queue.cuh)
  if constexpr (kEpilogueWarpgroup) ask_after();
  const bool stream_next = next_task < num_tasks && next_pulled;
  if constexpr (kNarrowTasks) {
    if (op.rows.num_rows <= kNarrowTokens || (kAblate & kAblateNarrow)) {
      l1_task_columns<kNarrowTokens>(table, smem, mainloop, st, p, me, maps, at, op, next_at, stream_next, clock);
      return;
    }
  }
  l1_task_columns<kTileTokens>(table, smem, mainloop, st, p, me, maps, at, op, next_at, stream_next, clock);
}

// FP8 128-token builds' L2 epilogue, straight from the registers: no shared-memory tile, no
// barrier (the next task refills this task's last stage only after its own first CTA barrier).
// The quad of lanes holding a token holds 64 of its channels per row group as BF16 pairs, lane
// t4 channels 8 c + 2 t4, + 1 (register_tokens_row); a transpose of each 4 x 4 block within the
// quad gives every lane 16 contiguous bytes, so a warp's store writes 64 contiguous bytes of
// each of its 8 token rows into combine[slot][token] of the token's rank.
MEGAMOE_DEVICE void l2_rows_from_registers(const WarpAcc& acc, const TaskRows& t, u32 ht, const Params& p,
                                           const Regions& me) {
  const u32 t4 = thread_index() % 4;
  int4 meta[2];
#pragma unroll
  for (u32 h = 0; h < 2; ++h) {  // the thread's token rows lo / hi (register_tokens_token)
    const u32 tok = register_tokens_token(2 * h);
    meta[h] = tok < t.num_rows ? __ldcg(reinterpret_cast<const int4*>(me.staging_meta()) + t.first_row + tok)
                               : make_int4(0, 0, 0, 0);
  }
  u32 out[2][kRtGroups][8];  // [token lo / hi][row group][chunk of 8 channels]: BF16 pairs, before the loads return
#pragma unroll
  for (u32 g = 0; g < kRtGroups; ++g) {
    const float(&v)[32] = rt_group(acc, g);
#pragma unroll
    for (u32 c = 0; c < 8; ++c)
#pragma unroll
      for (u32 h = 0; h < 2; ++h) out[h][g][c] = pack_bf16x2(v[4 * c + 2 * h], v[4 * c + 2 * h + 1]);
  }
#pragma unroll
  for (u32 h = 0; h < 2; ++h) {
    const bool valid = register_tokens_token(2 * h) < t.num_rows;  // the same in the quad
    const Regions src{p.peers[valid ? meta[h].x : 0]};
    u16* row = src.combine() + (static_cast<u64>(meta[h].z) * kMaxTokens + meta[h].y) * kBufHidden + ht * kTileRows;
#pragma unroll
    for (u32 g = 0; g < kRtGroups; ++g)
#pragma unroll
      for (u32 c0 = 0; c0 < 8; c0 += 4) {
        u32 a[4] = {out[h][g][c0], out[h][g][c0 + 1], out[h][g][c0 + 2], out[h][g][c0 + 3]};
        if constexpr (!(kAblate & kAblateTranspose)) {
          quad_transpose_step<0>(a);
          quad_transpose_step<1>(a);  // a: chunk c0 + t4, its 8 channels from lanes 0..3 in order
        }
        if (valid && stores_kept(a[0] ^ a[1] ^ a[2] ^ a[3]))
          *reinterpret_cast<uint4*>(row + kRegisterTokensGroupRows * g + 8 * (c0 + t4)) = make_uint4(a[0], a[1], a[2], a[3]);
      }
  }
}

// One L2 task once its token block is ready: the K loop and epilogue over the first kN token
// columns (kTileTokens, or kNarrowTokens when the block holds no more rows). `next_at`: the
// next task, streamed into when `stream_next` (there is one and its token block is ready).
template <u32 kN>
MEGAMOE_DEVICE void l2_task_columns(const ExpertTable& table, EpilogueSmem& smem, MainloopSmem* mainloop,
                                    MainloopState<kInter>& st, const Params& p, const Regions& me, const TmaMaps& maps,
                                    const TaskCoord& at, const TaskOperands& op, const TaskCoord& next_at,
                                    bool stream_next, TaskClock& clock) {
  constexpr u32 kNTiles = kN / 8;  // n8 token tiles computed
  constexpr bool kRegTok = kRegisterTokens && kN == kTileTokens;  // acc in the register-token map
  const u32 ht = at.tile;
  const TaskRows& t = op.rows;
  const u32 warp = thread_index() / 32, lane = thread_index() % 32;
  constexpr u32 kPassTokens = kN < kL2PassTokens ? kN : kL2PassTokens;
  // Lane i: the (rank, token, slot) of the warp's i-th row of a pass. With one pass and the
  // 32-token builds' registers to spare, loaded before the K loop: after it, the load was a
  // dependent round trip between the K loop and the combine stores of every task (the L2
  // epilogue 1.4 -> 0.6-0.8 us per task at 8-128 tokens per rank, docs/kernel_design.md).
  constexpr bool kMetaEarly = kPassTokens == kN && kTileTokens <= 32 && !kEpilogueWarpgroup;
  const auto load_meta = [&](u32 pass_tok0, u32 pass_rows) {
    int4 meta = make_int4(0, 0, 0, 0);
    if (warp + kNumMmaWarps * lane < pass_rows)
      meta = __ldcg(reinterpret_cast<const int4*>(me.staging_meta()) + t.first_row + pass_tok0 + warp + kNumMmaWarps * lane);
    return meta;
  };
  int4 early_meta = make_int4(0, 0, 0, 0);
  if constexpr (kMetaEarly) early_meta = load_meta(0, t.num_rows < kPassTokens ? t.num_rows : kPassTokens);
  WarpAcc acc;
  if (stream_next) {
    const TaskOperands next = l2_operands(table, p, me, maps, next_at);
    task_gemm<kInter, kN>(acc, mainloop, st, op, &next, p);
  } else {
    task_gemm<kInter, kN>(acc, mainloop, st, op, nullptr, p);
  }
  span_end(p, clock, kSpanL2Gemm);
  if constexpr (!kEpilogueWarpgroup) (*st.ask_after)();
  task_trace_point(p, true, st.tasks - 1, kTaskGemmDone);
  if constexpr (!kEpilogueWarpgroup) task_trace_point(p, true, st.tasks - 1, kTaskEpilogueStart);
  if constexpr ((kAblate & kAblateEpilogue) && !kEpilogueWarpgroup) {  // profiling: no inline epilogue
    keep_results_live(acc, me);
    __syncthreads();  // (the next task refills this task's last stage only after its first CTA barrier)
    task_trace_point(p, true, st.tasks - 1, kTaskDone);
    span_end(p, clock, kSpanL2Epilogue);
    span_count(p, clock, kSpanL2Tasks);
    return;
  }
  if constexpr (kRegTok && kRegisterTokens128 && !kEpilogueWarpgroup) {
    l2_rows_from_registers(acc, t, ht, p, me);
    task_trace_point(p, true, st.tasks - 1, kTaskDone);
    span_end(p, clock, kSpanL2Epilogue);
    span_count(p, clock, kSpanL2Tasks);
    return;
  }
  // Otherwise every pass's row metadata is loaded here, at once, before the BF16 rounding and the
  // first pass's tile writes: one round trip that those hide, where a load per pass after its
  // writes and barrier were 2 round trips in each 128-token task's epilogue.
  constexpr u32 kPasses = kN / kPassTokens;
  int4 late_meta[kPasses];
  if constexpr (!kMetaEarly && !kEpilogueWarpgroup) {
#pragma unroll
    for (u32 pass = 0; pass < kPasses; ++pass) {
      const u32 pass_tok0 = pass * kPassTokens;
      const u32 left = t.num_rows > pass_tok0 ? t.num_rows - pass_tok0 : 0;
      late_meta[pass] = load_meta(pass_tok0, left < kPassTokens ? left : kPassTokens);
    }
  }
  // Rounded to BF16 pairs first: half the registers stay live through the passes' stores. A pair
  // is two tokens of one channel (swap-AB) or two adjacent channels of one token (register tokens).
  u32 out[2][kNTiles][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (u32 nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        out[mt][nt][h] = pack_bf16x2(acc.v[mt][nt][2 * h], acc.v[mt][nt][2 * h + 1]);
  static_assert(!kRegTok || kN == kL2PassTokens || kRegisterTokens128, "the 64-token register-token map takes one pass");
  u8* tile = epilogue_tile(smem, mainloop, st);  // [pass tokens][256 channels] bf16, chunks permuted (epilogue_offset)
  constexpr u32 kPassTiles = kPassTokens / 8;
  const auto write_pass = [&](u32 pass) {
    if constexpr (kRegTok) {
      // out[mt][nt][token row lo / hi]: n8 block f = mt kNTiles + nt of the flattened groups (group
      // f / 8, block f % 8), channels register_tokens_row(f / 8, 4 (f % 8)) and + 1. 128-token
      // tiles: pass p holds tokens 64 p .. 64 p + 63, of both warpgroups.
#pragma unroll
      for (u32 mt = 0; mt < 2; ++mt)
#pragma unroll
        for (u32 nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (u32 h = 0; h < 2; ++h) {
            const u32 tok = register_tokens_token(2 * h);
            if (kRegisterTokens128 && tok / kPassTokens != pass) continue;
            const u32 f = mt * kNTiles + nt;  // (64-token tiles: group mt, block nt, written so)
            const u32 row = kRegisterTokens128 ? register_tokens_row(f / 8, 4 * (f % 8)) : register_tokens_row(mt, 4 * nt);
            *reinterpret_cast<u32*>(tile + epilogue_offset(tok - pass * kPassTokens, row * 2, kTileRows * 2)) = out[mt][nt][h];
          }
    } else {
      // out[mt][nt][h]: matrix (mt, h) of n8 tile nt is 8 channels (acc_row_base + 8 h + g) x 8
      // tokens, thread (g, t4) holding tokens 2 t4 and + 1: one transposed stmatrix writes 8
      // channels (16 bytes) of each of the tile's 8 token rows, for its 4 matrices.
      const u32 m = lane / 8;  // the matrix (mt = m / 2, h = m % 2) whose row (token) this lane addresses
      const u32 channel = acc_row_base(warp, m / 2) + 8 * (m % 2);
#pragma unroll
      for (u32 pt = 0; pt < kPassTiles; ++pt) {
        const u32 nt = pass * kPassTiles + pt;
        const u32 r[4] = {out[0][nt][0], out[0][nt][1], out[1][nt][0], out[1][nt][1]};
        stmatrix_x4_trans(smem_addr(tile + epilogue_offset(pt * 8 + lane % 8, channel * 2, kTileRows * 2)), r);
      }
    }
  };
  if constexpr (kEpilogueWarpgroup) {  // one pass (the whole task); the epilogue warpgroup sends the rows
    static_assert(kPassTokens == kN, "the hand-off tile holds the whole task");
    handoff_wait_empty(smem, st.handoffs, p, kPhaseL2);
    task_trace_point(p, true, st.tasks - 1, kTaskEpilogueStart);
    write_pass(0);
    handoff_publish(smem, kHandoffL2, at.block, ht, t, st.handoffs);
  } else {
#pragma unroll
    for (u32 pass = 0; pass < kN / kPassTokens; ++pass) {
      const u32 pass_tok0 = pass * kPassTokens;
      if (pass_tok0 >= t.num_rows) break;  // uniform over the CTA
      write_pass(pass);
      __syncthreads();
      // Each warp sends whole token rows (512 bytes) to combine[slot][token] of the source rank.
      const u32 pass_rows = t.num_rows - pass_tok0 < kPassTokens ? t.num_rows - pass_tok0 : kPassTokens;
      static_assert(kPassTokens <= 32 * kNumMmaWarps, "one row per lane and warp");
      const int4 my_meta = kMetaEarly ? early_meta : late_meta[pass];
#pragma unroll 1
      for (u32 i = 0, tok = warp; tok < pass_rows; ++i, tok += kNumMmaWarps) {
        int4 meta;
        meta.x = __shfl_sync(0xffffffffu, my_meta.x, i);
        meta.y = __shfl_sync(0xffffffffu, my_meta.y, i);
        meta.z = __shfl_sync(0xffffffffu, my_meta.z, i);
        Regions src{p.peers[meta.x]};
        u16* dst = src.combine() + (static_cast<u64>(meta.z) * kMaxTokens + meta.y) * kBufHidden + ht * kTileRows;
        reinterpret_cast<uint4*>(dst)[lane] = *reinterpret_cast<const uint4*>(tile + epilogue_offset(tok, lane * 16, kTileRows * 2));
      }
      release_epilogue_tile();
      __syncthreads();
    }
  }
  task_trace_point(p, true, st.tasks - 1, kTaskDone);
  span_end(p, clock, kSpanL2Epilogue);
  span_count(p, clock, kSpanL2Tasks);
}

// ready: the CTA's block-check state (wait_l1_block). The next task's first stages are streamed
// in during this one only when its token block is ready already.
MEGAMOE_DEVICE void l2_task(const ExpertTable& table, EpilogueSmem& smem, MainloopSmem* mainloop, MainloopState<kInter>& st,
                            const Params& p, const Regions& me, const TmaMaps& maps, u32 task, u32 next_task,
                            u32 num_tasks, BlockReadyState& ready, TaskClock& clock, const AskAfter& ask_after,
                            KnownCoord& known) {
  constexpr u32 kTiles = kHidden / kTileRows;
  span_start(p, clock);
  const u32 number = st.tasks++;
  task_trace_point(p, true, number, kTaskEntry);
  const TaskCoord at = task_coord_known<kTiles>(table, task, known);
  const TaskCoord next_at = next_task < num_tasks ? task_coord<kTiles>(table, next_task) : TaskCoord{~0u, 0, 0};
  known = {next_task, next_at};
  const TaskOperands op = l2_operands(table, p, me, maps, at);
  task_trace_point(p, true, number, kTaskOperands);
  const bool next_ready = wait_l1_block(p, me, table, at.block, at.expert, next_at.block, next_at.expert, ready, number);
  task_trace_point(p, true, number, kTaskBlockReady);
  st.ask_after = &ask_after;
  if constexpr (kEpilogueWarpgroup) ask_after();
  span_end(p, clock, kSpanL2Wait);
  const bool stream_next = next_task < num_tasks && next_ready;
  if constexpr (kNarrowTasks) {
    if (op.rows.num_rows <= kNarrowTokens || (kAblate & kAblateNarrow)) {
      l2_task_columns<kNarrowTokens>(table, smem, mainloop, st, p, me, maps, at, op, next_at, stream_next, clock);
      return;
    }
  }
  l2_task_columns<kTileTokens>(table, smem, mainloop, st, p, me, maps, at, op, next_at, stream_next, clock);
}

}  // namespace megamoe::mega
