"""Plugin tunables (no vLLM needed): environment, YAML file, unknown keys are errors."""
import os

import pytest

from vllm_megamoe.plugin.settings import CONFIG_ENV, KEYS, env_help, load_settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults():
    s = load_settings({})
    assert s.max_tokens_per_rank is None and s.path == "auto" and s.fallback == "portable"
    assert s.describe() == "defaults"


def test_env_and_file(tmp_path):
    cfg = tmp_path / "megamoe.yaml"
    cfg.write_text("max-tokens-per-rank: 512\nfallback: error\ntimeout_s: 5\n")
    s = load_settings({CONFIG_ENV: str(cfg), "VLLM_MEGAMOE_TIMEOUT_S": "7.5"})
    assert s.max_tokens_per_rank == 512 and s.fallback == "error"
    assert s.timeout_s == 7.5  # the environment wins over the file
    assert s.sources["timeout_s"] == "env" and s.sources["fallback"] == str(cfg)


def test_shipped_example_file_is_valid():
    s = load_settings({CONFIG_ENV: os.path.join(REPO, "configs", "megamoe-plugin.yaml")})
    assert s.max_tokens_per_rank == 8192


def test_unknown_keys_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_MAX_TOKEN_PER_RANK.*did you mean"):
        load_settings({"VLLM_MEGAMOE_MAX_TOKEN_PER_RANK": "8"})
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max_tokens: 8\n")
    with pytest.raises(ValueError, match="unknown key 'max_tokens'"):
        load_settings({CONFIG_ENV: str(cfg)})


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_MAX_TOKENS_PER_RANK='-3'"):
        load_settings({"VLLM_MEGAMOE_MAX_TOKENS_PER_RANK": "-3"})
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_FALLBACK.*one of"):
        load_settings({"VLLM_MEGAMOE_FALLBACK": "maybe"})
    with pytest.raises(ValueError, match=r"VLLM_MEGAMOE_SM90_STAGES='99'.*integer in \[2, 8\]"):
        load_settings({"VLLM_MEGAMOE_SM90_STAGES": "99"})
    for raw in ("inf", "1e400", "nan"):  # an endless barrier wait overflowed at buffer creation
        with pytest.raises(ValueError, match=f"VLLM_MEGAMOE_TIMEOUT_S='{raw}'.*positive, finite"):
            load_settings({"VLLM_MEGAMOE_TIMEOUT_S": raw})
    cfg = tmp_path / "twice.yaml"  # YAML keeps a repeated key's last value without a word
    cfg.write_text("max_tokens_per_rank: 512\nfallback: error\nmax_tokens_per_rank: 64\n")
    with pytest.raises(ValueError, match="(?s)not valid YAML.*'max_tokens_per_rank' appears twice.*line 1"):
        load_settings({CONFIG_ENV: str(cfg)})
    cfg.write_text("max-tokens-per-rank: 512\nmax_tokens_per_rank: 64\n")  # one key, two spellings
    with pytest.raises(ValueError, match="max_tokens_per_rank is set twice.*'max-tokens-per-rank'"):
        load_settings({CONFIG_ENV: str(cfg)})
    cfg = tmp_path / "list.yaml"
    cfg.write_text("- a\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_settings({CONFIG_ENV: str(cfg)})
    with pytest.raises(ValueError, match="cannot read"):
        load_settings({CONFIG_ENV: str(tmp_path / "missing.yaml")})


def test_file_values_reach_the_core_through_the_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "megamoe.yaml"
    cfg.write_text("path: portable\n")
    monkeypatch.setenv(CONFIG_ENV, str(cfg))
    monkeypatch.delenv("VLLM_MEGAMOE_PATH", raising=False)
    load_settings()
    assert os.environ["VLLM_MEGAMOE_PATH"] == "portable"  # ops.select_path reads it


def test_docs_list_every_key():
    docs = open(os.path.join(REPO, "docs", "serving.md")).read()
    for key in KEYS.values():
        assert key.env in docs, f"docs/serving.md does not document {key.env}"
    assert "| key (YAML) |" in env_help()


def test_every_variable_the_core_reads_is_a_known_key():
    """A VLLM_MEGAMOE_* variable the package reads but the plugin does not know would be rejected
    as unknown at vLLM start-up: every one read anywhere must be a key (or the config file)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2] / "vllm_megamoe"
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"VLLM_MEGAMOE_[A-Z0-9_]+", path.read_text()))
    known = {k.env for k in KEYS.values()} | {CONFIG_ENV}
    assert read <= known, f"unknown to plugin/settings.py: {sorted(read - known)}"
