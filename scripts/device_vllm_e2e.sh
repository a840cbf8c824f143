#!/usr/bin/env bash
# Real vLLM on one GPU machine: install it from the parts of scripts/vllm_gpu_pack.py, run the
# end-to-end tests (tests/gpu/test_vllm_e2e.py) and the end-to-end benchmark (benchmarks/vllm_e2e.py).
# One warm machine, consecutive calls (what a call writes outside the tree stays while it is held):
#   STEP=stash PART=1     carry [".vllm_gpu/part1"]: keep part 1; start drawing the test models on
#                         the GPU in the background (/tmp/megamoe-e2e/models, ~1 min)
#   STEP=stash PART=2     carry [".vllm_gpu/part2"]
#   STEP=install PART=3   carry [".vllm_gpu/part3", ".probe_jit/e2e"]: the last part, assemble, check
#                         `import vllm` and the plugin's entry point; wait for the models
#   STEP=test             the end-to-end tests, four groups in parallel (each engine takes
#                         MEGAMOE_E2E_GPU_MEM of the GPU); logs in $OUT
#   STEP=bench            the benchmark: BF16 then FP8 (MEGAMOE_COMMIT=<sha> names the tree's commit)
# Every step ends well inside a call's 600 s; results and logs are written under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
WORK=/tmp/megamoe-e2e; MODELS=$WORK/models; mkdir -p "$WORK"
export MEGAMOE_E2E_MODELS=$MODELS VLLM_MEGAMOE_CACHE_DIR=$WORK/jit
[ -d .probe_jit/e2e ] && mkdir -p "$VLLM_MEGAMOE_CACHE_DIR" && cp -n .probe_jit/e2e/* "$VLLM_MEGAMOE_CACHE_DIR"/ 2>/dev/null

draw_models() {  # the models of tests/gpu/test_vllm_e2e.py's fixture, drawn once
  local gen="python3 -m vllm_megamoe.e2e_models"
  $gen $MODELS/qwen3 --preset qwen3-30b-a3b-like --device cuda &&
  $gen $MODELS/qwen3_fp8 --preset qwen3-30b-a3b-like --experts fp8-block --device cuda &&
  $gen $MODELS/qwen3_swapped --preset qwen3-30b-a3b-like --swap-experts --device cuda &&
  $gen $MODELS/qwen3_seed1 --preset qwen3-30b-a3b-like --seed 1 --device cuda &&
  $gen $MODELS/deepseek --preset deepseek-v3-like --device cuda
}

case "${STEP:-}" in
  stash)
    python3 scripts/vllm_gpu_install.py stash ".vllm_gpu/part${PART:?PART=N}" || exit 1
    if [ "${PART}" = 1 ] && [ ! -e $WORK/models.started ]; then
      touch $WORK/models.started
      setsid nohup bash -c "$(declare -f draw_models); MODELS=$MODELS; draw_models > $WORK/models.log 2>&1; echo \$? > $WORK/models.rc" \
        > /dev/null 2>&1 < /dev/null &
      echo "drawing the test models in the background ($WORK/models.log)"
    fi ;;
  install)
    python3 scripts/vllm_gpu_install.py stash ".vllm_gpu/part${PART:?PART=N}" || exit 1
    python3 scripts/vllm_gpu_install.py assemble 2>&1 | tee "$OUT/install.log" || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/install.log"
    for _ in $(seq 120); do [ -e $WORK/models.rc ] && break; sleep 2; done
    echo "models: rc=$(cat $WORK/models.rc 2>/dev/null || echo 'still running')"; tail -3 $WORK/models.log
    du -sh $MODELS/* 2>/dev/null ;;
  test)
    source /tmp/megamoe-vllm/env.sh
    [ -e $WORK/models.rc ] || { draw_models > $WORK/models.log 2>&1 || { tail $WORK/models.log; exit 1; }; }
    export MEGAMOE_E2E_GPU_MEM="${MEGAMOE_E2E_GPU_MEM:-0.2}"
    T="-v -s -rs -p no:cacheprovider --tb=short tests/gpu/test_vllm_e2e.py"
    # ~5 engine starts each; they share test_vllm_e2e.py's runs only within one process
    groups=("bf16" "fp8 or bounds" "deepseek or serve" "reload or sleep")
    i=0; pids=()
    for k in "${groups[@]}"; do
      i=$((i + 1))
      timeout "${TEST_TIMEOUT:-560}" python3 -m pytest $T -k "$k" > "$OUT/e2e_group$i.log" 2>&1 &
      pids+=($!)
      sleep 5  # let the first engine's start-up lead
    done
    for p in "${pids[@]}"; do wait "$p"; done
    grep -h -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|teacher-forced|greedy \(|swapped|sleep mode|reload vs" "$OUT"/e2e_group*.log ;;
  bench)
    source /tmp/megamoe-vllm/env.sh
    commit="${MEGAMOE_COMMIT:-$(git rev-parse --short HEAD)}"
    gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
    out="$OUT/vllm_e2e_$gpu.json"
    python3 -m benchmarks.vllm_e2e $MODELS/qwen3 --commit "$commit" --out "$out" --log-dir $WORK/bench_logs \
      --backends ${BF16_BACKENDS:-default megamoe} --deadline-s "${BF16_DEADLINE:-230}" 2>&1 | tail -20
    python3 -m benchmarks.vllm_e2e $MODELS/qwen3_fp8 --commit "$commit" --out "$out" --log-dir $WORK/bench_logs \
      --backends ${FP8_BACKENDS:-default megamoe deep_gemm} --deadline-s "${FP8_DEADLINE:-310}" 2>&1 | tail -20
    python3 -m benchmarks.vllm_e2e --table "$out"
    tar czf "$OUT/bench_logs.tgz" -C $WORK bench_logs 2>/dev/null ;;
  *) echo "STEP= stash | install | test | bench (see the header of $0)"; exit 2 ;;
esac
