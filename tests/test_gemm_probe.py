"""benchmarks.gemm_probe's routing model (the GEMM timing itself needs an SM90 GPU)."""
import torch

from benchmarks import gemm_probe


def test_expert_rows_are_one_ranks_share_of_a_top_k_routing():
    counts = gemm_probe.expert_rows(tokens=512, ranks=2, experts=64, topk=6, seed=3)
    assert counts.shape == (32,) and counts.dtype == torch.int64
    # every token picks 6 distinct experts; rank 0 owns the first half of them
    assert 0 < int(counts.sum()) < 512 * 2 * 6
    assert abs(int(counts.sum()) - 512 * 2 * 6 / 2) < 0.1 * 512 * 6  # about half of all pairs
    assert torch.equal(counts, gemm_probe.expert_rows(tokens=512, ranks=2, experts=64, topk=6, seed=3))
    assert not torch.equal(counts, gemm_probe.expert_rows(tokens=512, ranks=2, experts=64, topk=6, seed=4))
