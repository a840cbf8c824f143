#!/usr/bin/env bash
# One device call (2 H200s): the fused SM90 mega kernel's tests, a first timing table (kernel vs
# portable vs unfused chain), then compute-sanitizer on a small case. Logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
OUT="${OUT:-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader
timeout 330 python3 -m pytest -x -q -rs -p no:cacheprovider ${MEGA_TESTS:-tests/gpu/test_sm90_mega_moe.py} 2>&1 | tee "$OUT/pytest_mega.log" | tail -25
if [ "${RUN_TIMING:-1}" = 1 ]; then
  timeout 180 python3 -m benchmarks.first_kernel_timing --gpus 2 --out "$OUT/first_kernel_ep2.json" 2>&1 | tail -14 | tee "$OUT/timing.log"
fi
if [ "${RUN_SANITIZER:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_probe.py 2>&1 | tail -6 | tee "$OUT/sanitizer_$tool.log"
  done
fi
