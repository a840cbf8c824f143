import pytest
import torch

from vllm_megamoe import quant

SCALES = [1e-3, 1.0, 300.0]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_fp8_tokens_roundtrip_error(gen, scale, fmt):
    x = torch.randn(67, 512, generator=gen) * scale
    x[5] = 0.0                     # a row of zeros stays exactly zero
    x[9, 17] = 1000.0 * scale      # an outlier only hurts its own 128-group
    q, s = quant.quantize_fp8_tokens(x, 128, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (67, 4) and s.dtype == torch.float32
    back = quant.dequantize_fp8_tokens(q, s, 128)
    assert torch.equal(back[5], torch.zeros(512))
    others = torch.ones(67, dtype=torch.bool)
    others[9] = False
    # e4m3 keeps 3 mantissa bits: per-element error <= 2^-4 relative to the value, plus
    # the subnormal floor; UE8M0 scales waste up to one bit of range.
    assert _rel(back[others], x[others]) < (0.04 if fmt == "float" else 0.05)
    assert torch.isclose(back[9, 17], x[9, 17], rtol=0.07)
    if fmt == "ue8m0":
        assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))
    # amax of every group maps to at most 448 and the scale is the float recipe
    assert q.float().abs().max() <= 448.0
    if fmt == "float":
        amax = x.reshape(67, 4, 128).abs().amax(-1).clamp_min(quant.AMAX_FLOOR)
        torch.testing.assert_close(s, amax / 448.0)


def test_fp8_tokens_bad_input():
    with pytest.raises(ValueError, match="multiple of group=128"):
        quant.quantize_fp8_tokens(torch.randn(4, 100))
    with pytest.raises(ValueError, match="scale_format"):
        quant.quantize_fp8_tokens(torch.randn(4, 128), scale_format="e8")
    with pytest.raises(ValueError, match="dtype"):
        quant.quantize_fp8_tokens(torch.randint(0, 3, (4, 128)))


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (3, 129)])
def test_fp8_blocks_roundtrip(gen, n, k):
    w = torch.randn(2, n, k, generator=gen) * 0.02
    w[0, :128, :128] = 0.0
    q, s = quant.quantize_fp8_blocks(w)
    assert q.shape == w.shape and s.shape == (2, -(-n // 128), -(-k // 128))
    back = quant.dequantize_fp8_blocks(q, s)
    assert torch.equal(back[0, :128, :128], torch.zeros(min(n, 128), 128))
    assert _rel(back, w) < 0.04
    # The scale of block (0,1) of expert 1 is its amax / 448.
    blk = w[1, :128, 128:256]
    torch.testing.assert_close(s[1, 0, 1], blk.abs().max() / 448.0)
    assert torch.all(s[0, 0, 0] <= 1e-9)  # the all-zero block keeps a tiny finite scale


def test_fp8_blocks_bad_scale_shape(gen):
    q, s = quant.quantize_fp8_blocks(torch.randn(256, 256, generator=gen))
    with pytest.raises(ValueError, match="scale_inv has shape"):
        quant.dequantize_fp8_blocks(q, s[:1])


def test_mxfp4_packing_bit_exact():
    # One row of 128 values: scale 1 (amax 6 -> exponent 127 + ceil(log2(1)) = 127).
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] * 8)
    packed, scales = quant.quantize_mxfp4(vals[None], 32)
    raw = packed.view(torch.uint8)[0]
    # even K index in the low nibble: codes 0,1 -> 0x10; 2,3 -> 0x32; ...; 8+0 (neg zero), 8+1 -> 0x98
    assert raw[:8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert scales.shape == (1, 1)
    assert quant.unpack_ue8m0(scales).tolist() == [[127, 127, 127, 127]]
    assert torch.equal(quant.dequantize_mxfp4(packed, scales), vals[None].abs() * vals[None].sign())


def test_mxfp4_rounding_ties_to_even():
    # With amax 6 in the group the scale is 1; ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] + [0.0] * 120)
    packed, scales = quant.quantize_mxfp4(row[None])
    back = quant.dequantize_mxfp4(packed, scales)[0, :8]
    assert back.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_ue8m0_pack_order():
    b = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    packed = quant.pack_ue8m0(b)
    # byte b of int j covers group 4j+b (little-endian int32)
    assert packed.tolist() == [[0x03020100, 0x07060504]]
    assert torch.equal(quant.unpack_ue8m0(packed), b)
    with pytest.raises(ValueError, match="multiple of 4"):
        quant.pack_ue8m0(torch.zeros(1, 6, dtype=torch.uint8))


@pytest.mark.parametrize("scale", SCALES)
def test_mxfp4_error_bound(gen, scale):
    w = torch.randn(3, 64, 256, generator=gen) * scale
    packed, scales = quant.quantize_mxfp4(w)
    assert packed.shape == (3, 64, 128) and scales.shape == (3, 64, 2)
    back = quant.dequantize_mxfp4(packed, scales)
    # E2M1 has 1 mantissa bit: about 0.1-0.2 relative error on Gaussian data
    assert _rel(back, w) < 0.2
    assert (back.abs() <= w.abs().reshape(3, 64, 8, 32).amax(-1).repeat_interleave(32, -1) * 2).all()


def test_mxfp4_bad_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        quant.quantize_mxfp4(torch.randn(4, 96))
