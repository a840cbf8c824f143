import pytest
import torch
import torch.nn.functional as F

from vllm_megamoe import reference


def naive_moe(x, idx, w, w13, w2, clamp=None, shared=None):
    """Token by token, slot by slot, in float64: independent of reference.moe_forward."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    i = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    experts = [(e, 1.0) for e in range(0)]
    for t in range(x.shape[0]):
        experts = [(int(idx[t, k]), float(w[t, k])) for k in range(idx.shape[1]) if idx[t, k] >= 0]
        mats = [(w13[e], w2[e], wt) for e, wt in experts]
        if shared is not None:
            mats.append((shared[0].double(), shared[1].double(), 1.0))
        for a, b, wt in mats:
            h = a @ x[t]
            gate, up = h[:a.shape[0] // 2], h[a.shape[0] // 2:]
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            out[t] += b @ (F.silu(gate) * up * wt)
    return out


def _problem(gen, t=23, h=256, i=128, e=6, k=3):
    x = torch.randn(t, h, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    idx[2, 0] = -1
    idx[7] = -1  # a fully masked token gets zeros
    w = torch.rand(t, k, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return x, idx, w, w13, w2


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_reference_matches_naive_loop(gen, clamp):
    x, idx, w, w13, w2 = _problem(gen)
    shared = (torch.randn(64, 256, generator=gen) / 16, torch.randn(256, 32, generator=gen) / 6)
    for sh in (None, shared):
        out = reference.moe_forward(x, idx, w, w13, w2, activation_clamp=clamp, shared=sh)
        ref = naive_moe(x, idx, w, w13, w2, clamp, sh)
        assert reference.relative_error(out, ref) < 1e-5
    out = reference.moe_forward(x, idx, w, w13, w2)
    assert torch.equal(out[7], torch.zeros(256))


@pytest.mark.parametrize("mode,bound", [("fp8", 0.08), ("bf16", 0.02)])
def test_emulated_modes_close_but_rounded(gen, mode, bound):
    x, idx, w, w13, w2 = _problem(gen)
    exact = reference.moe_forward(x, idx, w, w13, w2)
    emu = reference.moe_forward(x, idx, w, w13, w2, emulate=mode)
    err = reference.relative_error(emu, exact)
    assert 0 < err < bound
    # emulated output is exactly representable in bf16
    assert torch.equal(emu, emu.to(torch.bfloat16).float())


def test_relative_error_nan_never_passes():
    ref = torch.ones(4)
    assert reference.relative_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == float("inf")


def test_reference_bad_input(gen):
    x, idx, w, w13, w2 = _problem(gen)
    with pytest.raises(ValueError, match="outside"):
        reference.moe_forward(x, idx + 10, w, w13, w2)
    with pytest.raises(ValueError, match="emulate"):
        reference.moe_forward(x, idx, w, w13, w2, emulate="fp4")
    with pytest.raises(ValueError, match="w2 has shape"):
        reference.moe_forward(x, idx, w, w13, w2[:, :, :64])


@pytest.mark.parametrize("mode", [None, "fp8", "bf16"])
def test_per_expert_weights_give_the_same_output(gen, mode):
    from vllm_megamoe import ExpertWeights, transform_weights_for_mega_moe
    x, idx, w, w13, w2 = _problem(gen)
    weights = ExpertWeights.from_float(w13, w2, "fp8-block")
    whole = reference.moe_forward(x, idx, w, *weights.dequantize(), emulate=mode)
    asked = []

    def one_expert(e):
        asked.append(e)
        return weights.dequantize_expert(e)

    per_expert = reference.moe_forward_per_expert(x, idx, w, weights.num_experts, one_expert, emulate=mode)
    assert torch.equal(per_expert, whole)
    assert sorted(asked) == sorted(set(idx[idx >= 0].tolist())), "each routed expert once, no other"
    # the kernel's interleaved layout dequantizes to the same experts
    interleaved = transform_weights_for_mega_moe(weights, "sm90")
    assert torch.equal(reference.moe_forward_per_expert(x, idx, w, weights.num_experts,
                                                        interleaved.dequantize_expert, emulate=mode), whole)


def test_bf16_weights_read_one_expert_at_a_time(gen):
    x, idx, w, w13, w2 = _problem(gen)
    b13, b2 = w13.bfloat16(), w2.bfloat16()
    assert torch.equal(reference.moe_forward(x, idx, w, b13, b2),
                       reference.moe_forward(x, idx, w, b13.float(), b2.float()))


def test_per_expert_bad_input(gen):
    from vllm_megamoe import ExpertWeights
    x, idx, w, w13, w2 = _problem(gen)
    weights = ExpertWeights.from_float(w13, w2, "fp8-block")
    with pytest.raises(ValueError, match="dequantize it first"):
        reference.moe_forward(x, idx, w, weights.w13, weights.w2)
    with pytest.raises(ValueError, match="outside"):
        reference.moe_forward_per_expert(x, idx, w, 4, weights.dequantize_expert)
    with pytest.raises(ValueError, match="expert 6 is outside"):
        weights.dequantize_expert(6)
    with pytest.raises(ValueError, match=r"expert \d+: weights of dtype torch.float8_e4m3fn"):
        reference.moe_forward_per_expert(x, idx, w, 6, lambda e: (weights.w13[e], weights.w2[e]))
    with pytest.raises(ValueError, match=r"do not fit hidden 256"):
        reference.moe_forward_per_expert(x, idx, w, 6, lambda e: (w13[e][:, :128], w2[e]))
