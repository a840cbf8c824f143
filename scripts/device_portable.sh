#!/usr/bin/env bash
# One device call (2 GPUs): GPU tests of the portable path, then its benchmark against the chain.
# Usage on the device machine: bash scripts/device_portable.sh   (writes logs and JSON to $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
timeout 900 python3 -m pytest -q -rs -p no:cacheprovider tests/test_portable_gpu.py tests/test_portable.py 2>&1 | tee "$OUT/pytest_portable.log"
timeout 900 python3 -m benchmarks.bench_portable --gpus 2 --out "$OUT/portable_ep2.json" 2>&1 | tee "$OUT/bench_portable.log"
