#!/usr/bin/env bash
# No GPU: compile into .probe_jit/<PLAN> (or VLLM_MEGAMOE_CACHE_DIR) the SM90 builds the next device calls of
# scripts/device_next_session.sh load, so the device spends its minutes running them, not compiling
# (NVRTC here is the device's 13.0, and the cache keys hold only sources, defines and compiler).
# Carry the plan's folder (`run` carry [".probe_jit/ep2"]) and export VLLM_MEGAMOE_CACHE_DIR=$PWD/.probe_jit/ep2
# there: one folder a plan, so a call carries only its own builds (all plans together pass the 64 MiB).
#   PLAN=ep2 (default): the kernel tests on 2 GPUs (STEP=verify), STEP=decode, STEP=nvl_stores, STEP=bench
#   PLAN=ep1: STEP=one_gpu's kernel tests, STEP=wg128, STEP=task_scales and STEP=ep1_lookup
#   PLAN=cand: STEP=candidates: the one-GPU kernel tests' and sanitizer probe's builds of every
#              candidate tree in .probe_cand/ (scripts/candidate_trees.sh), and the probe's builds of
#              VARIANTS (SHAPES, TOKENS) as STEP=candidates runs them; carry [".probe_jit/cand", ".probe_cand"]
# A build missing here is still compiled on the device at its first call (a test's forced
# setting not listed below, a changed test buffer): this saves time, it decides nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
export VLLM_MEGAMOE_CACHE_DIR="${VLLM_MEGAMOE_CACHE_DIR:-$PWD/.probe_jit/${PLAN:-ep2}}"
pc() { "$PY" -m vllm_megamoe.cli precompile "$@" | tail -1; }
probe() {  # a failing probe shows why (its last lines) and stops the script
  local log; log=$(mktemp)
  "$PY" -m benchmarks.kernel_probe --compile-only "$@" > "$log" 2>&1 || { tail -5 "$log"; rm -f "$log"; return 1; }
  echo "$(grep -c -E ' (compiled|cached) [0-9a-f]{12}$' "$log") probe builds"; rm -f "$log"
}
V4=4096x2048x256x6 DSV3=7168x2048x256x8 QWEN3=2048x768x128x8 DSV3_64E=7168x2048x64x8 SMALL=512x384x24x5
# The multi-rank tests beside test_multi_gpu: back-to-back calls (62 tokens), the missing peer (16),
# CUDA graphs (64; in the formats given)
multi_rank_extras() {
  pc --shape $SMALL --format fp8-block --ep-size 2 --max-tokens-per-rank 62
  pc --shape $SMALL --format fp8-block --ep-size 2 --max-tokens-per-rank 16
  for f in "$@"; do pc --shape $QWEN3 --format $f --ep-size 2 --max-tokens-per-rank 64; done
}
# The one-GPU tests' builds (tests/gpu/test_sm90_mega_moe.py -k one_gpu: buffers of the cases' largest
# count) and the shared-GPU multi-rank tests of STEP=one_gpu; by shape, not from recorded specs,
# which a layout change makes stale
one_gpu_test_builds() {
  pc --shape $SMALL --format fp8-block --ep-size 1 --max-tokens-per-rank 256  # test_topk_ids_int32_and_int64
  for s in $SMALL $QWEN3 $V4 $DSV3_64E; do
    for f in fp8-block bf16; do pc --shape $s --format $f --ep-size 1 --max-tokens-per-rank 4096; done
  done
  for t in 32 64 128; do
    for s in $SMALL $V4 $QWEN3; do VLLM_MEGAMOE_SM90_TOKEN_TILE=$t pc --shape $s --format fp8-block --ep-size 1 --max-tokens-per-rank 4096; done
    for s in $SMALL $V4; do
      VLLM_MEGAMOE_SM90_MAINLOOP=tma VLLM_MEGAMOE_SM90_TOKEN_TILE=$t pc --shape $s --format bf16 --ep-size 1 --max-tokens-per-rank 4096
    done
  done
}
# tests/gpu/sanitize_probe.py (memcheck and racecheck of STEP=one_gpu and STEP=candidates): its cases'
# buffers hold 40, 200 and 300 tokens
sanitize_probe_builds() {
  for f in fp8-block bf16; do
    pc --shape $SMALL --format $f --ep-size 1 --max-tokens-per-rank 40
    VLLM_MEGAMOE_SM90_TOKEN_TILE=64 pc --shape $SMALL --format $f --ep-size 1 --max-tokens-per-rank 200
    VLLM_MEGAMOE_SM90_TOKEN_TILE=128 pc --shape $SMALL --format $f --ep-size 1 --max-tokens-per-rank 300
    VLLM_MEGAMOE_SM90_TOKEN_TILE=128 VLLM_MEGAMOE_SM90_EPILOGUE_WARPGROUP_128=1 \
      pc --shape $SMALL --format $f --ep-size 1 --max-tokens-per-rank 300
  done
}
case "${PLAN:-ep2}" in
  ep2)
    # tests/gpu/test_sm90_mega_moe.py on 2 ranks (mega_cases.SHAPES; buffers of the cases' largest count)
    for s in $SMALL $QWEN3 $V4 $DSV3_64E; do
      for f in fp8-block bf16; do pc --shape $s --format $f --ep-size 2 --max-tokens-per-rank 4096; done
    done
    VLLM_MEGAMOE_SM90_TOKEN_TILE=64 pc --shape $V4 --format fp8-block --ep-size 2 --max-tokens-per-rank 4096
    multi_rank_extras fp8-block bf16
    # STEP=decode, STEP=nvl_stores, then STEP=bench (buffers of 8192 tokens per rank)
    probe --gpus 2 --shapes v4-flash deepseek-v3 qwen3-30b-a3b --tokens 1 8 --variants default stages=5,tile=32 trace=1,trace_task=0
    probe --gpus 2 --shapes v4-flash deepseek-v3 qwen3-30b-a3b --tokens 1024 8192 --variants default ablate=stores
    for s in $V4 $DSV3 $QWEN3; do
      for f in fp8-block bf16; do pc --shape $s --format $f --ep-size 2 --max-tokens-per-rank 8192; done
    done ;;
  ep1)
    one_gpu_test_builds
    sanitize_probe_builds
    pc --shape $SMALL --format fp8-block --ep-size 2 --max-tokens-per-rank 4096
    multi_rank_extras fp8-block
    probe --gpus 1 --format fp8-block --shapes qwen3-30b-a3b --tokens 2048 8192 \
      --variants default stages=3 epilogue_wg128=1 epilogue_wg128=1,ablate=epilogue ablate=epilogue
    probe --gpus 1 --shapes v4-flash deepseek-v3 qwen3-30b-a3b --tokens 1024 8192 --variants default ablate=task_scales
    # STEP=ep1_lookup: its probe, then the EP1 benchmark (buffers of 8192 tokens per rank)
    probe --gpus 1 --format fp8-block --shapes v4-flash deepseek-v3 --tokens 768 1024 1536 --variants default stages=4,tile=32
    for s in $V4 $DSV3 $QWEN3; do
      for f in fp8-block bf16; do pc --shape $s --format $f --ep-size 1 --max-tokens-per-rank 8192; done
    done ;;
  cand)
    # STEP=candidates: each candidate tree's one-GPU test and sanitizer probe builds (this tree's tests
    # do not run in that step), then the A/B's builds (VARIANTS name the trees: csrc=.probe_cand/NAME/csrc)
    ls -d .probe_cand/*/csrc > /dev/null || { echo "no candidate trees: run scripts/candidate_trees.sh first"; exit 2; }
    for tree in .probe_cand/*/csrc; do
      export VLLM_MEGAMOE_CSRC_DIR="$PWD/$tree"; one_gpu_test_builds; sanitize_probe_builds; unset VLLM_MEGAMOE_CSRC_DIR
    done
    for fmt in ${FORMATS:-fp8-block bf16}; do
      tokens="${TOKENS:-1024 2048 8192}"; [ "$fmt" = bf16 ] && tokens="${BF16_TOKENS:-8192}"
      probe --gpus 1 --format $fmt --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} --tokens $tokens \
        --variants ${VARIANTS:-default $(for t in .probe_cand/*/csrc; do printf 'csrc=%s ' "$t"; done)}
    done ;;
  *) echo "unknown PLAN=${PLAN}: ep2, ep1 or cand"; exit 2 ;;
esac
du -sh "$VLLM_MEGAMOE_CACHE_DIR"
# `run` carries 64 MiB in all (.whl's wheels are 7 of them): a plan's cache that grew over several
# source versions is emptied and filled again
size_mb=$(du -sm "$VLLM_MEGAMOE_CACHE_DIR" | cut -f1)
if [ "$size_mb" -gt 50 ]; then
  echo "warning: $VLLM_MEGAMOE_CACHE_DIR holds ${size_mb} MB, near the 64 MiB a device call carries;" \
       "rm -rf it and run this PLAN again"
fi
