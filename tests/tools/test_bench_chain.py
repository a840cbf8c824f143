"""The unfused chain baseline's weight set-up (benchmarks/chain.py): expert by expert from
ExpertWeights gives the same prepared weights as from a whole dequantized copy."""
import pytest
import torch
import torch.distributed as dist

from benchmarks.chain import FP8, UnfusedChain
from vllm_megamoe import ExpertWeights


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_chain_from_weights_matches_the_dequantized_copy(gen, one_rank_group, fmt):
    w13 = torch.randn(3, 256, 128, generator=gen) * 0.05
    w2 = torch.randn(3, 128, 128, generator=gen) * 0.05
    weights = ExpertWeights.from_float(w13, w2, fmt)
    whole = UnfusedChain(*weights.dequantize(), fmt, one_rank_group)
    per_expert = UnfusedChain.from_weights(weights, fmt, one_rank_group)
    assert per_expert.el == 3 and per_expert.gemm_kind == whole.gemm_kind
    for name in ("w13", "w2") + (("s13", "s2") if whole.fp8 else ()):
        a, b = getattr(per_expert, name), getattr(whole, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b), name
    if whole.fp8:  # rowwise FP8 of the dequantized rows: close to them, not a copy of zeros
        d13 = per_expert.w13.float() * per_expert.s13.unsqueeze(-1)
        err = ((d13 - weights.dequantize()[0]).norm() / weights.dequantize()[0].norm()).item()
        assert 0 < err < 0.05


def test_chain_without_local_experts_is_refused(gen, one_rank_group):
    w13 = torch.randn(1, 256, 128, generator=gen)
    weights = ExpertWeights.from_float(w13, torch.randn(1, 128, 128, generator=gen), "bf16").experts(0, 0)
    with pytest.raises(ValueError, match="at least one local expert, got 0"):
        UnfusedChain.from_weights(weights, "bf16", one_rank_group)
