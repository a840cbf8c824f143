// Which (token block, weight tile) a GEMM task index of a phase stands for. CTAs take task
// indices in order as they ask (task_queue.cuh), so tasks with neighbouring indices run at the
// same time. Within one
// expert the tasks go weight tile by weight tile, every token block of a tile side by side: the
// CTAs busy with an expert that holds many token blocks (prefill) then stream the same weight
// tile together, one of them from HBM and the others from L2, instead of each re-reading its own
// tile from HBM once per token block. With one block per expert (decode) the order is unchanged.
#pragma once
#include "params.cuh"

namespace megamoe::mega {

struct TaskCoord {
  u32 block;   // token block (index over all local experts' blocks, see ExpertTable)
  u32 tile;    // weight tile of kTileRows rows
  u32 expert;  // the local expert that owns the block
};

// Tasks [block_start[e] * kTiles, block_start[e + 1] * kTiles) belong to expert e. Called by
// whole converged warps (the expert search is warp-cooperative).
template <u32 kTiles>
MEGAMOE_DEVICE TaskCoord task_coord(const ExpertTable& table, u32 task) {
  const u32 e = upper_bound_expert_warp(table.block_start, task / kTiles);
  const u32 first = table.block_start[e];
  const u32 blocks = table.block_start[e + 1] - first;
  const u32 i = task - first * kTiles;
  return {first + i % blocks, i / blocks, e};
}

// The coordinate of a CTA's next task, looked up by the task before it: one lookup per task
// instead of two (each is a warp-cooperative search on every MMA warp).
struct KnownCoord {
  u32 task = ~0u;
  TaskCoord at = {};
};

template <u32 kTiles>
MEGAMOE_DEVICE TaskCoord task_coord_known(const ExpertTable& table, u32 task, const KnownCoord& known) {
  return known.task == task ? known.at : task_coord<kTiles>(table, task);  // the same branch in every thread
}

}  // namespace megamoe::mega
