#!/usr/bin/env bash
# One device call for the SM90 grouped FP8 GEMM: environment, GPU tests, SASS check, timing.
# Usage on the device machine (repo root): bash scripts/device_sm90_gemm.sh   (logs under $OUT)
set -o pipefail
OUT=${OUT:-/tmp/megamoe_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export VLLM_MEGAMOE_CACHE_DIR=${VLLM_MEGAMOE_CACHE_DIR:-/tmp/megamoe_jit}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  echo "== environment"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'cuda-bindings', m.version('cuda-bindings'), 'nvrtc-wheel', m.version('nvidia-cuda-nvrtc'))"
} 2>&1 | tee "$OUT/env.log"

echo "== GPU tests" | tee "$OUT/tests.log"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE -s -p no:cacheprovider tests/gpu/test_sm90_gemm.py tests/test_kernel_compile.py 2>&1 | tee -a "$OUT/tests.log"
echo "pytest exit: $?" | tee -a "$OUT/tests.log"

echo "== SASS of the compiled kernels" | tee "$OUT/sass.log"
for cubin in "$VLLM_MEGAMOE_CACHE_DIR"/*.cubin; do
  [ -f "$cubin" ] || continue
  echo "-- $(basename "$cubin"): $(cuobjdump --dump-sass "$cubin" 2>/dev/null | grep -oE 'QGMMA\.[0-9x]+|HGMMA\.[0-9x]+|LDL|STL|UTMALDG\.[0-9]D' | sort | uniq -c | tr '\n' ' ')"
done 2>&1 | tee -a "$OUT/sass.log"
grep -h "registers\|spill" "$VLLM_MEGAMOE_CACHE_DIR"/*.log 2>/dev/null | sort | uniq -c | tee -a "$OUT/sass.log"

echo "== timing" | tee "$OUT/bench.log"
timeout ${BENCH_TIMEOUT:-200} python3 - <<'PY' 2>&1 | tee -a "$OUT/bench.log"
import statistics, sys, torch
sys.path.insert(0, ".")
from tests.gpu.test_sm90_gemm import make_problem
from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_bf16, grouped_gemm_fp8_block

HBM = 4.2e12      # measured device-to-device copy bandwidth on H200 (anchors.md)
FP8_PEAK = 1339e12  # measured FP8 _scaled_mm 8192^3
BF16_PEAK = 767e12  # measured BF16 matmul 8192^3

def timed(fn, reps=10, batches=5):
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)

def counts_for(rows, experts, seed):
    gen = torch.Generator().manual_seed(seed)
    hits = torch.randint(0, experts, (rows,), generator=gen)
    return torch.bincount(hits, minlength=experts).tolist()

cases = [  # name, N, K, experts, rows, configs (block tokens, consumer warpgroups, flavour)
    ("v4flash-L1 decode 48 rows/42 exp", 4096, 4096, 42, 48, [(8, 2, "fp8"), (16, 2, "fp8"), (8, 1, "fp8"), (8, 2, "bf16")]),
    ("v4flash-L1 787 rows/128 exp", 4096, 4096, 128, 787, [(8, 2, "fp8"), (16, 2, "fp8")]),
    ("v4flash-L1 24576 rows/128 exp", 4096, 4096, 128, 24576, [(192, 2, "fp8"), (128, 2, "fp8"), (96, 2, "fp8"), (192, 2, "bf16"), (128, 2, "bf16")]),
    ("v4flash-L2 24576 rows/128 exp", 4096, 2048, 128, 24576, [(192, 2, "fp8"), (128, 2, "fp8")]),
    ("qwen3-L1 1039 rows/64 exp", 1536, 2048, 64, 1039, [(16, 2, "fp8"), (32, 2, "fp8")]),
]
rows_out = []
for name, n, k, experts, rows, configs in cases:
    counts = counts_for(rows, experts, 0)
    x_q, x_s, w_q, w_s, offsets = make_problem(counts, n=n, k=k, seed=11)
    touched = sum(1 for c in counts if c)
    weight_bytes = touched * n * k
    flops = 2 * rows * n * k
    floor_us = max(weight_bytes / HBM, flops / FP8_PEAK) * 1e6
    floor_bf16_us = max(2 * weight_bytes / HBM, flops / BF16_PEAK) * 1e6
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    x_bf = (x_q.float() * x_s.repeat_interleave(128, 1)).bfloat16()
    w_bf = w_q.to(torch.bfloat16)
    for tokens, wg, flavour in configs:
        if flavour == "fp8":
            fn = lambda: grouped_gemm_fp8_block(x_q, x_s, w_q, w_s, offsets, out, block_n_tokens=tokens, num_consumer_wg=wg)
        else:
            fn = lambda: grouped_gemm_bf16(x_bf, w_bf, offsets, out, block_n_tokens=tokens, num_consumer_wg=wg)
        t = timed(fn)
        rows_out.append((name, f"{flavour} T{tokens}/WG{wg}", t, floor_us if flavour == "fp8" else floor_bf16_us, flops / t / 1e6))
    # torch bf16 grouped mm on the same routing (2x the weight bytes), when the build has it.
    try:
        ends = offsets[1:].contiguous()
        t = timed(lambda: torch._grouped_mm(x_bf, w_bf.transpose(1, 2), offs=ends))
        rows_out.append((name, "torch bf16 _grouped_mm", t, floor_bf16_us, flops / t / 1e6))
    except Exception as exc:  # noqa: BLE001
        rows_out.append((name, f"torch bf16 failed: {type(exc).__name__}", float('nan'), floor_bf16_us, float('nan')))
    del x_q, x_s, w_q, w_s, x_bf, w_bf
    torch.cuda.empty_cache()

print(f"{'case':36s} {'config':24s} {'median us':>10s} {'floor us':>9s} {'floor/t':>8s} {'TFLOPS':>8s}")
for name, cfg, t, floor_us, tflops in rows_out:
    print(f"{name:36s} {cfg:24s} {t:10.1f} {floor_us:9.1f} {floor_us / t:8.2f} {tflops:8.1f}")
PY
echo "bench exit: $?" | tee -a "$OUT/bench.log"
