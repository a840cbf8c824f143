"""On/off variables read the same by the settings registry and by code that reads a variable itself."""
import pathlib

import pytest

from vllm_megamoe.env_flags import FALSE, TRUE, parse_auto_flag, parse_flag
from vllm_megamoe.kernels import jit


@pytest.mark.parametrize("raw", [*TRUE, *FALSE, "TRUE", " Off "])
def test_settings_read_a_flag_as_parse_flag_does(monkeypatch, raw):
    from vllm_megamoe import settings
    on = raw.strip().lower() in TRUE
    assert parse_flag(raw) is on and settings._flag(raw) == ("1" if on else "0")
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", raw)
    assert settings.setting("jit_lineinfo") == ("1" if on else "0")


@pytest.mark.parametrize("raw,want", [("auto", None), (" AUTO ", None), ("1", True), ("off", False)])
def test_auto_or_a_flag(raw, want):
    """parse_auto_flag: the probes' auto-or-flag options (benchmarks/kernel_probe.py)."""
    assert parse_auto_flag(raw) is want
    with pytest.raises(ValueError, match="must be auto or a boolean"):
        parse_auto_flag("2")


def test_unset_or_empty_is_the_default_and_a_bad_value_names_the_variable(monkeypatch):
    from vllm_megamoe import settings
    monkeypatch.delenv("VLLM_MEGAMOE_JIT_LINEINFO", raising=False)
    assert settings.setting("jit_lineinfo") == "0"
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", " ")
    assert settings.setting("jit_lineinfo") == "0"
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", "2")
    with pytest.raises(ValueError, match=r"VLLM_MEGAMOE_JIT_LINEINFO='2': must be a boolean"):
        settings.setting("jit_lineinfo")
    with pytest.raises(ValueError, match="must be a boolean"):
        parse_flag("maybe")


def test_lineinfo_takes_true_and_false(monkeypatch):
    spec = jit.KernelSpec(source="sm90/mega_moe_kernel.cu", name="megamoe_sm90_fused")
    root = pathlib.Path("/src")
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", "true")  # was read as off before
    assert "-lineinfo" in jit._common_options(spec, root)
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", "no")
    assert "-lineinfo" not in jit._common_options(spec, root)


def test_path_variable_is_read_as_the_plugin_reads_it(monkeypatch):
    """VLLM_MEGAMOE_PATH is read through vllm_megamoe.settings (case and spaces ignored) by the
    plugin and the core alike; the core used to refuse ' Portable ' on the first call."""
    from vllm_megamoe import MoEShape, ops
    monkeypatch.setenv("VLLM_MEGAMOE_PATH", " Portable ")
    assert ops.select_path(MoEShape(256, 128, 8, 2), "bf16", "cpu")[0] == "portable"
    monkeypatch.setenv("VLLM_MEGAMOE_PATH", "fast")
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_PATH='fast': must be one of"):
        ops.select_path(MoEShape(256, 128, 8, 2), "bf16", "cpu")
