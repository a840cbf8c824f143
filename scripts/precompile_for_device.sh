#!/usr/bin/env bash
# No GPU: compile into .probe_jit/<PLAN> (or VLLM_MEGAMOE_CACHE_DIR) the SM90 builds a device script
# loads, so the device spends its minutes running them, not compiling (NVRTC here is the device's
# 13.0, and the cache keys hold only sources, defines and compiler). Carry the plan's folder
# (`run` carry [".probe_jit/verify"]); the device scripts use it when it is there.
#   PLAN=verify (default): scripts/device_verify.sh's kernel tests on one GPU and on 2 ranks, and
#                          the sanitizer probe
#   PLAN=bench:  scripts/device_bench.sh and scripts/device_tune.sh at EP1 and EP2 (8192 tokens a rank)
#   PLAN=e2e:    scripts/device_vllm_e2e.sh (the vLLM tests' and benchmark's layers)
# A build missing here is still compiled on the device at its first call: this saves time, it
# decides nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
export VLLM_MEGAMOE_CACHE_DIR="${VLLM_MEGAMOE_CACHE_DIR:-$PWD/.probe_jit/${PLAN:-verify}}"
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
      VLLM_MEGAMOE_SM90_TOKEN_TILE=$t pc --shape $s --format bf16 --ep-size 1 --max-tokens-per-rank 4096
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
    # the 128-token epilogue warpgroup is a development build (BuildOptions): the probe compiles it
    probe --gpus 1 --shapes $SMALL --format $f --tokens 300 --variants tile=128,epilogue_wg128=1
  done
}
case "${PLAN:-verify}" in
  verify)
    one_gpu_test_builds
    sanitize_probe_builds
    # tests/gpu/test_sm90_mega_moe.py on 2 ranks (mega_cases.SHAPES; buffers of the cases' largest count)
    for s in $SMALL $QWEN3 $V4 $DSV3_64E; do
      for f in fp8-block bf16; do pc --shape $s --format $f --ep-size 2 --max-tokens-per-rank 4096; done
    done
    multi_rank_extras fp8-block bf16 ;;
  bench)
    for ep in 1 2; do
      for s in $V4 $DSV3 $QWEN3; do
        for f in fp8-block bf16; do pc --shape $s --format $f --ep-size $ep --max-tokens-per-rank 8192; done
      done
    done ;;
  e2e)
    for f in bf16 fp8-block; do
      for t in 2048 16384; do pc --shape $QWEN3 --format $f --ep-size 1 --max-tokens-per-rank $t; done
    done
    pc --shape 2048x512x64x8 --format bf16 --ep-size 1 --max-tokens-per-rank 2048 ;;
  *) echo "unknown PLAN=${PLAN}: verify, bench or e2e"; exit 2 ;;
esac
du -sh "$VLLM_MEGAMOE_CACHE_DIR"
# `run` carries 64 MiB in all (.whl's wheels are 7 of them): a plan's cache that grew over several
# source versions is emptied and filled again
size_mb=$(du -sm "$VLLM_MEGAMOE_CACHE_DIR" | cut -f1)
if [ "$size_mb" -gt 50 ]; then
  echo "warning: $VLLM_MEGAMOE_CACHE_DIR holds ${size_mb} MB, near the 64 MiB a device call carries;" \
       "rm -rf it and run this PLAN again"
fi
