"""A checkpoint converted offline (`vllm-megamoe convert --arch sm90`) serves through vLLM with
`--moe-backend megamoe` with the same greedy tokens as the original checkpoint, and its expert
tensors are loaded as stored (the log says no runtime conversion happened)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm_helpers import REPO, child_env, compare_generations, generate  # noqa: E402

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 0.12


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_converted_checkpoint_serves_like_the_original(tiny_models, tmp_path, arch):
    src, dst = tiny_models[arch], str(tmp_path / f"{arch}-megamoe")
    done = subprocess.run([sys.executable, "-m", "vllm_megamoe.cli", "convert", src, dst, "--arch", "sm90",
                           "--format", "bf16", "--no-progress"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ref = generate(src)
    got = generate(dst, moe_backend="megamoe")
    assert "converted offline (arch sm90, format bf16, layout v1) as stored: no runtime conversion" in got["log"]
    assert "undoing the gate/up interleave" not in got["log"]
    compare_generations(got, ref, LOGPROB_ATOL)


def test_converted_checkpoint_refused_without_megamoe(tiny_models, tmp_path):
    """Served with another MoE backend, the stacked kernel-layout tensors must not load silently."""
    src, dst = tiny_models["qwen3_moe"], str(tmp_path / "q-megamoe")
    subprocess.run([sys.executable, "-m", "vllm_megamoe.cli", "convert", src, dst, "--arch", "sm90",
                    "--format", "bf16", "--no-progress"], cwd=REPO, env=child_env(), check=True,
                   capture_output=True, timeout=300)
    args = '{"dtype": "bfloat16", "enforce_eager": true, "max_model_len": 256, "gpu_memory_utilization": 0.1}'
    run = subprocess.run([sys.executable, os.path.join(REPO, "tests", "plugin", "vllm_helpers.py"), "generate", dst,
                          args], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "its expert weights are in the megamoe kernel layout" in run.stdout + run.stderr
    assert "Serve it with --moe-backend megamoe" in run.stdout + run.stderr


def test_corrupt_converted_checkpoint_is_refused(tiny_models, tmp_path):
    """One byte flipped in a shard: the sha256 check at load (VLLM_MEGAMOE_VERIFY_CHECKPOINT, on by
    default) refuses the checkpoint, naming the shard, instead of serving it."""
    src, dst = tiny_models["qwen3_moe"], str(tmp_path / "q-megamoe")
    subprocess.run([sys.executable, "-m", "vllm_megamoe.cli", "convert", src, dst, "--arch", "sm90",
                    "--format", "bf16", "--no-progress"], cwd=REPO, env=child_env(), check=True,
                   capture_output=True, timeout=300)
    shard = os.path.join(dst, "model-00001-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    args = ('{"dtype": "bfloat16", "enforce_eager": true, "max_model_len": 256, "gpu_memory_utilization": 0.1, '
            '"moe_backend": "megamoe"}')
    run = subprocess.run([sys.executable, os.path.join(REPO, "tests", "plugin", "vllm_helpers.py"), "generate", dst,
                          args], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode != 0 and "RESULT_JSON" not in run.stdout
    assert (f"megamoe: the converted checkpoint {dst} does not match the sha256 checksums of its index, so it is not "
            "loaded: model-00001-of-00001.safetensors: sha256 mismatch (index has ") in log, log[-4000:]
    assert "VLLM_MEGAMOE_VERIFY_CHECKPOINT=0 loads it unchecked" in log
