#!/usr/bin/env bash
# No GPU: the kernel candidates kept as patches (benchmarks/results/*/*.patch), each applied to this
# tree's csrc/ in .probe_cand/<patch name>/csrc, so that one device call tests and times all of them
# against this tree (STEP=candidates of scripts/device_next_session.sh; compile their builds first with
# PLAN=cand bash scripts/precompile_for_device.sh, and carry [".probe_jit/cand", ".probe_cand"]).
#   PATCHES="a.patch b.patch" bash scripts/candidate_trees.sh   (default: the patches listed below)
# A patch that no longer applies stops the script with git's message: rebase it first.
set -euo pipefail
cd "$(dirname "$0")/.."
PATCHES="${PATCHES:-benchmarks/results/early_epilogue_loads/early_epilogue_loads.patch
benchmarks/results/scales_into_tables/scales_into_tables_64.patch
benchmarks/results/memory_phases/memory_phases.patch
benchmarks/results/token_halves/token_halves.patch}"
rm -rf .probe_cand && mkdir -p .probe_cand
for patch in $PATCHES; do
  name=$(basename "$patch" .patch)
  mkdir -p ".probe_cand/$name"
  git archive HEAD csrc | tar -x -C ".probe_cand/$name"
  git apply --directory=".probe_cand/$name" "$patch"
  echo ".probe_cand/$name/csrc: $(git apply --numstat "$patch" | awk '{a += $1; d += $2} END {print "+" a " -" d}') lines ($patch)"
done
