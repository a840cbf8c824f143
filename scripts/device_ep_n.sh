#!/usr/bin/env bash
# EP4 / EP8 validation and benchmark on a machine with N NVLinked H200s (issue 10), one call each:
#     N=8 PART=tests bash scripts/device_ep_n.sh    # kernel + portable tests on N ranks
#     N=8 PART=bench bash scripts/device_ep_n.sh    # benchmark: 3 standard shapes + V4-Flash/V4-Pro
# (carry .whl for the SGLang baseline). Results and logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
N="${N:?set N to the number of GPUs (4 or 8)}"
OUT="${OUT:-out}"; mkdir -p "$OUT"
have=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$have" -ge "$N" ] || { echo "this machine has $have GPUs, N=$N"; exit 2; }
case "${PART:-tests}" in
  tests)
    MEGAMOE_GPU_RANKS="$N" timeout 580 python3 -m pytest -q -rs -p no:cacheprovider -o timeout=240 \
      tests/gpu/test_sm90_mega_moe.py -k "multi_gpu or missing_peer" 2>&1 | tee "$OUT/pytest_ep$N.log" | tail -30
    ;;
  bench)
    # V4-Flash is the v4-flash standard shape; V4-Pro is 7168 x 3072, 384 experts, top-6.
    GPUS="$N" SHAPES="${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b 7168x3072x384x6}" TOKENS="${TOKENS:-8 128 1024 8192}" \
      DEADLINE="${DEADLINE:-540}" bash scripts/device_bench.sh
    ;;
  *) echo "PART must be tests or bench"; exit 2 ;;
esac
