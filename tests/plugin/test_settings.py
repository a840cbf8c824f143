"""The package's settings (vllm_megamoe/settings.py, no vLLM needed): environment, YAML file,
unknown keys are errors, one reader, serving and developer keys."""
import os

import pytest

from vllm_megamoe.settings import CONFIG_ENV, DEVELOPER_KEYS, KEYS, USER_KEYS, env_help, load_settings, setting

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
    assert os.environ["VLLM_MEGAMOE_PATH"] == "portable"  # for code that reads a variable itself


def test_blank_variables_count_as_unset():
    s = load_settings({"VLLM_MEGAMOE_CACHE_DIR": "", "VLLM_MEGAMOE_VERIFY_CHECKPOINT": " "})
    assert s.cache_dir is None and s.verify_checkpoint == "1" and s.describe() == "defaults"
    assert setting("path", {"VLLM_MEGAMOE_PATH": ""}) == "auto"


def test_setting_is_the_one_reader(tmp_path):
    """setting(): the environment, else the VLLM_MEGAMOE_CONFIG file, else the default; parsed and
    refused as load_settings does (no export needed for the core to see a file value)."""
    cfg = tmp_path / "megamoe.yaml"
    cfg.write_text("path: portable\njit-lineinfo: on\nportable_kernels: reduce=torch\n")
    env = {CONFIG_ENV: str(cfg)}
    assert setting("path", env) == "portable" and setting("jit_lineinfo", env) == "1"
    assert setting("portable_kernels", env) == "scatter=auto,activation=auto,reduce=torch"
    assert setting("path", {**env, "VLLM_MEGAMOE_PATH": " SM90 "}) == "sm90"  # the environment wins
    assert setting("timeout_s", env) == 60.0 and setting("timeout_s", {}) == 60.0
    cfg.write_text("path: portable\nfast: yes\n")  # the file is read again once it changes
    with pytest.raises(ValueError, match="unknown key 'fast'"):
        setting("path", env)
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_PATH='fast': must be one of"):
        setting("path", {"VLLM_MEGAMOE_PATH": "fast"})
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_JIT_COMPILER='gcc': must be nvrtc, nvcc or auto"):
        setting("jit_compiler", {"VLLM_MEGAMOE_JIT_COMPILER": "gcc"})


def test_docs_list_the_serving_keys_only():
    """docs/serving.md's table is env_help(): the serving keys, and none of the developer keys."""
    docs = open(os.path.join(REPO, "docs", "serving.md")).read()
    for key in USER_KEYS.values():
        assert key.env in docs, f"docs/serving.md does not document {key.env}"
    for key in DEVELOPER_KEYS.values():
        assert key.env not in docs, f"docs/serving.md documents the developer key {key.env}"
    assert env_help() in docs, "docs/serving.md's table is not env_help()'s"
    assert "| key (YAML) |" in env_help(developer=True)
    assert len(USER_KEYS) + 1 <= 14  # the serving keys and VLLM_MEGAMOE_CONFIG


def test_every_variable_the_package_names_is_a_known_key():
    """A VLLM_MEGAMOE_* variable the package reads but the registry does not know would be rejected
    as unknown at vLLM start-up: every one named anywhere must be a key (or the config file)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2] / "vllm_megamoe"
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"VLLM_MEGAMOE_[A-Z0-9_]+", path.read_text()))
    known = {k.env for k in KEYS.values()} | {CONFIG_ENV}
    assert read <= known, f"unknown to vllm_megamoe/settings.py: {sorted(read - known)}"
