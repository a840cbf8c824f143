#!/usr/bin/env bash
# One device call (2 H200s, about 4-5 minutes, under 10 by construction): carried wheels, ceilings, then the
# benchmark of the three standard shapes (FP8, uniform + skewed routing, trimmed token list);
# results to $OUT: bench_ep2.json, bench_ep2_latency.png, bench_ep2_roofline.png, bench.log, env.txt,
# clocks.csv (SM and memory clocks, power and temperature per second).
# Usage on the device machine, from the repository root:
#     MEGAMOE_COMMIT=<sha> bash scripts/device_bench.sh          (carry: .whl for the SGLang baseline)
# Write the sha out, from this machine: on the device, `git rev-parse HEAD` gave the session's base
# commit, not the commit of the tree that travelled.
# Knobs (environment): GPUS, SHAPES, TOKENS, FORMATS, ITERS, SHAPE_TIMEOUT (s per shape), SHAPE_BUDGET.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/megamoe_bench.XXXXXX)"
GPUS="${GPUS:-2}"
SHAPES="${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b}"
TOKENS="${TOKENS:-1 8 128 1024 8192}"
ITERS="${ITERS:-10}"
FORMATS="${FORMATS:-fp8-block}"                 # e.g. "fp8-block bf16" (BF16 has no SGLang baseline)
SHAPE_TIMEOUT="${SHAPE_TIMEOUT:-130}"          # hard limit per shape (shell timeout)
SHAPE_BUDGET="${SHAPE_BUDGET:-75}"             # after this the ranks start no new case
RANKS_TIMEOUT=$((SHAPE_TIMEOUT - 20))           # the launcher kills the ranks before the shell does
DEADLINE="${DEADLINE:-500}"                     # no shape starts that could end after this (s)
NAME="bench_ep${GPUS}"
exec > >(tee -a "$OUT/bench.log") 2>&1
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

stamp "environment"
{
  nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>/dev/null || echo "matplotlib missing: no plots"
  echo "commit ${MEGAMOE_COMMIT:-unset}"
} 2>&1 | tee "$OUT/env.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
  stamp "installing carried wheels: $(ls .whl)"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    timeout 60 python3 -c "import deep_gemm as d; print('deep_gemm', d.__version__, 'fp8_mega_moe' in dir(d))" 2>&1 | tail -3 \
      | tee -a "$OUT/env.txt" || echo "deep_gemm does not import: the SGLang baseline will be skipped"
  else
    echo "wheel install failed: the SGLang baseline will be skipped"
  fi
else
  echo "no .whl/ carried: the SGLang baseline will be skipped"
fi

# The SM clock, power and temperature every second through the run: two machine leases ran
# the same prefill cases up to ~10 % apart (the SM clock drops to ~1.5 GHz under FP8 prefill,
# docs/kernel_design.md), and this says which lease was throttled when.
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -l 1 \
  > "$OUT/clocks.csv" 2>/dev/null &
CLOCKS_PID=$!
trap 'kill $CLOCKS_PID 2>/dev/null' EXIT

stamp "ceilings"
CEIL="$WORK/ceilings.json"
timeout -k 10 90 python3 -m benchmarks.ceilings --gpus "$GPUS" --out "$CEIL" --timeout 75
[ -s "$CEIL" ] || { echo "ceilings not measured: using the H200 anchors"; CEIL=anchors; }

for shape in $SHAPES; do
  if [ $(( $(date +%s) - T0 + SHAPE_TIMEOUT )) -gt "$DEADLINE" ]; then
    stamp "skipping $shape: it could end after the ${DEADLINE} s deadline"; continue
  fi
  stamp "bench $shape"
  # shellcheck disable=SC2086
  timeout -k 10 "$SHAPE_TIMEOUT" python3 -m benchmarks.bench --gpus "$GPUS" --shapes "$shape" \
    --formats $FORMATS --routings uniform skewed --tokens $TOKENS --iters "$ITERS" --warmup 2 \
    --profile-calls 2 --ceilings "$CEIL" --budget "$SHAPE_BUDGET" --timeout "$RANKS_TIMEOUT" \
    --pg-timeout 120 --records-dir "$WORK/records_$shape" --out "$WORK/$NAME.$shape.json" --no-plots
  echo "exit $?"
  if [ ! -s "$WORK/$NAME.$shape.json" ] && [ -d "$WORK/records_$shape" ]; then
    echo "rebuilding $shape from its raw records"
    timeout 30 python3 -m benchmarks.bench --from-records "$WORK/records_$shape" --gpus "$GPUS" \
      --ceilings "$CEIL" --out "$WORK/$NAME.$shape.json" --no-plots | tail -3
  fi
done

stamp "merge, table and plots"
timeout 45 python3 -m benchmarks.bench --merge "$WORK"/$NAME.*.json --ceilings "$CEIL" \
  --out "$OUT/$NAME.json" --plots-dir "$OUT"
if [ -s "$OUT/$NAME.json" ]; then
  stamp "compared with the first recorded run (B/A; A = portable vs chain, iters 20)"
  timeout 30 python3 -m benchmarks.bench --compare benchmarks/results/portable_ep2.json "$OUT/$NAME.json" | tail -25
else
  echo "merge failed: copying the per-shape files"
  cp "$WORK"/$NAME.*.json "$OUT"/ 2>/dev/null
  [ -f "$CEIL" ] && cp "$CEIL" "$OUT"/
fi
kill $CLOCKS_PID 2>/dev/null
stamp "done; files in $OUT:"
ls -la "$OUT"
