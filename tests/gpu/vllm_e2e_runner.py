"""One vLLM engine in a fresh process for tests/gpu/test_vllm_e2e.py:

    python tests/gpu/vllm_e2e_runner.py SPEC_JSON      # prints one RESULT_JSON: line

SPEC_JSON: {"model": DIR, "engine": {LLM kwargs}, "tasks": [TASK, ...]}; each TASK runs in order on
the one engine and adds its result under its "name":
  {"kind": "prompt_logprobs"}  teacher-forced: the logprob of every prompt token given the ones before
                               it, and the top-1 token there (PROMPTS, max_tokens=1)
  {"kind": "greedy"}           GREEDY_TOKENS greedy tokens a prompt, with each token's logprob and
                               the reference margin (top-1 minus top-2) for near-tie handling
  {"kind": "reload", "path": DIR}  vLLM's reload_weights from another checkpoint, then a prefix
                               cache reset (what RL frameworks do after a training step)
  {"kind": "sleep", "level": 1}    LLM.sleep then LLM.wake_up; records vLLM's "Sleep mode freed"
The prompts are random token ids from a fixed seed, the same in every process.
"""
from __future__ import annotations

import json
import random
import sys

NUM_PROMPTS = 8
PROMPT_LEN = 96
GREEDY_TOKENS = 24
FIRST_ID = 2          # ids 0 and 1 are BOS / EOS
ID_RANGE = 500        # within every test model's tokenizer and vocabulary


def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(FIRST_ID, ID_RANGE) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS)]


def _prompt_logprobs(llm) -> dict:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    actual, top1 = [], []
    for o, p in zip(outs, prompts()):
        a, t = [], []
        for tok, lp in zip(p[1:], o.prompt_logprobs[1:]):
            a.append(lp[tok].logprob)
            t.append(next(k for k, v in lp.items() if v.rank == 1))
        actual.append(a)
        top1.append(t)
    return {"actual": actual, "top1": top1}


def _greedy(llm) -> dict:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    result = {"token_ids": [], "logprobs": [], "margins": []}
    for o in outs:
        c = o.outputs[0]
        result["token_ids"].append(list(c.token_ids))
        result["logprobs"].append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        margins = []
        for lp in c.logprobs:
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        result["margins"].append(margins)
    return result


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    from vllm import LLM
    llm = LLM(model=spec["model"], **spec["engine"])
    result = {}
    for i, task in enumerate(spec["tasks"]):
        name = task.get("name", f"{task['kind']}{i}")
        if task["kind"] == "prompt_logprobs":
            result[name] = _prompt_logprobs(llm)
        elif task["kind"] == "greedy":
            result[name] = _greedy(llm)
        elif task["kind"] == "reload":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": task["path"]})
            llm.reset_prefix_cache()
            result[name] = True
        elif task["kind"] == "sleep":
            llm.sleep(level=task.get("level", 1))
            llm.wake_up()
            result[name] = True
        else:
            raise SystemExit(f"unknown task kind {task['kind']!r}")
    print("RESULT_JSON:" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
