"""The plugin's startup errors are what a user reads first (issue 53; no vLLM needed): the
interpreter prints a plugin error that a pydantic config wrapped as the message alone, and vLLM's
table of known variables learns the plugin's. tests/plugin/test_vllm_startup.py checks both
through `vllm serve`."""
import sys
from types import SimpleNamespace

import pytest

from vllm_megamoe.plugin import startup
from vllm_megamoe.settings import CONFIG_ENV, KEYS, load_settings


def _config_error(check):
    """What vLLM's VllmConfig raises when a check inside its __post_init__ fails."""
    pydantic = pytest.importorskip("pydantic")

    @pydantic.dataclasses.dataclass
    class Config:
        x: int = 0

        def __post_init__(self):
            check()

    try:
        Config()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no error")


def _hook_output(exc, capsys):
    calls = []
    hook = startup._excepthook(lambda *args: calls.append(args))
    hook(type(exc), exc, exc.__traceback__)
    return capsys.readouterr().err, calls


def test_a_wrapped_plugin_error_is_printed_as_its_message(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    exc = _config_error(lambda: load_settings({"VLLM_MEGAMOE_MAX_TOKEN_PER_RANK": "8"}))
    assert type(exc).__name__ == "ValidationError"
    err, calls = _hook_output(exc, capsys)
    assert err == ("megamoe: error: unknown environment variable VLLM_MEGAMOE_MAX_TOKEN_PER_RANK (did you mean "
                   "'VLLM_MEGAMOE_MAX_TOKENS_PER_RANK'?): rename or unset it\n")
    assert calls == []  # no traceback
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the traceback too, for a bug report
    err, calls = _hook_output(exc, capsys)
    assert len(calls) == 1 and err.startswith("megamoe: error: unknown environment variable")


def test_other_errors_keep_their_traceback(capsys):
    def not_ours():
        raise ValueError("a test's own error")
    err, calls = _hook_output(_config_error(not_ours), capsys)
    assert err == "" and len(calls) == 1
    err, calls = _hook_output(KeyError("x"), capsys)
    assert err == "" and len(calls) == 1


def test_one_problem_is_one_line():
    assert startup.one_line("--moe-backend megamoe cannot serve this configuration:\n  - add "
                            "--enable-expert-parallel") == ("--moe-backend megamoe cannot serve this configuration: "
                                                           "add --enable-expert-parallel")
    assert startup.one_line("a:\n  - x\n  - y") == "a:\n  - x\n  - y"


def test_install_is_idempotent(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    startup.install_excepthook()
    first = sys.excepthook
    startup.install_excepthook()
    assert sys.excepthook is first and first.__megamoe_previous__ is sys.__excepthook__


def test_variables_declared_to_a_vllm_table(monkeypatch):
    table = {"VLLM_PORT": lambda: None}
    assert startup.declare_environment_variables(SimpleNamespace(environment_variables=table)) == len(KEYS) + 1
    assert {k.env for k in KEYS.values()} | {CONFIG_ENV, "VLLM_PORT"} == set(table)
    monkeypatch.setenv("VLLM_MEGAMOE_TIMEOUT_S", "12")
    assert table["VLLM_MEGAMOE_TIMEOUT_S"]() == "12"
    assert startup.declare_environment_variables(SimpleNamespace(environment_variables=table)) == 0
    assert startup.declare_environment_variables(SimpleNamespace()) == 0  # a vLLM without the table
