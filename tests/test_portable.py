import os
from dataclasses import replace

import pytest
import torch

from vllm_megamoe import BarrierTimeoutError, ExpertWeights, MegaMoEError, MoEShape, SymmBuffer, ops, portable
from vllm_megamoe.launch import RankFailed, run_ranks

from portable_cases import assert_rows, check_rank, make_case

SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=8, topk=3)


def _cases(world):
    odd = [13, 0, 7, 29, 1, 5, 11, 3][:world]
    return [([16] * world, "uniform", 1), ([40] * world, "skewed", 2),
            ([9] * world, "masked", 3), (odd, "uniform", 4), (odd[::-1], "masked", 5)]


def _rank_main(rank, world, group, fmt, mode):
    return check_rank(rank, world, group, SHAPE, fmt, _cases(world), mode=mode)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_single_rank(fmt, mode):
    rows = check_rank(0, 1, None, SHAPE, fmt, _cases(1), mode=mode)
    assert_rows([rows], fmt)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_multi_rank_cpu(world, fmt):
    rows = run_ranks(_rank_main, world, (fmt, "exact"), timeout_s=240)
    assert_rows(rows, fmt)


def test_multi_rank_cpu_padded_mode():
    rows = run_ranks(_rank_main, 2, ("fp8-block", "padded"), timeout_s=240)
    assert_rows(rows, "fp8-block")


def _rank_repeated(rank, world, group):
    """Back-to-back calls with new inputs each time: no stale state between calls."""
    buf = SymmBuffer(SHAPE, 32, group, format="bf16")
    el = SHAPE.experts_per_rank(world)
    errs = []
    for call in range(6):
        weights, inputs = make_case(SHAPE, "bf16", [32 - 5 * call, 3 + call], "masked", 100 + call)
        x, idx, tw = inputs[rank]
        y = portable.mega_moe(x, idx, tw, weights.experts(rank * el, el), buf)
        from vllm_megamoe import reference
        w13, w2 = weights.dequantize()
        errs.append(reference.relative_error(y, reference.moe_forward(x, idx, tw, w13, w2, emulate="bf16")))
    buf.destroy()
    return errs


def test_back_to_back_calls():
    for errs in run_ranks(_rank_repeated, 2, timeout_s=240):
        assert max(errs) < 1e-2, errs


def _rank_dies(rank, world, group, shm_dir):
    os.environ["VLLM_MEGAMOE_SHM_DIR"] = shm_dir
    buf = SymmBuffer(SHAPE, 8, group, format="bf16", timeout_s=3)
    left = sorted(os.listdir(shm_dir))
    if rank == 1:
        os._exit(17)  # dies before its next call: rank 0 must not hang
    weights, inputs = make_case(SHAPE, "bf16", [8, 8], "uniform", 7)
    x, idx, tw = inputs[rank]
    try:
        portable.mega_moe(x, idx, tw, weights.experts(0, 4), buf)
    except BarrierTimeoutError as exc:
        return ("timeout", str(exc), left)
    return ("no error", "", left)


def test_dead_rank_raises_timeout_and_leaves_no_files(tmp_path):
    res = run_ranks(_rank_dies, 2, (str(tmp_path),), timeout_s=120, allow_failures=True)
    assert isinstance(res[1], RankFailed)
    kind, message, files_after_create = res[0]
    assert kind == "timeout", res[0]
    assert "rank 0/2" in message and "'dispatch'" in message and "3 s" in message
    assert files_after_create == []          # unlinked as soon as every rank mapped them
    assert os.listdir(tmp_path) == []


def test_bad_input_is_rejected_before_communication():
    weights, inputs = make_case(SHAPE, "bf16", [8], "uniform", 1)
    x, idx, tw = inputs[0]
    buf = SymmBuffer(SHAPE, 8, None, format="bf16")
    with pytest.raises(ValueError, match="exceed the SymmBuffer's max_tokens_per_rank=8"):
        portable.mega_moe(torch.cat([x, x]), torch.cat([idx, idx]), torch.cat([tw, tw]), weights, buf)
    odd = SymmBuffer(SHAPE, 7, None, format="bf16")  # regions rounded up to 16 rows; the bound stays 7
    with pytest.raises(ValueError, match="8 tokens on rank 0 exceed the SymmBuffer's max_tokens_per_rank=7"):
        portable.mega_moe(x, idx, tw, weights, odd)
    odd.destroy()
    bad = idx.clone()
    bad[0, 0] = 8
    with pytest.raises(ValueError, match=r"outside \[-1, 8\)"):
        portable.mega_moe(x, bad, tw, weights, buf)
    with pytest.raises(ValueError, match="weights are 'fp8-block'"):
        fp8, _ = make_case(SHAPE, "fp8-block", [8], "uniform", 1)
        portable.mega_moe(x, idx, tw, fp8, buf)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        portable.mega_moe(x, idx, tw[:, :2], weights, buf)
    with pytest.raises(ValueError, match="x has dtype"):
        portable.mega_moe(x.to(torch.int32), idx, tw, weights, buf)
    big = ExpertWeights.from_float(torch.randn(8, 512, 256), torch.randn(8, 256, 256), "bf16")
    with pytest.raises(ValueError, match="does not fit the SymmBuffer"):
        portable.mega_moe(x, idx, tw, big, buf)
    with pytest.raises(ValueError, match="x has hidden size"):
        portable.mega_moe(x[:, :128], idx, tw, weights, buf)
    with pytest.raises(ValueError, match="weights.w13 is on meta but x is on cpu"):
        portable.mega_moe(x, idx, tw, replace(weights, w13=weights.w13.to("meta")), buf)
    for clamp in (-1.0, float("nan"), "7", True):
        with pytest.raises(ValueError, match="activation_clamp=.* must be None or a number >= 0"):
            portable.mega_moe(x, idx, tw, weights, buf, activation_clamp=clamp)
    with pytest.raises(ValueError, match="must be a positive, finite number of seconds"):
        SymmBuffer(SHAPE, 8, None, format="bf16", timeout_s=float("inf"))


def test_kernel_layout_weights_must_be_contiguous():
    weights, _ = make_case(SHAPE, "bf16", [8], "uniform", 1)
    inter = ops.prepare_weights(weights, "sm90")
    strided = inter.w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    with pytest.raises(ValueError, match="w13 .layout='interleaved'. must be contiguous"):
        replace(inter, w13=strided)
    replace(weights, w13=strided)  # the checkpoint layout is read through torch ops: any strides


def test_timeout_variable_is_named(monkeypatch):
    for raw in ("abc", "-1", "inf"):  # the plugin's settings refuse the same values the same way
        monkeypatch.setenv("VLLM_MEGAMOE_TIMEOUT_S", raw)
        with pytest.raises(ValueError, match=f"VLLM_MEGAMOE_TIMEOUT_S='{raw}': must be a positive, finite number"):
            SymmBuffer(SHAPE, 8, None, format="bf16")
    monkeypatch.setenv("VLLM_MEGAMOE_TIMEOUT_S", "7.5")
    assert SymmBuffer(SHAPE, 8, None, format="bf16").timeout_s == 7.5


def _rank_builds(rank, world, group, tokens, fmt):
    try:
        SymmBuffer(SHAPE, tokens[rank], group, format=fmt[rank])
    except ValueError as exc:
        return str(exc)
    return "built"


def test_ranks_with_different_buffers_are_refused():
    """A rank whose buffer differs (tokens, format) would read and write the wrong offsets on its
    peers: every rank refuses, naming what differs."""
    for msg in run_ranks(_rank_builds, 2, ([16, 64], ["bf16", "bf16"]), timeout_s=120):
        assert "ranks build different SymmBuffers" in msg
        assert msg.endswith("Differing: max_tokens_per_rank (rank 0: 16, rank 1: 64)")
    for msg in run_ranks(_rank_builds, 2, ([16, 16], ["bf16", "fp8-block"]), timeout_s=120):
        assert msg.endswith("Differing: format (rank 0: 'bf16', rank 1: 'fp8-block')")
    assert run_ranks(_rank_builds, 2, ([16, 16], ["bf16", "bf16"]), timeout_s=120) == ["built", "built"]


def _rank_padded_over_bound(rank, world, group):
    buf = SymmBuffer(SHAPE, 8, group, format="bf16")
    weights, inputs = make_case(SHAPE, "bf16", [4, 8], "uniform", 3)
    x, idx, tw = inputs[rank]
    try:
        portable.mega_moe(x, idx, tw, weights.experts(4 * rank, 4), buf, mode="padded")
    except MegaMoEError as exc:
        return str(exc)
    return "no error"


def test_eager_padded_call_raises_what_it_dropped():
    """mode='padded' with a peer over the bound (its own token count): the rank that dropped the
    peer's rows raises after the call instead of returning a wrong output."""
    res = run_ranks(_rank_padded_over_bound, 2, timeout_s=120)
    assert "max_peer_tokens" in res[0] and "dropped" in res[0]


def test_an_eager_call_raises_what_a_replayed_call_flagged():
    """A captured (padded) call cannot raise: it sets the workspace's error flag. The next eager
    call, in either mode, raises it (once) instead of letting dropped routes pass unnoticed."""
    (counts, routing, seed), = _cases(1)[:1]
    weights, inputs = make_case(SHAPE, "bf16", counts, routing, seed)
    buf = SymmBuffer(SHAPE, 64, None, format="bf16")
    flag = buf.view("workspace")[buf.layout.workspace_slot("error_flag")]
    for mode in ("exact", "padded"):
        flag.fill_(portable.ERROR_BAD_EXPERT_ID)  # as a replay that met an expert id out of range leaves it
        with pytest.raises(MegaMoEError, match="expert ids outside .* during a captured call"):
            portable.mega_moe(*inputs[0], weights, buf, mode=mode)
        assert int(flag.item()) == 0
        portable.mega_moe(*inputs[0], weights, buf, mode=mode)  # reported once
    buf.destroy()


def test_zero_tokens_single_rank():
    weights, _ = make_case(SHAPE, "fp8-block", [0], "uniform", 1)
    buf = SymmBuffer(SHAPE, 8, None)
    y = portable.mega_moe(torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(0, 3, dtype=torch.long),
                          torch.zeros(0, 3), weights, buf)
    assert y.shape == (0, 256)


def test_cuda_buffer_refuses_ranks_without_peer_access(monkeypatch):
    """The CUDA backend checks every rank's host and P2P access before allocating anything."""
    import torch.distributed as dist

    from vllm_megamoe import PeerAccessError

    buf = SymmBuffer.__new__(SymmBuffer)
    buf.group, buf.num_ranks, buf.rank, buf.device = object(), 2, 0, torch.device("cuda", 0)

    def gather(out, me, group=None):
        out[:] = peers
    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    peers = [("node-a", 0), ("node-b", 1)]
    with pytest.raises(PeerAccessError, match="span hosts.*all2all backends"):
        buf._check_peer_access()
    peers = [("node-a", 0), ("node-a", 1)]
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    with pytest.raises(PeerAccessError, match=r"rank 0 \(cuda:0\) cannot access rank 1's GPU \(cuda:1\)"):
        buf._check_peer_access()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert buf._check_peer_access() is False  # one host, one GPU per rank, peer access everywhere
    peers = [("node-a", 0), ("node-a", 0)]
    assert buf._check_peer_access() is True   # two ranks on one GPU: the cuda-ipc route


def test_cuda_ipc_backend_needs_a_cuda_device():
    with pytest.raises(ValueError, match="backend='cuda-ipc' needs a CUDA device"):
        SymmBuffer(SHAPE, 8, None, backend="cuda-ipc", device="cpu")
    with pytest.raises(ValueError, match="must be one of"):
        SymmBuffer(SHAPE, 8, None, backend="ipc")


@pytest.mark.parametrize("kernel", ["scatter", "activation", "reduce"])
def test_portable_kernel_settings_are_checked(monkeypatch, kernel):
    """VLLM_MEGAMOE_PORTABLE_KERNELS (developer key): auto / torch / triton for every kernel, or
    kernel=choice; auto is triton where it imports; a bad value names the variable."""
    from vllm_megamoe import settings
    from vllm_megamoe.portable import activation, combine
    var = "VLLM_MEGAMOE_PORTABLE_KERNELS"
    read = {"scatter": combine.scatter_setting, "activation": activation.activation_setting,
            "reduce": combine.reduce_setting}[kernel]
    other = next(k for k in settings.PORTABLE_KERNELS if k != kernel)
    for have_triton in (True, False):
        monkeypatch.setattr(settings, "triton_available", lambda: have_triton)
        monkeypatch.delenv(var, raising=False)
        assert read() == ("triton" if have_triton else "torch")
        for value in ("auto", " ", f"{kernel}=auto", f"torch,{kernel}=auto", f"{other}=torch"):
            monkeypatch.setenv(var, value)
            assert read() == ("triton" if have_triton else "torch"), value
        for value in ("torch", f"{kernel}=torch", f"triton,{kernel}=torch", f" {kernel} = TORCH "):
            monkeypatch.setenv(var, value)
            assert read() == "torch", value
        monkeypatch.setenv(var, f"{kernel}=triton")
        if have_triton:
            assert read() == "triton"
        else:
            with pytest.raises(ValueError, match=f"{var}: {kernel}=triton needs the triton package"):
                read()
    monkeypatch.setenv(var, "nccl")
    with pytest.raises(ValueError, match=f"{var}='nccl': 'nccl' must be one of"):
        read()
    monkeypatch.setenv(var, f"{kernel}=cub")
    with pytest.raises(ValueError, match=f"{var}='{kernel}=cub': {kernel}='cub' must be one of"):
        read()
    monkeypatch.setenv(var, "redcue=torch")
    with pytest.raises(ValueError, match="unknown kernel 'redcue' \\(did you mean 'reduce'\\?\\)"):
        read()


def _rank_with_shm_dir(rank, world, group, bad_dir):
    if rank == 1:
        os.environ["VLLM_MEGAMOE_SHM_DIR"] = bad_dir
    try:
        SymmBuffer(SHAPE, 8, group, format="bf16", timeout_s=5)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_a_rank_without_its_shm_dir_stops_every_rank(tmp_path):
    """One rank's missing VLLM_MEGAMOE_SHM_DIR is raised on both ranks (the peer does not wait in
    a collective), naming the variable and the rank."""
    missing = str(tmp_path / "missing")
    for msg in run_ranks(_rank_with_shm_dir, 2, (missing,), timeout_s=120):
        assert msg == (f"megamoe: SymmBuffer not created: rank 1: VLLM_MEGAMOE_SHM_DIR={missing!r} is not "
                       "a directory (the CPU buffer's shared-memory files live there)")


def _rank_with_env(rank, world, group, name, value):
    if rank == 1:
        os.environ[name] = value
    try:
        SymmBuffer(SHAPE, 8, group, format="bf16", timeout_s=5)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_an_unknown_megamoe_variable_stops_every_rank():
    """A misspelt VLLM_MEGAMOE_* variable would do nothing: the core refuses it (callers that
    never load the plugin included), on every rank, naming the closest known one."""
    for msg in run_ranks(_rank_with_env, 2, ("VLLM_MEGAMOE_TIMEOUT", "3"), timeout_s=120):
        assert msg.startswith("megamoe: SymmBuffer not created: rank 1: unknown environment variable "
                              "VLLM_MEGAMOE_TIMEOUT (did you mean 'VLLM_MEGAMOE_TIMEOUT_S'?)"), msg
    assert run_ranks(_rank_with_env, 2, ("VLLM_MEGAMOE_TIMEOUT_S", "30"), timeout_s=120) == ["built", "built"]


def test_from_float_refuses_integer_weights():
    with pytest.raises(ValueError, match="w13 has dtype torch.int64"):
        ExpertWeights.from_float(torch.ones(8, 256, 256, dtype=torch.int64), torch.ones(8, 256, 128), "bf16")


def test_dense_weights_copy_only_what_needs_converting():
    """The grouped (CUDA) path reads BF16 checkpoint-layout weights in place instead of keeping
    a second copy of every expert; FP8 or interleaved weights get one dense copy, which a weight
    update (overwrite_weights_) refills in place: a CUDA graph may hold its address."""
    from vllm_megamoe.weights import overwrite_weights_, transform_weights_for_mega_moe
    gen = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(4, 256, 128, generator=gen), torch.randn(4, 128, 128, generator=gen)
    bf16 = ExpertWeights.from_float(w13, w2, "bf16")
    dense13, dense2 = portable._dense_weights(bf16, torch.bfloat16)
    assert dense13.data_ptr() == bf16.w13.data_ptr() and dense2.data_ptr() == bf16.w2.data_ptr()
    for weights in (ExpertWeights.from_float(w13, w2, "fp8-block"), transform_weights_for_mega_moe(bf16)):
        first = portable._dense_weights(weights, torch.bfloat16)
        assert torch.equal(first[0].float(), weights.dequantize()[0].bfloat16().float())
        assert portable._dense_weights(weights, torch.bfloat16)[0] is first[0]  # cached
        stale = first[0].clone()
        update = replace(weights, w13=weights.w13.flip(0).contiguous())
        overwrite_weights_(weights, update)
        again = portable._dense_weights(weights, torch.bfloat16)[0]
        assert again is first[0]  # the same tensor, refilled
        assert torch.equal(again.float(), weights.dequantize()[0].bfloat16().float())
        assert not torch.equal(again, stale)


def test_overwrite_refills_what_a_forward_pass_derived():
    """A dense copy first made in a forward pass under torch.inference_mode (as vLLM runs the
    model) is an inference tensor; a weight update outside that mode still refills it."""
    from vllm_megamoe.weights import overwrite_weights_
    gen = torch.Generator().manual_seed(8)
    weights = ExpertWeights.from_float(torch.randn(2, 256, 128, generator=gen),
                                       torch.randn(2, 128, 128, generator=gen), "fp8-block")
    with torch.inference_mode():
        dense = portable._dense_weights(weights, torch.float32)[1]
    assert dense.is_inference()
    update = replace(weights, w2=weights.w2.flip(0).contiguous(), w2_scale=weights.w2_scale.flip(0).contiguous())
    overwrite_weights_(weights, update)
    assert torch.equal(dense, update.dequantize()[1])
