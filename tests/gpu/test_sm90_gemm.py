"""SM90 grouped GEMMs (swap AB; FP8 with 128-K block scales, and BF16) against a float32
reference of the dequantized math.

The reference multiplies exactly the values the kernel sees (FP8 codes times their scales), so the
remaining error is FP32 accumulation order plus the final BF16 rounding (relative 2^-9 per
element): the bound is ||out - ref|| / ||ref|| < 5e-3 over the written rows, and every element of
those rows must be finite (the output is poisoned with NaN first).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

REL_ERROR_BOUND = 5e-3
FP8_MAX = 448.0


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 (Hopper) GPU")


def quantize_rows_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> e4m3 [M, K] and float32 scales [M, K/128] (amax / 448 per 128 values)."""
    m, k = x.shape
    blocks = x.float().view(m, k // 128, 128)
    scale = blocks.abs().amax(-1).clamp_min(1e-8) / FP8_MAX
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, k)
    return q, scale.contiguous()


def quantize_weights_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> e4m3 [E, N, K] and float32 scales [E, ceil(N/128), K/128]."""
    e, n, k = w.shape
    n_pad = -(-n // 128) * 128
    padded = torch.nn.functional.pad(w.float(), (0, 0, 0, n_pad - n))
    blocks = padded.view(e, n_pad // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-8) / FP8_MAX
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n_pad, k)[:, :n]
    return q.contiguous(), scale.contiguous()


def dequantize_x(x_q, x_s):
    return x_q.float() * x_s.repeat_interleave(128, dim=1)


def dequantize_w(w_q, w_s):
    n = w_q.shape[1]
    return w_q.float() * w_s.repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2)


def interleave_gate_up(w: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """[E, 2I, ...] rows [gate | up] -> [g0..g7, u0..u7, g8..g15, u8..u15, ...]."""
    e, n = w.shape[:2]
    gate, up = w[:, : n // 2], w[:, n // 2 :]
    rest = w.shape[2:]
    gate = gate.reshape(e, n // 2 // granularity, granularity, *rest)
    up = up.reshape(e, n // 2 // granularity, granularity, *rest)
    return torch.stack([gate, up], dim=2).reshape(e, n, *rest).contiguous()


def make_problem(counts, n, k, *, lead_rows=0, tail_rows=0, seed=0, device="cuda"):
    """Random (never zero) FP8 tokens grouped by expert, weights, scales and offsets.

    Token magnitudes vary per row and per 128-K block so that wrong scale indexing shows up.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    e = len(counts)
    m = lead_rows + sum(counts) + tail_rows
    x = torch.randn(m, k, generator=gen, device=device)
    x *= torch.rand(m, k // 128, generator=gen, device=device).repeat_interleave(128, 1) * 4 + 0.25
    w = torch.randn(e, n, k, generator=gen, device=device) * 0.05
    w *= torch.rand(e, -(-n // 128), k // 128, generator=gen, device=device).repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2) + 0.1
    x_q, x_s = quantize_rows_1x128(x)
    w_q, w_s = quantize_weights_128x128(w)
    offsets = torch.tensor([lead_rows] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return x_q, x_s, w_q, w_s, offsets


def reference(x_q, x_s, w_q, w_s, offsets):
    x = dequantize_x(x_q, x_s)
    w = dequantize_w(w_q, w_s)
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), device=x.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi] @ w[e].T
    return out


def check(out, ref, offsets, label=""):
    lo, hi = int(offsets[0]), int(offsets[-1])
    written = out[lo:hi].float()
    assert torch.isfinite(written).all(), f"{label}: {(~torch.isfinite(written)).sum().item()} rows/elements unwritten or non-finite"
    # Rows outside the grouped range must stay untouched (still the NaN poison).
    assert torch.isnan(out[:lo]).all() and torch.isnan(out[hi:]).all(), f"{label}: wrote outside the expert rows"
    if hi == lo:
        return 0.0
    err = ((written - ref[lo:hi]).norm() / ref[lo:hi].norm()).item()
    assert err < REL_ERROR_BOUND, f"{label}: relative error {err:.2e} >= {REL_ERROR_BOUND}"
    return err


def run(x_q, x_s, w_q, w_s, offsets, **kwargs):
    from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_fp8_block

    out = torch.full((x_q.shape[0], w_q.shape[1]), float("nan"), dtype=torch.bfloat16, device=x_q.device)
    grouped_gemm_fp8_block(x_q, x_s, w_q, w_s, offsets, out, **kwargs)
    torch.cuda.synchronize()
    return out


UNEVEN_COUNTS = [0, 1, 7, 128, 1000, 3, 0, 250]


@requires_sm90
@pytest.mark.parametrize("block_n_tokens", [8, 16, 32, 64, 96, 128, 192, None])
def test_uneven_experts_all_tile_sizes(block_n_tokens):
    problem = make_problem(UNEVEN_COUNTS, n=512, k=1024, lead_rows=5, tail_rows=9, seed=1)
    out = run(*problem, block_n_tokens=block_n_tokens)
    err = check(out, reference(*problem), problem[-1], f"tile {block_n_tokens}")
    print(f"uneven tile={block_n_tokens}: rel err {err:.2e}")


@requires_sm90
@pytest.mark.parametrize("num_consumer_wg", [1, 2])
@pytest.mark.parametrize("n", [192, 320])  # N % 128 == 64: the last tile is half out of range
def test_partial_n_tile_and_one_consumer(num_consumer_wg, n):
    problem = make_problem([3, 0, 40, 17], n=n, k=512, seed=2)
    out = run(*problem, block_n_tokens=16, num_consumer_wg=num_consumer_wg)
    check(out, reference(*problem), problem[-1], f"n={n} wg={num_consumer_wg}")


@requires_sm90
@pytest.mark.parametrize(
    "name,hidden,inter",
    [("v4flash", 4096, 2048), ("dsv3", 7168, 2048), ("qwen3_30b", 2048, 768)],
)
@pytest.mark.parametrize("layer", ["l1", "l2"])
def test_model_shapes(name, hidden, inter, layer):
    n, k = (2 * inter, hidden) if layer == "l1" else (hidden, inter)
    counts = [1, 0, 7, 128, 300, 2]
    problem = make_problem(counts, n=n, k=k, seed=3)
    ref = reference(*problem)
    for tokens in (8, 128):
        out = run(*problem, block_n_tokens=tokens)
        err = check(out, ref, problem[-1], f"{name} {layer} tile {tokens}")
        print(f"{name} {layer} N={n} K={k} tile={tokens}: rel err {err:.2e}")


@requires_sm90
@pytest.mark.parametrize("block_n_tokens", [8, 64])
def test_interleaved_gate_up_scales(block_n_tokens):
    """L1 layout: weight rows interleaved by 8, scales left in [gate blocks | up blocks] order.
    Gate and up get very different scales so a wrong lookup is far outside the bound."""
    inter, hidden = 768, 1024
    counts = [5, 0, 70, 1]
    x_q, x_s, w_q, w_s, offsets = make_problem(counts, n=2 * inter, k=hidden, seed=4)
    w_s[:, inter // 128 :] *= 16.0  # up blocks 16x the gate blocks
    ref_plain = reference(x_q, x_s, w_q, w_s, offsets)
    w_il = interleave_gate_up(w_q.view(torch.uint8)).view(torch.float8_e4m3fn)
    out = run(x_q, x_s, w_il, w_s, offsets, block_n_tokens=block_n_tokens, interleaved_gate_up=True)
    ref_il = interleave_gate_up(ref_plain.T.unsqueeze(0)).squeeze(0).T  # same column permutation
    check(out, ref_il, offsets, "interleaved")


@requires_sm90
def test_no_tokens_at_all_and_empty_m():
    problem = make_problem([0, 0, 0], n=128, k=256, lead_rows=4, seed=5)
    out = run(*problem, block_n_tokens=8)
    assert torch.isnan(out).all()  # nothing to write
    x_q, x_s, w_q, w_s, _ = problem
    empty = run(x_q[:0], x_s[:0], w_q, w_s, torch.zeros(4, dtype=torch.int32, device="cuda"))
    assert empty.shape == (0, 128)


@requires_sm90
def test_repeatable_and_graph_capturable():
    """Same inputs give bit-identical outputs (no races), also when replayed from a CUDA graph."""
    from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_fp8_block

    problem = make_problem([33, 2, 0, 190], n=256, k=768, seed=6)
    first = run(*problem, block_n_tokens=32)
    second = run(*problem, block_n_tokens=32)
    assert torch.equal(first, second)
    out = torch.full_like(first, float("nan"))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        grouped_gemm_fp8_block(*problem, out, block_n_tokens=32)  # warm-up load outside capture
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            grouped_gemm_fp8_block(*problem, out, block_n_tokens=32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


@requires_sm90
def test_smem_layout_matches_kernel():
    """The host's shared-memory arithmetic equals the kernel's own constexpr."""
    from vllm_megamoe.kernels import jit
    from vllm_megamoe.kernels import sm90_grouped_gemm as g

    for tokens in (8, 48, 192):
        for wg in (1, 2):
            for bf16 in (False, True):
                cfg = g.resolve_config(g.GroupedGemmConfig(block_tokens=tokens, num_consumer_wg=wg, bf16=bf16))
                kernel = jit.get_kernel(g.kernel_spec(cfg), torch.cuda.current_device())
                assert kernel.read_global_int(g.SMEM_SYMBOL) == g.smem_bytes(tokens, wg, cfg.stages, bf16)


@requires_sm90
def test_validation_errors():
    from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_fp8_block

    x_q, x_s, w_q, w_s, offsets = make_problem([4, 4], n=128, k=256, seed=7)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        grouped_gemm_fp8_block(x_q.float(), x_s, w_q, w_s, offsets)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_gemm_fp8_block(x_q[:, :200].contiguous(), x_s[:, :1].contiguous(), w_q[:, :, :200].contiguous(), w_s, offsets)
    with pytest.raises(ValueError, match="contiguous"):
        grouped_gemm_fp8_block(x_q.t(), x_s, w_q, w_s, offsets)
    with pytest.raises(ValueError, match="expert_offsets must be int32"):
        grouped_gemm_fp8_block(x_q, x_s, w_q, w_s, offsets.long())
    with pytest.raises(ValueError, match="w_scale must be"):
        grouped_gemm_fp8_block(x_q, x_s, w_q, w_s[:, :, :1].contiguous(), offsets)
    with pytest.raises(ValueError, match="multiple of 64"):
        grouped_gemm_fp8_block(x_q, x_s, w_q[:, :100].contiguous(), w_s, offsets)


@requires_sm90
@pytest.mark.parametrize("block_n_tokens,num_consumer_wg", [(8, 2), (32, 1), (128, 2), (192, 2), (None, 2)])
def test_bf16_variant(block_n_tokens, num_consumer_wg):
    """BF16 weights and tokens, no scales; reference in float32 from the same bf16 values."""
    from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_bf16

    counts = [0, 1, 7, 128, 1000, 3, 0, 250]
    n, k = 320, 1024  # N % 128 == 64 too
    gen = torch.Generator(device="cuda").manual_seed(8)
    lead, tail = 3, 6
    m = lead + sum(counts) + tail
    x = (torch.randn(m, k, generator=gen, device="cuda") * 2).bfloat16()
    w = (torch.randn(len(counts), n, k, generator=gen, device="cuda") * 0.05).bfloat16()
    offsets = torch.tensor([lead] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    ref = torch.full((m, n), float("nan"), device="cuda")
    bounds = offsets.tolist()
    for e in range(len(counts)):
        if bounds[e + 1] > bounds[e]:
            ref[bounds[e] : bounds[e + 1]] = x[bounds[e] : bounds[e + 1]].float() @ w[e].float().T
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_bf16(x, w, offsets, out, block_n_tokens=block_n_tokens, num_consumer_wg=num_consumer_wg)
    torch.cuda.synchronize()
    err = check(out, ref, offsets, f"bf16 tile {block_n_tokens}")
    print(f"bf16 tile={block_n_tokens} wg={num_consumer_wg}: rel err {err:.2e}")


@requires_sm90
def test_bf16_model_shape():
    from vllm_megamoe.kernels.sm90_grouped_gemm import grouped_gemm_bf16

    n, k = 1536, 2048  # Qwen3-30B-A3B-like L1
    counts = [1, 0, 7, 128, 300, 2]
    gen = torch.Generator(device="cuda").manual_seed(9)
    m = sum(counts)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(len(counts), n, k, generator=gen, device="cuda") * 0.05).bfloat16()
    offsets = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    ref = torch.cat([x[a:b].float() @ w[e].float().T for e, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
    out = grouped_gemm_bf16(x, w, offsets)
    torch.cuda.synchronize()
    check(out, ref, offsets, "bf16 qwen3 L1")
