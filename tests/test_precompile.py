"""`vllm-megamoe precompile`: recorded spec files, and the builds of --shape / --model layers, which
must be the builds the op loads for those layers on a worker's SymmBuffer (compared here with the
op's own kernel_spec on real CPU buffers of 1 and 2 ranks), with clear errors for bad arguments."""
import pytest

from vllm_megamoe import MoEShape, SymmBuffer, cli
from vllm_megamoe.kernels import jit, sm90_mega_moe, sm90_tuning
from vllm_megamoe.launch import run_ranks
from vllm_megamoe.plugin import runtime

needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc) not loadable")

# Two layer shapes one buffer serves (same experts, the buffer covers both): 1024x768x16x6.
LAYERS = [MoEShape(1024, 512, 16, 4), MoEShape(512, 768, 16, 6)]


def test_shape_parse_spec_and_covering():
    shape = MoEShape.parse(" 4096X2048x256x6 ")
    assert shape == MoEShape(4096, 2048, 256, 6) and MoEShape.parse(shape.spec()) == shape
    for bad in ("4096x2048x256", "4096x2048x256x6x1", "4096x-2048x256x6", "hidden", "4096x2048.0x256x6"):
        with pytest.raises(ValueError, match="HIDDENxINTERMEDIATExEXPERTSxTOPK"):
            MoEShape.parse(bad)
    cover = MoEShape.covering(LAYERS)
    assert cover == MoEShape(1024, 768, 16, 6) and all(s.fits_in(cover) for s in LAYERS)
    assert MoEShape.covering(LAYERS[:1]) == LAYERS[0]
    with pytest.raises(ValueError, match="no layer shapes"):
        MoEShape.covering([])


def _op_specs(rank, world, group, fmt, tokens):
    """What the op loads on a worker buffer covering LAYERS (plugin.runtime.ensure_buffer's shape),
    and the command line the worker logs for it."""
    # what the worker registered: LAYERS on the SM90 path, and a wider layer the portable path runs
    # (left out of the command, but the buffer covers it: the command names the buffer's shape)
    portable_layer = MoEShape(2048, 256, 16, 2)
    buf = SymmBuffer(MoEShape.covering([*LAYERS, portable_layer]), tokens, group, format=fmt, device="cpu")
    specs = [jit.spec_to_json(sm90_mega_moe.kernel_spec(shape, buf, choice))
             for shape in LAYERS for choice in sm90_tuning.choices(shape, fmt, world)]
    saved = runtime.STATE.layers, runtime.STATE.paths
    runtime.STATE.layers = [runtime.LayerInfo(f"layer{i}", s, fmt, buf.device, group, rank, world)
                            for i, s in enumerate([*LAYERS, portable_layer])]
    runtime.STATE.paths = {(s, fmt, str(buf.device)): ("portable" if s == portable_layer else "sm90", "test")
                           for s in [*LAYERS, portable_layer]}
    try:
        command = runtime.precompile_command(buf)
    finally:
        runtime.STATE.layers, runtime.STATE.paths = saved
    buf.destroy()
    return specs, command


def _cli_specs(argv):
    args = cli.build_parser().parse_args(argv)
    return cli._layer_specs(args)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_shape_specs_are_the_builds_the_op_loads(world, fmt, monkeypatch):
    """--shape gives exactly the specs the op's kernel_spec makes for every build each layer may
    run on the worker's buffer (choices), and the worker's log line is a command that gives them;
    also under a setting that changes the builds (the token tile)."""
    for tile in (None, "64"):
        if tile:
            monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", tile)
        if world == 1:
            results = [_op_specs(0, 1, None, fmt, 200)]
        else:
            results = run_ranks(_op_specs, world, (fmt, 200), timeout_s=240)
        for specs, command in results:
            assert specs == results[0][0] and command == results[0][1]
        want = list(dict.fromkeys(jit.spec_from_json(s) for s in results[0][0]))
        argv = results[0][1].split()
        assert argv[:2] == ["vllm-megamoe", "precompile"] and "--buffer-shape 2048x768x16x6" in results[0][1]
        assert _cli_specs(argv[1:]) == want
        assert sm90_mega_moe.layer_kernel_specs(LAYERS, fmt, world, 200, MoEShape(2048, 768, 16, 6)) == want
        assert sm90_mega_moe.layer_kernel_specs(LAYERS, fmt, world, 200) != want  # a smaller buffer: other builds
        tiles = {spec.define("MEGAMOE_TILE_TOKENS") for spec in want}
        assert tiles == {"64"} if tile else len(tiles) >= 2  # the table's tiles, or the forced one
        assert all(spec.define("MEGAMOE_NUM_RANKS") == str(world) for spec in want)


def test_dry_run_lists_builds_and_keys(capsys):
    argv = ["precompile", "--shape", "4096x2048x256x6", "--format", "fp8-block", "--ep-size", "2",
            "--max-tokens-per-rank", "8192", "--dry-run", "--compiler", "nvrtc"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    specs = sm90_mega_moe.layer_kernel_specs([MoEShape(4096, 2048, 256, 6)], "fp8-block", 2, 8192)
    assert lines[-1] == f"{len(specs)} kernels (--dry-run: none compiled)"
    assert lines[:-1] == [f"{sm90_mega_moe.describe_spec(s)} {jit.cache_key(s, 'nvrtc')[:12]}" for s in specs]
    assert all(line.startswith("4096x2048x256x6 fp8-block EP2 T=8192 tma/") for line in lines[:-1])


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to compile"),
    (["--shape", "4096x2048x256x6"], "--shape needs --format and --max-tokens-per-rank"),
    (["--format", "bf16"], "--format describes --shape or --model layers"),
    (["--max-tokens-per-rank", "8"], "--max-tokens-per-rank describes --shape or --model layers"),
    (["--shape", "4096x2048x256", "--format", "bf16", "--max-tokens-per-rank", "8"], "HIDDENxINTERMEDIATExEXPERTSxTOPK"),
    (["--shape", "4096x2048x256x6", "--format", "bf16", "--max-tokens-per-rank", "8", "--ep-size", "3"],
     "num_experts=256 must be divisible by num_ranks=3"),
    (["--shape", "4096x2000x256x6", "--format", "bf16", "--max-tokens-per-rank", "8"],
     "intermediate=2000 must be a positive multiple of 128"),
    (["--shape", "4096x2048x256x6", "--format", "bf16", "--max-tokens-per-rank", "0"], "max_tokens_per_rank=0"),
    (["--shape", "4096x2048x1024x6", "--format", "bf16", "--max-tokens-per-rank", "8"], "1024 local experts"),
    (["--shape", "4096x2048x256x6", "--shape", "2048x768x128x8", "--format", "bf16", "--max-tokens-per-rank", "8"],
     "layer has 128 local experts, the buffer was built for 256"),
    (["--shape", "4096x2048x256x6", "--buffer-shape", "2048x2048x256x6", "--format", "bf16",
      "--max-tokens-per-rank", "8"], "layer shape MoEShape(hidden=4096, intermediate=2048, num_experts=256, topk=6) "
     "does not fit the SymmBuffer built for MoEShape(hidden=2048,"),
    (["--shape", "4096x2048x256x6", "--format", "bf16", "--max-tokens-per-rank", "8", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size applies to --model's layers"),
    (["--shape", "4096x2048x256x6", "--format", "bf16", "--max-tokens-per-rank", "8", "--num-redundant-experts", "2"],
     "--num-redundant-experts applies to --model's layers"),
    (["--ep-size", "2"], "--ep-size describes --shape or --model layers"),
    (["--buffer-shape", "4096x2048x256x6"], "--buffer-shape describes --shape or --model layers"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    assert cli.main(["precompile", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-megamoe precompile: ") and message in err, err


@pytest.mark.parametrize("convention, fmt", [("qwen", "bf16"), ("mixtral", "bf16"), ("deepseek-fp8", "fp8-block"),
                                             ("stacked-linear", "bf16")])
def test_model_gives_the_layers_shapes(convention, fmt, tmp_path):
    """--model reads a checkpoint's MoE layers (headers and config only) and gives the builds of the
    shapes the plugin registers: global experts, top-k from the config, the format the experts load in."""
    from convert_checkpoints import make_checkpoint
    root = str(tmp_path / convention)
    make_checkpoint(root, convention, layers=3, experts=8, hidden=512, inter=256)
    shape = MoEShape(512, 256, 8, 2)  # config_for's num_experts_per_tok
    for ep in (1, 2):
        argv = ["precompile", "--model", root, "--ep-size", str(ep), "--max-tokens-per-rank", "96"]
        assert _cli_specs(argv) == sm90_mega_moe.layer_kernel_specs([shape], fmt, ep, 96)
        assert _cli_specs([*argv, "--shape", "256x256x8x2", "--format", fmt]) == \
            sm90_mega_moe.layer_kernel_specs([MoEShape(256, 256, 8, 2), shape], fmt, ep, 96)
    # TP without EP: each rank's slice of the intermediate; EPLB's redundant experts join the global count
    argv = ["precompile", "--model", root, "--max-tokens-per-rank", "96"]
    assert _cli_specs([*argv, "--tensor-parallel-size", "2"]) == \
        sm90_mega_moe.layer_kernel_specs([MoEShape(512, 128, 8, 2)], fmt, 1, 96)
    assert _cli_specs([*argv, "--ep-size", "2", "--tensor-parallel-size", "2"]) == \
        sm90_mega_moe.layer_kernel_specs([shape], fmt, 2, 96)
    assert _cli_specs([*argv, "--ep-size", "2", "--num-redundant-experts", "2"]) == \
        sm90_mega_moe.layer_kernel_specs([MoEShape(512, 256, 10, 2)], fmt, 2, 96)


def test_model_of_a_converted_checkpoint_and_bad_models(tmp_path, capsys):
    from convert_checkpoints import make_checkpoint
    from vllm_megamoe.convert import convert_checkpoint
    src, dst = str(tmp_path / "src"), str(tmp_path / "sm90-bf16")
    make_checkpoint(src, "deepseek-fp8", layers=3, experts=8, hidden=512, inter=256)
    convert_checkpoint(src, dst, arch="sm90", fmt="bf16", log=lambda msg: None)
    argv = ["precompile", "--model", dst, "--ep-size", "2", "--max-tokens-per-rank", "96"]
    assert _cli_specs(argv) == sm90_mega_moe.layer_kernel_specs([MoEShape(512, 256, 8, 2)], "bf16", 2, 96)
    for extra, message in (
            (["--format", "fp8-block"], f"--format fp8-block, but {dst}'s MoE experts load as bf16"),
            (["--tensor-parallel-size", "4"], "intermediate 256 / tensor-parallel 4): intermediate=64 must be"),
            (["--tensor-parallel-size", "3"], "intermediate 256 does not split over 3 tensor-parallel ranks"),
            (["--ep-size", "3"], "num_experts=8 must be divisible by num_ranks=3"),
            (["--ep-size", "2", "--tensor-parallel-size", "4"], "an EP group of 2 ranks holds whole tensor-parallel")):
        argv = ["precompile", "--model", dst, "--max-tokens-per-rank", "96", "--dry-run", *extra]
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err, extra
    sm100 = str(tmp_path / "sm100")
    convert_checkpoint(src, sm100, arch="sm100", fmt="bf16", log=lambda msg: None)
    assert cli.main(["precompile", "--model", sm100, "--max-tokens-per-rank", "96", "--dry-run"]) == 2
    assert "was converted for sm100, not the SM90 kernel" in capsys.readouterr().err
    assert cli.main(["precompile", "--model", str(tmp_path / "none"), "--max-tokens-per-rank", "96"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_the_plugin_settings_apply(tmp_path, monkeypatch, capsys):
    """The server's settings decide the builds, so precompile reads them as the plugin does: the YAML
    file's kernel keys (VLLM_MEGAMOE_CONFIG) and its max_tokens_per_rank; an unknown
    VLLM_MEGAMOE_* variable is refused as the server refuses it."""
    shape = MoEShape(2048, 768, 128, 8)
    config = tmp_path / "megamoe.yaml"
    config.write_text("sm90_token_tile: 64\nmax-tokens-per-rank: 300\n")
    monkeypatch.delenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", raising=False)
    monkeypatch.setenv("VLLM_MEGAMOE_CONFIG", str(config))
    argv = ["--shape", shape.spec(), "--format", "fp8-block", "--ep-size", "2"]
    specs = _cli_specs(["precompile", *argv])
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "64")  # what the plugin exports from the file
    assert specs == sm90_mega_moe.layer_kernel_specs([shape], "fp8-block", 2, 300)
    assert {s.define("MEGAMOE_TILE_TOKENS") for s in specs} == {"64"}
    monkeypatch.delenv("VLLM_MEGAMOE_CONFIG")
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILES", "64")
    assert cli.main(["precompile", *argv, "--max-tokens-per-rank", "300", "--dry-run"]) == 2
    assert "unknown environment variable VLLM_MEGAMOE_SM90_TOKEN_TILES" in capsys.readouterr().err


@needs_nvrtc
def test_shape_builds_compile_into_the_cache(tmp_path, monkeypatch, capsys):
    """The --shape builds land in the cache under the keys the op looks up, found there the second time."""
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path))
    argv = ["precompile", "--shape", "512x384x24x5", "--format", "bf16", "--ep-size", "2",
            "--max-tokens-per-rank", "16", "--compiler", "nvrtc"]
    specs = sm90_mega_moe.layer_kernel_specs([MoEShape(512, 384, 24, 5)], "bf16", 2, 16)
    assert cli.main(argv) == 0
    assert f"{len(specs)} compiled, 0 already there" in capsys.readouterr().out
    assert {p.stem.rsplit("-", 1)[1] for p in tmp_path.glob("*.cubin")} == {jit.cache_key(s, "nvrtc")[:40] for s in specs}
    assert cli.main(argv) == 0
    assert f"0 compiled, {len(specs)} already there" in capsys.readouterr().out


@needs_nvrtc
def test_recorded_specs_precompile_into_the_cache(tmp_path, monkeypatch, capsys):
    """With VLLM_MEGAMOE_JIT_RECORD set every spec compiled or taken from the cache is recorded once;
    `vllm-megamoe precompile FILE` compiles the recorded specs into another cache under the keys a
    later run looks up, and finds them there the second time."""
    from vllm_megamoe import cli

    def probe(stages):  # a small kernel: the stream-rate probe's source (benchmarks/stream_probe.py)
        return jit.KernelSpec.make("sm90/probe/stream_rate.cu", "megamoe_stream_rate",
                                   dict(PROBE_TOKENS=64, PROBE_STAGES=stages, PROBE_CHUNKS=4, PROBE_CLUSTER=1,
                                        PROBE_SHARE=0))

    record = tmp_path / "run" / "specs.jsonl"
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path / "first"))
    monkeypatch.delenv("VLLM_MEGAMOE_JIT_RECORD", raising=False)
    a = probe(2)
    jit.compile_kernel(a, "nvrtc")
    assert not record.exists()  # nothing recorded without the variable
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_RECORD", str(record))
    b = probe(4)
    for spec in (a, b, a):  # a from the cache, b compiled, a again: two lines
        jit.compile_kernel(spec, "nvrtc")
    assert jit.read_specs(record) == [a, b] and len(record.read_text().splitlines()) == 2
    monkeypatch.delenv("VLLM_MEGAMOE_JIT_RECORD")
    second = tmp_path / "second"
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(second))
    assert cli.main(["precompile", str(record), "--compiler", "nvrtc"]) == 0
    out = capsys.readouterr().out
    assert out.count("compiled megamoe_stream_rate") == 2 and "2 compiled, 0 already there" in out
    keys = {jit.cache_key(spec, "nvrtc")[:40] for spec in (a, b)}
    assert {p.stem.rsplit("-", 1)[1] for p in second.glob("*.cubin")} == keys
    assert cli.main(["precompile", str(record), "--compiler", "nvrtc"]) == 0
    assert "0 compiled, 2 already there" in capsys.readouterr().out


def test_precompile_reports_bad_input(tmp_path, capsys):
    from vllm_megamoe import cli
    assert cli.main(["precompile", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    assert cli.main(["precompile", str(bad)]) == 2
    assert "bad.jsonl, line 1" in capsys.readouterr().err




def test_dry_run_without_a_compiler_lists_builds_without_keys(tmp_path, monkeypatch, capsys):
    """The cache keys name the compiler: with none usable --dry-run still lists the builds, and says why
    there are no keys (here a VLLM_MEGAMOE_NVCC that is no executable, named as such)."""
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_COMPILER", "nvcc")
    monkeypatch.setenv("VLLM_MEGAMOE_NVCC", str(tmp_path / "nvcc"))
    with pytest.raises(jit.KernelCompileError, match="VLLM_MEGAMOE_NVCC=.*is not an executable file"):
        jit.choose_compiler()
    argv = ["precompile", "--shape", "512x384x24x5", "--format", "bf16", "--max-tokens-per-rank", "16", "--dry-run"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    specs = sm90_mega_moe.layer_kernel_specs([MoEShape(512, 384, 24, 5)], "bf16", 1, 16)
    assert captured.out.splitlines()[:-1] == [sm90_mega_moe.describe_spec(s) for s in specs]
    assert "no cache keys: VLLM_MEGAMOE_NVCC=" in captured.err
    assert cli.main(argv[:-1]) == 1  # compiling fails with the same message
    assert "is not an executable file" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_MEGAMOE_NVCC", "/bin/false")  # runs, but is no nvcc: no keys, no traceback
    assert cli.main([*argv, "--compiler", "nvcc"]) == 0
    assert "no cache keys: /bin/false --version failed" in capsys.readouterr().err


def test_an_unwritable_cache_is_an_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path / "file" / "jit"))
    argv = ["precompile", "--shape", "512x384x24x5", "--format", "bf16", "--max-tokens-per-rank", "16"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.startswith("vllm-megamoe precompile: ")
