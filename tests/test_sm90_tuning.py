"""Which build of the SM90 kernel a call runs: environment, tuning table, heuristic."""
import pytest

from vllm_megamoe import MoEShape
from vllm_megamoe.kernels import sm90_tuning as tu
from vllm_megamoe.kernels.sm90_tuning import Choice

V4 = MoEShape(4096, 2048, 256, 6)
DSV3 = MoEShape(7168, 2048, 256, 8)
KNOBS = ("VLLM_MEGAMOE_SM90_STAGES", "VLLM_MEGAMOE_SM90_TOKEN_TILE", "VLLM_MEGAMOE_SM90_TUNING")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 1\nentries: []\n")
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TUNING", str(empty))  # not the packaged table
    return monkeypatch


def _table(tmp_path, buckets, ranks=2, fmt="fp8-block"):
    import yaml
    doc = {"version": 1, "entries": [{"shape": {"hidden": 4096, "intermediate": 2048, "experts": 256, "topk": 6},
                                      "format": fmt, "ranks": ranks, "buckets": buckets}]}
    path = tmp_path / "tuning.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_heuristic_without_table_or_environment(clean_env):
    # TMA stages; 64-token tiles from 48 expected rows per local expert (1024 x 2 x 6 / 256).
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(4, 32)
    assert tu.choose(V4, "fp8-block", 2, 1023) == Choice(4, 32)
    assert tu.choose(V4, "fp8-block", 2, 1024) == Choice(4, 64)
    assert tu.choose(V4, "bf16", 1, 2048) == Choice(4, 64)
    assert tu.choices(V4, "fp8-block", 2) == [Choice(4, 32), Choice(4, 64), Choice(4, 128)]
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "32")  # a fixed tile replaces the heuristic's auto
    assert tu.choose(V4, "fp8-block", 2, 8192) == Choice(4, 32)
    assert tu.choices(V4, "fp8-block", 2) == [Choice(4, 32)]


def test_table_buckets_pick_by_tokens_per_rank(clean_env, tmp_path):
    path = _table(tmp_path, [{"max_tokens": 512, "stages": 5, "tile": 32},
                             {"max_tokens": 4096, "stages": 4, "tile": 64}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(path))
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(5, 32)
    assert tu.choose(V4, "fp8-block", 2, 512) == Choice(5, 32)
    assert tu.choose(V4, "fp8-block", 2, 513) == Choice(4, 64)
    assert tu.choose(V4, "fp8-block", 2, 9000) == Choice(4, 64)  # past the last bucket
    assert tu.choose(V4, "bf16", 2, 8) == Choice(4, 32)          # no entry for the format: heuristic
    assert tu.choices(V4, "fp8-block", 2) == [Choice(5, 32), Choice(4, 64)]


def test_environment_overrides_the_table(clean_env, tmp_path):
    path = _table(tmp_path, [{"max_tokens": 100000, "stages": 5, "tile": 64}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(path))
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "3")
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(3, 64)
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "32")
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(3, 32)


def test_a_tile_override_keeps_the_depth_that_fits(clean_env, tmp_path):
    """The table's 5 stages are for 32-token tiles; a larger tile from the environment runs as many
    stages as fit (4 for 64 tokens, whose epilogue warpgroup's tile takes a stage's room, 4 for
    128), an explicit depth stays (the op refuses it)."""
    from vllm_megamoe.kernels import sm90_smem
    path = _table(tmp_path, [{"max_tokens": 100000, "stages": 5, "tile": 32}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(path))
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(5, 32)
    for tile, stages in (("64", 4), ("128", 4), ("auto", 4)):
        clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", tile)
        c = tu.choose(V4, "fp8-block", 2, 8192)
        assert (c.tile, c.stages) == (int(tile) if tile != "auto" else 128, stages)  # auto: 384 rows per expert
        assert sm90_smem.fits(V4, 2, c.stages, c.tile)
        assert not sm90_smem.fits(V4, 2, c.stages + 1, c.tile)
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "5")
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "128")
    assert tu.choose(V4, "bf16", 2, 8192) == Choice(5, 128)


def test_expected_task_times_is_the_poisson_mean_of_the_block_costs():
    import math
    import random
    rng = random.Random(7)

    def poisson(lam):  # Knuth's method, for a check independent of the closed form
        limit, k, p = math.exp(-lam), 0, 1.0
        while True:
            p *= rng.random()
            if p <= limit:
                return k
            k += 1

    def cost(r, tile):  # block by block, as the kernel's queue cuts an expert's rows
        blocks = [min(tile, r - start) for start in range(0, r, tile)]
        if tile == 64:
            return len(blocks)
        return sum(tu.TILE_128_HALF_TASK_TIME if rows <= 64 else tu.TILE_128_TASK_TIME for rows in blocks)
    for lam, tile in ((40.0, 64), (64.0, 128), (96.0, 128), (171.0, 64), (171.0, 128)):
        draws = [poisson(lam) for _ in range(20000)]
        sampled = sum(cost(r, tile) for r in draws) / len(draws)
        assert abs(tu.expected_task_times(lam, tile) - sampled) < 0.02 * max(1.0, sampled), (lam, tile)
    assert tu.expected_task_times(0.0, 64) == 0.0
    assert tu.expected_task_times(5000.0, 64) == pytest.approx(5000 / 64 + 0.5, abs=0.1)
    with pytest.raises(ValueError, match="tile=32"):
        tu.expected_task_times(10.0, 32)


# kernel_probe graph times on one H200 (EP1; the tile crossover results in git history
# at 63d314b): the faster of tile=64 / tile=128 where they differ by more than 2 % (shape, tokens per
# rank, format, winner).
MEASURED_TILE_WINNERS = (
    ("v4-flash", 2048, "fp8-block", 64), ("v4-flash", 4096, "fp8-block", 128),
    ("deepseek-v3", 2048, "fp8-block", 128), ("deepseek-v3", 4096, "fp8-block", 128),
    ("deepseek-v3", 8192, "fp8-block", 128), ("qwen3-30b-a3b", 2048, "fp8-block", 128),
    ("qwen3-30b-a3b", 4096, "fp8-block", 128), ("qwen3-30b-a3b", 8192, "fp8-block", 128),
    ("v4-flash", 4096, "bf16", 128), ("v4-flash", 8192, "bf16", 128),
    ("deepseek-v3", 2048, "bf16", 128), ("deepseek-v3", 4096, "bf16", 128), ("deepseek-v3", 8192, "bf16", 128),
    ("qwen3-30b-a3b", 1024, "bf16", 128), ("qwen3-30b-a3b", 2048, "bf16", 128),
    ("qwen3-30b-a3b", 4096, "bf16", 128), ("qwen3-30b-a3b", 8192, "bf16", 128),
)


def test_auto_tile_128_follows_the_padding_model(clean_env):
    from benchmarks.common import STANDARD_SHAPES
    for name, tokens, fmt, tile in MEASURED_TILE_WINNERS:
        assert tu.choose(STANDARD_SHAPES[name], fmt, 1, tokens).tile == tile, (name, tokens, fmt)
    # below 64 expected rows an expert's one 128-token block is mostly padding: 64 (measured 1.12x
    # faster in FP8 at 48 rows), and below 48 rows 32
    assert tu.choose(V4, "fp8-block", 1, 2048).tile == 64 and tu.choose(V4, "fp8-block", 1, 1024).tile == 32
    # its token-scale table (28 KB) leaves room for 4 stages: the 128-token builds keep one copy of
    # the weight scales and the epilogue's per-token tables inside the token-scale table
    assert tu.choose(DSV3, "fp8-block", 1, 8192) == Choice(4, 128)
    wide = MoEShape(24576, 2048, 256, 8)  # 128-token stages: only 2 fit beside the token-scale table
    assert tu.choose(wide, "fp8-block", 1, 8192) == Choice(3, 64) == tu.choose(wide, "bf16", 1, 8192)
    assert [c.tile for c in tu.choices(wide, "fp8-block", 1)] == [32, 64]  # no 128 build compiled for it
    assert tu.choices(V4, "bf16", 2) == [Choice(4, 32), Choice(4, 64), Choice(4, 128)]
    assert tu.choices(V4, "fp8-block", 2) == [Choice(4, 32), Choice(4, 64), Choice(4, 128)]


def test_auto_tile_follows_rows_per_expert(clean_env):
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "auto")
    # EP2: 1024 tokens per rank x 2 ranks x top-6 / 256 experts = 48 rows per expert.
    assert tu.choose(V4, "fp8-block", 2, 1024).tile == 64 and tu.choose(V4, "fp8-block", 2, 1023).tile == 32
    assert tu.choices(V4, "fp8-block", 2) == [Choice(4, 32), Choice(4, 64), Choice(4, 128)]
    # BF16 from 24 rows (one H100, EP1: 64 faster at 24 rows in all three standard layers,
    # a tie at 18): V4-Flash-like EP1 1024 tokens = 24 rows, 1023 below
    assert tu.choose(V4, "bf16", 1, 1024) == Choice(4, 64) and tu.choose(V4, "bf16", 1, 1023).tile == 32
    assert tu.choose(V4, "fp8-block", 1, 1024).tile == 32 and tu.choose(DSV3, "bf16", 1, 768).tile == 64


def test_table_bucket_leaves_64_or_128_to_the_padding_model(clean_env, tmp_path):
    table = _table(tmp_path, [{"max_tokens": 724, "stages": 5, "tile": 32},
                              {"max_tokens": 1 << 20, "stages": 4, "tile": tu.TILE_64_OR_128}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(table))
    # EP2, V4-Flash-like: 1024 tokens per rank -> 48 rows per local expert (64), 8192 -> 384 (128);
    # the bucket's 64 over 32 holds below AUTO_TILE_ROWS_PER_EXPERT too (800 tokens: 37 rows)
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(5, 32)
    assert tu.choose(V4, "fp8-block", 2, 800) == tu.choose(V4, "fp8-block", 2, 1024) == Choice(4, 64)
    assert tu.choose(V4, "fp8-block", 2, 8192) == Choice(4, 128)
    assert tu.choices(V4, "fp8-block", 2) == [Choice(5, 32), Choice(4, 64), Choice(4, 128)]
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "64")  # the environment's tile wins
    assert tu.choose(V4, "fp8-block", 2, 8192) == Choice(4, 64)
    clean_env.delenv("VLLM_MEGAMOE_SM90_TOKEN_TILE")
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "2")  # no FP8 128-token build below 3 stages
    assert tu.choose(V4, "fp8-block", 2, 8192) == Choice(2, 64)
    assert Choice(2, 128) not in tu.choices(V4, "fp8-block", 2)


def test_bad_settings_are_named(clean_env, tmp_path):
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "48")
    with pytest.raises(ValueError, match="must be 32, 64, 128 or auto"):
        tu.choose(V4, "fp8-block", 2, 8)
    clean_env.delenv("VLLM_MEGAMOE_SM90_TOKEN_TILE")
    (tmp_path / "tma128").mkdir()
    fp8_128_tma = _table(tmp_path / "tma128", [{"max_tokens": 8, "stages": 3, "tile": 128}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(fp8_128_tma))
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(3, 128)
    # A table from before the kernel had one mainloop: "tma" in a bucket is accepted, another refused.
    (tmp_path / "named").mkdir()
    named = _table(tmp_path / "named", [{"max_tokens": 8, "mainloop": "tma", "stages": 3, "tile": 128}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(named))
    assert tu.choose(V4, "fp8-block", 2, 8) == Choice(3, 128)
    bad = _table(tmp_path, [{"max_tokens": 8, "mainloop": "wgmma", "stages": 4, "tile": 64}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(bad))
    with pytest.raises(ValueError, match="entry 0: bucket max_tokens=8 names mainloop 'wgmma': the SM90 kernel has only "
                                         "the 'tma' mainloop now; drop the bucket's mainloop field"):
        tu.choose(V4, "fp8-block", 2, 8)
    (tmp_path / "typo").mkdir()
    typo = _table(tmp_path / "typo", [{"max_tokens": 8, "stage": 4, "tile": 64}])
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(typo))
    with pytest.raises(ValueError, match="entry 0: bucket max_tokens=8: unknown fields \\['stage'\\]"):
        tu.choose(V4, "fp8-block", 2, 8)
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="is not a file"):
        tu.choose(V4, "fp8-block", 2, 8)
    twice = tmp_path / "twice.yaml"  # a repeated key: plain YAML would keep the second silently
    twice.write_text("version: 1\nentries: []\nentries: [{}]\n")
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(twice))
    with pytest.raises(ValueError, match="(?s)twice.yaml: not valid YAML.*'entries' appears twice"):
        tu.choose(V4, "fp8-block", 2, 8)
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: [1\n")
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(broken))
    with pytest.raises(ValueError, match="broken.yaml: not valid YAML"):
        tu.choose(V4, "fp8-block", 2, 8)


def test_tuning_script_buckets_the_fastest_correct_build():
    from benchmarks import tune_sm90

    def row(tokens, label, us, err=0.0):
        return dict(shape="v4-flash", format="fp8-block", tokens_per_rank=tokens, variant=label, mainloop=label,
                    graph_us=us, rel_err_vs_first_variant=err)
    probe = {"env": {"gpus": 2}, "rows": [
        row(8, "tma/4/32", 400), row(8, "tma/5/32", 380), row(8, "tma/3/32", 100, err=0.5),  # wrong: never wins
        row(8, "wgmma/4/32", 50),  # a build of another mainloop, withdrawn since: never wins
        row(128, "tma/4/32", 900), row(128, "tma/5/32", 950),
        row(1024, "tma/5/32", 1700), row(1024, "tma/5/64", 1500),
        row(8192, "tma/5/64", 6000), row(8192, "tma/4/64", 6100),
        row(8192, "tma/3/128", 5000)]}  # an FP8 128-token timing of the withdrawn swap-AB build: never wins
    doc = tune_sm90.table([probe], None, max_err=2e-2)
    (entry,) = doc["entries"]
    assert entry["shape"] == {"hidden": 4096, "intermediate": 2048, "experts": 256, "topk": 6} and entry["ranks"] == 2
    assert entry["buckets"] == [
        {"max_tokens": 32, "stages": 5, "tile": 32},          # sqrt(8 * 128)
        {"max_tokens": 362, "stages": 4, "tile": 32},         # sqrt(128 * 1024)
        {"max_tokens": tune_sm90.LAST_BUCKET, "stages": 5, "tile": tu.TILE_64_OR_128}]  # 1024 and 8192 merged
    parsed = tu.parse_table(doc)
    assert parsed[(4096, 2048, 256, 6, "fp8-block", 2)][0] == (32, Choice(5, 32), None)
    # With a noise margin, the heuristic's build (4 stages) keeps a point it is within the
    # margin of (8192: 6100 vs 6000); where it was not measured (1024) the fastest build wins.
    # No current 128-token build ran at 8192, and one exists: 64 or 128 by the model.
    margin = tune_sm90.table([probe], None, max_err=2e-2, min_gain=0.03)["entries"][0]["buckets"]
    assert margin[-2:] == [
        {"max_tokens": 2896, "stages": 5, "tile": tu.TILE_64_OR_128},       # sqrt(1024 * 8192)
        {"max_tokens": tune_sm90.LAST_BUCKET, "stages": 4, "tile": tu.TILE_64_OR_128}]
    assert tu.parse_table(tune_sm90.table([probe], None, 2e-2, 0.03))[(4096, 2048, 256, 6, "fp8-block", 2)][-1] == \
        (tune_sm90.LAST_BUCKET, Choice(4, 64), tu.TILE_64_OR_128)
    # A probe of the current FP8 128-token build (kernel_probe records its generation) may win.
    current = dict(probe, env={"gpus": 2, "fp8_tile128": tu.FP8_TILE128_BUILD})
    assert tune_sm90.table([current], None, max_err=2e-2)["entries"][0]["buckets"][-1] == \
        {"max_tokens": tune_sm90.LAST_BUCKET, "stages": 3, "tile": 128}
    # An existing entry for another layer is kept; the probed layer's is replaced.
    other = dict(entry, ranks=4)
    doc2 = tune_sm90.table([probe], {"version": 1, "entries": [other, dict(entry, buckets=[])]}, 2e-2)
    assert [e["ranks"] for e in doc2["entries"]] == [2, 4] and doc2["entries"][0]["buckets"] == entry["buckets"]
    # an existing table's "tma" column is dropped from the entries it keeps
    old = dict(entry, ranks=8, buckets=[dict(b, mainloop="tma") for b in entry["buckets"]])
    kept = tune_sm90.table([probe], {"version": 1, "entries": [old]}, 2e-2)["entries"][1]
    assert kept["ranks"] == 8 and kept["buckets"] == entry["buckets"]


def test_packaged_table_parses():
    path = tu.table_path()
    if path is None:
        pytest.skip("no packaged tuning table")
    import yaml
    tu.parse_table(yaml.safe_load(path.read_text()), str(path))


def test_doctor_names_the_build_and_reports_bad_settings(clean_env):
    from vllm_megamoe import doctor
    assert doctor._sm90_build(1).startswith("8 tok/rank -> tma/4/32, 4096 tok/rank -> tma/4/128")  # 192 rows per expert
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "12")
    assert doctor._sm90_build(1).startswith("error: VLLM_MEGAMOE_SM90_STAGES='12'")
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "5")  # valid, but the 128-token build cannot hold 5
    assert doctor._sm90_build(1).startswith("error: 5 stages need")
    clean_env.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "32")
    assert doctor._sm90_build(1).startswith("8 tok/rank -> tma/5/32, 4096 tok/rank -> tma/5/32")


def test_doctor_names_the_kernel_compiler(clean_env, tmp_path):
    from vllm_megamoe import doctor
    from vllm_megamoe.kernels import jit
    clean_env.setenv("VLLM_MEGAMOE_JIT_COMPILER", "nvcc")
    clean_env.setenv("VLLM_MEGAMOE_NVCC", str(tmp_path / "nvcc"))
    assert doctor._compiler().startswith("none: VLLM_MEGAMOE_NVCC=")
    clean_env.setenv("VLLM_MEGAMOE_NVCC", "/bin/false")  # fails: reported, not raised
    assert doctor._compiler().startswith("none: /bin/false --version failed")
    clean_env.setenv("VLLM_MEGAMOE_NVCC", "/bin/echo")  # runs, but says nothing of CUDA
    assert doctor._compiler().startswith("none: /bin/echo does not report a CUDA compiler version")
    clean_env.delenv("VLLM_MEGAMOE_NVCC")
    clean_env.setenv("VLLM_MEGAMOE_JIT_COMPILER", "nvrtc")
    if jit.nvrtc_available():
        assert doctor._compiler().startswith("nvrtc-%d.%d; cache " % jit.nvrtc_version())


def test_plugin_settings_offer_what_the_core_accepts():
    """The plugin declares its choices literally (it imports no torch); they must not drift from
    the core's lists."""
    from vllm_megamoe.plugin.settings import KEYS
    parse = {name: key.parse for name, key in KEYS.items()}
    if "sm90_token_tile" in parse:
        assert set(parse["sm90_token_tile"].choices) == {str(t) for t in tu.TILES} | {"auto"}
    assert "sm90_mainloop" not in parse or set(getattr(parse["sm90_mainloop"], "choices", ())) <= {tu.MAINLOOP}


def test_fp8_auto_tile_stays_below_128_under_two_forced_stages(clean_env):
    """The FP8 128-token build needs 3 stages (its register-token K loop): with
    VLLM_MEGAMOE_SM90_STAGES=2 the auto tile picks 64 where it would pick 128, and nothing compiles
    a 128-token build; BF16 keeps 128."""
    assert tu.choose(V4, "fp8-block", 1, 8192).tile == 128
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "2")
    assert tu.choose(V4, "fp8-block", 1, 8192) == Choice(2, 64)
    assert 128 not in [c.tile for c in tu.choices(V4, "fp8-block", 1)]
    assert tu.choose(V4, "bf16", 1, 8192) == Choice(2, 128)


def test_other_ep_sizes_take_the_nearest_entry_by_rows_per_expert(clean_env, tmp_path):
    """An EP size without its own entry uses the layer's entry at the nearest EP size, its buckets
    read in rows per local expert (512 tokens per rank at EP2 are 1024 at EP1 and 256 at EP4),
    their tiles kept and the heuristic's depth in place of the entry's."""
    import yaml
    ep2 = [{"max_tokens": 512, "stages": 5, "tile": 32},
           {"max_tokens": 1 << 20, "stages": 4, "tile": 64}]
    path = _table(tmp_path, ep2)
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(path))
    assert tu.table_entry(V4, "fp8-block", 1)[1] == 2 and tu.table_entry(V4, "bf16", 1) == ([], 0)
    assert tu.choose(V4, "fp8-block", 2, 512) == Choice(5, 32)  # its own EP size: as written
    assert tu.choose(V4, "fp8-block", 1, 1024) == Choice(4, 32)
    assert tu.choose(V4, "fp8-block", 1, 1025) == Choice(4, 64)
    assert tu.choose(V4, "fp8-block", 4, 256) == Choice(4, 32)
    assert tu.choose(V4, "fp8-block", 4, 257) == Choice(4, 64)
    assert tu.choices(V4, "fp8-block", 1) == [Choice(4, 32), Choice(4, 64)]
    # its own entry wins; of two other EP sizes the nearer, the larger of two as near
    doc = yaml.safe_load(path.read_text())
    shape = doc["entries"][0]["shape"]
    one = [{"max_tokens": 1 << 20, "stages": 3, "tile": 32}]
    eight = [{"max_tokens": 1 << 20, "stages": 3, "tile": 32}]
    doc["entries"] += [{"shape": shape, "format": "fp8-block", "ranks": 1, "buckets": one},
                       {"shape": shape, "format": "fp8-block", "ranks": 8, "buckets": eight}]
    (tmp_path / "more").mkdir()
    more = tmp_path / "more" / "tuning.yaml"
    more.write_text(yaml.safe_dump(doc))
    clean_env.setenv("VLLM_MEGAMOE_SM90_TUNING", str(more))
    assert tu.choose(V4, "fp8-block", 1, 1025) == Choice(3, 32)
    assert tu.table_entry(V4, "fp8-block", 4)[1] == 8   # 2 and 8 are as near to 4: the larger
    assert tu.choose(V4, "fp8-block", 4, 100) == Choice(4, 32)  # EP8's 3 stages not carried
    assert tu.table_entry(V4, "fp8-block", 3)[1] == 2
    assert tu.table_entry(V4, "fp8-block", 16)[1] == 8


def test_packaged_table_at_ep1_follows_the_ep2_rows_per_expert(clean_env):
    """One GPU, packaged table (EP2 entries): DeepSeek-V3-like at 1024 tokens (32 rows per expert)
    runs 64-token tiles, 0.945x the 32-token build's time on an H100 (docs/kernel_design.md), where the
    rows-per-expert heuristic (64 from 48 rows) kept 32; Qwen3-like at 512 tokens keeps 32."""
    clean_env.delenv("VLLM_MEGAMOE_SM90_TUNING")
    qwen3 = MoEShape(2048, 768, 128, 8)
    assert tu.choose(DSV3, "fp8-block", 1, 1024) == Choice(4, 64)
    assert tu.choose(DSV3, "fp8-block", 1, 512).tile == 32
    assert tu.choose(qwen3, "fp8-block", 1, 512).tile == 32
    assert tu.choose(V4, "fp8-block", 1, 1536).tile == 64
    # the EP2 entry's 5-stage middle bucket (257-724 tokens) is not carried: 4 stages, 32-token
    # tiles up to 1448 tokens at EP1 (1.012x the time with 5 at 1024 tokens on an H100)
    assert tu.choose(V4, "fp8-block", 1, 1024) == Choice(4, 32)
    assert [(b[0], b[1]) for b in tu.table_entry(V4, "fp8-block", 1)[0]] == \
        [(724, Choice(4, 32)), (1 << 20, Choice(4, 64))]


def test_benchmark_records_the_build_the_op_picks(clean_env):
    """benchmarks.bench labels each fused-kernel case with the build choose() gives the op for that
    call, environment overrides included, so a results file says which build each figure is."""
    from benchmarks.bench import sm90_build_label
    assert sm90_build_label(V4, "bf16", 1, 1024) == "tma/4/64"
    assert sm90_build_label(V4, "bf16", 1, 1023) == "tma/4/32"
    assert sm90_build_label(DSV3, "fp8-block", 2, 8192) == tu.choose(DSV3, "fp8-block", 2, 8192).label() == "tma/4/128"
    clean_env.setenv("VLLM_MEGAMOE_SM90_STAGES", "5")
    assert sm90_build_label(V4, "bf16", 1, 8) == "tma/5/32"
