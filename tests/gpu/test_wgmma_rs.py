"""The FP8 wgmma with its A operand in registers (csrc/sm90/probe/wgmma_rs_check.cu): the token
tile of a 64 x 128-byte K chunk loaded from the TMA's 128-byte swizzle by
`load_a_fragment_fp8_sw128` (ldmatrix), times a weight tile read through a descriptor, against a
float32 reference of the same e4m3 values (tests/test_wgmma_probe.py compiles it without a GPU).

Products of two e4m3 values are exact in FP32 and a row has 128 of them; Hopper's FP8 wgmma adds
them with a reduced-precision accumulator, so the bound is relative (1e-3 of the row's sum of
|products|), far below what a misplaced byte costs (a swapped row or K segment changes an element
by the size of its products).
"""

import pytest
import torch

from vllm_megamoe.kernels import jit

pytestmark = pytest.mark.gpu

SOURCE, ENTRY = "sm90/probe/wgmma_rs_check.cu", "megamoe_wgmma_rs_check"


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (SM90) GPU")


def spec(n: int) -> jit.KernelSpec:
    return jit.KernelSpec.make(SOURCE, ENTRY, dict(CHECK_N=n))


def random_e4m3(rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, 128] finite e4m3 values of mixed sign and magnitude (normal, then cast)."""
    x = torch.randn(rows, 128, generator=generator) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=generator))
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


@requires_sm90
@pytest.mark.parametrize("n", [64, 96])
def test_register_a_wgmma_matches_reference(n):
    import ctypes
    generator = torch.Generator().manual_seed(n)
    a, b = random_e4m3(64, generator), random_e4m3(n, generator)
    ref = a.float() @ b.float().T
    scale = a.float().abs() @ b.float().abs().T  # the row's sum of |products|
    dev = torch.device("cuda")
    a_dev, b_dev = a.view(torch.uint8).to(dev), b.view(torch.uint8).to(dev)
    d = torch.full((64, n), float("nan"), device=dev)
    kernel = jit.get_kernel(spec(n), torch.cuda.current_device())
    smem = (64 + n) * 128 + 1024
    kernel.launch(1, 128, smem, torch.cuda.current_stream().cuda_stream,
                  [ctypes.c_void_p(a_dev.data_ptr()), ctypes.c_void_p(b_dev.data_ptr()), ctypes.c_void_p(d.data_ptr())])
    torch.cuda.synchronize()
    out = d.cpu()
    assert torch.isfinite(out).all(), "elements of D were never written"
    err = ((out - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < 1e-3, f"N={n}: worst |D - ref| / sum|products| = {err:.3e}"
    # A transposed K segment pair (the swizzle or the fragment order wrong) would not pass:
    swapped = a.float().view(64, 8, 16)[:, [1, 0, 2, 3, 4, 5, 6, 7]].reshape(64, 128) @ b.float().T
    assert ((swapped - ref).abs() / scale).max().item() > 1e-2
