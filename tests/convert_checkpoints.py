"""Small random Hugging Face-style MoE checkpoints of each expert naming convention (for the
converter tests and benchmarks/bench_convert.py). No transformers needed: config.json is
written by hand, tensors with safetensors, experts of one layer spread over several shards."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from vllm_megamoe import quant

CONVENTIONS = ("mixtral", "qwen", "deepseek-fp8", "stacked-linear", "stacked-transposed")
VOCAB = 64


def _rand(gen, *shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)


def _fp8(gen, name, out_features, in_features, tensors):
    q, s = quant.quantize_fp8_blocks(torch.randn(out_features, in_features, generator=gen) * 0.05)
    tensors[name] = q
    tensors[name + "_scale_inv"] = s


def build_tensors(convention: str, *, layers: int = 3, experts: int = 4, hidden: int = 256,
                  inter: int = 128, seed: int = 0) -> dict:
    """{name: tensor} of a tiny MoE model in `convention`."""
    gen = torch.Generator().manual_seed(seed)
    h, i, e = hidden, inter, experts
    t = {"model.embed_tokens.weight": _rand(gen, VOCAB, h), "model.norm.weight": _rand(gen, h),
         "lm_head.weight": _rand(gen, VOCAB, h)}
    fp8 = convention == "deepseek-fp8"
    for n in range(layers):
        p = f"model.layers.{n}"
        t[f"{p}.input_layernorm.weight"] = _rand(gen, h)
        t[f"{p}.post_attention_layernorm.weight"] = _rand(gen, h)
        t[f"{p}.self_attn.rotary_emb.inv_freq"] = torch.rand(h // 4, generator=gen)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if fp8:
                _fp8(gen, f"{p}.self_attn.{proj}.weight", h, h, t)
            else:
                t[f"{p}.self_attn.{proj}.weight"] = _rand(gen, h, h)
        if convention == "mixtral":
            moe = f"{p}.block_sparse_moe"
            t[f"{moe}.gate.weight"] = _rand(gen, e, h)
            for x in range(e):
                t[f"{moe}.experts.{x}.w1.weight"] = _rand(gen, i, h)
                t[f"{moe}.experts.{x}.w3.weight"] = _rand(gen, i, h)
                t[f"{moe}.experts.{x}.w2.weight"] = _rand(gen, h, i)
        elif convention in ("qwen", "deepseek-fp8"):
            moe = f"{p}.mlp"
            if fp8 and n == 0:  # DeepSeek's first layers are dense
                for proj, (o, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                     ("down_proj", (h, i))):
                    _fp8(gen, f"{moe}.{proj}.weight", o, k, t)
                continue
            t[f"{moe}.gate.weight"] = _rand(gen, e, h)
            if fp8:
                t[f"{moe}.gate.e_score_correction_bias"] = torch.rand(e, generator=gen)
            for x in range(e):
                for proj, (o, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                     ("down_proj", (h, i))):
                    name = f"{moe}.experts.{x}.{proj}.weight"
                    if fp8:
                        _fp8(gen, name, o, k, t)
                    else:
                        t[name] = _rand(gen, o, k)
            shared = "shared_experts" if fp8 else "shared_expert"
            for proj, (o, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                if fp8:
                    _fp8(gen, f"{moe}.{shared}.{proj}.weight", o, k, t)
                else:
                    t[f"{moe}.{shared}.{proj}.weight"] = _rand(gen, o, k)
        else:
            moe = f"{p}.feed_forward"
            t[f"{moe}.router.weight"] = _rand(gen, e, h)
            if convention == "stacked-linear":
                t[f"{moe}.experts.gate_up_proj"] = _rand(gen, e, 2 * i, h)
                t[f"{moe}.experts.down_proj"] = _rand(gen, e, h, i)
            else:
                t[f"{moe}.experts.gate_up_proj"] = _rand(gen, e, h, 2 * i)
                t[f"{moe}.experts.down_proj"] = _rand(gen, e, i, h)
    return t


def config_for(convention: str, layers: int, experts: int, hidden: int, inter: int) -> dict:
    base = {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": VOCAB,
            "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    if convention == "mixtral":
        base.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=experts, intermediate_size=inter)
    elif convention == "qwen":
        base.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                    num_experts=experts, moe_intermediate_size=inter)
    elif convention == "deepseek-fp8":
        base.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                    n_routed_experts=experts, moe_intermediate_size=inter, first_k_dense_replace=1,
                    quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]})
    else:
        base.update(architectures=["Llama4ForCausalLM"], model_type="llama4_text",
                    num_local_experts=experts, intermediate_size=inter)
    return base


def write_checkpoint(root: str, tensors: dict, config: dict, shards: int = 3) -> None:
    """Save `tensors` round-robin over `shards` files (so one layer's experts land in several
    shards) with an index, or as model.safetensors when shards == 1; plus extra files."""
    os.makedirs(root, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, os.path.join(root, "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
        weight_map = {n: files[k % shards] for k, n in enumerate(names)}
        for fn in files:
            save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == fn},
                      os.path.join(root, fn), metadata={"format": "pt"})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(root, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 0.7}, f)
    with open(os.path.join(root, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": {"type": "BPE"}}\n')
    os.makedirs(os.path.join(root, "original"), exist_ok=True)
    with open(os.path.join(root, "original", "params.txt"), "w") as f:
        f.write("nested file carried over\n")


def make_checkpoint(root: str, convention: str, *, layers: int = 3, experts: int = 4,
                    hidden: int = 256, inter: int = 128, shards: int = 3, seed: int = 0) -> dict:
    tensors = build_tensors(convention, layers=layers, experts=experts, hidden=hidden,
                            inter=inter, seed=seed)
    write_checkpoint(root, tensors, config_for(convention, layers, experts, hidden, inter), shards)
    return tensors
