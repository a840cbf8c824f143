"""The portable path on 1 and 2 GPUs, eager and under CUDA graph capture (marked gpu)."""
import pytest
import torch

from vllm_megamoe import MoEShape, SymmBuffer, portable, reference
from vllm_megamoe.launch import run_ranks

from portable_cases import EMULATED_BOUND, EXACT_BOUND, assert_rows, check_rank, make_case

SHAPES = [MoEShape(hidden=256, intermediate=128, num_experts=8, topk=3),
          MoEShape(hidden=1024, intermediate=512, num_experts=32, topk=4)]


def _cases(world):
    odd = [13, 0, 7, 29][:world]
    return [([16] * world, "uniform", 1), ([200] * world, "skewed", 2), ([9] * world, "masked", 3),
            (odd, "uniform", 4), (odd[::-1], "masked", 5), ([1000] * world, "uniform", 6)]


def _rank_main(rank, world, group, shape, fmt, mode):
    return check_rank(rank, world, group, shape, fmt, _cases(world), device=f"cuda:{rank}", mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_portable_one_gpu(shape, fmt, mode):
    rows = _rank_main(0, 1, None, shape, fmt, mode)
    assert_rows([rows], fmt)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_portable_two_gpus(fmt, mode):
    rows = run_ranks(_rank_main, 2, (SHAPES[1], fmt, mode), backend="nccl", timeout_s=300)
    assert_rows(rows, fmt)


def _graph_rank(rank, world, group, shape, fmt, tokens):
    """Capture one call, then replay it with fresh inputs copied into the static tensors."""
    dev = torch.device("cuda", rank if world > 1 else torch.cuda.current_device())
    el = shape.experts_per_rank(world)
    weights, inputs = make_case(shape, fmt, [tokens] * world, "masked", 50)
    local = weights.experts(rank * el, el).to(dev)
    buf = SymmBuffer(shape, tokens, group, format=fmt, device=dev)
    x, idx, tw = (t.to(dev) for t in inputs[rank])
    static = [x.clone(), idx.clone(), tw.clone()]
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):  # warm-up: caches weights and lazy state outside capture
        portable.mega_moe(*static, local, buf, mode="padded")
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = portable.mega_moe(*static, local, buf)
    errs = []
    w13, w2 = weights.dequantize()
    for replay in range(4):
        _, fresh = make_case(shape, fmt, [tokens] * world, ["uniform", "skewed", "masked"][replay % 3],
                             200 + replay)
        x, idx, tw = fresh[rank]
        for dst, src in zip(static, (x, idx, tw)):
            dst.copy_(src.to(dev))
        y_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(dev)
        emulate = "fp8" if fmt == "fp8-block" else "bf16"
        ref = reference.moe_forward(x, idx, tw, w13, w2, emulate=emulate)
        errs.append(reference.relative_error(y_static.cpu(), ref))
    portable.check_errors(buf)
    buf.destroy()
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_cuda_graph_one_gpu(fmt):
    errs = _graph_rank(0, 1, None, SHAPES[1], fmt, 64)
    assert max(errs) <= EMULATED_BOUND[fmt], errs


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_cuda_graph_two_gpus(fmt):
    for errs in run_ranks(_graph_rank, 2, (SHAPES[1], fmt, 64), backend="nccl", timeout_s=300):
        assert max(errs) <= EMULATED_BOUND[fmt], errs


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_padded_mode_with_the_triton_combine_scatter(fmt):
    """VLLM_MEGAMOE_PORTABLE_KERNELS=scatter=triton: live rows written by one kernel to their peers; the
    same cases as the index_put version, eager and captured."""
    env = {"VLLM_MEGAMOE_PORTABLE_KERNELS": "scatter=triton"}
    rows = run_ranks(_rank_main, 2, (SHAPES[1], fmt, "padded"), backend="nccl", timeout_s=300, env=env)
    assert_rows(rows, fmt)
    for errs in run_ranks(_graph_rank, 2, (SHAPES[1], fmt, 64), backend="nccl", timeout_s=300, env=env):
        assert max(errs) <= EMULATED_BOUND[fmt], errs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_triton_activation_one_gpu(mode, monkeypatch):
    """VLLM_MEGAMOE_PORTABLE_KERNELS=activation=triton: SwiGLU x weight + FP8 requantization in one kernel,
    the same cases against the reference (FP8 weights; BF16 has no requantization)."""
    monkeypatch.setenv("VLLM_MEGAMOE_PORTABLE_KERNELS", "activation=triton")
    rows = _rank_main(0, 1, None, SHAPES[1], "fp8-block", mode)
    errs = _graph_rank(0, 1, None, SHAPES[1], "fp8-block", 64)
    assert_rows([rows], "fp8-block")
    assert max(errs) <= EMULATED_BOUND["fp8-block"], errs


@pytest.mark.gpu
def test_triton_activation_matches_the_torch_ops():
    """The fused kernel against reference.swiglu + quant.quantize_fp8_tokens on random rows:
    scales equal but for silu's last bits, FP8 codes equal but on rounding boundaries, dequantized
    rows within one FP8 step."""
    from vllm_megamoe import quant
    from vllm_megamoe.portable import activation as portable_activation
    torch.manual_seed(0)
    rows, inter = 300, 512
    gate_up = (torch.randn(rows, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(rows, device="cuda")
    ends = torch.tensor([100, 100, 250], dtype=torch.int32, device="cuda")  # rows 250.. are never read
    for clamp in (None, 2.5):
        q, s = portable_activation.swiglu_quantize_fp8(gate_up, w, ends, clamp)
        act = reference.swiglu(gate_up.float(), clamp, round_to_bf16=True) * w[:, None]
        q_ref, s_ref = quant.quantize_fp8_tokens(act, 128, "float")
        torch.testing.assert_close(s[:250], s_ref[:250], rtol=1e-6, atol=0)
        got = quant.dequantize_fp8_tokens(q[:250], s[:250])
        want = quant.dequantize_fp8_tokens(q_ref[:250], s_ref[:250])
        step = s_ref[:250].repeat_interleave(128, dim=1) * 32  # one e4m3 step at the top of the range
        assert ((got - want).abs() <= step).all()
        # A group's scale may differ from the reference's in its last bit (silu's exp), which
        # changes every dequantized value of the group by as much; the FP8 codes themselves
        # differ only where the value sits on a rounding boundary.
        assert (q[:250].view(torch.uint8) == q_ref[:250].view(torch.uint8)).float().mean() > 0.999


@pytest.mark.gpu
def test_triton_reduce_matches_the_torch_ops(monkeypatch):
    """VLLM_MEGAMOE_PORTABLE_KERNELS=reduce=triton: the top-k reduce kernel against the torch version on
    random combine slots with masked routes, and the portable path with it (eager and captured)."""
    from vllm_megamoe.portable import combine as portable_combine
    shape = SHAPES[1]
    buf = SymmBuffer(shape, 300, None, format="bf16", device="cuda:0")
    try:
        torch.manual_seed(0)
        k, h = shape.topk, shape.hidden
        for t in (1, 77, 300):
            buf.view("combine").copy_(torch.randn_like(buf.view("combine"), dtype=torch.float32).to(torch.bfloat16))
            idx = torch.randint(-1, shape.num_experts, (t, k), device="cuda", dtype=torch.int32)
            want = portable._reduce(buf, idx, t, h)
            got = portable_combine.reduce_slots(buf, idx, h)
            # The same FP32 sums in slot order: equal but where torch's reduction order differs
            # in the last bit (then one BF16 step at most).
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
            assert (got == want).float().mean() > 0.999
    finally:
        buf.destroy()
    monkeypatch.setenv("VLLM_MEGAMOE_PORTABLE_KERNELS", "reduce=triton")
    for fmt in ("bf16", "fp8-block"):
        assert_rows([_rank_main(0, 1, None, shape, fmt, "padded")], fmt)
        errs = _graph_rank(0, 1, None, shape, fmt, 64)
        assert max(errs) <= EMULATED_BOUND[fmt], errs
