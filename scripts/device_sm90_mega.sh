#!/usr/bin/env bash
# One device call (2 H200s): the fused SM90 mega kernel's tests, the portable path's GPU tests,
# compute-sanitizer on a small case, then the portable benchmark. Logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
OUT="${OUT:-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader
timeout 1200 python3 -m pytest -x -q -rs -p no:cacheprovider ${MEGA_TESTS:-tests/gpu/test_sm90_mega_moe.py} 2>&1 | tee "$OUT/pytest_mega.log"
if [ "${RUN_SANITIZER:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_probe.py 2>&1 | tail -8 | tee "$OUT/sanitizer_$tool.log"
  done
fi
if [ -n "${EXTRA_TESTS:-}" ]; then
  timeout 900 python3 -m pytest -q -rs -p no:cacheprovider $EXTRA_TESTS 2>&1 | tail -30 | tee "$OUT/pytest_extra.log"
fi
