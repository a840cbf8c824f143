"""The fused SM90 mega kernel on 1 and 2 H200s against the reference and the portable path."""
import os
import subprocess
import sys
import time

import pytest
import torch

from vllm_megamoe.launch import run_ranks

from mega_cases import EMULATED_BOUND, SHAPES, assert_rows, run_cases

# shares_gpu: the multigpu tests here can run with their ranks on one GPU (SHARED_GPU below)
pytestmark = [pytest.mark.gpu, pytest.mark.shares_gpu]


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (SM90) GPU")

CASES_1GPU = [([1], "uniform", 1), ([7], "masked", 2), ([128], "skewed", 3), ([1000], "uniform", 4),
              ([4096], "uniform", 5)]
# Multi-GPU tests run on MEGAMOE_GPU_RANKS GPUs (default 2; scripts/device_ep_n.sh sets 4 or 8).
RANKS = int(os.environ.get("MEGAMOE_GPU_RANKS", "2"))
# MEGAMOE_SHARED_GPU=1: the ranks are processes sharing GPU 0 in a gloo group (the GPU time-slices
# their persistent kernels, so each cross-rank wait lasts up to a time slice). That checks the
# protocol (counts, peer stores, barriers, call counters, timeouts) on a machine with one GPU;
# it says nothing about NVLink or speed.
SHARED_GPU = os.environ.get("MEGAMOE_SHARED_GPU") == "1"
BACKEND = "gloo" if SHARED_GPU else "nccl"
requires_ranks = pytest.mark.skipif(not SHARED_GPU and torch.cuda.device_count() < RANKS,
                                    reason=f"needs {RANKS} GPUs (or MEGAMOE_SHARED_GPU=1)")


def _per_rank(*values):
    """Token counts for RANKS ranks, cycling through `values` (uneven, with zeros)."""
    return [values[r % len(values)] for r in range(RANKS)]


CASES_NGPU = [(_per_rank(1, 7, 2), "uniform", 1), (_per_rank(7, 0), "masked", 2),
              (_per_rank(128), "skewed", 3), (_per_rank(0, 1000, 33), "uniform", 4),
              (_per_rank(4096), "uniform", 5), (_per_rank(3, 129, 64, 1), "masked", 6)]


def _rank(rank, world, group, shape_name, fmt, cases, calls=1):
    return run_cases(rank, world, group, shape_name, fmt, cases, calls_per_case=calls)


@requires_sm90
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_one_gpu(shape_name, fmt):
    rows = _rank(0, 1, None, shape_name, fmt, CASES_1GPU)
    assert_rows([rows], fmt)


@requires_sm90
@pytest.mark.multigpu
@requires_ranks
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_multi_gpu(shape_name, fmt):
    rows = run_ranks(_rank, RANKS, (shape_name, fmt, CASES_NGPU), backend=BACKEND, timeout_s=600)
    assert_rows(rows, fmt)


@requires_sm90
@pytest.mark.parametrize("tile", ["32", "64", "128"])
@pytest.mark.parametrize("shape_name", ["small-odd", "v4-flash", "qwen3-30b-a3b"])
def test_token_tiles_one_gpu(shape_name, tile, monkeypatch):
    """FP8 with each token tile forced, whatever the table picks. With 64-token tiles the cases
    mix full token blocks with narrow ones (at most 32 rows: K loop and epilogue over 32 columns),
    and 1-128 tokens run narrow tasks only; 128-token tiles (the
    register-token loop with four row groups per warpgroup) compute every block whole."""
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", tile)
    rows = _rank(0, 1, None, shape_name, "fp8-block", CASES_1GPU)
    assert_rows([rows], "fp8-block")


@requires_sm90
@pytest.mark.parametrize("tile", ["32", "64", "128"])
@pytest.mark.parametrize("shape_name", ["small-odd", "v4-flash"])
def test_bf16_token_tiles_one_gpu(shape_name, tile, monkeypatch):
    """BF16 with each token tile forced (the deferred-wait K loop of every TMA build: 32- and
    64-token tiles with the epilogue warpgroup, 128-token tiles with the epilogue in a stage),
    1 to 4096 tokens: tasks shorter and longer than the stages, partial token blocks."""
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", tile)
    rows = _rank(0, 1, None, shape_name, "bf16", CASES_1GPU)
    assert_rows([rows], "bf16")


@requires_sm90
@pytest.mark.multigpu
@requires_ranks
def test_token_tile_64_multi_gpu(monkeypatch):
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "64")
    rows = run_ranks(_rank, RANKS, ("v4-flash", "fp8-block", CASES_NGPU), backend=BACKEND, timeout_s=600)
    assert_rows(rows, "fp8-block")


@requires_sm90
@pytest.mark.multigpu
@requires_ranks
def test_back_to_back_calls_multi_gpu():
    """100 calls with new inputs each time: counters and barriers stay consistent."""
    cases = [(_per_rank(13 + i % 50, 40 - i % 37), ["uniform", "masked", "skewed"][i % 3], 500 + i)
             for i in range(100)]
    rows = run_ranks(_rank, RANKS, ("small-odd", "fp8-block", cases), backend=BACKEND, timeout_s=600)
    assert_rows(rows, "fp8-block")


@requires_sm90
def test_back_to_back_calls_one_gpu():
    """100 calls at EP1: the call counter and the grid's barriers stay consistent without peers."""
    cases = [([13 + i % 50], ["uniform", "masked", "skewed"][i % 3], 700 + i) for i in range(100)]
    rows = _rank(0, 1, None, "small-odd", "fp8-block", cases)
    assert_rows([rows], "fp8-block")


@requires_sm90
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_small_grid_one_gpu(fmt, monkeypatch):
    """A grid of 6 CTAs (VLLM_MEGAMOE_NUM_SMS): every phase takes several items per thread or warp
    (the announce 4096 tokens in 2-3 rounds of the 6 CTAs' threads, the staging, pull and reduce many
    each), and every GEMM task queue runs deep; the output still matches the reference."""
    monkeypatch.setenv("VLLM_MEGAMOE_NUM_SMS", "6")
    rows = _rank(0, 1, None, "small-odd", fmt, [([4096], "uniform", 11), ([300], "masked", 12)])
    assert_rows([rows], fmt)


def _graph_rank(rank, world, group, fmt):
    from mega_cases import global_weights, inputs
    from vllm_megamoe import SymmBuffer, reference
    from vllm_megamoe.kernels import sm90_mega_moe
    shape = SHAPES["qwen3-30b-a3b"]
    dev = torch.device("cuda", torch.cuda.current_device())
    weights = global_weights(shape, fmt, dev)
    el = shape.experts_per_rank(world)
    local = weights.experts(rank * el, el)
    w13f, w2f = weights.dequantize()
    buf = SymmBuffer(shape, 64, group, format=fmt, device=dev)
    static = [t.clone() for t in inputs(shape, [64] * world, "uniform", 9, dev)[rank]]
    y = torch.empty(64, shape.hidden, dtype=torch.bfloat16, device=dev)
    sm90_mega_moe.mega_moe(*static, local, buf, y=y)  # compile and warm up outside capture
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm90_mega_moe.mega_moe(*static, local, buf, y=y)
    errs = []
    for replay in range(5):
        fresh = inputs(shape, [64] * world, ["uniform", "skewed", "masked"][replay % 3], 100 + replay, dev)[rank]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(dev)
        ref = reference.moe_forward(*fresh, w13f, w2f, emulate="fp8" if fmt == "fp8-block" else "bf16")
        errs.append(reference.relative_error(y, ref))
    buf.destroy()
    return errs


@requires_sm90
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_cuda_graph_one_gpu(fmt):
    from mega_cases import EMULATED_BOUND
    errs = _graph_rank(0, 1, None, fmt)
    assert max(errs) <= EMULATED_BOUND[fmt], errs


@requires_sm90
@pytest.mark.multigpu
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
@requires_ranks
def test_cuda_graph_multi_gpu(fmt):
    from mega_cases import EMULATED_BOUND
    for errs in run_ranks(_graph_rank, RANKS, (fmt,), backend=BACKEND, timeout_s=600):
        assert max(errs) <= EMULATED_BOUND[fmt], errs


@requires_sm90
@pytest.mark.multigpu
@requires_ranks
def test_missing_peer_times_out_with_a_message():
    """Rank 1 never launches: rank 0 must report rank and phase and abort, not hang."""
    probe = os.path.join(os.path.dirname(__file__), "timeout_probe.py")
    start = time.time()
    proc = subprocess.run([sys.executable, probe, "3", BACKEND], capture_output=True, text=True, timeout=240)
    elapsed = time.time() - start
    out = proc.stdout + proc.stderr
    assert "megamoe: rank 0 timed out in dispatch (NVLink barrier)" in out, out[-3000:]
    assert "RANK0_FAILED" in out, out[-3000:]
    assert elapsed < 200


@requires_sm90
def test_phase_clock_orders_the_phases_on_one_gpu():
    """Every CTA stamps every mark, in order, and no CTA passes an NVLink barrier before every CTA
    reached it (pull -> L1 and L1 -> L2 wait per token block: no barrier between those marks); the
    output is unchanged by the clock."""
    from mega_cases import EMULATED_BOUND, global_weights, inputs
    from vllm_megamoe import SymmBuffer, reference
    from vllm_megamoe.kernels import phase_clock, sm90_mega_moe
    shape = SHAPES["qwen3-30b-a3b"]
    dev = torch.device("cuda", 0)
    weights = global_weights(shape, "fp8-block", dev)
    buf = SymmBuffer(shape, 256, None, format="fp8-block", device=dev)
    x, idx, tw = inputs(shape, [200], "skewed", 11, dev)[0]
    clock = phase_clock.new_clock(sm90_mega_moe.grid_size(shape, buf), dev)
    y = sm90_mega_moe.mega_moe(x, idx, tw, weights, buf, phase_clock=clock)
    torch.cuda.synchronize()
    w13f, w2f = weights.dequantize()
    assert reference.relative_error(y, reference.moe_forward(x, idx, tw, w13f, w2f, emulate="fp8")) <= \
        EMULATED_BOUND["fp8-block"]
    marks = list(phase_clock.MARKS)
    ns, spans = clock.cpu()[:, :len(marks)], clock.cpu()[:, len(marks):]
    assert bool((ns > 0).all()), "a CTA left a mark unwritten"
    assert bool((ns[:, 1:] >= ns[:, :-1]).all()), "marks out of order within a CTA"
    # Barriers of all CTAs: staged -> dispatched, l2_done -> combined.
    for before, after in (("staged", "dispatched"), ("l2_done", "combined")):
        assert int(ns[:, marks.index(after)].min()) >= int(ns[:, marks.index(before)].max()), (before, after)
    summary = phase_clock.summarize(clock)
    assert summary["ctas"] == ns.shape[0] and summary["total_us"] > 0
    # Task spans: every task counted once (one GPU: every expert is local), and a task's spans fit its loop.
    from vllm_megamoe.kernels import sm90_tuning
    col = {name: spans[:, i] for i, name in enumerate(phase_clock.SPANS)}
    tile = sm90_tuning.choose(shape, "fp8-block", 1, x.shape[0]).tile
    rows = torch.bincount(idx[idx >= 0].flatten().long().cpu(), minlength=shape.num_experts)
    blocks = int(((rows + tile - 1) // tile).sum())
    assert int(col["l1_tasks"].sum()) == blocks * (2 * shape.intermediate // 256)
    assert int(col["l2_tasks"].sum()) == blocks * (shape.hidden // 256)
    assert bool((col["l1_gemm"] + col["l1_epilogue"] <= col["l1_loop"]).all())
    assert bool((col["l2_wait"] + col["l2_gemm"] + col["l2_epilogue"] <= col["l2_loop"]).all())
    task = summary["task_us"]
    assert task["l1_gemm"] > 0 and task["l1_epilogue"] > 0 and task["l2_gemm"] > 0 and 0.5 < task["sm_ghz"] < 3.0
    with pytest.raises(ValueError, match="phase_clock"):
        sm90_mega_moe.mega_moe(x, idx, tw, weights, buf, phase_clock=clock[:1])
    buf.destroy()


@requires_sm90
@pytest.mark.parametrize("layout", ["interleaved", "checkpoint"])
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_weight_update_under_cuda_graph_one_gpu(fmt, layout):
    """An RL weight update as the plugin makes it: new weights converted to the kernel layout and
    copied over the old ones in place (overwrite_weights_). A CUDA graph captured before the
    update then computes with the new weights: the kernel keeps no copy of them, and its TMA
    descriptors (cached per weights object, by address) stay valid. Weights passed in checkpoint
    layout (a library caller) run through an interleaved copy the update refills in place."""
    from mega_cases import global_weights, inputs
    from vllm_megamoe import SymmBuffer, reference
    from vllm_megamoe.kernels import sm90_mega_moe
    from vllm_megamoe.weights import overwrite_weights_, transform_weights_for_mega_moe
    shape = SHAPES["small-odd"]
    dev = torch.device("cuda", 0)
    emulate = "fp8" if fmt == "fp8-block" else "bf16"
    kernel_layout = transform_weights_for_mega_moe if layout == "interleaved" else (lambda w: w)
    served = kernel_layout(global_weights(shape, fmt, dev, seed=0))
    buf = SymmBuffer(shape, 64, None, format=fmt, device=dev)
    static = [t.clone() for t in inputs(shape, [64], "uniform", 31, dev)[0]]
    y = torch.empty(64, shape.hidden, dtype=torch.bfloat16, device=dev)
    sm90_mega_moe.mega_moe(*static, served, buf, y=y)  # compile and warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm90_mega_moe.mega_moe(*static, served, buf, y=y)
    errs = []
    for seed in (0, 1, 2):  # seed 0 before the update, then two updates
        update = global_weights(shape, fmt, dev, seed=seed)
        if seed:
            overwrite_weights_(served, kernel_layout(update))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errs.append(reference.relative_error(
            y, reference.moe_forward(*static, *update.dequantize(), emulate=emulate)))
    buf.destroy()
    assert max(errs) <= EMULATED_BOUND[fmt], errs


@requires_sm90
@pytest.mark.parametrize("tokens", [37, 200])
def test_topk_ids_int32_and_int64_one_gpu(tokens):
    """int64 ids (torch.topk's dtype) are read as they come, without a conversion kernel: the
    output is bit-identical to int32 ids', and a captured call whose int64 id lies outside
    [-1, E) but would wrap into range as int32 (2**32 + 1 -> 1) is flagged, not routed; with a few
    of the announcing CTA's threads busy (37 tokens) and with most of them (200)."""
    from mega_cases import global_weights, inputs
    from vllm_megamoe import MegaMoEError, SymmBuffer, portable
    from vllm_megamoe.kernels import sm90_mega_moe
    shape = SHAPES["small-odd"]
    dev = torch.device("cuda", 0)
    weights = global_weights(shape, "fp8-block", dev)
    buf = SymmBuffer(shape, 256, None, format="fp8-block", device=dev)
    x, idx, tw = inputs(shape, [tokens], "masked", 21, dev)[0]
    assert idx.dtype == torch.int64
    y64 = sm90_mega_moe.mega_moe(x, idx, tw, weights, buf)
    y32 = sm90_mega_moe.mega_moe(x, idx.to(torch.int32), tw, weights, buf)
    torch.cuda.synchronize()
    assert torch.equal(y64.view(torch.int16), y32.view(torch.int16))
    portable.check_errors(buf)
    static = [x.clone(), idx.clone(), tw.clone()]
    y = torch.empty_like(y64)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no host-side id check under capture: the kernel's own check
        sm90_mega_moe.mega_moe(*static, weights, buf, y=y)
    static[1][3, 0] = 2 ** 32 + 1
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(MegaMoEError, match="outside"):
        portable.check_errors(buf)
    for bad_id in (-(2 ** 40), shape.num_experts + 3):  # below int's range; in int's range, past E
        static[1].copy_(idx)
        static[1][5, 1] = bad_id
        graph.replay()
        torch.cuda.synchronize()
        with pytest.raises(MegaMoEError, match="outside"):
            portable.check_errors(buf)
    buf.destroy()


@requires_sm90
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_unaligned_x_and_y_one_gpu(fmt):
    """The kernel moves x and y in 16-byte vectors: an x viewed at a 2-byte offset is staged from an
    aligned copy (same output, bit for bit), a y at such an offset is refused with a message."""
    from mega_cases import global_weights, inputs
    from vllm_megamoe import SymmBuffer
    from vllm_megamoe.kernels import sm90_mega_moe
    shape = SHAPES["qwen3-30b-a3b"]
    dev = torch.device("cuda", 0)
    weights = global_weights(shape, fmt, dev)
    buf = SymmBuffer(shape, 64, None, format=fmt, device=dev)
    x, idx, tw = inputs(shape, [45], "uniform", 31, dev)[0]
    flat = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device=dev)
    x_odd = flat[1:].view_as(x)
    x_odd.copy_(x)
    assert x_odd.data_ptr() % 16 == 2 and x_odd.is_contiguous()
    y = sm90_mega_moe.mega_moe(x, idx, tw, weights, buf)
    y_odd_x = sm90_mega_moe.mega_moe(x_odd, idx, tw, weights, buf)
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), y_odd_x.view(torch.int16))
    out = torch.empty(y.numel() + 1, dtype=torch.bfloat16, device=dev)[1:].view_as(y)
    with pytest.raises(ValueError, match="16-byte"):
        sm90_mega_moe.mega_moe(x, idx, tw, weights, buf, y=out)
    buf.destroy()


@requires_sm90
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_activation_clamp_128_token_tiles_one_gpu(fmt, monkeypatch):
    """The 128-token builds' own L1 epilogue applies the activation clamp as the portable path
    does (the other tests of these builds run without one): the kernel's clamped output is within
    the format's bound of the portable path's, and the clamp changes the output well beyond it."""
    from mega_cases import global_weights, inputs
    from vllm_megamoe import SymmBuffer, portable, reference
    from vllm_megamoe.kernels import sm90_mega_moe
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "128")
    shape = SHAPES["qwen3-30b-a3b"]
    dev = torch.device("cuda", 0)
    weights = global_weights(shape, fmt, dev)
    buf = SymmBuffer(shape, 1000, None, format=fmt, device=dev)
    for t in (1000, 200):  # whole 128-token blocks and a partial last one
        x, idx, tw = inputs(shape, [t], "uniform", 7 + t, dev)[0]
        y = sm90_mega_moe.mega_moe(x, idx, tw, weights, buf, activation_clamp=0.5)
        want = portable.mega_moe(x, idx, tw, weights, buf, activation_clamp=0.5)
        unclamped = portable.mega_moe(x, idx, tw, weights, buf)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
        err = reference.relative_error(y, want)
        assert err <= 2 * EMULATED_BOUND[fmt], (fmt, t, err)
        assert reference.relative_error(unclamped, want) > 20 * EMULATED_BOUND[fmt]  # the clamp matters here
    buf.destroy()


@requires_sm90
@pytest.mark.parametrize("tile", ["32", "64", "128"])
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_epilogue_warpgroup_is_bit_identical_one_gpu(fmt, tile, monkeypatch):
    """The TMA builds' epilogue warpgroup computes what the MMA warpgroups' own epilogue does
    (SwiGLU on the BF16-rounded gate / up, the FP8 scale per token, the combine rows): the outputs
    of the two builds are equal bit for bit, with full and narrow (or partial) token blocks, with
    and without the activation clamp, and over several calls of one buffer. 128-token tiles: the
    layers whose 64 KB hand-off tile fits (BuildOptions.epilogue_warpgroup_128), against the
    register epilogue of the FP8 builds and the stage-tile one of the BF16 builds."""
    from mega_cases import global_weights, inputs
    from vllm_megamoe import SymmBuffer
    from vllm_megamoe.kernels import sm90_mega_moe, sm90_tuning
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", tile)
    dev = torch.device("cuda", 0)
    cases = ((("qwen3-30b-a3b", [1000, 200]), ("small-odd", [4096, 300])) if tile == "128"
             else (("qwen3-30b-a3b", [1000, 37]), ("v4-flash", [4096, 300])))
    for shape_name, tokens in cases:
        shape = SHAPES[shape_name]
        weights = global_weights(shape, fmt, dev)
        buf = SymmBuffer(shape, max(tokens), None, format=fmt, device=dev)
        for t, clamp in zip(tokens, (None, 0.5)):
            x, idx, tw = inputs(shape, [t], "uniform", 41 + t, dev)[0]
            outs = {}
            for on, threads in (("1", 384), ("0", 256)):
                options = sm90_mega_moe.BuildOptions(epilogue_warpgroup=on == "1", epilogue_warpgroup_128=True)
                spec = sm90_mega_moe.kernel_spec(shape, buf, sm90_tuning.choose(shape, fmt, 1, t), options)
                assert sm90_mega_moe.threads_per_cta(spec) == threads  # two different builds run
                outs[on] = sm90_mega_moe.mega_moe(x, idx, tw, weights, buf, activation_clamp=clamp, options=options)
            torch.cuda.synchronize()
            assert torch.isfinite(outs["1"]).all()
            assert torch.equal(outs["1"].view(torch.int16), outs["0"].view(torch.int16)), (shape_name, t, clamp)
        buf.destroy()
