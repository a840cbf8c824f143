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


def spec(n: int, reuse: int = 0, serial: int = 0, reload: int = 1) -> jit.KernelSpec:
    return jit.KernelSpec.make(SOURCE, ENTRY, dict(CHECK_N=n, CHECK_REUSE=reuse, CHECK_SERIAL=serial, CHECK_RELOAD=reload))


def random_e4m3(rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, 128] finite e4m3 values of mixed sign and magnitude (normal, then cast)."""
    x = torch.randn(rows, 128, generator=generator) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=generator))
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def run_check(n: int, a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor | None = None, reuse: int = 0,
              serial: int = 0, reload: int = 1) -> list[torch.Tensor]:
    """D (and D2 with a2 and reuse 1 / 2: 4 reps of A, A2, wgmma_rs_check.cu) from the check kernel, on the CPU."""
    import ctypes
    dev = torch.device("cuda")
    tiles = [t.view(torch.uint8).to(dev) for t in (a, b) + ((a2,) if a2 is not None else ())]
    outs = [torch.full((64, n), float("nan"), device=dev) for _ in range(1 if a2 is None else 2)]
    kernel = jit.get_kernel(spec(n, reuse, serial, reload), torch.cuda.current_device())
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
@pytest.mark.parametrize("reuse", [1, 2])
def test_fragment_reloaded_with_no_group_in_flight(n, reuse):
    """Two groups per fragment, the fragment reloaded every rep once both groups are done
    (CHECK_SERIAL 1): both groups hold 2 (A + A2) x B^T, whether group 1 reads the fragment or a
    copy of it. The rule a register-A K loop has to keep."""
    a, b, a2, ref, scale = reuse_case(n)
    d, d2 = run_check(n, a, b, a2, reuse=reuse, serial=1)
    for out, what in ((d, "first group"), (d2, "second group")):
        assert_close(out, ref, scale, f"N={n}, reuse={reuse}, {what}")


@requires_sm90
@pytest.mark.parametrize("n", [64, 128])
def test_queued_group_is_right_when_nothing_is_reloaded(n):
    """Group 1 left queued across reps (CHECK_SERIAL 0) but the fragment loaded once: right."""
    a, b, a2, _, _ = reuse_case(n)
    d, d2 = run_check(n, a, b, a2, reuse=1, reload=0)
    ref, scale = 4 * a.float() @ b.float().T, 4 * a.float().abs() @ b.float().abs().T
    for out, what in ((d, "first group"), (d2, "second group")):
        assert_close(out, ref, scale, f"N={n}, {what}")


@requires_sm90
@pytest.mark.parametrize("n", [64, 128])
def test_reloading_while_a_group_is_queued_corrupts_it(n):
    """Why the rule (measured on H200, deterministic over repeated runs): reloading the fragment
    while group 1, which reads it, may still be queued (CHECK_SERIAL 0) leaves group 0, waited
    for, right and group 1 wrong in the rows of the fragment's registers 0 and 2 (relative errors
    26-50, non-finite elements at N=128): the PTX ISA's rule, no access to a queued wgmma's A
    registers. If this test fails with D2 right, the hardware or ptxas changed."""
    a, b, a2, ref, scale = reuse_case(n)
    d, d2 = run_check(n, a, b, a2, reuse=1)
    assert_close(d, ref, scale, f"N={n}, first group")
    err = ((d2 - ref).abs() / scale).nan_to_num(nan=float("inf")).max().item()
    assert err > 1e-2, f"N={n}: the queued group was right (error {err:.2e})"


@requires_sm90
@pytest.mark.parametrize("n", [64, 128])
def test_queued_group_reading_a_copy_survives_the_reload(n):
    """The same loop with group 1 reading a copy of the fragment in other registers (reuse 2; the
    copy an XOR with blockIdx.x, so ptxas cannot fold it back into the fragment): both groups
    right. The hazard is the register overlap, not a window after wait_group (an earlier build believed the
    latter from a build whose copy ptxas 13.0 had folded away; docs/kernel_design.md), so a K loop may
    keep a register-A group in flight across a reload of another register set."""
    a, b, a2, ref, scale = reuse_case(n)
    d, d2 = run_check(n, a, b, a2, reuse=2)
    for out, what in ((d, "first group"), (d2, "second group")):
        assert_close(out, ref, scale, f"N={n}, {what}")
