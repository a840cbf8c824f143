#!/usr/bin/env bash
# Device calls for the fused SM90 kernel on 2 H200s (nvidia-h200-x2), each under 10 minutes:
#   STEP=verify  every kernel test of the default builds (or of VLLM_MEGAMOE_SM90_MAINLOOP=... when
#                set), then compute-sanitizer memcheck
#                and racecheck on a small case
#   STEP=probe   per-phase times of the table's builds next to forced token tiles and 5 stages
#                (benchmarks/kernel_probe.py); feed the JSON to `python -m benchmarks.tune_sm90`
#                for configs/sm90_mega_moe.yaml
#   STEP=decode  1 and 8 tokens per rank, the three shapes: per-phase times of each rank (which rank
#                waits in a barrier, which one works) next to 5 stages and the chunk trace of each
#                CTA's first L1 task (what a K chunk waits for when a CTA runs one task), 2 GPUs
#   STEP=ep1_lookup one GPU: v38's EP1 builds (the EP2 table by rows per expert) against the former
#                heuristic's at 768-1536 tokens, then the EP1 benchmark (carry .whl and the builds:
#                PLAN=ep1 precompile, or kernel_probe --compile-only as in docs/kernel_notes.md v38)
#   STEP=bench   the standard benchmark of the three shapes in FP8 and BF16 (carry .whl for SGLang;
#                set MEGAMOE_COMMIT=<sha>)
#   STEP=portable the portable path with VLLM_MEGAMOE_PORTABLE_ACTIVATION / _REDUCE=triton: tests and timing
#   STEP=final   within BUDGET s (default 540): every kernel test of the default builds, the benchmark
#                (FP8 + BF16, 1-8192 tokens per rank with 4096, SGLang: carry .whl, set MEGAMOE_COMMIT),
#                then, if time is left, a probe of 5 TMA stages at decode and the portable path's
#                one-GPU CUDA-graph tests
#   STEP=ablate  FP8 kernel tests of a few shapes, then the default build next to its ablations
#                (kernel_probe ablate=promotion / mma) and optionally another commit's sources
#   STEP=spans   one-GPU kernel tests, then task spans (phase clock) of the three shapes, V4-Flash-like
#                ablations (tma / mma / both) and optionally another commit's sources
#   STEP=ab      kernel tests of this tree (SANITIZE=1: then memcheck and racecheck), then the same
#                kernel_probe of this tree and of other csrc trees (BASES) side by side
#   STEP=tree128 a csrc tree (TREE) at 128-token tiles against this tree: its tests, shared-GPU multi-rank,
#                graph times side by side, sanitizers (one H200)
#   STEP=epilogue_cost graph times with and without the GEMM epilogues (FORMAT, default bf16), one GPU
#   STEP=stream  the operand stream alone, with and without 2-CTA weight / token multicast
#                (benchmarks/stream_probe.py; its GPU test first), weights from HBM and from L2, one GPU
#   STEP=contig  the operand stream alone with each weight box stored whole against rows of K, at decode
#                task counts (benchmarks/stream_probe.py --layout), one GPU
#   STEP=one_gpu every check one H200 allows (nvidia-h200): the one-GPU kernel tests, the multi-rank
#                tests with 2 ranks sharing the GPU (MEGAMOE_SHARED_GPU=1: protocol only), the
#                kernel_probe A/B against BASES at EP1 (one process, variants csrc=<base>/csrc, ROUNDS
#                rounds in turn), then memcheck and racecheck, within BUDGET s (TEST_TIMEOUT: the
#                one-GPU tests' limit; NO_SANITIZE=1: no sanitizers, the probe gets their time)
#   STEP=sanitize memcheck and racecheck on the sanitize probe alone (one GPU)
#   STEP=task_scales what loading a task's FP8 scale tables at its start costs (ablate=task_scales), one GPU
#   STEP=nvl_stores the FP8 128-token L2 epilogue's 64-byte peer stores at EP2: with and without them (2 GPUs)
#   STEP=wg128   the 128-token epilogue warpgroup (VLLM_MEGAMOE_SM90_EPILOGUE_WARPGROUP_128, v31): its GPU
#                tests, racecheck of its cases, and the A/B that tells its two costs apart (one GPU)
#   STEP=candidates every candidate tree in .probe_cand/ (scripts/candidate_trees.sh: the patches in PATCHES;
#                the kept ones are in git history at 63d314b) against this tree, one GPU: one process per shape timing this tree
#                and every tree (VARIANTS, default "default csrc=<tree>/csrc ..."; outputs must match bit
#                for bit), each tree's one-GPU kernel tests, then memcheck and racecheck of each tree,
#                within BUDGET s (PARTS / CANDS pick parts and trees; carry [".probe_jit/cand",
#                ".probe_cand"], filled by PLAN=cand of precompile_for_device.sh)
#   STEP=inproc  one_gpu's one-process A/B alone (this tree and the BASES trees), one GPU
#   STEP=trace   where in a K chunk each warp spends its cycles (chunk trace builds), FP8
#   STEP=wgmma   FP8 wgmma patterns of the K loop alone on every SM (benchmarks/wgmma_probe.py), one GPU
#   STEP=rs      the register-A wgmma's GPU check (tests/gpu/test_wgmma_rs.py), then the probe's
#                register-A forms with the real fragment loader and the fused pattern with real
#                refill copies (prod+wait+copy), one GPU
#   STEP=pitch   the row-pitch experiment: per-phase times of V4-Flash-like vs 4352- / 2176-wide variants
#   STEP=ncu_mem memory sections and raw counters (DRAM / L2 bytes, hit rates) per VARIANTS, one GPU
#   STEP=ncu_src stall samples per SASS instruction (source.csv) of one launch, one GPU
#   STEP=ncu     Nsight Compute sections of one launch (one GPU; V4-Flash-like; TOKENS=64 per rank:
#                about the per-rank expert load of 8-16 tokens per rank at EP2)
# Usage: STEP=verify bash scripts/device_next_session.sh   (results in $OUT; GPUS=1: the probes at EP1 on one H200)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
# A cache filled without a GPU may be carried (VLLM_MEGAMOE_CACHE_DIR=$PWD/.probe_jit/ep2, filled by
# `PLAN=ep2 bash scripts/precompile_for_device.sh` (or ep1: .probe_jit/<PLAN>) before the
# call, carry [".probe_jit/ep2"]:
# ~75 builds the EP2 steps load, ~3 min of this machine's CPU instead of the device's; v30: with the
# cache filled the one-GPU tests took 40 s instead of 217 s). Every step also records the kernels it
# loads into $OUT/jit_specs.jsonl (`vllm-megamoe precompile FILE` compiles them again); a spec holds
# its build's defines, buffer offsets included, so the plans compile by shape instead.
export VLLM_MEGAMOE_CACHE_DIR="${VLLM_MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit}"
export VLLM_MEGAMOE_JIT_RECORD="${VLLM_MEGAMOE_JIT_RECORD:-$OUT/jit_specs.jsonl}"
T="-q -rs -p no:cacheprovider --tb=short"
# compute-sanitizer memcheck and racecheck on tests/gpu/sanitize_probe.py, each within $1 s
sanitize() {
  for tool in memcheck racecheck; do
    timeout "$1" compute-sanitizer --tool $tool --report-api-errors no --print-limit 20 \
      python3 tests/gpu/sanitize_probe.py > "$OUT/$tool.log" 2>&1
    tail -6 "$OUT/$tool.log"
  done
}
# kernel_probe at EP1 of this tree and every BASES tree in one process, in turn for ROUNDS rounds
# (a GPU drifts within a call: a build run twice can differ by more than a change does at 1-8
# tokens), within $1 s, into $OUT/$2, the last $3 lines shown
inproc_ab() {
  local ab="${VARIANTS:-default}" b
  for b in ${BASES:-}; do ab="$ab csrc=$b/csrc"; done
  timeout "$1" python3 -m benchmarks.kernel_probe --gpus 1 --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} \
    --tokens ${TOKENS:-1 8 8192} --variants $ab --rounds ${ROUNDS:-2} --out "$OUT/$2" 2>&1 | tail -"$3"
}
case "${STEP:-verify}" in
  verify)   # ~9 min: every kernel test of the default build, then memcheck and racecheck
    timeout 370 python3 -m pytest $T -o timeout=200 tests/gpu/test_sm90_mega_moe.py 2>&1 > "$OUT/kernel_tests.log"
    tail -4 "$OUT/kernel_tests.log"
    sanitize 140
    # optional: PROBE_VARIANTS at PROBE_TOKENS tokens per rank of V4-Flash (e.g. sms=66 against the default)
    [ -n "${PROBE_VARIANTS:-}" ] && timeout 170 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes v4-flash \
      --tokens ${PROBE_TOKENS:-8192} --variants $PROBE_VARIANTS --out "$OUT/probe_verify.json" 2>&1 | tail -8 ;;
  probe)    # ~7 min: per-phase probes of the table's builds next to forced token tiles and 5 stages
    T0=$(date +%s); left() { echo $(( 540 - ($(date +%s) - T0) )); }
    timeout 250 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes v4-flash --tokens 1 8 128 512 1024 8192 \
      --variants ${VARIANTS:-default tile=32 tile=64 stages=5,tile=32} --out "$OUT/probe_v4.json" 2>&1 | tail -26
    [ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} \
      --shapes qwen3-30b-a3b deepseek-v3 --tokens 1 8 128 1024 8192 --variants ${VARIANTS:-default tile=32 tile=64} \
      --out "$OUT/probe_shapes.json" 2>&1 | tail -21 ;;
  decode)   # ~3 min: where a handful of tokens per rank spends its time, per rank (kernel_probe per_rank)
    timeout 240 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} \
      --tokens ${TOKENS:-1 8} --variants ${VARIANTS:-default stages=5,tile=32 trace=1,trace_task=0} --out "$OUT/probe_decode.json" 2>&1 | tail -50 ;;
  ep1_lookup) # ~4 min, one GPU: v38's EP1 builds (the EP2 table read by rows per expert) against the
            # heuristic's (4-stage 32-token tiles below 48 rows per expert), then the EP1 benchmark
    timeout 120 python3 -m benchmarks.kernel_probe --gpus 1 --format fp8-block --shapes v4-flash deepseek-v3 \
      --tokens 768 1024 1536 --variants default stages=4,tile=32 --rounds 3 --out "$OUT/probe_ep1_lookup.json" 2>&1 | tail -14
    GPUS=1 FORMATS="fp8-block bf16" TOKENS="1 8 128 1024 8192" SHAPE_TIMEOUT=110 SHAPE_BUDGET=80 DEADLINE=330 \
      bash scripts/device_bench.sh > /dev/null 2>&1
    grep -E "^== " "$OUT/bench.log" ;;
  bench)
    FORMATS="fp8-block bf16" TOKENS="1 8 128 1024 8192" SHAPE_TIMEOUT=170 SHAPE_BUDGET=120 DEADLINE=560 \
      bash scripts/device_bench.sh > /dev/null 2>&1
    grep -E "^== " "$OUT/bench.log" ;;
  portable) # the portable path's Triton activation and reduce: their GPU tests, then portable vs chain
            # with both off / on
    timeout 150 python3 -m pytest $T tests/test_portable_gpu.py -k "triton_activation or triton_reduce" \
      > "$OUT/portable_tests.log" 2>&1
    tail -3 "$OUT/portable_tests.log"
    for a in torch triton; do
      VLLM_MEGAMOE_PORTABLE_ACTIVATION=$a VLLM_MEGAMOE_PORTABLE_REDUCE=$a timeout 150 python3 -m benchmarks.first_kernel_timing --gpus 2 \
        --shapes deepseek-v3 v4-flash --tokens 8 128 --out "$OUT/portable_$a.json" 2>&1 | tail -6
    done ;;
  final)
    T0=$(date +%s); left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
    timeout 300 python3 -m pytest $T --durations=6 -o timeout=280 tests/gpu/test_sm90_mega_moe.py > "$OUT/kernel_tests.log" 2>&1
    grep -E "passed|failed|error" "$OUT/kernel_tests.log" | tail -3
    L=$(left); echo "== $L s left for the benchmark"
    FORMATS="fp8-block bf16" TOKENS="1 8 128 1024 4096 8192" SHAPE_TIMEOUT=110 SHAPE_BUDGET=80 \
      DEADLINE=$(( L > 130 ? L - 70 : 60 )) bash scripts/device_bench.sh > /dev/null 2>&1
    grep -E "^== " "$OUT/bench.log"
    L=$(left); echo "== $L s left for the probe"
    [ "$L" -gt 75 ] && timeout $(( L - 35 )) python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes v4-flash deepseek-v3 \
      --tokens 8 128 --variants mainloop=tma mainloop=tma,stages=5,tile=32 --iters 10 --out "$OUT/probe_stages.json" 2>&1 | tail -5
    L=$(left)
    [ "$L" -gt 30 ] && timeout $(( L - 3 )) python3 -m pytest $T tests/test_portable_gpu.py -k cuda_graph_one_gpu 2>&1 | tail -2 ;;
  ablate)   # ~8 min: the FP8 kernel tests of a few shapes, then per-phase times of the default build,
            # its ablations (no promotion / no wgmma: what is left of the mainloop) and, with
            # BASE_CSRC=<dir of another commit's csrc> (carry it), that build side by side
    env ${TEST_ENV:-} timeout 200 python3 -m pytest $T -o timeout=190 tests/gpu/test_sm90_mega_moe.py \
      -k "${TESTS:-fp8 and (v4 or qwen3 or small)}" > "$OUT/kernel_tests_fp8.log" 2>&1
    tail -2 "$OUT/kernel_tests_fp8.log"
    timeout 220 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes ${SHAPES:-v4-flash} --tokens ${TOKENS:-8 128 1024 8192} \
      --variants ${VARIANTS:-default ablate=promotion ablate=mma} --out "$OUT/probe_ablate.json" 2>&1 | tail -14
    [ -n "${BASE_CSRC:-}" ] && VLLM_MEGAMOE_CSRC_DIR="$BASE_CSRC" timeout 120 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} \
      --shapes ${SHAPES:-v4-flash} --tokens ${TOKENS:-8 128 1024 8192} --out "$OUT/probe_base.json" 2>&1 | tail -6 ;;
  spans)    # ~8 min: one-GPU kernel tests (TESTS), then per-phase times and task spans (phase clock) of the
            # default build for SHAPES x TOKENS, the V4-Flash-like 8192-token build next to its ablations
            # (tma: the math alone; mma: the copies alone; tma+mma: the loop's skeleton) and, with
            # BASE_CSRC=<another commit's csrc> (carry it), that build's times (its clock has no span
            # columns: graph times only)
    timeout 200 python3 -m pytest $T -o timeout=190 tests/gpu/test_sm90_mega_moe.py \
      -k "${TESTS:-one_gpu or phase_clock}" > "$OUT/kernel_tests.log" 2>&1
    tail -2 "$OUT/kernel_tests.log"
    timeout 200 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} \
      --tokens ${TOKENS:-8 1024 8192} --variants ${VARIANTS:-default} --out "$OUT/probe_spans.json" 2>&1 | tail -40
    [ -n "${BASE_CSRC:-}" ] && VLLM_MEGAMOE_CSRC_DIR="$BASE_CSRC" timeout 150 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} \
      --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} --tokens ${TOKENS:-8 1024 8192} \
      --out "$OUT/probe_spans_base.json" 2>&1 | head -12
    timeout 150 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes v4-flash --tokens 8192 \
      --variants ${ABLATE_VARIANTS:-default ablate=tma ablate=mma ablate=tma+mma} --out "$OUT/probe_spans_ablate.json" 2>&1 | tail -12 ;;
  ab)       # ~8 min: kernel tests (TESTS, default: the FP8 ones) of this tree, then the same probe of this
            # tree and of every csrc tree in BASES (directories holding a csrc/, e.g. .probe_base: carry
            # them), same shapes, tokens and variants, one JSON each
    timeout ${TEST_TIMEOUT:-230} python3 -m pytest $T -o timeout=200 tests/gpu/test_sm90_mega_moe.py \
      -k "${TESTS:-fp8 or token_tile or back_to_back}" > "$OUT/kernel_tests_ab.log" 2>&1
    tail -2 "$OUT/kernel_tests_ab.log"
    [ -n "${SANITIZE:-}" ] && sanitize 120  # memcheck and racecheck too (SANITIZE=1)
    timeout ${PROBE_TIMEOUT:-150} python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes ${SHAPES:-v4-flash deepseek-v3} \
      --tokens ${TOKENS:-1024 8192} --variants ${VARIANTS:-default} --out "$OUT/probe_new.json" 2>&1 | tail -16
    for b in ${BASES:-}; do
      VLLM_MEGAMOE_CSRC_DIR="$b/csrc" timeout ${PROBE_TIMEOUT:-150} python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} \
        --shapes ${SHAPES:-v4-flash deepseek-v3} --tokens ${TOKENS:-1024 8192} --variants ${VARIANTS:-default} \
        --out "$OUT/probe_$(basename "$b").json" 2>&1 | tail -16
    done ;;
  one_gpu)  # ~9-10 min on one H200: what a change needs before it merges when no second GPU is lent (the
            # one-GPU tests took 180-220 s in v24-v25: TEST_TIMEOUT defaults to 240)
    T0=$(date +%s); left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest $T -o timeout=160 tests/gpu/test_sm90_mega_moe.py -k one_gpu > "$OUT/kernel_tests_1gpu.log" 2>&1
    tail -2 "$OUT/kernel_tests_1gpu.log"
    # the same GPU time-slices the ranks' kernels: a short kernel timeout keeps a stuck wait short
    MEGAMOE_SHARED_GPU=1 VLLM_MEGAMOE_TIMEOUT_S=20 timeout 150 python3 -m pytest $T -o timeout=140 \
      tests/gpu/test_sm90_mega_moe.py -k "${SHARED_TESTS:-(multi_gpu and small and fp8) or back_to_back_calls_multi or missing_peer or (cuda_graph_multi and fp8)}" \
      > "$OUT/kernel_tests_shared.log" 2>&1
    tail -2 "$OUT/kernel_tests_shared.log"
    D=2; [ -n "${NO_SANITIZE:-}" ] && D=1  # NO_SANITIZE=1: the probe takes what is left
    [ "$(left)" -gt 100 ] && inproc_ab $(( $(left) / D - 10 )) probe_1gpu_ab.json 24
    L=$(left); [ "$L" -gt 60 ] && [ -z "${NO_SANITIZE:-}" ] && sanitize $(( L / 2 - 5 )) ;;
  candidates) # ~9-10 min on one H200 for all parts and four trees: split it with PARTS (below)
    # PARTS (default "probe tests sanitize", in that order): the A/B of this tree and every tree (one
    # process per shape), each tree's one-GPU kernel tests, each tree's memcheck and racecheck. CANDS:
    # the trees (default every .probe_cand/*), e.g. a second call PARTS="tests sanitize" CANDS="a b"
    # for the trees the A/B found faster.
    T0=$(date +%s); left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
    TREES=""; for c in ${CANDS:-$(ls .probe_cand 2>/dev/null)}; do TREES="$TREES .probe_cand/$c"; done
    [ -n "$TREES" ] || { echo "no .probe_cand/* (carry it)"; exit 2; }
    VARIANTS="${VARIANTS:-default $(for t in $TREES; do printf 'csrc=%s/csrc ' "$t"; done)}"
    for part in ${PARTS:-probe tests sanitize}; do
      case $part in
        probe)
          # FP8 one probe per shape (a probe writes its JSON at its end: a cut one loses only its shape),
          # at the table's 32-, 64- and 128-token builds; BF16 at prefill only (BF16_TOKENS); RESERVE s
          # are kept for what follows
          set -- ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b}
          while [ $# -gt 0 ]; do
            budget=$(( ($(left) - ${RESERVE:-150}) / $# )); [ "$budget" -gt 30 ] || break
            timeout $budget python3 -m benchmarks.kernel_probe --gpus 1 --format fp8-block --shapes $1 \
              --tokens ${TOKENS:-1024 2048 8192} --variants $VARIANTS --rounds ${ROUNDS:-3} \
              --out "$OUT/probe_candidates_fp8_$1.json" 2>&1 | tail -12
            shift
          done
          [ "$(left)" -gt 100 ] && timeout $(( $(left) * 6 / 10 )) python3 -m benchmarks.kernel_probe --gpus 1 --format bf16 \
            --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} --tokens ${BF16_TOKENS:-8192} --variants $VARIANTS \
            --rounds ${ROUNDS:-3} --out "$OUT/probe_candidates_bf16.json" 2>&1 | tail -12 ;;
        tests)
          for tree in $TREES; do  # one log for every tree (8 files come back from $OUT)
            [ "$(left)" -gt 60 ] || break
            echo "== $tree" >> "$OUT/tests_candidates.log"
            VLLM_MEGAMOE_CSRC_DIR="$PWD/$tree/csrc" timeout ${TEST_TIMEOUT:-150} python3 -m pytest $T -o timeout=140 \
              tests/gpu/test_sm90_mega_moe.py -k "${TEST_K:-one_gpu}" > "$OUT/tests.tmp" 2>&1
            cat "$OUT/tests.tmp" >> "$OUT/tests_candidates.log"; echo "$tree: $(tail -1 "$OUT/tests.tmp")"; rm -f "$OUT/tests.tmp"
          done ;;
        sanitize)
          for tree in $TREES; do  # each tree's sanitizers, their reports' ends into one log
            L=$(left); [ "$L" -gt 60 ] || break
            echo "== $tree"; VLLM_MEGAMOE_CSRC_DIR="$PWD/$tree/csrc" sanitize $(( L / 5 ))
            for tool in memcheck racecheck; do
              { echo "== $tree $tool"; tail -6 "$OUT/$tool.log"; } >> "$OUT/sanitizers.log"; rm -f "$OUT/$tool.log"
            done
          done ;;
        *) echo "unknown part $part: probe, tests or sanitize"; exit 2 ;;
      esac
    done ;;
  inproc)   # ~4-6 min, one H200: only the one-process A/B of one_gpu (this tree and every BASES tree, in
            # turn for ROUNDS rounds), within PROBE_TIMEOUT s
    inproc_ab ${PROBE_TIMEOUT:-540} probe_inproc_ab.json 40 ;;
  sanitize) # ~4 min, one H200: memcheck and racecheck on tests/gpu/sanitize_probe.py (each within SAN_TIMEOUT s)
    sanitize ${SAN_TIMEOUT:-130} ;;
  tree128)  # ~8 min, one H200: a source tree in TREE (default .probe_e128: `mkdir -p .probe_e128 && git
            # archive next/epilogue-128 csrc | tar -x -C .probe_e128` before the call) against this tree at
            # 128-token tiles: TREE's kernel through the forced-tile, clamp, epilogue-warpgroup and one-GPU
            # tests and a shared-GPU multi-rank test, then graph times of both trees in one process (outputs
            # should match bit for bit: rel_err 0), then memcheck and racecheck on TREE
    TREE="${TREE:-.probe_e128}"
    VLLM_MEGAMOE_CSRC_DIR="$PWD/$TREE/csrc" timeout 170 python3 -m pytest $T -o timeout=160 tests/gpu/test_sm90_mega_moe.py \
      -k "(token_tiles_one_gpu and 128) or clamp or bit_identical or test_one_gpu" > "$OUT/tree_tests.log" 2>&1
    tail -2 "$OUT/tree_tests.log"
    VLLM_MEGAMOE_CSRC_DIR="$PWD/$TREE/csrc" VLLM_MEGAMOE_SM90_TOKEN_TILE=128 VLLM_MEGAMOE_SM90_MAINLOOP=tma MEGAMOE_SHARED_GPU=1 \
      VLLM_MEGAMOE_TIMEOUT_S=20 timeout 100 python3 -m pytest $T -o timeout=90 tests/gpu/test_sm90_mega_moe.py \
      -k "multi_gpu and (v4 or deepseek)" > "$OUT/tree_tests_shared.log" 2>&1
    tail -2 "$OUT/tree_tests_shared.log"
    timeout 150 python3 -m benchmarks.kernel_probe --gpus 1 --shapes v4-flash deepseek-v3 qwen3-30b-a3b \
      --tokens ${TOKENS:-2048 8192} --variants tile=128 tile=128,csrc=$TREE/csrc --rounds 2 \
      --out "$OUT/probe_tree128.json" 2>&1 | tail -16
    VLLM_MEGAMOE_CSRC_DIR="$PWD/$TREE/csrc" sanitize 120 ;;  # (80 s cut racecheck short in v22)
  epilogue_cost) # ~2 min, one H200: what the GEMM epilogues cost in FORMAT's builds (default bf16): graph
            # times with and without them (ablate=epilogue drops the 128-token builds' own epilogues and
            # the epilogue warpgroup's work), 128- and 64-token tiles, 2048 and 8192 tokens per rank
    timeout 200 python3 -m benchmarks.kernel_probe --gpus 1 --format ${FORMAT:-bf16} --shapes v4-flash deepseek-v3 qwen3-30b-a3b \
      --tokens ${TOKENS:-2048 8192} --variants tile=128 tile=128,ablate=epilogue tile=64 tile=64,ablate=epilogue \
      --out "$OUT/probe_epilogue_${FORMAT:-bf16}.json" 2>&1 | tail -30 ;;
  contig)   # ~3 min, one H200: does HBM serve a decode task's weight stream faster when each 256 x 128-byte
            # box is stored whole (stream_probe --layout tiled, kernel_notes v26)? The probe's GPU test, then
            # rows vs tiled at V4-Flash-like L1 (32 chunks, 96 SMs) / L2 (16 chunks), Qwen3-like L1 (16
            # chunks, 48 SMs) and every SM, 1 and 4 tasks per CTA, without and with 1000 clocks of math per chunk
    timeout 150 python3 -m pytest $T tests/gpu/test_stream_multicast.py > "$OUT/stream_tests.log" 2>&1
    tail -2 "$OUT/stream_tests.log"
    for run in "32 96" "16 96" "16 48" "32 132" "16 132"; do
      set -- $run
      for tasks in 1 4; do
        echo "== chunks $1, CTAs $2, tasks $tasks"
        timeout 60 python3 -m benchmarks.stream_probe --configs 32:1:0 --chunks $1 --ctas $2 --tasks $tasks --blocks 1 \
          --tiles 512 --cold --layout rows tiled --spin 0 1000 --out "$OUT/contig_c$1_n$2_t$tasks.json" 2>&1 | tail -5
      done
    done ;;
  stream)   # ~1 min, one H200: does a cluster sharing the weight box stream chunks faster (kernel_notes v22)?
    timeout 120 python3 -m pytest $T tests/gpu/test_stream_multicast.py > "$OUT/stream_tests.log" 2>&1
    tail -2 "$OUT/stream_tests.log"
    for tiles in 512 16; do  # 512 MB of weights (HBM), 16 MB (L2-resident)
      timeout 120 python3 -m benchmarks.stream_probe --tiles $tiles ${CONFIGS:+--configs $CONFIGS} \
        --out "$OUT/stream_probe_tiles$tiles.json" 2>&1 | tail -7
    done ;;
  trace)    # ~4 min: the chunk trace (VLLM_MEGAMOE_SM90_CHUNK_TRACE, phase_clock.chunk_trace): SM cycles of
            # each interval of a few K chunks of one L1 task per CTA (stage wait, wgmma issues and waits,
            # promotions, CTA barrier, refill), next to the untraced build, with and without copies
    timeout 250 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} \
      --tokens ${TOKENS:-1024 8192} --variants ${VARIANTS:-default trace=1 trace=1,ablate=tma_warm} \
      --out "$OUT/probe_trace.json" 2>&1 | tail -24 ;;
  wgmma)    # ~1 min: cycles per K chunk of the fused kernel's wgmma patterns without copies, next to
            # the shapes' ceilings and one-group alternatives (csrc/sm90/probe/wgmma_rate.cu)
    timeout 200 python3 -m benchmarks.wgmma_probe ${CONFIGS:+--configs $CONFIGS} --out "$OUT/wgmma_probe.json" 2>&1 | tail -14 ;;
  rs)       # ~2 min: is load_a_fragment_fp8_sw128 right (float32 reference), and how fast are the
            # register-A forms with it (64:2:2:2:rs+prod+wait+copy: the fused 64-token prefill loop's pattern)
    timeout 120 python3 -m pytest $T tests/gpu/test_wgmma_rs.py > "$OUT/wgmma_rs_tests.log" 2>&1
    tail -2 "$OUT/wgmma_rs_tests.log"
    timeout 200 python3 -m benchmarks.wgmma_probe --configs ${CONFIGS:-64:2:2:0 64:2:2:2 64:2:2:2:prod+wait 64:2:2:2:prod+wait+copy \
      64:2:2:0:rs 64:2:2:2:rs 64:2:2:2:rs+prod+wait 64:2:2:2:rs+prod+wait+copy 128:2:1:2:rs 64:2:1:3:rs 96:2:1:3:rs \
      96:2:1:4:rs} --out "$OUT/wgmma_probe_rs.json" 2>&1 | tail -8 ;;
  pitch)    # ~2 min: does the weight / staging row pitch set the per-chunk time? V4-Flash-like (4096-byte
            # rows) next to the same layer 256 channels wider (4352) and with a wider intermediate
            # (2176-byte L2 rows), full and no-math builds (docs/kernel_notes.md v5)
    timeout 300 python3 -m benchmarks.kernel_probe --gpus ${GPUS:-2} --shapes v4-flash 4352x2048x256x6 4096x2176x256x6 \
      --tokens ${TOKENS:-8192} --variants default ablate=promotion+mma --out "$OUT/probe_pitch.json" 2>&1 | tail -8 ;;
  ncu_mem)  # memory-system sections and raw counters of one launch per variant (one GPU, V4-Flash-like)
    for v in ${VARIANTS:-default ablate=mma}; do
      name=$(echo "$v" | tr '=,' '__')
      timeout 240 ncu --clock-control none --kernel-name megamoe_sm90_fused --launch-skip 4 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis -o "$OUT/mem_$name" \
        python3 -m benchmarks.kernel_probe --gpus 1 --shapes ${SHAPES:-v4-flash} --tokens ${TOKENS:-8192} --iters 3 \
        --variants "$v" > "$OUT/ncu_mem_$name.txt" 2>&1
      tail -2 "$OUT/ncu_mem_$name.txt"
      ncu --import "$OUT/mem_$name.ncu-rep" --page raw --csv > "$OUT/raw_$name.csv" 2>&1
      ncu --import "$OUT/mem_$name.ncu-rep" --page details > "$OUT/details_$name.txt" 2>&1
      grep -E "Duration|Throughput|Hit Rate|Busy|Bandwidth" "$OUT/details_$name.txt" | head -24
      rm -f "$OUT/mem_$name.ncu-rep"
    done ;;
  ncu)      # Nsight Compute on one launch of the default build (one GPU, V4-Flash-like, TOKENS per rank)
    timeout 300 ncu --clock-control none --kernel-name megamoe_sm90_fused --launch-skip 4 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      python3 -m benchmarks.kernel_probe --gpus 1 --shapes v4-flash --tokens ${TOKENS:-64} --iters 3 \
      > "$OUT/ncu.txt" 2>&1
    grep -E "Throughput|Duration|Stall|Issued|Bandwidth|Hit Rate" "$OUT/ncu.txt" | head -60 ;;
  ncu_src)  # stall samples per SASS instruction of one launch (one GPU, V4-Flash-like, TOKENS per rank),
            # attributed to source lines (benchmarks/ncu_regions.py; the build has line info)
    export VLLM_MEGAMOE_JIT_LINEINFO=${LINEINFO:-1}
    timeout 400 ncu --clock-control none --kernel-name megamoe_sm90_fused --launch-skip 4 --launch-count 1 \
      --section WarpStateStats --section SourceCounters --section SpeedOfLight -o "$OUT/rep" \
      python3 -m benchmarks.kernel_probe --gpus 1 --shapes v4-flash --tokens ${TOKENS:-4096} --iters 3 \
      --format ${FORMAT:-fp8-block} > "$OUT/ncu_run.txt" 2>&1
    tail -3 "$OUT/ncu_run.txt"
    ncu --import "$OUT/rep.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2> "$OUT/source.err"
    ncu --import "$OUT/rep.ncu-rep" --page details > "$OUT/details.txt" 2>&1
    grep -E "Duration|Throughput|Issued|Stall" "$OUT/details.txt" | head -30
    cp "$(ls -t "$VLLM_MEGAMOE_CACHE_DIR"/megamoe_sm90_fused-*.cubin | head -1)" "$OUT/kernel.cubin"
    python3 -m benchmarks.ncu_regions "$OUT/source.csv" --cubin "$OUT/kernel.cubin" > "$OUT/regions.txt" 2>&1
    head -45 "$OUT/regions.txt"; rm -f "$OUT/rep.ncu-rep" ;;
  wg128)    # ~5 min, one GPU: the 128-token epilogue warpgroup (v31: 1.01-1.06x slower, its K loops 1.06-1.18x
            # longer). Its tests (bit-identical to the inline epilogue; the clamp), racecheck of its
            # small-odd cases, then the A/B that tells its costs apart at Qwen3-like 2048 / 8192 tokens:
            # stages=3 (the inline epilogue at its depth) and its build with ablate=epilogue (the hand-off
            # without the third warpgroup's work) against ablate=epilogue at 4 stages
    timeout 150 python3 -m pytest $T -o timeout=140 tests/gpu/test_sm90_mega_moe.py -k "bit_identical or activation_clamp_128" \
      > "$OUT/wg128_tests.log" 2>&1
    tail -3 "$OUT/wg128_tests.log"
    VLLM_MEGAMOE_TIMEOUT_S=20 timeout 120 compute-sanitizer --tool racecheck --report-api-errors no --print-limit 20 \
      python3 tests/gpu/sanitize_probe.py "epilogue warpgroup" > "$OUT/wg128_racecheck.log" 2>&1
    tail -3 "$OUT/wg128_racecheck.log"
    timeout 200 python3 -m benchmarks.kernel_probe --gpus 1 --format ${FORMAT:-fp8-block} --shapes qwen3-30b-a3b \
      --tokens ${TOKENS:-2048 8192} --variants default stages=3 epilogue_wg128=1 epilogue_wg128=1,ablate=epilogue \
      ablate=epilogue --rounds 3 --iters 300 --out "$OUT/probe_wg128.json" 2>&1 | tail -26 ;;
  task_scales) # ~3 min, one H200: what is left of loading a task's FP8 scale tables at its start:
            # ablate=task_scales (only a CTA's first task of a phase loads them) against the default, in
            # steady state (v33, before any prefetch: 0.92-0.93x at 8192 tokens; v34, with the 128-token
            # builds' copies into the tables: 0.96-0.99x of them, kernel_notes v34)
    timeout 200 python3 -m benchmarks.kernel_probe --gpus 1 --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} \
      --tokens ${TOKENS:-1024 8192} --variants default ablate=task_scales --rounds 2 --iters 300 \
      --out "$OUT/probe_task_scales.json" 2>&1 | tail -14 ;;
  nvl_stores) # ~3 min, 2 GPUs: what the FP8 128-token L2 epilogue's stores cost at EP2, where half its
            # combine rows go to the peer over NVLink in 64-byte runs (kernel_notes v21 (d); at EP1 the
            # stores were 1-3 % of a call, v30): graph times with and without them (ablate=stores), in turn
    timeout 240 python3 -m benchmarks.kernel_probe --gpus 2 --shapes ${SHAPES:-v4-flash deepseek-v3 qwen3-30b-a3b} \
      --tokens ${TOKENS:-1024 8192} --variants default ablate=stores --rounds 2 --out "$OUT/probe_nvl_stores.json" 2>&1 | tail -16 ;;
  *) echo "unknown STEP=${STEP}: verify, one_gpu, ep1_lookup, candidates, wg128, ab, trace, wgmma, rs, probe, bench, final, portable, ablate, pitch, ncu, ncu_mem, ncu_src, nvl_stores or task_scales"; exit 2 ;;
esac
