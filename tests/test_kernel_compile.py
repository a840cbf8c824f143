"""CPU-only checks of the kernel JIT: the SM90 sources compile for sm_90a through NVRTC without a
GPU, the cache is keyed and written correctly, and import stays light.

NVRTC comes from pip: cuda-bindings (Python API) + nvidia-cuda-nvrtc (libnvrtc.so); the tests skip
only when those cannot be loaded.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from vllm_megamoe.kernels import jit

needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc) not loadable")

# (name, hidden, intermediate): the L1 GEMM is N = 2*inter, K = hidden; L2 is N = hidden, K = inter.
SHAPES = [("v4flash", 4096, 2048), ("dsv3", 7168, 2048), ("qwen3_30b", 2048, 768)]


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_MEGAMOE_CACHE_DIR", str(tmp_path / "jit"))
    return tmp_path / "jit"


def _resources(log: str) -> tuple[int, int]:
    """(stack bytes, spill bytes) from ptxas -v; (0, 0) when the report is absent (seen with
    NVRTC 13.0 next to cuda-bindings 13.3 when a program is compiled a second time in a process)."""
    match = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    if not match:
        return 0, 0
    return int(match.group(1)), int(match.group(2))


def test_import_is_light():
    """`import vllm_megamoe.kernels` works without cuda-python (it is imported on first use)."""
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "import vllm_megamoe, vllm_megamoe.kernels\n"
        "from vllm_megamoe.kernels import jit, sm90_mega_moe, sm90_tuning\n"
        "print(jit.nvrtc_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False"


def test_compiler_choice_env(monkeypatch):
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_COMPILER", "bogus")
    with pytest.raises(ValueError, match="nvrtc, nvcc or auto"):
        jit.choose_compiler()


def _small_spec(tile: int = 32):
    """A small build of the fused kernel (the JIT tests' kernel: it compiles in a few seconds)."""
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe
    from vllm_megamoe.kernels.sm90_tuning import Choice
    shape = MoEShape(512, 384, 24, 5)
    return sm90_mega_moe._make_spec(shape, BufferLayout(shape, 1, 64, "bf16"), Choice(4, tile))


@needs_nvrtc
def test_cache_key_tracks_defines_and_sources(private_cache, tmp_path, monkeypatch):
    import shutil

    a, b = _small_spec(32), _small_spec(64)
    assert jit.cache_key(a, "nvrtc") != jit.cache_key(b, "nvrtc")
    assert jit.cache_key(a, "nvrtc") == jit.cache_key(a, "nvrtc")
    # An edit to any header changes the key.
    copy = tmp_path / "csrc"
    shutil.copytree(jit.csrc_dir(), copy)
    monkeypatch.setenv("VLLM_MEGAMOE_CSRC_DIR", str(copy))
    before = jit.cache_key(a, "nvrtc")
    with open(copy / "sm90" / "ptx.cuh", "a") as handle:
        handle.write("\n// edited\n")
    assert jit.cache_key(a, "nvrtc") != before


@needs_nvrtc
def test_a_spec_that_names_its_tree_builds_from_it(private_cache, tmp_path, monkeypatch):
    """KernelSpec.csrc: the same spec of two source trees is two kernels (two cache keys), also
    when VLLM_MEGAMOE_CSRC_DIR changes within the process; a tree without sm90/ is refused."""
    import shutil

    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe

    other = tmp_path / "other" / "csrc"
    shutil.copytree(jit.csrc_dir(), other)
    with open(other / "sm90" / "ptx.cuh", "a") as handle:
        handle.write("\n// another commit\n")
    shape = MoEShape(4096, 2048, 256, 6)

    class _Buf:
        layout = BufferLayout(shape, 2, 4096, "fp8-block")

    buf = _Buf()
    monkeypatch.delenv("VLLM_MEGAMOE_CSRC_DIR", raising=False)
    mine = sm90_mega_moe.kernel_spec(shape, buf)
    assert mine.csrc == "" and jit.spec_root(mine) == jit.csrc_dir()
    monkeypatch.setenv("VLLM_MEGAMOE_CSRC_DIR", str(other))
    theirs = sm90_mega_moe.kernel_spec(shape, buf)
    assert theirs.csrc == str(other.resolve()) and theirs != mine
    monkeypatch.delenv("VLLM_MEGAMOE_CSRC_DIR")
    # the spec keeps its tree after the variable is gone; the keys differ by the sources alone
    assert sm90_mega_moe.kernel_spec(shape, buf) == mine
    assert jit.spec_root(theirs) == other.resolve()
    assert jit.cache_key(theirs, "nvrtc") != jit.cache_key(mine, "nvrtc")
    assert jit.cache_key(theirs, "nvrtc") == jit.cache_key(dataclasses.replace(mine, csrc=str(other)), "nvrtc")
    with pytest.raises(FileNotFoundError, match="not a CUDA source tree"):
        jit.spec_root(dataclasses.replace(mine, csrc=str(tmp_path)))


@needs_nvrtc
def test_compile_error_carries_log(private_cache, tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(jit.csrc_dir(), copy)
    (copy / "sm90" / "broken.cu").write_text('#include "ptx.cuh"\nextern "C" __global__ void k() { undefined_symbol(); }\n')
    monkeypatch.setenv("VLLM_MEGAMOE_CSRC_DIR", str(copy))
    with pytest.raises(jit.KernelCompileError, match="undefined_symbol"):
        jit.compile_kernel(jit.KernelSpec.make("sm90/broken.cu", "k"), "nvrtc")


@needs_nvrtc
def test_atomic_cache_writes_leave_no_temporaries(private_cache):
    jit.compile_kernel(_small_spec(), "nvrtc")
    names = os.listdir(private_cache)
    assert any(n.endswith(".cubin") for n in names)
    assert not [n for n in names if n.endswith(".tmp")]


def _nvcc_found() -> bool:
    try:
        return jit.find_nvcc() is not None
    except jit.KernelCompileError:  # a VLLM_MEGAMOE_NVCC that is no executable (tested elsewhere)
        return False


@pytest.mark.skipif(not _nvcc_found(), reason="nvcc not installed")
def test_nvcc_and_nvrtc_agree_on_resources(private_cache):
    """The nvcc path compiles the same source; both report no spills."""
    spec = _small_spec()
    compiled = jit.compile_kernel(spec, "nvcc")
    assert compiled.cubin[:4] == b"\x7fELF"
    assert _resources(compiled.log)[1] == 0


# ----------------------------------------------------------------------------- fused mega kernel
FUSED_CASES = [("v4-flash", 4096, 2048, 256, 6), ("deepseek-v3", 7168, 2048, 256, 8),
               ("qwen3-30b-a3b", 2048, 768, 128, 8)]


_V4 = ("v4-flash", 4096, 2048, 256, 6)


def _v4_buf(fmt="fp8-block"):
    from vllm_megamoe import BufferLayout, MoEShape
    shape = MoEShape(4096, 2048, 256, 6)

    class _Buf:  # what kernel_spec reads of a SymmBuffer
        layout = BufferLayout(shape, 2, 4096, fmt)
    return shape, _Buf()


@needs_nvrtc
@pytest.mark.parametrize("build", ["32", "64", "128", "128-wg"])
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
@pytest.mark.parametrize("name,hidden,inter,experts,topk", FUSED_CASES)
def test_fused_mega_kernel_compiles_for_sm90a(private_cache, monkeypatch, name, hidden, inter, experts, topk, fmt,
                                              build):
    """The fused kernel compiles through NVRTC for the standard shapes at EP2, without spills, at
    32-, 64- and 128-token tiles ("-wg": the 128-token epilogue warpgroup, a probe's build whose tile
    fits the Qwen3-like layer only); the shared memory it declares fits next to the dynamic stages."""
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe

    options = sm90_mega_moe.SERVING
    if build == "128-wg":
        if name != "qwen3-30b-a3b":
            pytest.skip("the 128-token epilogue warpgroup's tile does not fit beside 3 stages (the 128 build)")
        options = sm90_mega_moe.BuildOptions(epilogue_warpgroup_128=True)
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", build.split("-")[0])
    shape = MoEShape(hidden, inter, experts, topk)

    class _Buf:  # what kernel_spec reads of a SymmBuffer
        layout = BufferLayout(shape, 2, 4096, fmt)

    spec = sm90_mega_moe.kernel_spec(shape, _Buf(), None, options)
    assert (sm90_mega_moe.threads_per_cta(spec) == 384) == (build in ("32", "64", "128-wg"))
    compiled = jit.compile_kernel(spec, "nvrtc")
    assert len(compiled.cubin) > 10_000
    _, spills = _resources(compiled.log)
    # With an epilogue warpgroup the launch gives every thread 168 registers (384 threads): the
    # Qwen3-like FP8 build keeps a few long-lived values (the call count, two parameters) in local
    # memory around the staging and the register split, not in a K loop (~1000 spilled bytes when
    # the K loop spills).
    allowed = 48 if "MEGAMOE_EPILOGUE_WARPGROUP" in dict(spec.defines) else 0
    assert spills <= allowed, compiled.log
    assert "serialized" not in compiled.log, compiled.log  # e.g. a function call next to wgmma (C7510)
    assert "C75" not in compiled.log, compiled.log  # any other wgmma performance loss (C7514, C7517, ...)
    static = re.search(r"(\d+) bytes smem", compiled.log)
    if static:  # ptxas reports static shared memory; dynamic stages come on top of it
        assert int(static.group(1)) + sm90_mega_moe.dynamic_smem_bytes(spec) <= 227 * 1024


def test_fp8_128_token_tiles_need_three_stages(monkeypatch):
    from vllm_megamoe.kernels import sm90_mega_moe

    shape, buf = _v4_buf()
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "128")
    assert str(dict(sm90_mega_moe.kernel_spec(shape, buf).defines)["MEGAMOE_TILE_TOKENS"]) == "128"
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_STAGES", "2")  # the register-token loop needs 3 or more
    with pytest.raises(ValueError, match="FP8 128-token tiles need 3 or more stages"):
        sm90_mega_moe.kernel_spec(shape, buf)


def test_no_mainloop_switch_is_left():
    """One mainloop: the kernel's sources test no mainloop define, the op passes none and reads no
    VLLM_MEGAMOE_SM90_MAINLOOP."""
    import pathlib
    from vllm_megamoe.kernels import sm90_mega_moe
    root = pathlib.Path(__file__).resolve().parent.parent
    for path in [*(jit.csrc_dir() / "sm90").rglob("*.cu*"), *(root / "vllm_megamoe" / "kernels").glob("*.py")]:
        text = path.read_text()
        assert "MEGAMOE_SMEM_MAINLOOP" not in text and "SM90_MAINLOOP" not in text, path
    shape, buf = _v4_buf()
    assert not [k for k in dict(sm90_mega_moe.kernel_spec(shape, buf).defines) if "MAINLOOP" in k and "STAGES" not in k
                and "SMEM_BYTES" not in k]


@pytest.mark.parametrize("field,good,define,value", [
    ("ablate", 3, "MEGAMOE_ABLATE", "3"),
    ("chunk_trace", True, "MEGAMOE_CHUNK_TRACE", "1")])
def test_profiling_builds_are_opt_in(monkeypatch, field, good, define, value):
    """BuildOptions.ablate / chunk_trace add their define (and a separate cache entry); no
    environment variable reaches them; bad ablation names are refused."""
    from vllm_megamoe.kernels import sm90_mega_moe

    shape, buf = _v4_buf()
    plain = sm90_mega_moe.kernel_spec(shape, buf)
    assert define not in dict(plain.defines)
    for var in ("VLLM_MEGAMOE_SM90_ABLATE", "VLLM_MEGAMOE_SM90_CHUNK_TRACE"):  # the old switches do nothing
        monkeypatch.setenv(var, "1")
    assert sm90_mega_moe.kernel_spec(shape, buf) == plain
    profiled = sm90_mega_moe.kernel_spec(shape, buf, None, sm90_mega_moe.BuildOptions(**{field: good}))
    assert dict(profiled.defines)[define] == value and profiled != plain
    assert sm90_mega_moe.parse_ablation("promotion+mma") == 3 and sm90_mega_moe.parse_ablation("") == 0
    with pytest.raises(ValueError, match="ablate='epilogues'"):
        sm90_mega_moe.parse_ablation("epilogues")
    assert sm90_mega_moe.kernel_spec(shape, buf) == plain


def test_ablation_warning_says_whether_outputs_are_right(caplog):
    """keep_padding alone changes only what padding rows compute (its outputs are right: the
    zeroing's A/B); with any other ablation the build's outputs are wrong, and the warning says which."""
    import logging

    from vllm_megamoe.kernels import sm90_mega_moe

    shape, buf = _v4_buf()
    for value, says in (("keep_padding", "outputs are right"), ("keep_padding+mma", "outputs are wrong"),
                        ("tma", "outputs are wrong")):
        bits = sm90_mega_moe.parse_ablation(value)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            sm90_mega_moe.kernel_spec(shape, buf, None, sm90_mega_moe.BuildOptions(ablate=bits))
        assert any(says in r.getMessage() and str(bits) in r.getMessage() for r in caplog.records), (value, caplog.text)


def test_chunk_trace_task_is_chosen_per_build():
    """BuildOptions.trace_task picks the traced L1 task of a trace build (default
    phase_clock.TRACE_TASK), is a separate build per task, is ignored without the trace, and a bad
    value is refused."""
    from vllm_megamoe.kernels import phase_clock, sm90_mega_moe
    B = sm90_mega_moe.BuildOptions

    shape, buf = _v4_buf()
    assert "MEGAMOE_TRACE_TASK" not in dict(sm90_mega_moe.kernel_spec(shape, buf, None, B(trace_task=0)).defines)
    first = sm90_mega_moe.kernel_spec(shape, buf, None, B(chunk_trace=True, trace_task=0))
    assert dict(first.defines)["MEGAMOE_TRACE_TASK"] == "0"
    default = sm90_mega_moe.kernel_spec(shape, buf, None, B(chunk_trace=True))
    assert dict(default.defines)["MEGAMOE_TRACE_TASK"] == str(phase_clock.TRACE_TASK) and default != first
    with pytest.raises(ValueError, match="trace_task=-1"):
        B(chunk_trace=True, trace_task=-1)


def test_ablation_bits_match_the_kernel():
    """The op's ablation names and bits are config.cuh's kAblate* constants (and the preprocessor
    test of tma_warm in mainloop_smem.cuh uses the same bit)."""
    from vllm_megamoe.kernels import sm90_mega_moe

    mega = jit.csrc_dir() / "sm90" / "mega"
    pairs = re.findall(r"constexpr u32 kAblate(\w+) = (\d+);", (mega / "config.cuh").read_text())
    kernel = {re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower(): int(bit) for name, bit in pairs}
    assert kernel == sm90_mega_moe.ABLATIONS
    assert f"#if MEGAMOE_ABLATE & {kernel['tma_warm']}" in (mega / "mainloop_smem.cuh").read_text()
    # every name is where a developer looks it up: the kernel probe's help
    from benchmarks import kernel_probe
    for name in kernel:
        assert name in kernel_probe.__doc__, name


def test_error_record_phases_match_the_kernel():
    """Python's phase names are the CUDA enum's, in order; every record kind has a message."""
    from vllm_megamoe.kernels import error_record

    sync = (jit.csrc_dir() / "sm90" / "mega" / "sync.cuh").read_text()
    enum = re.search(r"enum Phase : int \{([^}]*)\}", sync).group(1)
    names = re.findall(r"case (kPhase\w+): return \"([^\"]+)\"", sync)
    assert [n for _, n in names] == list(error_record.PHASES[:len(names)])
    assert len(re.findall(r"kPhase\w+", enum)) == len(error_record.PHASES)
    kinds = dict(re.findall(r"(kError\w+) = (\d+)", re.search(r"enum ErrorKind[^}]*\}", sync).group(0)))
    assert {int(v) for v in kinds.values()} == {error_record.KIND_GRID_TIMEOUT, error_record.KIND_NVLINK_TIMEOUT,
                                                 error_record.KIND_STAGING_FULL, error_record.KIND_BLOCK_TIMEOUT,
                                                 error_record.KIND_STAGE_TIMEOUT, error_record.KIND_HANDOFF_TIMEOUT}
    assert all(error_record.describe([int(v), 0, 3, 5, 7, 2, 6, 0]) for v in kinds.values())
    msg = error_record.describe([4, 1, 2, 5, 7, 2, 6, 0])  # an L1 task waiting for its block's rows
    assert "pull -> L1 (token block pulled): token block 7 reached 2 of 6" in msg and "rows pulled" in msg
    msg = error_record.describe([2, 0, 1, 0, 1, 1, 2, 0])
    assert msg == ("megamoe: rank 0 timed out in dispatch (NVLink barrier): 1 of 2 ranks arrived, rank 1 did not; "
                   "a peer rank did not launch this call or died.")
    assert error_record.describe([0] * 8) is None
    kind = error_record.KIND_STAGE_TIMEOUT
    assert "TMA stage 3 (use 9) never landed" in error_record.describe([kind, 1, 3, 5, 3, 9, 0, 0])
    msg = error_record.describe([error_record.KIND_HANDOFF_TIMEOUT, 1, 3, 5, 1, 9, 0, 0])
    assert "epilogue warpgroup's release of the tile (hand-off 9)" in msg


def test_error_watchdog_logs_a_report(caplog, monkeypatch):
    """The watchdog thread logs a record as soon as the kernel writes it (read through numpy: the
    thread never calls into torch, which could abort the process at interpreter exit)."""
    import logging
    import time

    import torch

    from vllm_megamoe.kernels import error_record

    rec = torch.zeros(error_record.RECORD_INTS, dtype=torch.int32)
    monkeypatch.setitem(error_record._records, 99, rec)
    monkeypatch.setitem(error_record._words, 99, rec.numpy())
    monkeypatch.setattr(error_record, "_reported", set())
    caplog.set_level(logging.ERROR, logger=error_record.__name__)
    error_record._start_watchdog()
    rec[:7] = torch.tensor([error_record.KIND_NVLINK_TIMEOUT, 1, 4, 0, 1, 0, 2], dtype=torch.int32)
    deadline = time.time() + 5
    while "rank 1 timed out in L2 / combine (NVLink barrier)" not in caplog.text and time.time() < deadline:
        time.sleep(0.05)
    assert "1 of 2 ranks arrived, rank 0 did not" in caplog.text
    assert error_record.report(torch.device("cpu", 99)).startswith("megamoe: rank 1 timed out")


def test_phase_clock_marks_match_the_kernel():
    """Python's mark names are the CUDA enum's, in order, and summarize reads a launch's clock."""
    from vllm_megamoe.kernels import phase_clock

    src = (jit.csrc_dir() / "sm90" / "mega" / "phase_clock.cuh").read_text()
    enum = re.search(r"enum PhaseMark : int \{([^}]*)\}", src).group(1)
    names = re.findall(r"kMark(\w+)", enum)
    snake = [re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", n).lower() for n in names]
    assert snake == list(phase_clock.MARKS)
    assert "kNumPhaseMarks" in enum
    spans = re.search(r"enum TaskSpan : int \{([^}]*)\}", src).group(1)
    names = re.findall(r"\bkSpan(\w+)", spans)
    assert [re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", n).lower() for n in names] == list(phase_clock.SPANS)
    # Two CTAs 1 us apart; CTA 1 needs 3 us more for L1, which delays everything after it.
    import torch
    base = 10**12
    cta0 = [base + 1000 * i for i in range(len(phase_clock.MARKS))]
    cta1 = [t + 1000 + (3000 if i >= 5 else 0) for i, t in enumerate(cta0)]
    s = phase_clock.summarize(torch.tensor([cta0, cta1, [0] * len(cta0)], dtype=torch.int64))  # row 3: unwritten
    assert s["ctas"] == 2 and s["total_us"] == pytest.approx(13.0)
    assert s["marks"]["l1_done"] == dict(first_us=5.0, last_us=9.0)
    assert s["phases_us"]["l1_start->l1_done"] == pytest.approx(4.0)
    assert s["phases_us"]["l1_done->l2_start"] == pytest.approx(1.0)
    assert phase_clock.summarize(torch.zeros(2, len(cta0), dtype=torch.int64)) == {}


def test_phase_clock_task_spans():
    """Span columns become an average task's microseconds at the clock the L1 marks imply."""
    import torch

    from vllm_megamoe.kernels import phase_clock
    marks = [10**12 + 1000 * i for i in range(len(phase_clock.MARKS))]  # L1 takes 1000 ns per CTA
    spans = dict(l1_loop=2000, l1_tasks=2, l1_gemm=1200, l1_epilogue=600, l2_loop=900, l2_tasks=3, l2_wait=90,
                 l2_gemm=450, l2_epilogue=300)  # cycles at 2 GHz (2000 cycles in 1000 ns)
    row = marks + [spans[name] for name in phase_clock.SPANS]
    idle = marks + [0] * len(phase_clock.SPANS)  # a CTA that got no task
    s = phase_clock.summarize(torch.tensor([row, row, idle], dtype=torch.int64))
    t = s["task_us"]
    assert t["sm_ghz"] == pytest.approx(2.0)  # from the CTAs whose loop ran
    ghz = 2.0
    assert t["l1_tasks"] == 4 and t["l2_tasks"] == 6
    assert t["l1_gemm"] == pytest.approx(2400 / 4 / ghz / 1e3)
    assert t["l1_between"] == pytest.approx((4000 - 2400 - 1200) / 4 / ghz / 1e3)
    assert t["l2_wait"] == pytest.approx(180 / 6 / ghz / 1e3)
    assert t["l2_between"] == pytest.approx((1800 - 180 - 900 - 600) / 6 / ghz / 1e3)
    assert "task_us" not in phase_clock.summarize(torch.tensor([marks], dtype=torch.int64))


def test_chunk_trace_constants_match_the_kernel():
    """The chunk trace's window and layout are phase_clock.cuh's (and the kernel's warp count)."""
    from vllm_megamoe.kernels import phase_clock

    mega = jit.csrc_dir() / "sm90" / "mega"
    src = (mega / "phase_clock.cuh").read_text()
    consts = dict(re.findall(r"(kTrace\w+) = (\d+)", re.search(r"constexpr u32 kTraceTask[^;]*;", src).group(0)))
    assert "kTraceTask = MEGAMOE_TRACE_TASK," in src
    assert int(re.search(r"#define MEGAMOE_TRACE_TASK (\d+)", src).group(1)) == phase_clock.TRACE_TASK
    assert int(consts["kTraceFirstChunk"]) == phase_clock.TRACE_FIRST_CHUNK
    assert int(consts["kTraceChunks"]) == phase_clock.TRACE_CHUNKS
    assert int(consts["kTracePoints"]) == len(phase_clock.TRACE_POINTS) == len(phase_clock.TRACE_INTERVALS)
    assert f"kNumMmaWarps = {phase_clock.WARPS};" in (mega / "config.cuh").read_text()
    # every point is written once, in order, in each lagged K loop (swap-AB and register tokens)
    for header in ("mainloop_smem.cuh", "k_loop_register_tokens.cuh"):
        loop = (mega / header).read_text()
        assert [int(i) for i in re.findall(r"trace_point\(trace, c, (\d+)\)", loop)] == list(
            range(len(phase_clock.TRACE_POINTS))), header


def test_task_trace_constants_match_the_kernel():
    """The task trace's points and layout are phase_clock.cuh's; every point is written in both
    GEMM phases, and every way a task's epilogue ends writes its last point."""
    from vllm_megamoe.kernels import phase_clock

    mega = jit.csrc_dir() / "sm90" / "mega"
    src = (mega / "phase_clock.cuh").read_text()
    points = re.search(r"enum TaskTracePoint : u32 \{([^}]*)\}", src).group(1)
    names = [n.strip().split(" ")[0] for n in points.split(",") if n.strip()]
    assert names[-1] == "kTaskTracePoints" and len(names) - 1 == len(phase_clock.TASK_POINTS)
    assert len(phase_clock.TASK_INTERVALS) == len(phase_clock.TASK_POINTS)
    assert f"kTaskTraceTasks = {phase_clock.TASK_TRACE_TASKS};" in src
    gemm = (mega / "expert_gemm.cuh").read_text()
    callers = gemm + (mega / "block_ready.cuh").read_text() + (mega.parent / "mega_moe_kernel.cu").read_text()
    for name in names[:-1]:
        for phase in ("false", "true"):  # the L1 and L2 phases, or (wait_block) the phase it waits in
            assert re.search(rf"task_trace_point\(p, ({phase}|phase == kPhaseL1), [^;]+, {name}\)", callers), (phase, name)
    for span in ("kSpanL1Epilogue", "kSpanL2Epilogue"):
        ends = gemm.count(f"span_end(p, clock, {span});")
        done = len(re.findall(rf"task_trace_point\(p, \w+, st.tasks - 1, kTaskDone\);\n\s*span_end\(p, clock, {span}\);", gemm))
        assert ends == done > 0, span


def test_task_trace_intervals():
    """task_trace: per phase and interval the mean cycles over the traced CTAs and a warpgroup's
    warps; `between` needs the next task's entry, and untraced phases are left out."""
    import torch

    from vllm_megamoe.kernels import phase_clock as pc
    points, warps, tasks = len(pc.TASK_POINTS), pc.WARPS, pc.TASK_TRACE_TASKS
    steps = torch.tensor([0, 100, 250, 300, 5000, 5040, 5400, 5420], dtype=torch.int64)  # entry .. queued
    trace = torch.zeros(2, warps, tasks, points, dtype=torch.int64)
    for w in range(warps):
        late = 60 if w == 0 else 0           # warp 0 reaches the block barrier 60 cycles after the others
        first = 10**9 + steps.clone()
        first[1] += late
        trace[1, w, 0] = first                # L2 only; L1 left unwritten
        trace[1, w, 1, 0] = first[-1] + 700   # the next task's entry
    marks = [10**12 + 1000 * i for i in range(len(pc.MARKS))]
    row = torch.tensor(marks + [0] * len(pc.SPANS), dtype=torch.int64)
    traced = torch.cat([row, torch.zeros(pc.TRACE_COLUMNS, dtype=torch.int64), trace.flatten()])
    clock = torch.stack([traced, traced])
    assert clock.shape[1] == pc.columns(True)
    t = pc.summarize(clock)["task_trace"]
    assert set(t) == {"l2"} and t["l2"]["ctas"] == 2
    l2 = t["l2"]
    assert l2["lookup"]["wg0"] == pytest.approx(100 + 60 / 4) and l2["lookup"]["wg1"] == pytest.approx(100)
    assert l2["block_check"]["max_warp"] == pytest.approx(150) and l2["block_check"]["wg0"] == pytest.approx(150 - 60 / 4)
    assert l2["block_barrier"]["wg1"] == pytest.approx(50)
    assert l2["gemm"]["wg1"] == pytest.approx(4700) and l2["epilogue"]["wg0"] == pytest.approx(360)
    assert l2["slot_write"]["wg0"] == pytest.approx(20) and l2["between"]["wg1"] == pytest.approx(700)
    one_task = trace.clone()
    one_task[:, :, 1] = 0                  # no CTA ran a second task: no `between`
    clock1 = torch.cat([row, torch.zeros(pc.TRACE_COLUMNS, dtype=torch.int64), one_task.flatten()]).unsqueeze(0)
    assert "between" not in pc.summarize(clock1)["task_trace"]["l2"]


@needs_nvrtc
def test_kernel_probe_compile_only_fills_the_cache_the_op_reads(private_cache):
    """kernel_probe --compile-only compiles, without a GPU, every build a probe of the same
    arguments loads (the table's builds of each variant), under the cache keys the op computes
    for a real buffer of the probe's size; a second run finds them all cached."""
    from benchmarks import kernel_probe
    from vllm_megamoe import MoEShape, SymmBuffer
    from vllm_megamoe.kernels import sm90_mega_moe, sm90_tuning

    shape_name, tokens = "512x384x24x5", [8, 64]
    lines = kernel_probe.compile_only([shape_name], "fp8-block", tokens, ["default", "trace=1"], 1)
    builds = sm90_tuning.choices(MoEShape(512, 384, 24, 5), "fp8-block", 1)
    assert len(lines) == 2 * len(builds) and all(line.endswith(tuple("0123456789abcdef")) for line in lines)
    assert all(" compiled " in line for line in lines)
    cubins = sorted(private_cache.glob("*.cubin"))
    assert len(cubins) == len(lines)
    # the op's own spec for a buffer of max(tokens) rows per rank has one of those keys
    shape = MoEShape(512, 384, 24, 5)
    buf = SymmBuffer(shape, max(tokens), None, format="fp8-block", backend="local", device="cpu")
    spec = sm90_mega_moe.kernel_spec(shape, buf, sm90_tuning.choose(shape, "fp8-block", 1, 8))
    key = jit.cache_key(spec, jit.choose_compiler())
    assert any(c.name.endswith(f"-{key[:40]}.cubin") for c in cubins)
    again = kernel_probe.compile_only([shape_name], "fp8-block", tokens, ["default", "trace=1"], 1)
    assert all(" cached " in line for line in again)


def test_chunk_trace_intervals():
    """chunk_trace: per interval, the mean cycles over traced CTAs, chunks and a warpgroup's warps;
    g0's promotion runs from a chunk's last point to the next chunk's start."""
    import torch

    from vllm_megamoe.kernels import phase_clock as pc
    points, chunks, warps = len(pc.TRACE_POINTS), pc.TRACE_CHUNKS, pc.WARPS
    gaps = torch.arange(1, points, dtype=torch.int64) * 10      # 10, 20, ... cycles between points
    chunk_len = int(gaps.sum()) + 100                            # + 100 cycles of g0's promotion
    trace = torch.zeros(warps, chunks, points, dtype=torch.int64)
    for w in range(warps):
        for c in range(chunks):
            start = 10**9 + c * chunk_len + (500 if w >= warps // 2 else 0)  # warpgroup 1 runs 500 cycles later
            trace[w, c, 0] = start
            trace[w, c, 1:] = start + torch.cumsum(gaps, 0) + (7 if w == 5 else 0) * torch.arange(1, points)
    marks = [10**12 + 1000 * i for i in range(len(pc.MARKS))]
    row = torch.tensor(marks + [0] * len(pc.SPANS), dtype=torch.int64)
    traced = torch.cat([row, trace.flatten()])
    untraced = torch.cat([row, torch.zeros(pc.TRACE_COLUMNS, dtype=torch.int64)])
    traced = torch.cat([traced, torch.zeros(pc.TASK_TRACE_COLUMNS, dtype=torch.int64)])
    untraced = torch.cat([untraced, torch.zeros(pc.TASK_TRACE_COLUMNS, dtype=torch.int64)])
    clock = torch.stack([traced, untraced, traced])
    assert clock.shape[1] == pc.columns(True)
    t = pc.summarize(clock)["chunk_trace"]
    assert t["ctas"] == 2
    assert t["stage_wait"]["wg0"] == pytest.approx(10)
    assert t["wait_g0"]["wg0"] == pytest.approx(80)
    assert t["stage_wait"]["wg1"] == pytest.approx(10 + 7 / 4)  # warp 5's intervals are 7 cycles longer
    assert t["stage_wait"]["max_warp"] == pytest.approx(17)
    assert t["promote_g0"]["wg0"] == pytest.approx(100) and t["promote_g0"]["wg1"] == pytest.approx(100 - 7 * 8 / 4)
    assert t["chunk_cycles"] == pytest.approx(chunk_len)
    assert "chunk_trace" not in pc.summarize(torch.stack([untraced, untraced]))
    assert "chunk_trace" not in pc.summarize(clock[:, :pc.COLUMNS])


@needs_nvrtc
def test_chunk_trace_build_compiles_without_spills(private_cache, monkeypatch):
    """The trace build of the V4-Flash-like FP8 64-token kernel compiles through NVRTC without
    serialised wgmmas (its clock stores sit inside the K loop) and spills no more than the
    epilogue-warpgroup builds do outside their K loops (test_fused_mega_kernel_compiles_for_sm90a)."""
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "64")
    from vllm_megamoe.kernels import sm90_mega_moe

    shape, buf = _v4_buf()
    spec = sm90_mega_moe.kernel_spec(shape, buf, None, sm90_mega_moe.BuildOptions(chunk_trace=True))
    compiled = jit.compile_kernel(spec, "nvrtc")
    assert _resources(compiled.log)[1] <= 48, compiled.log
    assert "serialized" not in compiled.log, compiled.log
    assert "C75" not in compiled.log, compiled.log


@pytest.mark.parametrize("tile,on,threads", [(64, True, 384), (64, False, 256), (32, True, 384), (32, False, 256),
                                             (128, True, 256)])
def test_epilogue_warpgroup_builds(monkeypatch, tile, on, threads):
    """The 32- and 64-token builds run an epilogue warpgroup (384 threads, its tile in static
    shared memory: 5 stages still fit the 32-token tiles, 4 the 64-token ones), unless a probe's
    BuildOptions(epilogue_warpgroup=False) says otherwise; the 128-token ones launch 256 threads."""
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe, sm90_smem
    from vllm_megamoe.kernels.sm90_tuning import Choice

    monkeypatch.delenv("VLLM_MEGAMOE_CSRC_DIR", raising=False)  # _make_spec below names no tree; kernel_spec would
    monkeypatch.setenv("VLLM_MEGAMOE_SM90_EPILOGUE_WARPGROUP", "0")  # the old switch does nothing
    options = sm90_mega_moe.BuildOptions(epilogue_warpgroup=on)
    shape = MoEShape(4096, 2048, 256, 6)

    class _Buf:
        layout = BufferLayout(shape, 2, 4096, "bf16")

    spec = sm90_mega_moe._make_spec(shape, _Buf.layout, Choice(4, tile), options)
    assert sm90_mega_moe.threads_per_cta(spec) == threads
    assert ("MEGAMOE_EPILOGUE_WARPGROUP" in dict(spec.defines)) == (threads == 384)
    in_stage = sm90_smem.static_smem_bytes(128, 2, tile)
    if threads == 384:
        assert in_stage >= tile * 256 * 2  # the hand-off tile
        assert sm90_smem.fits(shape, 2, 5, 32) and not sm90_smem.fits(shape, 2, 5, 64)
    buf = _Buf()  # the op's per-buffer spec cache tells the two builds apart
    assert sm90_mega_moe.kernel_spec(shape, buf, Choice(4, tile), options) == spec
    other = sm90_mega_moe.kernel_spec(shape, buf, Choice(4, tile), sm90_mega_moe.BuildOptions(epilogue_warpgroup=not on))
    assert (other != spec) == (tile in (32, 64))


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_epilogue_warpgroup_128_where_its_tile_fits(monkeypatch, ranks):
    """BuildOptions(epilogue_warpgroup_128=True) gives the 128-token builds an epilogue warpgroup
    where its 64 KB tile fits beside 3 stages: the Qwen3-like layer (the tile in static shared
    memory), not V4-Flash- or DeepSeek-V3-like (their 128-token builds keep the epilogue in a
    stage); off in the serving builds, and off with epilogue_warpgroup=False; a depth that cannot
    fit is refused."""
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe, sm90_smem
    from vllm_megamoe.kernels.sm90_tuning import Choice

    qwen3, v4, dsv3 = MoEShape(2048, 768, 128, 8), MoEShape(4096, 2048, 256, 6), MoEShape(7168, 2048, 256, 8)
    wg128 = sm90_mega_moe.BuildOptions(epilogue_warpgroup_128=True)

    def threads(shape, stages, options):
        spec = sm90_mega_moe._make_spec(shape, BufferLayout(shape, ranks, 4096, "fp8-block"), Choice(stages, 128), options)
        return sm90_mega_moe.threads_per_cta(spec)

    assert not sm90_smem.has_epilogue_warpgroup(128, qwen3, ranks)
    assert threads(qwen3, 3, sm90_mega_moe.SERVING) == 256
    assert sm90_smem.has_epilogue_warpgroup(128, qwen3, ranks, enabled_128=True)
    assert not sm90_smem.has_epilogue_warpgroup(128, enabled_128=True)  # no shape: no 128-token warpgroup
    assert threads(qwen3, 3, wg128) == 384
    with_wg = sm90_smem._smem_bytes(qwen3, ranks, 3, 128, True)
    assert with_wg <= sm90_smem.SMEM_PER_BLOCK < sm90_smem._smem_bytes(qwen3, ranks, 4, 128, True)
    for shape in (v4, dsv3):
        assert not sm90_smem.has_epilogue_warpgroup(128, shape, ranks, enabled_128=True)
        assert threads(shape, 4, wg128) == 256
    assert not sm90_smem.has_epilogue_warpgroup(128, qwen3, ranks, enabled=False, enabled_128=True)
    with pytest.raises(ValueError, match="4 stages need"):
        threads(qwen3, 4, wg128)


@pytest.mark.parametrize("setting,tile,on", [(None, 32, True), (None, 64, False), (None, 128, False),
                                             (True, 128, True), (True, 64, True), (False, 32, False)])
def test_weights_evict_first_builds(monkeypatch, setting, tile, on):
    """The builds compile the weight copies' L2 evict-first policy in where
    BuildOptions.weights_evict_first says (None, the serving builds: the 32-token builds), and a
    call uses it where the setting says (None: at most EVICT_FIRST_MAX_TOKENS tokens on the rank);
    a changed setting is another build; the old environment switch does nothing."""
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe, sm90_tuning
    from vllm_megamoe.kernels.sm90_tuning import Choice

    monkeypatch.setenv("VLLM_MEGAMOE_SM90_WEIGHTS_EVICT_FIRST", "0")
    shape = MoEShape(2048, 768, 128, 8)

    class _Buf:
        layout = BufferLayout(shape, 2, 4096, "fp8-block")

    buf = _Buf()
    spec = sm90_mega_moe.kernel_spec(shape, buf, Choice(4, tile), sm90_mega_moe.BuildOptions(weights_evict_first=setting))
    assert ("MEGAMOE_WEIGHTS_EVICT_FIRST" in dict(spec.defines)) == on
    other = sm90_mega_moe.kernel_spec(shape, buf, Choice(4, tile), sm90_mega_moe.BuildOptions(weights_evict_first=not on))
    assert other != spec
    big = MoEShape(7168, 2048, 256, 8)  # 11 GB of FP8 expert weights on one rank, 5.5 GB on each of two
    limits = {(shape, "fp8-block", 1): 128, (shape, "bf16", 2): 128, (big, "fp8-block", 1): 16, (big, "fp8-block", 2): 16}
    for (layer, fmt, ranks), limit in limits.items():
        assert sm90_tuning.evict_first_max_tokens(layer, fmt, ranks) == limit
        calls = [sm90_tuning.weights_evict_first_call(n, layer, fmt, ranks, setting) for n in (1, limit, limit + 1)]
        assert calls == ([True, True, False] if setting is None else [setting] * 3)


@needs_nvrtc
def test_weights_evict_first_reaches_the_copies(private_cache, monkeypatch, tmp_path):
    """A build with the policy compiled in has 3-D (weight box) TMA copies with a cache policy operand
    in the SASS (`UTMALDG.3D ..., desc[URn]`, taken in the calls that ask for it) beside plain
    ones; a build without it has none."""
    import subprocess

    from benchmarks.sass_census import find_nvdisasm
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe
    from vllm_megamoe.kernels.sm90_tuning import Choice

    try:
        nvdisasm = find_nvdisasm()
    except SystemExit:
        pytest.skip("nvdisasm not found")
    shape = MoEShape(2048, 768, 128, 8)

    class _Buf:
        layout = BufferLayout(shape, 1, 4096, "fp8-block")

    copies = {}
    for env in ("1", "0"):
        options = sm90_mega_moe.BuildOptions(weights_evict_first=env == "1")
        cubin = tmp_path / f"evict_{env}.cubin"
        cubin.write_bytes(jit.compile_kernel(sm90_mega_moe.kernel_spec(shape, _Buf(), Choice(4, 32), options),
                                             "nvrtc").cubin)
        sass = subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True, check=True).stdout
        loads = [line for line in sass.splitlines() if "UTMALDG.3D" in line]
        copies[env] = (len(loads), sum("desc[" in line for line in loads))
    assert 0 < copies["1"][1] < copies["1"][0], copies
    assert copies["0"][0] > 0 and copies["0"][1] == 0, copies


def test_params_mirror_matches_the_kernel_struct():
    """sm90_mega_moe._Params lists the fields of megamoe::mega::Params in the same order."""
    from vllm_megamoe.kernels import sm90_mega_moe

    src = (jit.csrc_dir() / "sm90" / "mega" / "params.cuh").read_text()
    body = re.search(r"struct Params \{(.*?)\n\};", src, re.S).group(1)
    fields = re.findall(r"^\s*[\w:<>\s\*]+?[\s\*](\w+)(?:\[\d+\])?;", body, re.M)
    assert fields == [name for name, _ in sm90_mega_moe._Params._fields_]


@needs_nvrtc
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_128_token_tiles_of_a_small_layer(fmt, monkeypatch):
    """A layer whose token-scale table has fewer than 4 K-block rows (hidden and intermediate
    < 512) keeps the 128-token epilogue's per-token tables in static shared memory: it compiles,
    and host and kernel agree on its shared memory."""
    from vllm_megamoe import BufferLayout, MoEShape
    from vllm_megamoe.kernels import sm90_mega_moe, sm90_smem

    monkeypatch.setenv("VLLM_MEGAMOE_SM90_TOKEN_TILE", "128")
    small, large = MoEShape(256, 128, 8, 2), MoEShape(512, 256, 8, 2)
    assert not sm90_smem.epilogue_tables_in_mainloop(small, 128) and sm90_smem.epilogue_tables_in_mainloop(large, 128)
    assert not sm90_smem.epilogue_tables_in_mainloop(large, 64)

    class _Buf:
        layout = BufferLayout(small, 2, 256, fmt)

    compiled = jit.compile_kernel(sm90_mega_moe.kernel_spec(small, _Buf()), "nvrtc")
    assert len(compiled.cubin) > 10_000


def test_spec_json_round_trip_and_bad_lines(tmp_path):
    """spec_to_json / spec_from_json give back the same spec; read_specs keeps the distinct specs in
    order and names the line of a bad one."""
    spec = jit.KernelSpec.make("sm90/mega_moe_kernel.cu", "megamoe_sm90_fused", {"A": 3, "B": True},
                               extra_options=("-lineinfo",), csrc="/some/tree")
    assert jit.spec_from_json(jit.spec_to_json(spec)) == spec
    other = jit.KernelSpec.make("sm90/probe/wgmma_rate.cu", "wgmma_rate", {"X": 1})
    path = tmp_path / "specs.jsonl"
    path.write_text("\n".join([jit.spec_to_json(spec), "", jit.spec_to_json(other), jit.spec_to_json(spec)]) + "\n")
    assert jit.read_specs(path) == [spec, other]
    for bad, why in (("{", "not JSON"), ('{"name": "k"}', "keys source, name"),
                     ('{"source": "a.cu", "name": "k", "flavour": 1}', "keys source, name"),
                     ('{"source": "a.cu", "name": "k", "defines": [1]}', "defines")):
        path.write_text(jit.spec_to_json(spec) + "\n" + bad + "\n")
        with pytest.raises(ValueError, match=f"line 2: .*{why}"):
            jit.read_specs(path)


def test_specs_of_another_source_tree_are_not_recorded(tmp_path, monkeypatch):
    """A spec that names its own source tree (an A/B's second tree) holds a path of this machine:
    the record leaves it out."""
    record = tmp_path / "specs.jsonl"
    monkeypatch.setenv("VLLM_MEGAMOE_JIT_RECORD", str(record))
    jit._record(jit.KernelSpec.make("sm90/mega_moe_kernel.cu", "k", {"A": 1}, csrc=str(tmp_path)))
    assert not record.exists()
    jit._record(jit.KernelSpec.make("sm90/mega_moe_kernel.cu", "k", {"A": 1}))
    assert len(record.read_text().splitlines()) == 1
