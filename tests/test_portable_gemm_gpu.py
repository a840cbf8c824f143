"""The Triton block-scaled FP8 grouped GEMM of the portable path, against float math (gpu)."""
import pytest
import torch

from vllm_megamoe import quant, reference
from vllm_megamoe.portable.gemm import grouped_fp8_block_gemm


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 512), (4096, 2048), (384, 7168)])
def test_grouped_fp8_block_gemm_matches_float(n, k):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(n + k)
    counts = [0, 1, 7, 128, 0, 1000, 33]
    g, p = len(counts), sum(counts)
    a = torch.randn(p + 5, k, generator=gen)                      # 5 spare rows past the last end
    w = torch.randn(g, n, k, generator=gen) / k ** 0.5
    a_q, a_s = quant.quantize_fp8_tokens(a, 128)
    w_q, w_s = quant.quantize_fp8_blocks(w)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((p + 5, n), float("nan"), dtype=torch.bfloat16, device=dev)
    grouped_fp8_block_gemm(a_q.to(dev), a_s.to(dev), w_q.to(dev), w_s.to(dev), ends.to(dev), out)
    out = out.cpu()
    a_f, w_f = quant.dequantize_fp8_tokens(a_q, a_s), quant.dequantize_fp8_blocks(w_q, w_s)
    start = 0
    for e, c in enumerate(counts):
        ref = a_f[start:start + c].double() @ w_f[e].double().T
        if c:
            # FP32 accumulation of exact FP8 products, one BF16 rounding of the output.
            assert reference.relative_error(out[start:start + c], ref) < 4e-3, (e, c)
        start += c
    assert torch.isnan(out[p:]).all(), "rows past the last expert must stay untouched"


@pytest.mark.gpu
def test_grouped_fp8_block_gemm_bad_input():
    dev = torch.device("cuda")
    a = torch.zeros(4, 256, device=dev).to(torch.float8_e4m3fn)
    w = torch.zeros(2, 128, 256, device=dev).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a_s has shape"):
        grouped_fp8_block_gemm(a, torch.ones(4, 3, device=dev), w, torch.ones(2, 1, 2, device=dev),
                               torch.tensor([2, 4], dtype=torch.int32, device=dev))
