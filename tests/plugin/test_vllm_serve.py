"""`vllm serve MODEL --moe-backend megamoe`, and the same from a `--config` YAML, answer an
OpenAI /v1/completions request on loopback."""
import os

import pytest

pytest.importorskip("vllm")

from vllm_helpers import REPO, Server  # noqa: E402

pytestmark = pytest.mark.vllm

CPU_ARGS = ["--enforce-eager", "--max-model-len", "256", "--gpu-memory-utilization", "0.1"]


def check_completion(server, model):
    reply = server.complete(model, "Hello, my name is")
    choice = reply["choices"][0]
    assert reply["object"] == "text_completion"
    assert len(choice["token_ids"]) == 16 and isinstance(choice["text"], str)
    log = server.log()
    assert "Using megamoe MoE backend" in log and "runs the portable path" in log


def test_serve_with_flag(tiny_models):
    model = tiny_models["mixtral"]
    with Server([model, "--moe-backend", "megamoe", "--dtype", "bfloat16", *CPU_ARGS]) as server:
        check_completion(server, model)


def test_serve_with_config_yaml(tiny_models, tmp_path):
    """The shipped configs/serve-megamoe.yaml, plus a plugin tunables file."""
    model = tiny_models["qwen3_moe"]
    tunables = tmp_path / "megamoe.yaml"
    tunables.write_text("max_tokens_per_rank: 1024\n")
    deploy = os.path.join(REPO, "configs", "serve-megamoe.yaml")
    with Server([model, "--config", deploy, "--max-num-batched-tokens", "1024", *CPU_ARGS],
                env={"VLLM_MEGAMOE_CONFIG": str(tunables)}) as server:
        check_completion(server, model)
        assert "max_tokens_per_rank=1024" in server.log()
