"""The plugin against vLLM releases it was not checked against: a warning naming the release, a
hook point that moved as an error naming it, and vLLM itself left running (register logs it)."""
import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402

import vllm_megamoe.plugin as plugin  # noqa: E402
from vllm_megamoe.plugin import hooks  # noqa: E402

pytestmark = pytest.mark.vllm


class Recorder:
    def __init__(self):
        self.lines = []

    def __call__(self, fmt, *args):
        self.lines.append(fmt % args)


def test_checked_release_installs_quietly(monkeypatch):
    warned = Recorder()
    monkeypatch.setattr(hooks.logger, "warning", warned)
    hooks.install()  # the installed release (the hooks are in place already: idempotent)
    assert warned.lines == []
    assert plugin.checked_vllm_release(vllm.__version__)


def test_unchecked_release_warns(monkeypatch):
    warned = Recorder()
    monkeypatch.setattr(hooks.logger, "warning", warned)
    monkeypatch.setattr(vllm, "__version__", "0.99.1+cpu")
    hooks.install()
    assert len(warned.lines) == 1
    assert "vLLM 0.99.1+cpu is not one of the releases" in warned.lines[0]
    assert "scripts/vllm_releases.sh 0.99.1" in warned.lines[0]


@pytest.mark.parametrize("version,error,message", [
    # A release the plugin was not checked on: install a checked one.
    ("0.99.1", AttributeError("module 'vllm.config.kernel' has no attribute 'KernelConfig'"),
     r"cannot hook into vLLM 0\.99\.1: AttributeError: .*KernelConfig.*checked against vLLM "
     r"0\.32, 0\.33, 0\.34: install one of those"),
    # A checked release: a bug to report.
    ("0.34.0", ValueError("something else"),
     r"vLLM 0\.34\.0: ValueError: something else\. vLLM 0\.34\.0 is a release the plugin is "
     r"checked on, so this is a bug"),
])
def test_a_hook_that_fails_is_an_error_naming_the_release(monkeypatch, version, error, message):
    def failing():
        raise error
    monkeypatch.setattr(hooks, "_extend_moe_backend_choices", failing)
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(RuntimeError, match=message):
        hooks.install()


def test_register_logs_a_failed_install_instead_of_raising(monkeypatch):
    def failing():
        raise RuntimeError("vllm-megamoe cannot hook into vLLM 0.99.1: ...")
    logged = []
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(hooks, "install", failing)
    monkeypatch.setattr(hooks.logger, "error", lambda fmt, *args, **kw: logged.append((fmt % args, kw)))
    plugin.register()  # vLLM calls it in every process: it must not take vLLM down
    assert logged == [("vllm-megamoe cannot hook into vLLM 0.99.1: ...", {"exc_info": True})]
    plugin.register()  # once per process
    assert len(logged) == 1


def test_doctor_says_whether_the_release_is_checked(monkeypatch):
    from vllm_megamoe import doctor
    assert "(the plugin is checked on 0.32, 0.33, 0.34)" in doctor._vllm_version()
    monkeypatch.setattr(doctor, "_version", lambda module: "0.99.1")
    row = doctor._vllm_version()
    assert row.startswith("0.99.1 (not a release the plugin is checked on: 0.32, 0.33, 0.34;")
    assert "scripts/vllm_releases.sh 0.99.1" in row
    monkeypatch.setattr(doctor, "_version", lambda module: "not installed")
    assert doctor._vllm_version() == "not installed"


def test_release_names():
    assert plugin.public_version("0.32.0+cpu") == "0.32.0" and plugin.public_version("0.34.0") == "0.34.0"
    assert plugin.checked_vllm_release("0.33.1+cu130") and not plugin.checked_vllm_release("0.3.4")
    assert not plugin.checked_vllm_release("0.35.0rc1+cpu")
