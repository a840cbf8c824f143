#!/usr/bin/env bash
# No GPU: kernel candidates kept as patches, each applied to this tree's csrc/ in
# .probe_cand/<patch name>/csrc, so that one device call tests and times all of them against this
# tree (STEP=candidates of scripts/device_next_session.sh; compile their builds first with
# PLAN=cand bash scripts/precompile_for_device.sh, and carry [".probe_jit/cand", ".probe_cand"]).
#   PATCHES="a.patch b.patch" bash scripts/candidate_trees.sh
# The candidates of kernel_notes v35-v37 were kept under benchmarks/results/, which now holds only the
# runs of record: those patches are in git history at 63d314b (see HISTORY_PATCHES below). Without
# PATCHES the script prints how to get them with `git show 63d314b:<path>` and exits 2.
# A patch that no longer applies stops the script with git's message: rebase it first.
set -euo pipefail
cd "$(dirname "$0")/.."
HISTORY=63d314b
HISTORY_PATCHES=(
  benchmarks/results/early_epilogue_loads/early_epilogue_loads.patch  # in git history at 63d314b
  benchmarks/results/scales_into_tables/scales_into_tables_64.patch   # in git history at 63d314b
  benchmarks/results/memory_phases/memory_phases.patch                # in git history at 63d314b
  benchmarks/results/token_halves/token_halves.patch                  # in git history at 63d314b
)
if [ -z "${PATCHES:-}" ]; then
  echo "candidate_trees.sh: no PATCHES given. The candidate patches that were kept in benchmarks/results/"
  echo "are in git history at $HISTORY; get them with git show, then pass them in PATCHES:"
  echo "  mkdir -p .probe_patches"
  list=""
  for p in "${HISTORY_PATCHES[@]}"; do
    echo "  git show $HISTORY:$p > .probe_patches/$(basename "$p")"
    list="$list .probe_patches/$(basename "$p")"
  done
  echo "  PATCHES=\"${list# }\" bash scripts/candidate_trees.sh"
  exit 2
fi
rm -rf .probe_cand && mkdir -p .probe_cand
for patch in $PATCHES; do
  name=$(basename "$patch" .patch)
  mkdir -p ".probe_cand/$name"
  git archive HEAD csrc | tar -x -C ".probe_cand/$name"
  git apply --directory=".probe_cand/$name" "$patch"
  echo ".probe_cand/$name/csrc: $(git apply --numstat "$patch" | awk '{a += $1; d += $2} END {print "+" a " -" d}') lines ($patch)"
done
