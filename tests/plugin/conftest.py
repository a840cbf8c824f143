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
