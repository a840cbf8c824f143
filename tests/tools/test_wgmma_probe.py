"""CPU checks of benchmarks/wgmma_probe.py: config parsing, and that the probe kernel's patterns
compile for sm_90a without spills and without ptxas serializing the wgmmas (a serialized build
would time something other than the pattern it names)."""
import re

import pytest

from benchmarks import sass_census
from benchmarks import wgmma_probe as wp
from vllm_megamoe.kernels import jit

needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc) not loadable")


def test_configs_parse_and_bad_ones_are_named():
    assert wp.parse_config("64:2:2:2") == dict(n=64, warpgroups=2, groups=2, mode=2, a_regs=False, products=False,
                                               stage_wait=False, copy=False)
    assert wp.parse_config("64:2:2:2:prod+wait+copy")["copy"] is True
    assert wp.parse_config("128:2:1:3:rs")["a_regs"] is True
    both = wp.parse_config("64:2:2:2:prod+wait")
    assert both["products"] and both["stage_wait"] and not both["a_regs"]
    assert wp.parse_config("64:2:2:2:rs+prod+wait+copy")["products"] is True
    for bad, what in (("64:2:2", "N:WG:GROUPS:MODE"), ("60:2:2:0", "multiple of 8"), ("64:3:2:0", "WG and GROUPS"),
                      ("64:2:2:5", "MODE 0 to 4"), ("128:2:2:3", "one group per warpgroup"),
                      ("128:2:2:3:rs", "one group per warpgroup"), ("128:2:1:0:ss", "N:WG:GROUPS:MODE"),
                      ("64:2:2:0:prod", "prod takes MODE 1 or 2"), ("64:2:2:1:wait", "wait takes MODE 2"),
                      ("64:2:2:2:wait+fast", "N:WG:GROUPS:MODE"), ("64:2:2:2:copy", "add wait")):
        with pytest.raises(ValueError, match=what):
            wp.parse_config(bad)


def test_work_and_memory_per_chunk():
    cfg = wp.parse_config("64:2:2:2")  # the fused kernel's 64-token FP8 build: 256 weight rows x 64 tokens
    assert wp.macs_per_chunk(cfg) == 256 * 64 * 128
    assert wp.stage_bytes(cfg) == (256 + 64) * 128 and wp.smem_bytes(cfg, 4) <= 227 * 1024
    for same_tile in ("128:2:1:2:rs", "64:2:2:2:rs"):  # the same CTA tile with the tokens on the M side
        rs = wp.parse_config(same_tile)
        assert wp.macs_per_chunk(rs) == wp.macs_per_chunk(cfg) and wp.stage_bytes(rs) == wp.stage_bytes(cfg)
        # tokens loaded once per warpgroup (2 x 8 KB) instead of once per m64 group (4 x 8 KB)
        assert wp.smem_reads_per_chunk(rs) == 48 * 1024
    assert wp.smem_reads_per_chunk(cfg) == 64 * 1024
    assert wp.smem_reads_per_chunk(wp.parse_config("96:2:1:3:rs")) == (2 * 64 + 2 * 96) * 128


def test_compile_report_reads_ptxas():
    log = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized\n"
           "ptxas info    : Used 229 registers, used 1 barriers\n    0 bytes stack frame, 8 bytes spill stores")
    assert wp.compile_report(log) == dict(registers=229, spill_bytes=8, serialized=True)
    assert wp.compile_report("")["serialized"] is False


@needs_nvrtc
@pytest.mark.parametrize("config", ["64:2:2:0", "64:2:2:2", "32:2:2:2", "128:2:1:2", "64:2:1:3", "128:2:1:2:rs",
                                    "96:2:1:3:rs", "64:2:2:2:rs", "64:2:2:2:prod+wait+copy"])
def test_patterns_compile_pipelined(config, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path))
    report = wp.compile_report(jit.compile_kernel(wp.spec(wp.parse_config(config), 4, 32)).log)
    assert report["serialized"] is False and report["spill_bytes"] == 0


@needs_nvrtc
@pytest.mark.parametrize("n,reuse", [(64, 0), (96, 0), (128, 1), (128, 2)])
def test_register_a_check_kernel_compiles(n, reuse, tmp_path, monkeypatch):
    """The GPU checks of the register-A wgmma (tests/gpu/test_wgmma_rs.py) and its fragment loader
    compile for sm_90a without spills or serialised wgmmas."""
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path))
    log = jit.compile_kernel(jit.KernelSpec.make("sm90/probe/wgmma_rs_check.cu", "megamoe_wgmma_rs_check",
                                                 dict(CHECK_N=n, CHECK_REUSE=reuse))).log
    report = wp.compile_report(log)
    assert report["spill_bytes"] in (0, None) and not report["serialized"], log


def _have_nvdisasm() -> bool:
    try:
        sass_census.find_nvdisasm()
        return True
    except SystemExit:
        return False


@needs_nvrtc
@pytest.mark.skipif(not _have_nvdisasm(), reason="needs nvdisasm (CUDA toolkit or nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("reuse,serial", [(1, 0), (2, 0), (1, 1), (2, 1)])
def test_register_a_reuse_checks_compile_to_what_they_check(n, reuse, serial, tmp_path, monkeypatch):
    """The GPU checks of a fragment reloaded every rep (tests/gpu/test_wgmma_rs.py) prove something
    only if, in their SASS, the loop is not serialised, group 1 reads the registers the loop's
    ldmatrix reloads (CHECK_REUSE 1) or a copy in other registers (2, where it matters), and is left in flight
    across the reload (DEPBAR.LE 1 closing the rep) or not (CHECK_SERIAL 1: DEPBAR.LE 0)."""
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path))
    compiled = jit.compile_kernel(jit.KernelSpec.make("sm90/probe/wgmma_rs_check.cu", "megamoe_wgmma_rs_check",
                                                      dict(CHECK_N=n, CHECK_REUSE=reuse, CHECK_SERIAL=serial)),
                                  "nvrtc", use_cache=False)
    assert not wp.compile_report(compiled.log)["serialized"], compiled.log
    ins = sass_census.parse(sass_census.disassemble(compiled.cubin))
    (loop,) = sass_census.wgmma_loops(ins)
    body = loop.body(ins)
    loaded = {int(re.match(r"LDSM\S*\s+R(\d+)", i.text).group(1)) + j for i in body if i.base == "LDSM" for j in range(4)}
    qgmma = [i for i in body if i.base == "QGMMA"]
    assert len(loaded) == 16 and len(qgmma) == 8
    reads = [{int(re.match(r"QGMMA\S*\s+R\d+,\s*R(\d+)", i.text).group(1)) + j for i in group for j in range(4)}
             for group in (qgmma[:4], qgmma[4:])]
    assert reads[0] == loaded
    if reuse == 1:
        assert reads[1] == loaded
    elif not serial:  # with nothing in flight across the reload ptxas may fold the copy back
        assert not reads[1] & loaded
    waits = [i.text for i in body if i.opcode.startswith("WARPGROUP.DEPBAR")]
    assert waits[-1].startswith(f"WARPGROUP.DEPBAR.LE gsb0, 0x{1 - serial}"), waits
