import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu: needs 2 or more CUDA GPUs")
    config.addinivalue_line("markers", "shares_gpu: its multigpu tests can run their ranks on one GPU "
                            "(MEGAMOE_SHARED_GPU=1)")
    config.addinivalue_line("markers", "vllm: needs vLLM installed (skipped without it)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    shared_gpu = os.environ.get("MEGAMOE_SHARED_GPU") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2 and not (shared_gpu and "shares_gpu" in item.keywords):
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))


@pytest.fixture
def gen():
    """A fresh seeded generator per test, so failures reproduce."""
    return torch.Generator().manual_seed(1234)
