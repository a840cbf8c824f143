"""GPU tests run one after another in the pytest process and in the ranks it spawns: give the
memory a test cached back to the driver, so the ranks of the next test (one of them on the same
GPU) find it free."""
import gc

import pytest


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    yield
    import torch
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
