// The fused SM90 mega MoE kernel: one persistent launch per MoE layer and rank.
//   stage + announce -> [NVLink barrier] -> counts read from the peers, pull -> L1 + SwiGLU -> (per token
//   block) L2 + combine writes -> [NVLink barrier] -> top-k reduce -> counters reset
// The pull -> L1 and L1 -> L2 dependencies are per-token-block counters (block_ready.cuh);
// the 32- and 64-token TMA builds run the GEMM epilogues on a third warpgroup (epilogue_warpgroup.cuh);
// GEMM tasks go to CTAs in index order as they ask (task_queue.cuh);
// every CTA of the grid must be resident (the host checks occupancy) and every wait times out
// with a report naming the rank and the phase.
#include "mega/combine.cuh"
#include "mega/dispatch.cuh"
#include "mega/expert_gemm.cuh"
#include "mega/phase_clock.cuh"
#include "mega/sync.cuh"
#include "mega/task_queue.cuh"

using namespace megamoe;
using namespace megamoe::mega;

extern __shared__ __align__(16) u8 dynamic_smem[];  // the mainloop's stages (MainloopSmem)

// L1 + SwiGLU, then L2 + combine writes, task by task (the MMA warpgroups' part with an epilogue
// warpgroup). Every value is rebuilt here from the kernel's parameters and shared memory: values
// live across a setmaxnreg are spilled.
MEGAMOE_DEVICE void gemm_phases(const ExpertTable& table, EpilogueSmem& epilogue, TaskClock& clock, const Params& p,
                                const TensorMap& w13_map, const TensorMap& w2_map, const TensorMap& l1_map,
                                const TensorMap& l2_map) {
  MainloopSmem* mainloop = mainloop_smem_at(dynamic_smem);
  const Regions me{p.peers[p.rank]};
  const TmaMaps maps{&w13_map, &w2_map, &l1_map, &l2_map};
  const u32 blocks = table.block_start[kNumLocalExperts];
  __shared__ u32 task_slot;
  // No grid sync after the pull: each L1 task waits for the rows of its own token block.
  __shared__ u32 l1_pulled_flags[2];
  BlockReadyState l1_pulled{l1_pulled_flags, 0, ~0u, false, false};
  MainloopState<kHidden> l1_state{0, false, kPhaseL1};
  KnownCoord l1_known;
  loop_start(p, clock);
  for_each_task(me.workspace() + kSlotL1TaskCounter, blocks * kL1Tiles, &task_slot, [&](u32 task, u32 next, const AskAfter& ask_after) {
    l1_task(table, epilogue, mainloop, l1_state, p, me, maps, task, next, blocks * kL1Tiles, l1_pulled, clock, ask_after, l1_known);
  }, [&] { task_trace_point(p, false, l1_state.tasks - 1, kTaskQueued); });
  if constexpr (!kEpilogueWarpgroup) publish_unpublished(me, l1_state.unpublished);  // the last L1 task's tile, past the queue's barrier
  loop_end(p, clock, kSpanL1Loop);
  mark_phase(p, kMarkL1Done);
  // No grid sync here: each L2 task waits for the L1 tiles of its own token block (block_ready.cuh).
  mark_phase(p, kMarkL2Start);

  __shared__ u32 l2_ready_flags[2];
  BlockReadyState l2_ready{l2_ready_flags, 0, ~0u, false, false};
  MainloopState<kInter> l2_state{l1_state.seq, false, kPhaseL2};  // stage sequence numbers carry on (TMA barrier parity)
  l2_state.handoffs = l1_state.handoffs;                           // and so do the epilogue hand-offs
  KnownCoord l2_known;
  loop_start(p, clock);
  for_each_task(me.workspace() + kSlotL2TaskCounter, blocks * kL2Tiles, &task_slot, [&](u32 task, u32 next, const AskAfter& ask_after) {
    l2_task(table, epilogue, mainloop, l2_state, p, me, maps, task, next, blocks * kL2Tiles, l2_ready, clock, ask_after, l2_known);
  }, [&] { task_trace_point(p, true, l2_state.tasks - 1, kTaskQueued); });
  loop_end(p, clock, kSpanL2Loop);
  if constexpr (kEpilogueWarpgroup) handoff_done(epilogue, l2_state.handoffs, p);
}

extern "C" __global__ void __launch_bounds__(kNumThreads, 1)
megamoe_sm90_fused(const __grid_constant__ Params p, const __grid_constant__ TensorMap w13_map,
                   const __grid_constant__ TensorMap w2_map, const __grid_constant__ TensorMap l1_map,
                   const __grid_constant__ TensorMap l2_map) {
  __shared__ ExpertTable table;
  __shared__ EpilogueSmem epilogue;
  __shared__ TaskClock clock;
  task_clock_init(p, clock);
  MainloopSmem* mainloop = mainloop_smem_at(dynamic_smem);
  init_mainloop(*mainloop);  // the TMA mainloop's stage barriers (visible after the dispatch barrier)
  if (thread_index() == 0) init_handoff(epilogue);  // the epilogue warpgroup's (likewise)
  const Regions me{p.peers[p.rank]};
  const TmaMaps maps{&w13_map, &w2_map, &l1_map, &l2_map};
  if (thread_index() == 0) {  // the four descriptors into the cache now, not at each phase's first copy
    tma_prefetch_descriptor(maps.w13);
    tma_prefetch_descriptor(maps.w2);
    tma_prefetch_descriptor(maps.l1);
    tma_prefetch_descriptor(maps.l2);
  }
  const u32 num_ctas = gridDim.x;
  // Calls made on this buffer before this one (CTA 0 bumps it at the end, once every CTA passed
  // the last NVLink barrier): the NVLink barriers' targets.
  const u32 calls = ld_cg_u32(reinterpret_cast<const u8*>(me.workspace() + kSlotCallCount));

  mark_phase(p, kMarkStart);
  stage_tokens(p, me);
  announce_pairs(p, me);
  mark_phase(p, kMarkStaged);
  nvlink_barrier(p.peers, p.rank, num_ctas, calls, 0, kPhaseDispatchBarrier, p.timeout_ns, p.error_record);
  mark_phase(p, kMarkDispatched);

  build_expert_table(table, p, me);
  pull_rows(table, p, me);
  mark_phase(p, kMarkPulled);
  mark_phase(p, kMarkL1Start);  // (no barrier between: the L1 tasks wait per token block)

#if MEGAMOE_EPILOGUE_WARPGROUP
  // Warpgroups 0-1 run the K loops with most of the registers, warpgroup 2 the epilogues
  // (epilogue_warpgroup.cuh); every warp takes the launch's share again for the phases after.
  // Between two setmaxnreg of a warpgroup its warps meet at a barrier (the PTX ISA's rule): a CTA
  // without tasks may otherwise pass from one to the next without any.
  if (thread_index() >= kNumMmaThreads) {
    setmaxnreg_dec<kEpilogueRegs>();
    run_epilogue_warpgroup(epilogue, p);
    named_barrier_sync(kBarrierEpilogue, kEpilogueWarps * 32);
    setmaxnreg_inc<kLaunchRegs>();
  } else {
    setmaxnreg_inc<kMmaRegs>();
    gemm_phases(table, epilogue, clock, p, w13_map, w2_map, l1_map, l2_map);
    mma_barrier();
    setmaxnreg_dec<kLaunchRegs>();
  }
  __syncthreads();  // the epilogue warpgroup's last combine writes, before the barrier's release
#else
  gemm_phases(table, epilogue, clock, p, w13_map, w2_map, l1_map, l2_map);
#endif
  mark_phase(p, kMarkL2Done);
  nvlink_barrier(p.peers, p.rank, num_ctas, calls, 1, kPhaseL2, p.timeout_ns, p.error_record);
  mark_phase(p, kMarkCombined);
  reset_l1_blocks(me, table.block_start[kNumLocalExperts]);
  reset_task_counters(me);

  reduce_combine(p, me);
  mark_phase(p, kMarkEnd);
  write_task_clock(p, clock);
  reset_counters(me);
}
