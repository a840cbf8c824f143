"""Random MoE checkpoints with real models' MoE layers, for end-to-end runs through vLLM on a GPU.

    python -m vllm_megamoe.e2e_models OUT_DIR --preset qwen3-30b-a3b-like [--experts fp8-block]
                                      [--seed 0] [--device cuda] [--swap-experts]

`tiny_model.py` makes the 2-layer toys the CPU tests serve; this module makes checkpoints whose MoE
layers have the sizes of the models users serve, written tensor by tensor with safetensors (no
model class is instantiated, so it works with any `transformers` and fills GPU-sized layers in
seconds on a GPU):

  qwen3-30b-a3b-like  Qwen3MoeForCausalLM, Qwen3-30B-A3B's MoE layer (hidden 2048, expert width 768,
                      128 experts, top-8, normalised top-k), 4 layers, vocab 4096
  deepseek-v3-like    DeepseekV3ForCausalLM: MLA attention, one dense layer then 2 MoE layers with one
                      shared expert, sigmoid scores with a correction bias, grouped top-k (8 groups,
                      4 kept), routed_scaling_factor 2.5; hidden 2048, expert width 512, 64 experts,
                      top-8, vocab 4096
  tiny-qwen3          Qwen3MoeForCausalLM at CPU size (hidden 256, expert width 128, 16 experts, top-4)
  tiny-deepseek       DeepseekV3ForCausalLM at CPU size (hidden 256, 16 experts, top-4, 4 groups;
                      DeepSeek's MLA head sizes, the only ones vLLM's CPU MLA takes)

`--experts fp8-block` stores the routed experts as FP8 e4m3 with 128x128 block scales
(`weight_scale_inv`, DeepSeek-V3's recipe) and lists every other linear layer in `ignored_layers`,
so only the MoE backend differs between two runs of one checkpoint. `--swap-experts` exchanges
each even expert with the next odd one in every layer (same router): the wrong MoE output that an
expert-placement bug gives, used by the tests as a negative control.

The weights are random but scaled so that the models behave like trained ones where the tests
look: every linear keeps the residual stream's scale, the experts write a quarter of it, the
router is decisive, and the output head has heavy-tailed row norms (a clear best next token).
The tokenizer is tiny_model's byte-level BPE; a tokenizer-less run can pass token ids.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

EXPERT_FORMATS = ("bf16", "fp8-block")


@dataclass(frozen=True)
class Preset:
    arch: str                   # "qwen3_moe" or "deepseek_v3"
    hidden: int
    expert_width: int           # moe_intermediate_size
    num_experts: int
    topk: int
    layers: int
    vocab: int = 4096
    heads: int = 16
    kv_heads: int = 4           # qwen3_moe
    head_dim: int = 128         # qwen3_moe
    dense_width: int = 0        # deepseek_v3: the dense layer's MLP width (first_k_dense_replace=1)
    shared_experts: int = 0
    groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int = 0        # deepseek_v3 MLA
    kv_lora_rank: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_dim: int = 0


PRESETS = {
    "qwen3-30b-a3b-like": Preset("qwen3_moe", hidden=2048, expert_width=768, num_experts=128, topk=8,
                                 layers=4, heads=32, kv_heads=4, head_dim=128),
    "deepseek-v3-like": Preset("deepseek_v3", hidden=2048, expert_width=512, num_experts=64, topk=8,
                               layers=3, heads=16, dense_width=4096, shared_experts=1, groups=8,
                               topk_groups=4, routed_scaling_factor=2.5, q_lora_rank=768,
                               kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128),
    "tiny-qwen3": Preset("qwen3_moe", hidden=256, expert_width=128, num_experts=16, topk=4, layers=2,
                         vocab=512, heads=4, kv_heads=2, head_dim=64),
    "tiny-deepseek": Preset("deepseek_v3", hidden=256, expert_width=128, num_experts=16, topk=4,
                            layers=3, vocab=512, heads=4, dense_width=512, shared_experts=1, groups=4,
                            topk_groups=2, routed_scaling_factor=2.5, q_lora_rank=128,
                            kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128),
}

EXPERT_OUTPUT_SCALE = 0.25   # experts write a quarter of the residual stream's scale
ROUTER_GAIN = 4.0            # router logits of a few units: decisive routing, few near-ties
LM_HEAD_GAIN = 1.5           # logits of a few units before the heavy-tailed row norms
LM_HEAD_NORM_SPREAD = 0.75


def _config(p: Preset, max_positions: int = 4096) -> dict:
    common = dict(vocab_size=p.vocab, hidden_size=p.hidden, num_hidden_layers=p.layers,
                  num_attention_heads=p.heads, max_position_embeddings=max_positions,
                  num_experts_per_tok=p.topk, moe_intermediate_size=p.expert_width,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
                  bos_token_id=0, eos_token_id=1, hidden_act="silu", rope_theta=10000.0,
                  initializer_range=0.02, use_cache=True)
    if p.arch == "qwen3_moe":
        return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    num_key_value_heads=p.kv_heads, head_dim=p.head_dim, num_experts=p.num_experts,
                    intermediate_size=4 * p.expert_width, decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True, attention_bias=False, output_router_logits=False,
                    router_aux_loss_coef=0.0)
    return dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                num_key_value_heads=p.heads, n_routed_experts=p.num_experts,
                n_shared_experts=p.shared_experts, intermediate_size=p.dense_width,
                first_k_dense_replace=1, moe_layer_freq=1, n_group=p.groups,
                topk_group=p.topk_groups, topk_method="noaux_tc", scoring_func="sigmoid",
                norm_topk_prob=True, routed_scaling_factor=p.routed_scaling_factor,
                q_lora_rank=p.q_lora_rank, kv_lora_rank=p.kv_lora_rank,
                qk_rope_head_dim=p.rope_dim, qk_nope_head_dim=p.nope_dim, v_head_dim=p.v_dim,
                attention_bias=False, rope_scaling=None)


def _tensor_specs(p: Preset):
    """(name, shape, kind) of every tensor; kind picks the initialisation (see _fill)."""
    H, I, E = p.hidden, p.expert_width, p.num_experts
    yield "model.embed_tokens.weight", (p.vocab, H), "embed"
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (H,), "norm"
        yield pre + "post_attention_layernorm.weight", (H,), "norm"
        a = pre + "self_attn."
        if p.arch == "qwen3_moe":
            yield a + "q_proj.weight", (p.heads * p.head_dim, H), "linear"
            yield a + "k_proj.weight", (p.kv_heads * p.head_dim, H), "linear"
            yield a + "v_proj.weight", (p.kv_heads * p.head_dim, H), "linear"
            yield a + "o_proj.weight", (H, p.heads * p.head_dim), "linear"
            yield a + "q_norm.weight", (p.head_dim,), "norm"
            yield a + "k_norm.weight", (p.head_dim,), "norm"
        else:
            yield a + "q_a_proj.weight", (p.q_lora_rank, H), "linear"
            yield a + "q_a_layernorm.weight", (p.q_lora_rank,), "norm"
            yield a + "q_b_proj.weight", (p.heads * (p.nope_dim + p.rope_dim), p.q_lora_rank), "linear"
            yield a + "kv_a_proj_with_mqa.weight", (p.kv_lora_rank + p.rope_dim, H), "linear"
            yield a + "kv_a_layernorm.weight", (p.kv_lora_rank,), "norm"
            yield a + "kv_b_proj.weight", (p.heads * (p.nope_dim + p.v_dim), p.kv_lora_rank), "linear"
            yield a + "o_proj.weight", (H, p.heads * p.v_dim), "linear"
        m = pre + "mlp."
        if p.arch == "deepseek_v3" and i == 0:
            yield m + "gate_proj.weight", (p.dense_width, H), "linear"
            yield m + "up_proj.weight", (p.dense_width, H), "linear"
            yield m + "down_proj.weight", (H, p.dense_width), "down"
            continue
        yield m + "gate.weight", (E, H), "router"
        if p.arch == "deepseek_v3":
            yield m + "gate.e_score_correction_bias", (E,), "bias"
            S = p.shared_experts * I
            yield m + "shared_experts.gate_proj.weight", (S, H), "linear"
            yield m + "shared_experts.up_proj.weight", (S, H), "linear"
            yield m + "shared_experts.down_proj.weight", (H, S), "down"
        for e in range(E):
            yield m + f"experts.{e}.gate_proj.weight", (I, H), "expert"
            yield m + f"experts.{e}.up_proj.weight", (I, H), "expert"
            yield m + f"experts.{e}.down_proj.weight", (H, I), "expert_down"
    yield "model.norm.weight", (H,), "norm"
    yield "lm_head.weight", (p.vocab, H), "lm_head"


def _fill(kind: str, shape, gen, device):
    import torch
    randn = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
    if kind == "norm":
        return 1.0 + 0.1 * randn(*shape)
    if kind == "bias":
        return 0.1 * randn(*shape)          # the correction bias stays float32, as in DeepSeek-V3
    if kind == "embed":
        return randn(*shape)
    fan_in = shape[-1]
    w = randn(*shape) / math.sqrt(fan_in)
    if kind in ("down", "expert_down"):
        w *= EXPERT_OUTPUT_SCALE
    elif kind == "router":
        w *= ROUTER_GAIN
    elif kind == "lm_head":
        spread = torch.exp(LM_HEAD_NORM_SPREAD * randn(shape[0], 1))
        w *= LM_HEAD_GAIN * spread
    return w


def _swap_partner(name: str) -> Optional[str]:
    """experts.{2k}.X <-> experts.{2k+1}.X, for --swap-experts."""
    if ".experts." not in name:
        return None
    head, rest = name.split(".experts.", 1)
    e, tail = rest.split(".", 1)
    return f"{head}.experts.{int(e) ^ 1}.{tail}"


def make_moe_checkpoint(out_dir: str, preset: str = "qwen3-30b-a3b-like", experts: str = "bf16",
                        seed: int = 0, device: Optional[str] = None, swap_experts: bool = False,
                        shard_bytes: int = 2 << 30) -> str:
    """Write the `preset` checkpoint to out_dir (reused when it holds one made with the same
    arguments); return out_dir. device: where the random tensors are drawn ("cuda" is fast);
    the values depend on the seed and the device type, not on swap_experts' partner order."""
    import torch
    from safetensors.torch import save_file

    from . import quant
    from .tiny_model import _make_tokenizer
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {sorted(PRESETS)}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r} is not one of {EXPERT_FORMATS}")
    p = PRESETS[preset]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    stamp = json.dumps({"preset": preset, "spec": asdict(p), "experts": experts, "seed": seed,
                        "device": torch.device(device).type, "swap": swap_experts, "v": 1},
                       sort_keys=True)
    stamp_path = os.path.join(out_dir, "e2e_model.json")
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    specs = list(_tensor_specs(p))
    gen = torch.Generator(device=device).manual_seed(seed)
    # Draw every tensor in spec order (so --swap-experts changes only where tensors are stored).
    values = {}
    for name, shape, kind in specs:
        values[name] = (kind, _fill(kind, shape, gen, device))
    names = [n for n, _, _ in specs]
    if swap_experts:
        names_to_source = {n: (_swap_partner(n) or n) for n in names}
    else:
        names_to_source = {n: n for n in names}
    shards, current, size, index = [], {}, 0, {}
    ignored = []
    for name in names:
        kind, value = values[names_to_source[name]]
        out = {}
        if kind in ("expert", "expert_down") and experts == "fp8-block":
            q, s = quant.quantize_fp8_blocks(value, (128, 128))
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, s
        elif kind == "bias":
            out[name] = value.float()
        else:
            out[name] = value.to(torch.bfloat16)
            if kind in ("linear", "down", "lm_head", "router") and experts == "fp8-block":
                ignored.append(name[: -len(".weight")])
        for k, v in out.items():
            current[k] = v.cpu().contiguous()
            size += v.numel() * v.element_size()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    total = 0
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fn), metadata={"format": "pt"})
        for k, v in shard.items():
            index[k] = fn
            total += v.numel() * v.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    config = _config(p)
    if experts == "fp8-block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128],
                                         "ignored_layers": sorted(ignored)}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    _make_tokenizer(min(p.vocab, 512)).save_pretrained(out_dir)
    with open(stamp_path, "w") as f:
        f.write(stamp)
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b-like")
    ap.add_argument("--experts", choices=EXPERT_FORMATS, default="bf16",
                    help="the routed experts' format; every other layer is BF16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="where to draw the tensors (default: cuda if present)")
    ap.add_argument("--swap-experts", action="store_true",
                    help="store expert 2k's weights as 2k+1's and back (a negative control)")
    a = ap.parse_args(argv)
    print(make_moe_checkpoint(a.out_dir, a.preset, a.experts, a.seed, a.device, a.swap_experts))


if __name__ == "__main__":
    main()
