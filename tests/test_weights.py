import pytest
import torch

from vllm_megamoe import ExpertWeights, quant, transform_weights_for_mega_moe, transforms


def _float_weights(gen, e=3, i=128, h=256):
    return (torch.randn(e, 2 * i, h, generator=gen) * 0.05, torch.randn(e, h, i, generator=gen) * 0.05)


@pytest.mark.parametrize("fmt,bound", [("bf16", 0.005), ("fp8-block", 0.04)])
def test_from_float_dequantize(gen, fmt, bound):
    w13, w2 = _float_weights(gen)
    w = ExpertWeights.from_float(w13, w2, fmt)
    d13, d2 = w.dequantize()
    for a, b in ((d13, w13), (d2, w2)):
        err = ((a - b).norm() / b.norm()).item()
        assert 0 < err < bound


def test_sm90_transform_interleaves_l1_only(gen):
    w = ExpertWeights.from_float(*_float_weights(gen), "fp8-block")
    k = transform_weights_for_mega_moe(w, "sm90")
    assert k.layout == "interleaved"
    assert torch.equal(k.w13.view(torch.uint8), transforms.interleave_gate_up(w.w13.view(torch.uint8)))
    assert torch.equal(k.w2.view(torch.uint8), w.w2.view(torch.uint8))
    assert torch.equal(k.w13_scale, w.w13_scale)
    assert transform_weights_for_mega_moe(k, "sm90") is k
    # dequantize undoes the layout: same float weights either way
    assert torch.equal(k.dequantize()[0], w.dequantize()[0])
    with pytest.raises(ValueError, match="sm100"):
        transform_weights_for_mega_moe(w, "sm100")


def test_experts_slice(gen):
    w = ExpertWeights.from_float(*_float_weights(gen, e=4), "fp8-block")
    part = w.experts(2, 2)
    assert part.num_experts == 2 and torch.equal(part.w13_scale, w.w13_scale[2:])


def test_weights_bad_input(gen):
    w13, w2 = _float_weights(gen)
    with pytest.raises(ValueError, match="w13 has dtype"):
        ExpertWeights("fp8-block", w13, w2)
    q13, s13 = quant.quantize_fp8_blocks(w13)
    q2, s2 = quant.quantize_fp8_blocks(w2)
    with pytest.raises(ValueError, match="needs w13_scale"):
        ExpertWeights("fp8-block", q13, q2)
    with pytest.raises(ValueError, match="w2 has shape"):
        ExpertWeights("fp8-block", q13, q2[:, :, :64], s13, s2)
    with pytest.raises(ValueError, match="format="):
        ExpertWeights("int4", q13, q2, s13, s2)
    with pytest.raises(ValueError, match="takes no scales"):
        ExpertWeights("bf16", w13.bfloat16(), w2.bfloat16(), s13, s2)


def test_prepare_weights_per_path(gen):
    from vllm_megamoe import ops
    w = ExpertWeights.from_float(*_float_weights(gen), "fp8-block")
    k = ops.prepare_weights(w, "sm90")
    assert k.layout == "interleaved" and ops.prepare_weights(k, "sm90") is k
    assert ops.prepare_weights(k, "portable") is k  # the CPU portable path reads either layout
    back = ops.prepare_weights(k, "portable", device="cuda")  # on GPUs the interleave is undone
    assert back.layout == "checkpoint"
    assert torch.equal(back.w13.view(torch.uint8), w.w13.view(torch.uint8))
    assert ops.prepare_weights(w, "portable") is w
    with pytest.raises(ValueError, match="own weight class"):
        ops.prepare_weights(w, "sm100")
