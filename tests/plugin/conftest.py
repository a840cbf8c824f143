import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Paths of the tiny random BF16 checkpoints the vLLM tests run: {"qwen3_moe", "mixtral"}."""
    pytest.importorskip("transformers")
    from vllm_megamoe.tiny_model import make_tiny_moe
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_moe(str(root / arch), arch, seed=0) for arch in ("qwen3_moe", "mixtral")}


def pytest_configure(config):
    """scripts/vllm_releases.sh runs these tests against another release's code: make sure that
    code, not the installed vLLM, is the one imported (its subprocesses inherit PYTHONPATH)."""
    expected = os.environ.get("MEGAMOE_EXPECT_VLLM")
    if expected:
        import vllm
        from vllm_megamoe.plugin import public_version
        if public_version(vllm.__version__) != expected:
            raise pytest.UsageError(f"MEGAMOE_EXPECT_VLLM={expected} but vllm {vllm.__version__} "
                                    f"was imported from {vllm.__file__}")
