import pytest
import torch

from vllm_megamoe import transforms


@pytest.mark.parametrize("shape", [(64, 5), (3, 48, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16])
def test_interleave_roundtrip_and_order(gen, shape, dtype):
    t = (torch.randn(*shape, generator=gen) * 100).to(dtype)
    out = transforms.interleave_gate_up(t)
    n = shape[-2]
    half = n // 2
    for row in range(n):
        pair, within = divmod(row, 16)
        src = pair * 8 + within % 8 + (half if within >= 8 else 0)
        assert torch.equal(out[..., row, :], t[..., src, :])
    assert torch.equal(transforms.deinterleave_gate_up(out), t)
    rows = torch.arange(n)
    assert torch.equal(transforms.interleaved_row_to_source_row(rows, n),
                       torch.tensor([pair * 8 + w % 8 + (half if w >= 8 else 0)
                                     for pair, w in (divmod(r, 16) for r in range(n))]))


def test_interleave_first_rows_fact():
    t = torch.arange(32).reshape(32, 1)
    out = transforms.interleave_gate_up(t).flatten().tolist()
    assert out[:16] == list(range(8)) + list(range(16, 24))


@pytest.mark.parametrize("shape", [(256, 3), (2, 128, 4)])
def test_utccp_transpose_fact_and_roundtrip(gen, shape):
    sf = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=gen)
    out = transforms.transpose_sf_for_utccp(sf)
    mn = shape[-2]
    for g in range(mn // 128):
        for i in range(32):
            for j in range(4):
                assert torch.equal(out[..., g * 128 + i * 4 + j, :], sf[..., g * 128 + j * 32 + i, :])
    assert torch.equal(transforms.untranspose_sf_for_utccp(out), sf)


def test_transform_bad_input():
    with pytest.raises(ValueError, match="multiple of 2\\*gran=16"):
        transforms.interleave_gate_up(torch.zeros(24, 4))
    with pytest.raises(ValueError, match="multiple of 128"):
        transforms.transpose_sf_for_utccp(torch.zeros(96, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        transforms.interleave_gate_up(torch.zeros(16))
