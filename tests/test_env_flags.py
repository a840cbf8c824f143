"""On/off variables read the same by the plugin's settings and by the core's own readers."""
import pathlib

import pytest

from vllm_megamoe.env_flags import FALSE, TRUE, env_flag, parse_auto_flag, parse_flag
from vllm_megamoe.kernels import jit, sm90_smem


@pytest.mark.parametrize("raw", [*TRUE, *FALSE, "TRUE", " Off "])
def test_core_and_plugin_read_a_flag_alike(monkeypatch, raw):
    settings = pytest.importorskip("vllm_megamoe.plugin.settings")
    monkeypatch.setenv("VLLM_MEGAMOE_TEST_FLAG", raw)
    on = raw.strip().lower() in TRUE
    assert env_flag("VLLM_MEGAMOE_TEST_FLAG", not on) is on
    assert settings._flag(raw) == ("1" if on else "0")



@pytest.mark.parametrize("raw,want", [("auto", None), (" AUTO ", None), ("1", True), ("off", False)])
def test_core_and_plugin_read_auto_or_a_flag_alike(raw, want):
    """The evict-first variable's reader (sm90_tuning) and its plugin key share parse_auto_flag."""
    settings = pytest.importorskip("vllm_megamoe.plugin.settings")
    assert parse_auto_flag(raw) is want
    assert settings._auto_or_flag(raw) == {None: "auto", True: "1", False: "0"}[want]
    with pytest.raises(ValueError, match="must be auto or a boolean"):
        parse_auto_flag("2")

def test_unset_or_empty_is_the_default_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.delenv("VLLM_MEGAMOE_TEST_FLAG", raising=False)
    assert env_flag("VLLM_MEGAMOE_TEST_FLAG", True) is True
    monkeypatch.setenv("VLLM_MEGAMOE_TEST_FLAG", " ")
    assert env_flag("VLLM_MEGAMOE_TEST_FLAG", False) is False
    monkeypatch.setenv("VLLM_MEGAMOE_TEST_FLAG", "2")
    with pytest.raises(ValueError, match=r"VLLM_MEGAMOE_TEST_FLAG='2' must be a boolean"):
        env_flag("VLLM_MEGAMOE_TEST_FLAG", False)
    with pytest.raises(ValueError, match="must be a boolean"):
        parse_flag("maybe")


def test_lineinfo_and_the_epilogue_warpgroup_take_true_and_false(monkeypatch):
    spec = jit.KernelSpec(source="sm90/mega_moe_kernel.cu", name="megamoe_sm90_fused")
    root = pathlib.Path("/src")
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", "true")  # was read as off before
    assert "-lineinfo" in jit._common_options(spec, root)
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_LINEINFO", "no")
    assert "-lineinfo" not in jit._common_options(spec, root)
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_EPILOGUE_WARPGROUP", "false")
    assert not sm90_smem.has_epilogue_warpgroup("tma", 64)
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_EPILOGUE_WARPGROUP", "on")
    assert sm90_smem.has_epilogue_warpgroup("tma", 64)


def test_path_variable_is_read_as_the_plugin_reads_it(monkeypatch):
    """The plugin accepts ' Portable ' for VLLM_MEGAMOE_PATH (case and spaces ignored); the core
    used to refuse it on the first call."""
    from vllm_megamoe import MoEShape, ops
    monkeypatch.setenv("VLLM_MEGAMOE_PATH", " Portable ")
    assert ops.select_path(MoEShape(256, 128, 8, 2), "bf16", "cpu")[0] == "portable"
    monkeypatch.setenv("VLLM_MEGAMOE_PATH", "fast")
    with pytest.raises(ValueError, match="VLLM_MEGAMOE_PATH='fast' must be one of"):
        ops.select_path(MoEShape(256, 128, 8, 2), "bf16", "cpu")
