#!/usr/bin/env bash
# Inputs of the SM90 tuning table, in one call (~7 min): per-phase times of the table's builds next to
# forced token tiles and 5 stages (benchmarks/kernel_probe.py), for the three standard shapes, on as
# many GPUs as GPUS says (default 1; GPUS=2 on a two-GPU machine). Then, on this machine:
#     python -m benchmarks.tune_sm90 probe_v4.json probe_shapes.json   # -> configs/sm90_mega_moe.yaml
# Results in $OUT. VARIANTS replaces the compared builds (kernel_probe --variants).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
export VLLM_MEGAMOE_CACHE_DIR="${VLLM_MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit}"
T0=$(date +%s); left() { echo $(( 540 - ($(date +%s) - T0) )); }
timeout 250 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-1} --shapes v4-flash --tokens 1 8 128 512 1024 8192 \
  --variants ${VARIANTS:-default tile=32 tile=64 stages=5,tile=32} --out "$OUT/probe_v4.json" 2>&1 | tail -26
[ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 -m benchmarks.kernel_probe --gpus ${GPUS:-1} \
  --shapes qwen3-30b-a3b deepseek-v3 --tokens 1 8 128 1024 8192 --variants ${VARIANTS:-default tile=32 tile=64} \
  --out "$OUT/probe_shapes.json" 2>&1 | tail -21
