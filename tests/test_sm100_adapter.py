"""SM100 (Blackwell) adapter: conversion facts, activation staging, discovery, and the calls the
adapter makes into DeepGEMM (checked against a recording fake; no SM100 GPU here)."""
import importlib.util
import math

import pytest
import torch

from vllm_megamoe import ops, quant, reference
from vllm_megamoe.convert.layouts import to_kernel_layout
from vllm_megamoe.errors import UnsupportedError
from vllm_megamoe.shape import MoEShape
from vllm_megamoe.sm100 import (BufferSpec, Sm100MoE, activation_spec, convert_experts,
                                create_worker_buffers, discovery, from_kernel_experts)
from vllm_megamoe.sm100 import act_quant, buffer as sm100_buffer, sf_layout

from sm100_fake_deepgemm import FakeGroup, make_fake

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# -- helpers: expected layouts written from the reference-doc facts ------------------------
def interleaved_source_row(r, n):
    pair, within = divmod(r, 16)
    return pair * 8 + within % 8 + (n // 2 if within >= 8 else 0)


def utccp_source_row(r):
    g, rem = divmod(r, 128)
    i, j = divmod(rem, 4)
    return g * 128 + j * 32 + i


def known_mxfp4(e, n, k, gen):
    """Float weights whose MXFP4 codes and exponents are known: (w, codes [e,n,k], exps [e,n,k/32])."""
    codes = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
    codes.view(e, n, k // 32, 32)[..., 5] = 7 | (torch.randint(0, 2, (e, n, k // 32), generator=gen,
                                                             dtype=torch.uint8) << 3)  # |6| in every group
    exps = torch.randint(120, 134, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    mag = torch.tensor(E2M1)[(codes & 7).long()]
    val = torch.where((codes & 8) != 0, -mag, mag)
    w = val * torch.exp2(exps.float() - 127).repeat_interleave(32, dim=-1)
    return w, codes, exps


def expected_packed(codes):
    c = codes.int()
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def expected_sf_int(exps):
    e = exps.long().view(*exps.shape[:-1], -1, 4)
    v = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
    return v.to(torch.int64)


def assert_kernel_sf_strides(sf, mn):
    assert sf.dtype == torch.int32
    assert sf.stride(-2) == 1 and sf.stride(-1) == mn and sf.stride(0) == mn * sf.shape[-1]


# -- conversion ------------------------------------------------------------------------------
def test_mxfp4_conversion_matches_reference_facts(gen):
    e, i, h = 2, 128, 256
    w13, c13, x13 = known_mxfp4(e, 2 * i, h, gen)
    w2, c2, x2 = known_mxfp4(e, h, i, gen)
    out = convert_experts(w13, w2, fmt="mxfp4")
    p13, p2 = expected_packed(c13), expected_packed(c2)
    s13, s2 = expected_sf_int(x13), expected_sf_int(x2)
    got13 = out.w13.view(torch.uint8)
    got_sf13 = out.w13_sf.long() & 0xFFFFFFFF
    for r in range(2 * i):
        src = interleaved_source_row(r, 2 * i)
        assert torch.equal(got13[:, r], p13[:, src]), r                        # interleave + FP4 packing
        usrc = interleaved_source_row(utccp_source_row(r), 2 * i)              # interleave, then UTCCP
        assert torch.equal(got_sf13[:, r], s13[:, usrc] & 0xFFFFFFFF), r       # UE8M0 packing
    assert torch.equal(out.w2.view(torch.uint8), p2)                           # L2 order unchanged
    got_sf2 = out.w2_sf.long() & 0xFFFFFFFF
    for r in range(h):
        assert torch.equal(got_sf2[:, r], s2[:, utccp_source_row(r)] & 0xFFFFFFFF), r
    assert tuple(out.w13.shape) == (e, 2 * i, h // 2) and out.w13.dtype == torch.int8
    assert tuple(out.w13_sf.shape) == (e, 2 * i, h // 128)
    assert_kernel_sf_strides(out.w13_sf, 2 * i)
    assert_kernel_sf_strides(out.w2_sf, h)


def test_first_bytes_of_a_known_row():
    # Row 0, K=0..3 = [6, -0.5, 1, 0] with scale 1: codes 7, 9, 2, 0 -> bytes 0x97, 0x02.
    w13 = torch.zeros(1, 256, 128)
    w13[0, 0, :4] = torch.tensor([6.0, -0.5, 1.0, 0.0])
    w13[0, :, 4] = 6.0  # every row's first group has amax 6 -> exponent 127 + 0
    out = convert_experts(w13, torch.full((1, 128, 128), 6.0), fmt="mxfp4")
    assert out.w13.view(torch.uint8)[0, 0, :2].tolist() == [0x97, 0x02]
    assert out.w13_sf[0, 0, 0].item() & 0xFF == 127


def test_bf16_conversion_interleaves_l1_only(gen):
    w13 = torch.randn(2, 256, 128, generator=gen).bfloat16()
    w2 = torch.randn(2, 128, 128, generator=gen).bfloat16()
    out = convert_experts(w13, w2, fmt="bf16")
    assert out.w13_sf is None and out.w2_sf is None and out.mma_type == "bf16xbf16"
    for r in range(256):
        assert torch.equal(out.w13[:, r], w13[:, interleaved_source_row(r, 256)])
    assert torch.equal(out.w2, w2)


def mxfp4_bound(src):
    """Per-element MXFP4 error bound: half the code spacing at the value, at its group's scale."""
    g = src.reshape(*src.shape[:-1], -1, 32)
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6)))
    m = g.abs() / scale
    half_gap = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0))
    return (half_gap * scale).reshape(src.shape) * (1 + 1e-6)


@pytest.mark.parametrize("source", ["bf16", "fp8-block"])
def test_dequantized_conversion_within_mxfp4_error(gen, source):
    e, i, h = 3, 256, 512
    w13 = torch.randn(e, 2 * i, h, generator=gen) * torch.rand(e, 2 * i, 1, generator=gen) * 3
    w2 = torch.randn(e, h, i, generator=gen) * 0.02
    if source == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        out = convert_experts(w13, w2, fmt="mxfp4", chunk_experts=2)
        ref13, ref2 = w13.float(), w2.float()
    else:
        q13, s13 = quant.quantize_fp8_blocks(w13)
        q2, s2 = quant.quantize_fp8_blocks(w2)
        out = convert_experts(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2, chunk_experts=2)
        assert out.format == "mxfp4"  # FP8 checkpoints default to fp8xfp4
        ref13 = quant.dequantize_fp8_blocks(q13, s13)
        ref2 = quant.dequantize_fp8_blocks(q2, s2)
    d13, d2 = out.dequantize()
    assert bool(((d13 - ref13).abs() <= mxfp4_bound(ref13)).all())
    assert bool(((d2 - ref2).abs() <= mxfp4_bound(ref2)).all())
    rel = (d13 - ref13).norm() / ref13.norm()
    assert 0.01 < rel < 0.15  # really quantized, and about as well as MXFP4 can


def test_same_values_as_converter_and_load_from_converted_checkpoint(gen):
    w13 = torch.randn(2, 256, 512, generator=gen).bfloat16()
    w2 = torch.randn(2, 512, 128, generator=gen).bfloat16()
    mine = convert_experts(w13, w2, fmt="mxfp4")
    theirs = to_kernel_layout(w13, w2, arch="sm100", fmt="mxfp4")
    for a, b in [(mine.w13, theirs.w13), (mine.w2, theirs.w2), (mine.w13_sf, theirs.w13_scale),
                 (mine.w2_sf, theirs.w2_scale)]:
        assert torch.equal(a, b)  # same values...
    # ...but the converter stores the scales K-major, which the kernel refuses:
    assert sf_layout.layout_problem(theirs.w13_scale, 256, 512, 2) is not None
    loaded = from_kernel_experts(theirs.w13, theirs.w2, theirs.w13_scale, theirs.w2_scale, fmt="mxfp4")
    assert sf_layout.layout_problem(loaded.w13_sf, 256, 512, 2) is None
    assert torch.equal(loaded.w13_sf, mine.w13_sf)
    stored = mine.to_kernel_experts()
    assert stored.w13_scale.is_contiguous() and torch.equal(stored.w13_scale, mine.w13_sf)


def test_sf_layout_errors_say_what_is_wrong():
    sf = torch.zeros(2, 256, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="not MN-major.*to_mn_major"):
        sf_layout.check_sf("w13_sf", sf, 256, 512, 2)
    with pytest.raises(ValueError, match="expected torch.int32"):
        sf_layout.check_sf("w13_sf", sf.float(), 256, 512, 2)
    odd = sf_layout.empty_mn_major(2, 6, 3)
    assert odd.stride() == (24, 1, 8)  # MN padded to 16 bytes
    assert sf_layout.layout_problem(odd, 6, 384, 2) is None


def test_converted_weights_equal_deepgemm_transform(gen):
    if importlib.util.find_spec("deep_gemm") is None:
        pytest.skip("DeepGEMM is not importable here")
    try:
        import deep_gemm
        transform = deep_gemm.transform_weights_for_mega_moe
    except Exception as exc:  # importable but not usable (e.g. no CUDA)
        pytest.skip(f"DeepGEMM does not load here: {exc}")
    w13 = torch.randn(2, 256, 512, generator=gen).bfloat16()
    w2 = torch.randn(2, 512, 128, generator=gen).bfloat16()
    q13, s13 = quant.quantize_mxfp4(w13)
    q2, s2 = quant.quantize_mxfp4(w2)
    (t13, ts13), (t2, ts2) = transform((q13, sf_layout.to_mn_major(s13)),
                                       (q2, sf_layout.to_mn_major(s2)))
    mine = convert_experts(w13, w2, fmt="mxfp4")
    for a, b in [(mine.w13, t13), (mine.w2, t2), (mine.w13_sf, ts13), (mine.w2_sf, ts2)]:
        assert torch.equal(a, b.cpu()) and a.stride() == b.stride()


# -- activation staging ----------------------------------------------------------------------
def stage(x, chunk_rows):
    t, h = x.shape
    out_x = torch.empty(t + 3, h, dtype=torch.float8_e4m3fn)
    out_sf = torch.empty(t + 3, h // 128, dtype=torch.int32)
    act_quant.stage_fp8(x, out_x, out_sf, act_quant.ActScratch(h, chunk_rows, "cpu"))
    return out_x[:t], out_sf[:t]


def test_stage_fp8_equals_oracle_quantization(gen):
    x = (torch.randn(37, 512, generator=gen) * torch.logspace(-6, 4, 37).unsqueeze(1)).bfloat16()
    x[3] = 0
    x[5, :32] = 0
    q, sf = stage(x, chunk_rows=8)  # several chunks, a partial last one
    q_ref, s_ref = quant.quantize_fp8_tokens(x, 32, "ue8m0")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    exps = (torch.log2(s_ref).round() + 127).to(torch.uint8)
    assert torch.equal(sf, quant.pack_ue8m0(exps))
    # byte b of int j covers K group 4j + b
    assert (sf[0, 1].item() >> 16) & 0xFF == exps[0, 6].item()


def test_stage_fp8_power_of_two_ceiling_is_exact():
    # amax/448 exactly a power of two, one ulp above, and just below
    amax = torch.tensor([448.0, 448.0 * 2 ** -10, 448.0 * (1 + 2 ** -7), 448.0 * (1 - 2 ** -8)])
    x = torch.zeros(4, 128)
    x[:, 0] = amax
    _, sf = stage(x.bfloat16(), chunk_rows=4)
    got = (sf[:, 0] & 0xFF).tolist()
    want = [127 + math.ceil(math.log2(float(a.bfloat16()) / 448)) for a in amax]
    assert got == want == [127, 117, 128, 127]


# -- discovery and the path oracle ---------------------------------------------------------
@pytest.fixture
def modules(monkeypatch):
    """Install fake modules by name for discovery; returns the dict to fill."""
    table = {}

    def fake_import(name):
        if name not in table:
            raise ImportError(f"No module named {name!r}")
        return table[name]
    monkeypatch.setattr(discovery, "_import", fake_import)
    discovery.reset()
    yield table
    discovery.reset()


def test_discovery_prefers_installed_deep_gemm(modules):
    modules["deep_gemm"] = make_fake("2.8.1")
    modules["vllm.third_party.deep_gemm"] = make_fake("2.6.1")
    api, _ = discovery.find_deep_gemm()
    assert api.source == "deep_gemm" and api.version == "2.8.1" and api.supports_base
    assert api.buffer_factory == "SymmBuffer"
    assert "2.8.1 (deep_gemm)" in discovery.describe()


def test_discovery_falls_back_to_vllm_bundled_copy(modules):
    import types
    modules["deep_gemm"] = types.ModuleType("deep_gemm")  # an old DeepGEMM without mega
    modules["vllm.third_party.deep_gemm"] = make_fake("2.6.1")
    api, reasons = discovery.find_deep_gemm()
    assert api.source == "vllm.third_party.deep_gemm"
    assert api.buffer_factory == "get_symm_buffer_for_mega_moe"  # SymmBuffer needs ring tokens
    assert not api.supports_base
    assert "has no mega API" in reasons[0]


def test_discovery_none_message_says_what_to_install(modules):
    api, reasons = discovery.find_deep_gemm()
    assert api is None and len(reasons) == 2
    with pytest.raises(UnsupportedError, match="install DeepGEMM.*VLLM_MEGAMOE_FALLBACK=portable"):
        discovery.require_deep_gemm()


@pytest.fixture
def sm100_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.delenv("VLLM_MEGAMOE_PATH", raising=False)
    monkeypatch.delenv("VLLM_MEGAMOE_FALLBACK", raising=False)
    return torch.device("cuda", 0)


SHAPE = MoEShape(hidden=4096, intermediate=2048, num_experts=256, topk=6)


def test_select_path_on_sm100(modules, sm100_gpu, monkeypatch):
    with pytest.raises(UnsupportedError, match="install DeepGEMM"):
        ops.select_path(SHAPE, "fp8-block", sm100_gpu, 8)
    monkeypatch.setenv("VLLM_MEGAMOE_FALLBACK", "portable")
    path, why = ops.select_path(SHAPE, "fp8-block", sm100_gpu, 8)
    assert path == "portable" and "VLLM_MEGAMOE_FALLBACK=portable" in why
    monkeypatch.setenv("VLLM_MEGAMOE_PATH", "sm100")
    with pytest.raises(UnsupportedError, match="install DeepGEMM"):
        ops.select_path(SHAPE, "fp8-block", sm100_gpu, 8)
    modules["deep_gemm"] = make_fake("2.8.1")
    discovery.reset()
    path, why = ops.select_path(SHAPE, "fp8-block", sm100_gpu, 8)
    assert path == "sm100" and "mxfp4" in why and "2.8.1" in why
    with pytest.raises(UnsupportedError, match="intermediate=768"):
        ops.select_path(MoEShape(2048, 768, 128, 8), "fp8-block", sm100_gpu, 8)
    monkeypatch.delenv("VLLM_MEGAMOE_PATH")
    path, why = ops.select_path(MoEShape(2048, 768, 128, 8), "fp8-block", sm100_gpu, 8)
    assert path == "portable" and "intermediate=768" in why
    assert ops.select_path(MoEShape(2048, 768, 128, 8), "bf16", sm100_gpu, 8)[0] == "sm100"


# -- the adapter against the recording fake -----------------------------------------------
H, I, E, K = 256, 512, 4, 3


def make_layer(fake, gen, fmt="mxfp4", max_tokens=40, activation=None, buffers=None, spec_k=K):
    api, _ = discovery.inspect_module(fake, "deep_gemm")
    w13 = torch.randn(E, 2 * I, H, generator=gen).bfloat16() * 0.1
    w2 = torch.randn(E, H, I, generator=gen).bfloat16() * 0.1
    w = convert_experts(w13, w2, fmt=fmt)
    spec = BufferSpec.of(MoEShape(H, I, E, spec_k), w.mma_type, max_tokens)
    if buffers is None:
        buffers = create_worker_buffers(api, FakeGroup(), [spec])
    return Sm100MoE(w, buffers[spec], activation=activation), buffers


def inputs(gen, t, k=K):
    x = (torch.randn(t, H, generator=gen) * 2).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
    idx[1, 0] = -1  # a masked route
    w = torch.rand(t, k, generator=gen)
    return x, idx.to(torch.int32), w


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("version", ["2.8.1", "2.6.1"])
def test_forward_through_fake_matches_reference(gen, fmt, version):
    fake = make_fake(version)
    layer, _ = make_layer(fake, gen, fmt, activation=activation_spec("silu", clamp=4.0))
    x, idx, w = inputs(gen, 29)
    out = torch.full((40, H), float("nan"), dtype=torch.bfloat16)
    y = layer(x, idx, w, out=out)
    assert y.data_ptr() == out.data_ptr() and y.shape == (29, H)
    d13, d2 = layer.weights.dequantize()
    ref = reference.moe_forward(x.float(), idx, w, d13, d2, activation_clamp=4.0)
    err = (y.float() - ref).norm() / ref.norm()
    assert err < (0.05 if fmt == "mxfp4" else 0.01), err
    counts = torch.bincount(idx[idx >= 0].long(), minlength=E).int()
    assert torch.equal(layer.recv_stats, counts)
    assert torch.equal(layer.take_recv_stats(), counts) and int(layer.recv_stats.sum()) == 0


def test_kernel_call_arguments(gen):
    fake = make_fake("2.8.1", compute=False)
    layer, bufs = make_layer(fake, gen, activation=activation_spec("silu", clamp=7.0))
    x, idx, w = inputs(gen, 9)
    out = torch.empty(40, H, dtype=torch.bfloat16)
    layer(x, idx, w, out=out)
    names = [c[0] for c in fake.calls]
    assert names == ["SymmBuffer", "fp8_fp4_mega_moe"]
    _, create, raw_create = fake.calls[0]
    assert create["num_experts"] == E and create["num_topk"] == K and create["hidden"] == H
    assert create["intermediate_hidden"] == I and create["mma_type"] == "fp8xfp4"
    assert create["num_max_tokens_per_rank"] == 40 and create["base"] is None
    _, call, raw = fake.calls[1]
    assert call["y"] == {"dtype": torch.bfloat16, "shape": (9, H), "stride": (H, 1),
                         "ptr": out.data_ptr(), "contiguous": True}
    (w13, sf13), (w2, sf2) = call["l1_weights"], call["l2_weights"]
    assert (w13["dtype"], w13["shape"], w13["ptr"]) == (torch.int8, (E, 2 * I, H // 2),
                                                        layer.weights.w13.data_ptr())
    assert (w2["dtype"], w2["shape"]) == (torch.int8, (E, H, I // 2))
    assert (sf13["dtype"], sf13["shape"], sf13["stride"]) == (torch.int32, (E, 2 * I, H // 128),
                                                              (2 * I * H // 128, 1, 2 * I))
    assert (sf2["shape"], sf2["stride"]) == ((E, H, I // 128), (H * I // 128, 1, H))
    assert raw["sym_buffer"] is bufs[next(iter(bufs))].dg
    assert raw["cumulative_local_expert_recv_stats"] is layer.recv_stats
    assert call["recipe"] == (1, 1, 32) and call["activation"] == "swiglu"
    assert call["activation_clamp"] == 7.0 and call["fast_math"] is True
    assert (call["activation_alpha"], call["activation_beta"]) == (1.0, 0.0)  # defaults, not passed
    # inputs staged into the buffer the kernel reads
    dg = raw["sym_buffer"]
    assert torch.equal(dg.topk_idx[:9], idx.long()) and torch.equal(dg.topk_weights[:9], w)
    q, s = quant.quantize_fp8_tokens(x, 32, "ue8m0")
    assert torch.equal(dg.x[:9].view(torch.uint8), q.view(torch.uint8))


def test_one_buffer_shared_by_layers_and_base_for_other_specs(gen):
    fake = make_fake("2.8.1", compute=False)
    api, _ = discovery.inspect_module(fake, "deep_gemm")
    s_fp4 = BufferSpec.of(MoEShape(H, I, E, K), "fp8xfp4", 40)
    s_bf16 = BufferSpec.of(MoEShape(H, I, E, K), "bf16xbf16", 40)
    bufs = create_worker_buffers(api, FakeGroup(), [s_fp4, s_fp4, s_bf16, s_fp4])
    assert [c[0] for c in fake.calls] == ["SymmBuffer", "SymmBuffer"]  # one per distinct spec
    first, second = fake.calls[0][2], fake.calls[1][2]
    assert first["base"] is None and first["mma_type"] == "bf16xbf16"  # the larger one first
    assert second["base"] is bufs[s_bf16].dg
    assert bufs[s_fp4].dg.buffer.data_ptr() == bufs[s_bf16].dg.buffer.data_ptr()  # same memory
    a, _ = make_layer(fake, gen, buffers=bufs)
    b, _ = make_layer(fake, gen, buffers=bufs)
    c, _ = make_layer(fake, gen, "bf16", buffers=bufs)
    x, idx, w = inputs(gen, 5)
    for layer in (a, b, c, a):
        layer(x, idx, w)
    kernel_calls = [(n, raw["sym_buffer"]) for n, _, raw in fake.calls[2:]]
    assert [n for n, _ in kernel_calls] == ["fp8_fp4_mega_moe"] * 2 + ["bf16_mega_moe",
                                                                       "fp8_fp4_mega_moe"]
    assert kernel_calls[0][1] is kernel_calls[1][1] is kernel_calls[3][1] is bufs[s_fp4].dg
    assert kernel_calls[2][1] is bufs[s_bf16].dg
    assert a.buffer.scratch is c.buffer.scratch or c.buffer.scratch is None


def test_without_base_each_spec_gets_a_buffer_with_a_warning(gen, caplog):
    fake = make_fake("2.6.1", compute=False)
    api, _ = discovery.inspect_module(fake, "deep_gemm")
    specs = [BufferSpec.of(MoEShape(H, I, E, K), m, 40) for m in ("fp8xfp4", "bf16xbf16")]
    with caplog.at_level("WARNING"):
        bufs = create_worker_buffers(api, FakeGroup(), specs)
    assert len({id(b.dg) for b in bufs.values()}) == 2 and "no SymmBuffer(base=)" in caplog.text


def test_misspelt_variable_refused_before_deepgemm_is_called(monkeypatch):
    fake = make_fake("2.8.1", compute=False)
    api, _ = discovery.inspect_module(fake, "deep_gemm")
    spec = BufferSpec.of(MoEShape(H, I, E, K), "fp8xfp4", 40)
    monkeypatch.setenv("VLLM_MEGAMOE_MAX_TOKEN_PER_RANK", "64")  # the key is max_tokens_per_rank
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_MAX_TOKEN_PER_RANK.*VLLM_MEGAMOE_MAX_TOKENS_PER_RANK"):
        create_worker_buffers(api, FakeGroup(), [spec])
    assert fake.calls == []  # no rendezvous started: no rank waits for this one
    monkeypatch.delenv("VLLM_MEGAMOE_MAX_TOKEN_PER_RANK")
    create_worker_buffers(api, FakeGroup(), [spec])
    assert [c[0] for c in fake.calls] == ["SymmBuffer"]


def allocations_during(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [ev for ev in prof.events() if getattr(ev, "cpu_memory_usage", 0) > 0]


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_forward_allocates_nothing(gen, fmt):
    fake = make_fake("2.8.1", compute=False)
    layer, _ = make_layer(fake, gen, fmt, max_tokens=2000)
    layer.buffer.scratch = act_quant.ActScratch(H, 64, "cpu") if fmt == "mxfp4" else None
    x, idx, w = inputs(gen, 150)  # three quantization chunks
    out = torch.empty(2000, H, dtype=torch.bfloat16)
    layer(x, idx, w, out=out)  # warm-up
    assert allocations_during(lambda: layer(x, idx, w, out=out)) == []
    # without `out` the only allocation is y itself
    allocs = allocations_during(lambda: layer(x, idx, w))
    assert [ev.cpu_memory_usage for ev in allocs] == [150 * H * 2]


def test_buffer_creation_refused_during_graph_capture(gen, monkeypatch):
    monkeypatch.setattr(sm100_buffer, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        make_layer(make_fake("2.8.1"), gen)


def test_activation_mapping(gen):
    fake = make_fake("2.8.1", compute=False)
    oai = activation_spec("swigluoai")
    assert (oai.clamp, oai.alpha, oai.beta) == (7.0, 1.702, 1.0)
    layer, _ = make_layer(fake, gen, activation=oai)
    x, idx, w = inputs(gen, 4)
    layer(x, idx, w)
    call = fake.calls[-1][1]
    assert (call["activation_alpha"], call["activation_beta"], call["activation_clamp"]) == (
        1.702, 1.0, 7.0)
    with pytest.raises(UnsupportedError, match="activation_alpha.*2.8"):
        make_layer(make_fake("2.6.1"), gen, activation=oai)
    with pytest.raises(UnsupportedError, match="'gelu' is not supported.*SwiGLU only"):
        activation_spec("gelu")
    with pytest.raises(ValueError, match="clamp -1"):
        activation_spec("silu", clamp=-1)
    from types import SimpleNamespace
    from vllm_megamoe.sm100 import activation_from_hf_config
    assert activation_from_hf_config(SimpleNamespace(swiglu_limit=10)).clamp == 10.0
    assert activation_from_hf_config(SimpleNamespace()).clamp is None


def test_call_errors_say_what_to_change(gen):
    fake = make_fake("2.8.1", compute=False)
    layer, bufs = make_layer(fake, gen, max_tokens=10)
    assert layer.buffer.max_tokens == 384  # DeepGEMM aligns the tokens
    x, idx, w = inputs(gen, 385)
    with pytest.raises(ValueError, match="385 tokens exceeds.*384"):
        layer(x, idx, w)
    with pytest.raises(ValueError, match="x must be bf16"):
        layer(x[:4].float(), idx[:4], w[:4])
    w13 = torch.randn(E, 2 * I, H).bfloat16()
    bf = convert_experts(w13, torch.randn(E, H, I).bfloat16(), fmt="bf16")
    with pytest.raises(ValueError, match="bf16xbf16.*buffer was made for fp8xfp4"):
        Sm100MoE(bf, next(iter(bufs.values())))


def test_ops_mega_moe_runs_the_sm100_branch(gen):
    fake = make_fake("2.8.1")
    layer, _ = make_layer(fake, gen)
    x, idx, w = inputs(gen, 6)
    y = ops.mega_moe(x, idx, w, layer.weights, layer.buffer, path="sm100")
    assert fake.calls[-1][0] == "fp8_fp4_mega_moe" and y.shape == (6, H)
    with pytest.raises(UnsupportedError, match="DeepGEMM buffer"):
        ops.mega_moe(x, idx, w, layer.weights, object(), path="sm100")


def test_doctor_reports_deep_gemm(modules):
    from vllm_megamoe import doctor
    modules["vllm.third_party.deep_gemm"] = make_fake("2.8.1")
    rows = dict(doctor.collect())
    assert rows["deep_gemm (SM100)"].startswith("2.8.1 (vllm.third_party.deep_gemm)")


# -- on any CUDA GPU (not SM100): the torch side of the per-call op ------------------------
@pytest.mark.gpu
def test_cuda_staging_bitwise_allocation_free_and_graph_capturable(gen):
    dev = torch.device("cuda", torch.cuda.current_device())
    fake = make_fake("2.8.1", compute=False)
    api, _ = discovery.inspect_module(fake, "deep_gemm")
    spec = BufferSpec.of(MoEShape(H, I, E, K), "fp8xfp4", 500)

    class CudaFake:  # the fake's SymmBuffer with its views moved to the GPU
        def __init__(self, *a, **kw):
            self.inner = fake.SymmBuffer(*a, **kw)
            for name in ("x", "x_sf", "topk_idx", "topk_weights"):
                setattr(self, name, torch.zeros_like(getattr(self.inner, name), device=dev))
            self.num_max_tokens_per_rank = self.inner.num_max_tokens_per_rank
    fake.SymmBuffer = CudaFake
    buf = sm100_buffer.Sm100Buffer(api, FakeGroup(), spec)
    buf.scratch = act_quant.ActScratch(H, 128, dev)  # several chunks
    w13 = torch.randn(E, 2 * I, H, generator=gen).bfloat16().to(dev)
    w2 = torch.randn(E, H, I, generator=gen).bfloat16().to(dev)
    weights = convert_experts(w13, w2, fmt="mxfp4")
    cpu = convert_experts(w13.cpu(), w2.cpu(), fmt="mxfp4")
    for a, b in [(weights.w13, cpu.w13), (weights.w13_sf, cpu.w13_sf), (weights.w2_sf, cpu.w2_sf)]:
        assert torch.equal(a.cpu(), b) and a.stride() == b.stride()
    layer = Sm100MoE(weights, buf)
    x, idx, w = inputs(gen, 300)
    x = (x.float() * torch.logspace(-5, 3, 300).unsqueeze(1)).bfloat16()
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    out = torch.empty(500, H, dtype=torch.bfloat16, device=dev)
    layer(x, idx, w, out=out)
    q, s = quant.quantize_fp8_tokens(x.cpu(), 32, "ue8m0")
    assert torch.equal(buf.x[:300].cpu().view(torch.uint8), q.view(torch.uint8))
    exps = (torch.log2(s).round() + 127).to(torch.uint8)
    assert torch.equal(buf.x_sf[:300].cpu(), quant.pack_ue8m0(exps))
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    layer(x, idx, w, out=out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats(dev)["allocation.all.allocated"] == before
    buf.x.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, idx, w, out=out)
    buf.x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf.x[:300].cpu().view(torch.uint8), q.view(torch.uint8))


# -- the real kernel: only on an SM100-family GPU with DeepGEMM (never run by this project) ----
def _real_api():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs an SM100-family GPU (compute capability 10.x)")
    discovery.reset()
    api, reasons = discovery.find_deep_gemm()
    if api is None:
        pytest.skip("DeepGEMM mega API not found: " + "; ".join(reasons))
    return api


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act", [("mxfp4", "silu"), ("bf16", "silu"), ("mxfp4", "swigluoai")])
def test_real_deepgemm_single_rank_matches_reference(gen, fmt, act):
    api = _real_api()
    h, i, e, k, t = 1024, 512, 8, 4, 100
    dev = torch.device("cuda", torch.cuda.current_device())
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.05).bfloat16().to(dev)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.05).bfloat16().to(dev)
    weights = convert_experts(w13, w2, fmt=fmt)
    spec = BufferSpec.of(MoEShape(h, i, e, k), weights.mma_type, 256)
    buf = create_worker_buffers(api, None, [spec])[spec]
    try:
        spec_act = activation_spec(act)
        layer = Sm100MoE(weights, buf, activation=spec_act)
    except UnsupportedError as exc:
        pytest.skip(str(exc))
    x = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(dev)
    idx[::7, 0] = -1
    w = torch.rand(t, k, generator=gen).to(dev)
    out = torch.full((256, h), float("nan"), dtype=torch.bfloat16, device=dev)
    y = layer(x, idx, w, out=out).float().cpu()
    torch.cuda.synchronize()
    d13, d2 = (a.cpu() for a in layer.weights.dequantize())
    if act == "silu":
        ref = reference.moe_forward(x.float().cpu(), idx.cpu(), w.cpu(), d13, d2)
    else:  # the assumed alpha/beta semantics: gate * sigmoid(alpha * gate) * (up + beta)
        ref = torch.zeros(t, h)
        for tok in range(t):
            for j in range(k):
                ex = int(idx[tok, j])
                if ex >= 0:
                    g, u = (d13[ex] @ x[tok].float().cpu()).chunk(2)
                    g, u = g.clamp(max=spec_act.clamp), u.clamp(-spec_act.clamp, spec_act.clamp)
                    a = g * torch.sigmoid(spec_act.alpha * g) * (u + spec_act.beta)
                    ref[tok] += float(w[tok, j]) * (d2[ex] @ a)
    err = float((y - ref).norm() / ref.norm())
    assert err < (0.08 if fmt == "mxfp4" else 0.02), f"relative error {err:.4f}"
    counts = torch.bincount(idx[idx >= 0].long().cpu(), minlength=e).int()
    assert torch.equal(layer.recv_stats.cpu(), counts)
