#!/usr/bin/env bash
# The kernel's checks on a GPU machine, in one call (~6-9 min): every SM90 kernel test of the default
# builds, the multi-rank tests (on as many GPUs as the machine has; on one GPU as ranks sharing it,
# which checks the protocol, not NVLink), the portable path's GPU tests, then compute-sanitizer
# memcheck and racecheck on a small case. Logs in $OUT; the last lines of each part are printed.
#     bash scripts/device_verify.sh
# Carry .probe_jit/verify, filled without a GPU by `PLAN=verify bash scripts/precompile_for_device.sh`,
# so the call runs the builds instead of compiling them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
[ -d .probe_jit/verify ] && export VLLM_MEGAMOE_CACHE_DIR="${VLLM_MEGAMOE_CACHE_DIR:-$PWD/.probe_jit/verify}"
export VLLM_MEGAMOE_CACHE_DIR="${VLLM_MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit}"
T="-q -rs -p no:cacheprovider --tb=short"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"

timeout 300 python3 -m pytest $T -o timeout=200 tests/gpu/test_sm90_mega_moe.py -k one_gpu > "$OUT/kernel_one_gpu.log" 2>&1
tail -2 "$OUT/kernel_one_gpu.log"
if [ "$gpus" -ge 2 ]; then
  timeout 300 python3 -m pytest $T -o timeout=200 tests/gpu/test_sm90_mega_moe.py -k "not one_gpu" > "$OUT/kernel_multi_gpu.log" 2>&1
else  # ranks time-slice one GPU: a short kernel timeout keeps a stuck wait short
  MEGAMOE_SHARED_GPU=1 VLLM_MEGAMOE_TIMEOUT_S=20 timeout 200 python3 -m pytest $T -o timeout=140 \
    tests/gpu/test_sm90_mega_moe.py -k "not one_gpu" > "$OUT/kernel_multi_gpu.log" 2>&1
fi
tail -2 "$OUT/kernel_multi_gpu.log"
timeout 150 python3 -m pytest $T tests/test_portable_gpu.py tests/test_portable_gemm_gpu.py tests/test_reference.py \
  > "$OUT/portable_gpu.log" 2>&1
tail -2 "$OUT/portable_gpu.log"
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --report-api-errors no --print-limit 20 \
    python3 tests/gpu/sanitize_probe.py > "$OUT/$tool.log" 2>&1
  tail -3 "$OUT/$tool.log"
done
