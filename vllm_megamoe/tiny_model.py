"""Tiny random Mixture-of-Experts checkpoints for tests and demos (no downloads).

    python -m vllm_megamoe.tiny_model OUT_DIR [--arch qwen3_moe|mixtral] [--seed 0]
                                      [--experts bf16|fp8-block]

writes a Hugging Face checkpoint (config.json, model.safetensors, tokenizer files) of a
2-layer model with hidden 256, expert width 128, 8 experts, top-2: small enough that vLLM on
CPU loads and runs it in seconds, and sized so every megamoe path accepts it (hidden and
intermediate are multiples of 128). Weights are random but reproducible from the seed.
The tokenizer is a byte-level BPE trained in-process on a few sentences, so `vllm serve`
can take and return text. `--experts fp8-block` stores the experts as FP8 with 128x128 block
scales (`weight_scale_inv`, DeepSeek-V3's checkpoint format) and keeps every other layer BF16
(`ignored_layers`), so vLLM's CPU build serves it.

Needs `transformers` and `tokenizers` (both come with vLLM); the package itself does not.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

ARCHS = ("qwen3_moe", "mixtral")
EXPERT_FORMATS = ("bf16", "fp8-block")

# The sizes every test and the demo use; change them here only.
TINY = dict(hidden_size=256, moe_intermediate_size=128, num_experts=8, top_k=2,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=512, max_position_embeddings=1024)

EXPERT_OUTPUT_SCALE = 0.25
LM_HEAD_NORM_SPREAD = 0.75

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Expert parallelism places experts on different GPUs and moves tokens between them.",
    "Hello, my name is vLLM. I serve large language models quickly and cheaply.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "0123456789 + - * / = ( ) [ ] { } < > ? ! , . ; : ' \" @ # $ % ^ & _ ~",
]


def _make_config(arch: str, vocab_size: int):
    t = TINY
    common = dict(
        vocab_size=vocab_size, hidden_size=t["hidden_size"],
        num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
        max_position_embeddings=t["max_position_embeddings"], num_experts_per_tok=t["top_k"],
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
        # Wide logits make greedy choices robust to rounding differences between MoE backends.
        initializer_range=0.08,
    )
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        cfg = Qwen3MoeConfig(intermediate_size=2 * t["moe_intermediate_size"],
                             moe_intermediate_size=t["moe_intermediate_size"],
                             decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                             **common)
        cfg.num_experts = t["num_experts"]
    elif arch == "mixtral":
        from transformers import MixtralConfig
        cfg = MixtralConfig(intermediate_size=t["moe_intermediate_size"], **common)
        cfg.num_local_experts = t["num_experts"]
    else:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    return cfg


def _make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_tiny_moe(out_dir: str, arch: str = "qwen3_moe", seed: int = 0,
                  megamoe: Optional[dict] = None, experts: str = "bf16") -> str:
    """Write a tiny random `arch` MoE checkpoint to out_dir; return out_dir. Its experts are
    BF16 or, with experts="fp8-block", FP8 with 128x128 block scales; all else is BF16.

    megamoe: optional dict stored as config.json["megamoe"] (marks an offline-converted
    checkpoint; only for tests of that detection, the weights are not converted here).
    Reuses out_dir when it already holds a checkpoint written with the same arguments.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r} is not one of {EXPERT_FORMATS}")
    stamp = json.dumps({"arch": arch, "seed": seed, "megamoe": megamoe, "tiny": TINY,
                        "experts": experts}, sort_keys=True)
    stamp_path = os.path.join(out_dir, "tiny_model.json")
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _make_tokenizer(TINY["vocab_size"])
    config = _make_config(arch, TINY["vocab_size"])
    if megamoe is not None:
        config.megamoe = dict(megamoe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Random (not one) norms, so no norm is an identity by accident.
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
            elif "experts" in name and ("down_proj" in name or ".w2" in name):
                # Experts write a quarter of the residual stream's scale: MoE backends that
                # round differently then rarely flip a greedy choice of these flat random
                # models, while a wrong MoE result still moves logprobs far beyond test bounds.
                p.mul_(EXPERT_OUTPUT_SCALE)
            elif name == "lm_head.weight":
                # Heavy-tailed row norms: the best token usually leads the next by a wide
                # (relative) margin, so greedy decoding is not a string of near-ties.
                g = torch.Generator().manual_seed(seed + 1)
                spread = torch.exp(LM_HEAD_NORM_SPREAD * torch.randn(p.shape[0], 1, generator=g))
                p.mul_(spread.to(p.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if experts == "fp8-block":
        _quantize_experts_fp8_block(out_dir)
    with open(stamp_path, "w") as f:
        f.write(stamp)
    return out_dir


def _is_expert_weight(name: str) -> bool:
    return ".experts." in name and name.endswith(".weight")


def _quantize_experts_fp8_block(out_dir: str) -> None:
    """Rewrite the saved checkpoint with FP8 128x128-block experts and say so in config.json."""
    from safetensors.torch import load_file, save_file

    from . import quant
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        if _is_expert_weight(name):
            out[name], out[name + "_scale_inv"] = quant.quantize_fp8_blocks(t.float(), (128, 128))
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    # Every other linear layer stays BF16: vLLM's CPU build has no FP8 linear kernels.
    ignored = sorted(name[: -len(".weight")] for name, t in tensors.items()
                     if t.dim() == 2 and not _is_expert_weight(name) and "embed" not in name)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "ignored_layers": ignored}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", choices=EXPERT_FORMATS, default="bf16",
                   help="the experts' format; every other layer is BF16")
    a = p.parse_args(argv)
    print(make_tiny_moe(a.out_dir, a.arch, a.seed, experts=a.experts))


if __name__ == "__main__":
    main()
