#!/usr/bin/env bash
# The next device session's first calls (2 H200s): what this session could not finish.
#   STEP=tests   the fused kernel's full test file (its mainloop code was refactored since it ran)
#   STEP=graph   the CUDA-graph BF16 failure and the timeout probe, with full output
#   STEP=smem    the cp.async shared-memory mainloop: kernel tests + timing next to the ldg one
#   STEP=first    graph, then the full tests, then memcheck (one call)
#   STEP=kernel   every fused-kernel test in one pytest process
#   STEP=final    kernel tests + kernel_probe phases/variants + the standard benchmark
#   STEP=memcheck compute-sanitizer memcheck without host API noise
# Usage: STEP=graph bash scripts/device_next_session.sh   (results in $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
OUT="${OUT:-out}"; mkdir -p "$OUT"
T="-q -rs -p no:cacheprovider -o timeout=150"
case "${STEP:-tests}" in
  tests)
    timeout 560 python3 -m pytest $T tests/gpu/test_sm90_mega_moe.py tests/test_portable_gemm_gpu.py 2>&1 \
      | tee "$OUT/tests.log" | tail -40 ;;
  graph)
    timeout 400 python3 -m pytest $T tests/gpu/test_sm90_mega_moe.py -k "cuda_graph or missing_peer" 2>&1 | tee "$OUT/graph.log" | tail -40 ;;
  smem)
    VLLM_MEGAMOE_SM90_MAINLOOP=smem timeout 330 python3 -m pytest -x $T tests/gpu/test_sm90_mega_moe.py \
      -k "one_gpu or (multi_gpu and (qwen3 or v4))" 2>&1 | tee "$OUT/smem_tests.log" | tail -20
    for m in ldg smem; do
      VLLM_MEGAMOE_SM90_MAINLOOP=$m timeout 120 python3 -m benchmarks.first_kernel_timing --gpus 2 --tokens 8 128 --shapes v4-flash qwen3-30b-a3b \
        --out "$OUT/timing_$m.json" 2>&1 | tail -8
    done ;;
  first)   # graph + full tests + memcheck in one call (under 10 minutes)
    timeout 170 python3 -m pytest $T -v tests/gpu/test_sm90_mega_moe.py -k "cuda_graph or missing_peer" 2>&1 > "$OUT/graph.log"
    tail -30 "$OUT/graph.log"
    timeout 300 python3 -m pytest $T --durations=0 tests/gpu/test_sm90_mega_moe.py tests/test_portable_gemm_gpu.py \
      -k "not cuda_graph and not missing_peer" 2>&1 > "$OUT/tests.log"
    tail -40 "$OUT/tests.log"
    timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
      python3 tests/gpu/sanitize_probe.py > "$OUT/memcheck.log" 2>&1
    tail -15 "$OUT/memcheck.log" ;;
  second)  # the timeout probe, the V4 multi-GPU cases without the 150 s limit, ldg vs smem timing
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_sm90_mega_moe.py -k missing_peer 2>&1 > "$OUT/probe.log"
    tail -5 "$OUT/probe.log"
    timeout 260 python3 -m pytest -q -rs -p no:cacheprovider --tb=short --durations=0 tests/gpu/test_sm90_mega_moe.py \
      -k "multi_gpu and v4" 2>&1 > "$OUT/v4_multi.log"
    tail -30 "$OUT/v4_multi.log"
    for m in ldg smem; do
      VLLM_MEGAMOE_SM90_MAINLOOP=$m timeout 100 python3 -m benchmarks.first_kernel_timing --gpus 2 --tokens 8 128 --shapes v4-flash qwen3-30b-a3b \
        --out "$OUT/timing_$m.json" 2>&1 | tail -8
    done ;;
  kernel)   # every test of the fused kernel, one pytest process (under 6 minutes)
    timeout 330 python3 -m pytest -q -rs -p no:cacheprovider --tb=short -o timeout=200 --durations=5 \
      tests/gpu/test_sm90_mega_moe.py 2>&1 > "$OUT/kernel_tests.log"
    tail -40 "$OUT/kernel_tests.log" ;;
  wgmma)    # quick look at the wgmma mainloop: one-GPU tests of two shapes, then its timing next to smem
    VLLM_MEGAMOE_SM90_MAINLOOP=wgmma timeout 100 python3 -m pytest -q -rs -p no:cacheprovider --tb=short -o timeout=90 \
      tests/gpu/test_sm90_mega_moe.py -k "one_gpu and (qwen3 or v4)" 2>&1 > "$OUT/wgmma_tests.log"
    tail -25 "$OUT/wgmma_tests.log"
    timeout 90 python3 -m benchmarks.kernel_probe --gpus 2 --shapes v4-flash --tokens 8 128 1024 8192 --variants \
      default mainloop=wgmma mainloop=wgmma,stages=5 --out "$OUT/probe_v4.json" 2>&1 | tail -16 ;;
  final)    # kernel tests (default, then the smem fallback), phase probes (about 6-7 minutes)
    T0=$(date +%s); left() { echo $(( ${BUDGET:-380} - ($(date +%s) - T0) )); }
    timeout 230 python3 -m pytest -q -rs -p no:cacheprovider --tb=short -o timeout=200 \
      tests/gpu/test_sm90_mega_moe.py 2>&1 > "$OUT/kernel_tests.log"
    tail -4 "$OUT/kernel_tests.log"
    VLLM_MEGAMOE_SM90_MAINLOOP=smem timeout 90 python3 -m pytest -q -rs -p no:cacheprovider --tb=short -o timeout=80 \
      tests/gpu/test_sm90_mega_moe.py -k "(one_gpu and (qwen3 or v4)) or (multi_gpu and v4) or back_to_back" \
      2>&1 > "$OUT/smem_tests.log"
    tail -4 "$OUT/smem_tests.log"
    timeout 90 python3 -m benchmarks.kernel_probe --gpus 2 --shapes v4-flash --tokens 1 8 128 1024 8192 --variants \
      default mainloop=smem --out "$OUT/probe_v4.json" 2>&1 | tail -12
    [ "$(left)" -gt 40 ] && timeout $(( $(left) - 5 )) python3 -m benchmarks.kernel_probe --gpus 2 \
      --shapes qwen3-30b-a3b deepseek-v3 --tokens 1 8 128 1024 8192 --out "$OUT/probe_shapes.json" 2>&1 | tail -12
    echo "== $(left) s of the budget left"; ls "$OUT" ;;
  memcheck)
    timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
      python3 tests/gpu/sanitize_probe.py 2>&1 | tail -30 | tee "$OUT/memcheck.log" ;;
esac
