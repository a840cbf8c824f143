// Persistent-grid task scheduler for grouped (per-expert) GEMMs.
//
// Rows of the token matrix are grouped by expert: expert e owns rows
// [expert_offsets[e], expert_offsets[e+1]) and the offsets live in device memory (no host
// sync). The work is a list of tasks (expert, n_block, token_block), experts in order, n_block
// major and token_block minor inside an expert, so CTAs running neighbouring tasks at the same
// time read the same weight tile and the second read hits L2.
// Tasks go round-robin: CTA b runs tasks b, b + grid, b + 2*grid, ... Each role of a CTA
// (producer, every consumer warpgroup) walks its own scheduler copy; the walk is deterministic,
// so all roles agree on the task sequence without talking to each other.
#pragma once
#include "ptx.cuh"

namespace megamoe {

struct GroupedTask {
  int expert;
  int n_block;     // index of the BLOCK_W-row weight tile
  int row_begin;   // first token row of this task in the grouped token matrix
  int num_rows;    // valid token rows in this task, 1..kBlockTokens
};

template <int kBlockTokens>
struct GroupedTaskScheduler {
  const int* expert_offsets;
  int num_experts;
  int num_n_blocks;
  int next_task;
  // Cursor over experts: tasks [expert_task_begin, expert_task_begin + expert_num_tasks) belong to `expert`.
  int expert;
  int expert_task_begin;
  int expert_num_tasks;
  int expert_row_begin;
  int expert_row_end;

  MEGAMOE_DEVICE GroupedTaskScheduler(const int* offsets, int experts, int n_blocks)
      : expert_offsets(offsets), num_experts(experts), num_n_blocks(n_blocks),
        next_task(static_cast<int>(blockIdx.x)), expert(-1), expert_task_begin(0), expert_num_tasks(0),
        expert_row_begin(0), expert_row_end(0) {}

  // Fills `task` with the next task of this CTA; false once none is left.
  MEGAMOE_DEVICE bool next(GroupedTask& task) {
    const int wanted = next_task;
    while (wanted >= expert_task_begin + expert_num_tasks) {
      expert_task_begin += expert_num_tasks;
      ++expert;
      if (expert >= num_experts) {
        expert_num_tasks = 1 << 30;  // park the cursor: every later call also fails
        return false;
      }
      expert_row_begin = expert == 0 ? ldg_int(expert_offsets) : expert_row_end;
      expert_row_end = ldg_int(expert_offsets + expert + 1);
      const int num_token_blocks = ceil_div(expert_row_end - expert_row_begin, kBlockTokens);
      expert_num_tasks = num_token_blocks * num_n_blocks;
    }
    if (expert >= num_experts) return false;
    const int local = wanted - expert_task_begin;
    const int num_token_blocks = expert_num_tasks / num_n_blocks;
    const int token_block = local % num_token_blocks;
    task.expert = expert;
    task.n_block = local / num_token_blocks;
    task.row_begin = expert_row_begin + token_block * kBlockTokens;
    task.num_rows = min(kBlockTokens, expert_row_end - task.row_begin);
    next_task += static_cast<int>(gridDim.x);
    return true;
  }
};

}  // namespace megamoe
