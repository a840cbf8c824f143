"""The tiny checkpoints the vLLM tests and the demo serve: FP8-block experts are the BF16
checkpoint's experts quantized in 128x128 blocks, everything else is unchanged."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from vllm_megamoe import quant  # noqa: E402
from vllm_megamoe.tiny_model import make_tiny_moe  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_block_experts(tmp_path, arch):
    bf16_dir = make_tiny_moe(str(tmp_path / "bf16"), arch, seed=3)
    fp8_dir = make_tiny_moe(str(tmp_path / "fp8"), arch, seed=3, experts="fp8-block")
    bf16 = load_file(os.path.join(bf16_dir, "model.safetensors"))
    fp8 = load_file(os.path.join(fp8_dir, "model.safetensors"))
    experts = [n for n in bf16 if ".experts." in n]
    assert len(experts) == 2 * 8 * 3  # 2 layers, 8 experts, gate/up/down
    assert set(fp8) == set(bf16) | {n + "_scale_inv" for n in experts}
    for name, ref in bf16.items():
        if name not in experts:
            assert torch.equal(fp8[name], ref), name
            continue
        q, s = fp8[name], fp8[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == ref.shape
        assert s.dtype == torch.float32 and s.shape == (-(-ref.shape[0] // 128), -(-ref.shape[1] // 128))
        err = (quant.dequantize_fp8_blocks(q, s, (128, 128)) - ref.float()).abs().max()
        assert 0 < err <= ref.float().abs().max() / 16  # e4m3 keeps 3 mantissa bits
    config = json.load(open(os.path.join(fp8_dir, "config.json")))["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert "lm_head" in config["ignored_layers"]
    assert not any(".experts." in name for name in config["ignored_layers"])


def test_unknown_experts_format(tmp_path):
    with pytest.raises(ValueError, match="experts='int4' is not one of"):
        make_tiny_moe(str(tmp_path / "x"), experts="int4")
