"""CPU checks of benchmarks/stream_probe.py: config parsing, the byte arithmetic, the size checks,
the expected checksums, and that the probe kernel builds for sm_90a in every form (its GPU run:
tests/gpu/test_stream_multicast.py)."""
import pytest
import torch

from benchmarks import stream_probe as sp
from vllm_megamoe.kernels import jit

needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc) not loadable")


def test_configs_parse_and_bad_ones_are_named():
    assert sp.parse_config("128:2:1") == dict(tokens=128, cluster=2, share=1)
    assert sp.parse_config("32:1:0") == dict(tokens=32, cluster=1, share=0)
    for bad, what in (("128:2", "TOKENS:CLUSTER:SHARE"), ("128:x:1", "TOKENS:CLUSTER:SHARE"),
                      ("96:1:0", "32, 64 or 128"), ("128:4:0", "CLUSTER=4"), ("128:1:1", "SHARE=1"),
                      ("128:2:3", "SHARE=3")):
        with pytest.raises(ValueError, match=what):
            sp.parse_config(bad)


def test_bytes_per_chunk():
    alone, weights_shared, tokens_shared = (sp.parse_config(c) for c in ("128:1:0", "128:2:1", "128:2:2"))
    for cfg in (alone, weights_shared, tokens_shared):  # every CTA's stage receives both boxes whole
        assert sp.stage_bytes(cfg) == (256 + 128) * 128
    assert sp.fetched_bytes(alone) == 48 * 1024
    assert sp.fetched_bytes(weights_shared) == 16 * 1024 + 16 * 1024
    assert sp.fetched_bytes(tokens_shared) == 32 * 1024 + 8 * 1024
    assert sp.smem_bytes(alone, 4) <= 227 * 1024 < sp.smem_bytes(alone, 5)


def test_size_checks_name_the_problem():
    cfg = sp.parse_config("128:2:1")
    sp.check_sizes(cfg, 4, 8, 2, 132)
    with pytest.raises(ValueError, match="fewer --stages"):
        sp.check_sizes(cfg, 5, 8, 2, 132)
    with pytest.raises(ValueError, match="--blocks must be even"):
        sp.check_sizes(cfg, 4, 8, 3, 132)
    with pytest.raises(ValueError, match="--tiles must be even"):
        sp.check_sizes(sp.parse_config("128:2:2"), 4, 7, 2, 132)
    with pytest.raises(ValueError, match="multiple of the cluster size"):
        sp.check_sizes(cfg, 4, 8, 2, 131)


def _words(t: torch.Tensor) -> int:
    return int(t.view(torch.int32).to(torch.int64).sum()) % 2**32


@pytest.mark.parametrize("config", ["64:1:0", "64:2:1", "64:2:2"])
def test_expected_checksums_follow_the_task_order(config):
    cfg = sp.parse_config(config)
    g = torch.Generator().manual_seed(3)
    tiles, blocks, ctas, tasks = 4, 2, 6, 5
    weights = torch.randint(0, 256, (tiles * 256, 256), dtype=torch.uint8, generator=g)
    tokens = torch.randint(0, 256, (blocks * 64, 256), dtype=torch.uint8, generator=g)
    got = sp.expected_checksums(weights, tokens, cfg, tasks, ctas, tiles, blocks)
    for cta in range(ctas):  # the same sums, task by task from the rows themselves
        total = 0
        for t in range(tasks):
            g_task = t * ctas + cta
            if cfg["share"] == 2:  # a pair: one token block, tiles 2k and 2k + 1
                block, tile = (g_task // 2) % blocks, (2 * (g_task // (2 * blocks)) + g_task % 2) % tiles
            else:
                block, tile = g_task % blocks, (g_task // blocks) % tiles
            total += _words(weights[tile * 256:(tile + 1) * 256]) + _words(tokens[block * 64:(block + 1) * 64])
        assert got[cta] == total % 2**32
    if cfg["share"]:  # a cluster's two CTAs run different tasks (one operand in common)
        assert got[0] != got[1]
    # The tiled layout ([tile][chunk][256 rows][128 bytes]) holds each tile's bytes in another order:
    # the same sums (a box split by 128 bytes of K, 2 chunks here).
    tiled = weights.view(tiles, 256, 2, 128).transpose(1, 2).reshape(tiles * 2 * 256, 128)
    assert sp.expected_checksums(tiled, tokens, cfg, tasks, ctas, tiles, blocks) == got


@needs_nvrtc
@pytest.mark.parametrize("config", list(sp.CONFIGS) + ["32:2:2", "32:1:0"])
def test_probe_builds(config):
    cfg = sp.parse_config(config)
    for checksum in (False, True):
        for tiled in (False, True):
            log = jit.compile_kernel(sp.spec(cfg, 4, 32, checksum, tiled=tiled)).log
            assert "Used" in log and "spill stores" in log
            assert " 0 bytes spill stores" in log


@needs_nvrtc
def test_spin_builds_hold_each_stage():
    """PROBE_SPIN: the consumer's clock loop is in the build (a SASS loop reading the SM clock) only
    when asked for, and the spin is part of the build's identity."""
    from benchmarks import sass_census
    cfg = sp.parse_config("128:1:0")
    plain, spun = sp.spec(cfg, 4, 32), sp.spec(cfg, 4, 32, spin=1600)
    assert plain != spun and ("PROBE_SPIN", "1600") in spun.defines

    def clock_reads(spec):  # S2UR / CS2R of SR_CLOCKLO..: the SM clock
        text = sass_census.disassemble(jit.compile_kernel(spec).cubin)
        return sum("SR_CLOCK" in line for line in text.splitlines())
    assert clock_reads(spun) >= clock_reads(plain) + 1


def test_table_marks_a_launch_that_did_not_run_at_once():
    row = dict(sp.parse_config("128:2:1"), config="128:2:1", registers=26, cycles_per_chunk=1500.0,
               wait_cycles_per_chunk=1500.0, landed_bytes_per_clock=32.0, fetched_bytes_per_clock=21.3,
               fetched_tb_per_s=None, all_at_once=False)
    lines = sp.table([row, dict(row, fetched_tb_per_s=5.4321, all_at_once=True, spin=1000,
                                wait_cycles_per_chunk=500.0)]).splitlines()
    assert lines[1].split()[-2:] == ["-", "NO"] and lines[2].split()[-2:] == ["5.43", "yes"]
    assert lines[2].split()[1:3] == ["rows", "1000"] and lines[2].split()[7] == "500"
    tiled = sp.table([dict(row, layout="tiled")]).splitlines()[1].split()
    assert tiled[1] == "tiled"


def test_spin_must_not_be_negative():
    with pytest.raises(SystemExit):
        sp.main(["--compile-only", "--spin", "-5"])


def test_bad_ctas_and_layout_are_refused():
    for argv in (["--ctas", "0"], ["--layout", "columns"]):
        with pytest.raises(SystemExit):
            sp.main(["--compile-only", *argv])
