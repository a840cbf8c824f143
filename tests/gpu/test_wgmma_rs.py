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


def spec(n: int, reuse: int = 0) -> jit.KernelSpec:
    return jit.KernelSpec.make(SOURCE, ENTRY, dict(CHECK_N=n, CHECK_REUSE=reuse))


def random_e4m3(rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, 128] finite e4m3 values of mixed sign and magnitude (normal, then cast)."""
    x = torch.randn(rows, 128, generator=generator) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=generator))
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def run_check(n: int, a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor | None = None, reuse: int = 0) -> list[torch.Tensor]:
    """D (and D2 with a2 and reuse 1 / 2: 4 reps of A, A2, wgmma_rs_check.cu) from the check kernel, on the CPU."""
    import ctypes
    dev = torch.device("cuda")
    tiles = [t.view(torch.uint8).to(dev) for t in (a, b) + ((a2,) if a2 is not None else ())]
    outs = [torch.full((64, n), float("nan"), device=dev) for _ in range(1 if a2 is None else 2)]
    kernel = jit.get_kernel(spec(n, reuse), torch.cuda.current_device())
    smem = (64 + n + (64 if a2 is not None else 0)) * 128 + 1024
    args = [ctypes.c_void_p(tiles[0].data_ptr()), ctypes.c_void_p(tiles[1].data_ptr()), ctypes.c_void_p(outs[0].data_ptr()),
            ctypes.c_void_p(tiles[2].data_ptr() if a2 is not None else 0),
            ctypes.c_void_p(outs[1].data_ptr() if a2 is not None else 0)]
    kernel.launch(1, 128, smem, torch.cuda.current_stream().cuda_stream, args)
    torch.cuda.synchronize()
    return [o.cpu() for o in outs]


def assert_close(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: elements of D were never written"
    err = ((out - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < 1e-3, f"{what}: worst |D - ref| / sum|products| = {err:.3e}"


@requires_sm90
@pytest.mark.parametrize("n", [64, 96])
def test_register_a_wgmma_matches_reference(n):
    generator = torch.Generator().manual_seed(n)
    a, b = random_e4m3(64, generator), random_e4m3(n, generator)
    ref = a.float() @ b.float().T
    scale = a.float().abs() @ b.float().abs().T  # the row's sum of |products|
    dev = torch.device("cuda")
    out = run_check(n, a, b)[0]
    assert_close(out, ref, scale, f"N={n}")
    # A transposed K segment pair (the swizzle or the fragment order wrong) would not pass:
    swapped = a.float().view(64, 8, 16)[:, [1, 0, 2, 3, 4, 5, 6, 7]].reshape(64, 128) @ b.float().T
    assert ((swapped - ref).abs() / scale).max().item() > 1e-2


def reuse_case(n: int):
    generator = torch.Generator().manual_seed(100 + n)
    a, b, a2 = random_e4m3(64, generator), random_e4m3(n, generator), random_e4m3(64, generator)
    ref = 2 * (a.float() + a2.float()) @ b.float().T
    scale = 2 * (a.float().abs() + a2.float().abs()) @ b.float().abs().T
    # one k-step of one rep read from the other tile would be caught
    assert (((a.float()[:, 96:] - a2.float()[:, 96:]) @ b.float()[:, 96:].T).abs() / scale).max() > 1e-2
    return a, b, a2, ref, scale


@requires_sm90
@pytest.mark.parametrize("n", [64, 128])
def test_second_group_reads_its_own_copy_of_the_reloaded_fragment(n):
    """k_loop_register_tokens' pattern: the fragment is reloaded for the next chunk while the
    chunk's second group may still run, so that group reads a copy (copy_a_fragment) made once
    the previous second group is complete. Four reps of A, A2, A, A2: both groups hold
    2 (A + A2) x B^T."""
    a, b, a2, ref, scale = reuse_case(n)
    d, d2 = run_check(n, a, b, a2, reuse=2)
    for out, what in ((d, "first group"), (d2, "second group")):
        assert_close(out, ref, scale, f"N={n}, {what}")


@requires_sm90
@pytest.mark.parametrize("n", [64, 128])
def test_a_queued_group_reads_its_register_a_when_it_runs(n):
    """Why the copy: with one fragment (CHECK_REUSE 1, its register reuse asserted in the SASS by
    tests/test_wgmma_probe.py), the second group, still queued when the next rep reloads the
    fragment, sums some of the new tile (and of the address bytes the reload puts in the same
    registers first), while the first group, waited for, is right. Measured on H200: relative
    errors of 26-50 and non-finite elements. If this ever passes with D2 right, the hardware
    reads at issue and the copy is merely unnecessary."""
    a, b, a2, ref, scale = reuse_case(n)
    d, d2 = run_check(n, a, b, a2, reuse=1)
    assert_close(d, ref, scale, f"N={n}, first group")
    err = ((d2 - ref).abs() / scale).nan_to_num(nan=float("inf")).max().item()
    assert err > 1e-2, f"N={n}: the second group read its fragment at issue (error {err:.2e})"
