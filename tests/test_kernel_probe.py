"""The kernel probe's pure parts: variant parsing, phase rows from a clock, merging ranks."""
import pytest

from benchmarks import kernel_probe as kp
from vllm_megamoe.kernels import phase_clock


def test_variants_map_to_the_kernel_knobs():
    assert kp.variant_env("default") == {}
    assert kp.variant_env("stages=3") == {"VLLM_MEGAMOE_SM90_STAGES": "3"}
    assert kp.variant_env("tile=64,stages=5") == {"VLLM_MEGAMOE_SM90_TOKEN_TILE": "64",
                                                 "VLLM_MEGAMOE_SM90_STAGES": "5"}
    # development builds go to the op as BuildOptions, not through the environment
    from vllm_megamoe.kernels.sm90_mega_moe import SERVING, BuildOptions
    assert kp.variant_env("trace=1,trace_task=0") == {}
    assert kp.variant_options("trace=1,trace_task=0") == BuildOptions(chunk_trace=True, trace_task=0)
    assert kp.variant_options("default") == kp.variant_options("stages=3") == SERVING
    assert kp.variant_options("ablate=mma+tma,epilogue_wg=0,epilogue_wg128=1,evict_first=auto") == \
        BuildOptions(ablate=18, epilogue_warpgroup=False, epilogue_warpgroup_128=True, weights_evict_first=None)
    assert kp.variant_options("evict_first=1").weights_evict_first is True
    assert kp.variant_env("csrc=x,trace=1") == {"VLLM_MEGAMOE_CSRC_DIR": "x"}
    for bad in ("mainloop=wgmma", "ablate=epilogues", "trace_task=two", "trace=maybe"):
        with pytest.raises(ValueError, match="variant"):
            kp.variant_options(bad)
    assert kp.variant_env("csrc=.probe_base/csrc") == {"VLLM_MEGAMOE_CSRC_DIR": ".probe_base/csrc"}
    for bad in ("stages", "depth=3", "stages=", "stages=3,", "csrc="):
        with pytest.raises(ValueError, match="variant"):
            kp.variant_env(bad)


def _round(us, sha="a", err=0.0, l1=None):
    return dict(shape="s", format="f", tokens_per_rank=1, variant="default", rank=0, graph_us=us,
                rel_err_vs_first_variant=err, clock_total_us=us - 1, ctas=132,
                phases_us={"L1": l1 if l1 is not None else us / 2}, out_sha1=sha)


def test_rounds_report_the_median_round():
    """--rounds: the case is the round with the median time (a measured row: its phases go with
    it), every round's time is kept in order, the worst error counts, and digests that differ
    between rounds (the same inputs) show."""
    m = kp.combine_rounds([_round(30.0, l1=1.0), _round(10.0, l1=2.0, err=1e-3), _round(20.0, l1=3.0)])
    assert (m["graph_us"], m["phases_us"]["L1"]) == (20.0, 3.0)
    assert m["graph_us_rounds"] == [30.0, 10.0, 20.0]
    assert m["rel_err_vs_first_variant"] == 1e-3 and m["out_sha1"] == "a"
    even = kp.combine_rounds([_round(40.0), _round(10.0, sha="b")])
    assert even["graph_us"] == 10.0 and even["out_sha1"] == "a|b"  # the lower median; digests differ
    assert kp.combine_rounds([_round(7.0)])["graph_us_rounds"] == [7.0]
    # two ranks: per round the slower rank's time; printed one line per case
    r0, r1 = dict(even, rank=0), dict(kp.combine_rounds([_round(35.0), _round(15.0)]), rank=1)
    merged = kp.merge([[r0], [r1]])[0]
    assert merged["graph_us_rounds"] == [40.0, 15.0] and merged["graph_us"] == 15.0
    text = kp.table([merged])
    assert "graph us per round" in text and "40.0" in text.splitlines()[text.splitlines().index("graph us per round:") + 1]


def test_main_refuses_bad_rounds_and_repeated_variants(capsys):
    with pytest.raises(SystemExit):
        kp.main(["--gpus", "1", "--rounds", "0"])
    assert "--rounds 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kp.main(["--gpus", "1", "--variants", "default", "stages=5", "default"])
    assert "each variant once" in capsys.readouterr().err


def test_shapes_by_name_or_dimensions():
    assert kp.probe_shape("v4-flash") == kp.probe_shape("4096x2048x256x6")
    assert kp.probe_shape("4352x2048x256x6").hidden == 4352
    with pytest.raises(Exception, match="HIDDENxINTERxEXPERTSxTOPK"):
        kp.probe_shape("4096x2048")


def test_phase_rows_follow_the_latest_cta():
    import torch
    marks = len(phase_clock.MARKS)
    # Marks 1 us apart on CTA 0; CTA 1 spends 5 us more in L1 (marks l1_done onwards later).
    cta0 = [10**9 + 1000 * i for i in range(marks)]
    cta1 = [t + (5000 if i >= phase_clock.MARKS.index("l1_done") else 0) for i, t in enumerate(cta0)]
    row = kp.phase_row(phase_clock.summarize(torch.tensor([cta0, cta1])))
    assert row["L1"] == pytest.approx(6.0) and row["dispatch"] == pytest.approx(2.0)
    assert row["L1 sync"] == pytest.approx(1.0) and sum(row.values()) == pytest.approx(14.0)


def test_merge_takes_the_slowest_rank():
    def row(rank, us, l1):
        return dict(shape="s", format="f", tokens_per_rank=8, variant="default", rank=rank, graph_us=us,
                    rel_err_vs_first_variant=0.0, clock_total_us=us - 5, ctas=132, phases_us={"L1": l1},
                    out_sha1=f"digest{rank}")
    merged = kp.merge([[row(0, 100.0, 40.0)], [row(1, 90.0, 55.0)]])
    assert len(merged) == 1
    m = merged[0]
    assert (m["graph_us"], m["phases_us"]["L1"], m["ranks"], m["clock_total_us"]) == (100.0, 55.0, 2, 95.0)
    assert m["out_sha1"] == "digest0,digest1"
    assert "rank" not in m and "graph us" in kp.table(merged)
    # each rank's own figures are kept, in rank order, and printed one line per rank
    assert [(pr["rank"], pr["graph_us"], pr["phases_us"]["L1"]) for pr in m["per_rank"]] == [(0, 100.0, 40.0), (1, 90.0, 55.0)]
    lines = [line for line in kp.table(merged).splitlines() if " r0 " in line or " r1 " in line]
    assert len(lines) == 2 and lines[0].split()[4:6] == ["nan", "nan"] and "40" in lines[0] and "55" in lines[1]


def test_merge_sums_task_counts_and_keeps_the_slower_spans():
    def row(rank, gemm, tasks):
        return dict(shape="s", format="f", tokens_per_rank=8, variant="default", rank=rank, graph_us=10.0,
                    rel_err_vs_first_variant=0.0, clock_total_us=9.0, ctas=132, phases_us={},
                    task_us={"l1_gemm": gemm, "l1_tasks": tasks})
    m = kp.merge([[row(0, 3.0, 10.0)], [row(1, 4.5, 12.0)]])[0]
    assert m["task_us"] == {"l1_gemm": 4.5, "l1_tasks": 22.0}
    assert "us per task" in kp.table([m]) and "22/0" in kp.table([m])


def test_table_prints_a_chunk_trace():
    """Rows of a trace build get one line of cycles per interval (warpgroup 0 / 1) and the total."""
    trace = {k: dict(wg0=100.0 + i, wg1=200.0 + i, max_warp=300.0) for i, k in enumerate(phase_clock.TRACE_INTERVALS)}
    trace.update(ctas=132, chunk_cycles=1234.0)
    r = dict(shape="v4-flash", format="f", tokens_per_rank=8192, variant="trace=1", graph_us=10.0,
             rel_err_vs_first_variant=0.0, clock_total_us=9.0, ctas=132, phases_us={}, chunk_trace=trace)
    text = kp.table(kp.merge([[dict(r, rank=0)], [dict(r, rank=1, chunk_trace={})]]))
    line = text.splitlines()[-1]
    assert "cycles per chunk" in text and line.split()[:3] == ["v4-flash", "8192", "trace=1:"]
    assert "100/200" in line and line.endswith("1234")


def test_table_prints_a_task_trace():
    """Rows of a trace build get one line per traced phase: cycles per interval around a task
    (warpgroup 0 / 1), '-' where no CTA ran the next task, and the traced CTAs."""
    names = phase_clock.TASK_INTERVALS
    l2 = {k: dict(wg0=10.0 + i, wg1=20.0 + i, max_warp=30.0) for i, k in enumerate(names) if k != "between"}
    l2.update(ctas=7, ctas_between=0)
    r = dict(shape="qwen3-30b-a3b", format="f", tokens_per_rank=128, variant="trace=1", graph_us=10.0,
             rel_err_vs_first_variant=0.0, clock_total_us=9.0, ctas=132, phases_us={}, task_trace={"l2": l2})
    text = kp.table(kp.merge([[dict(r, rank=0)]]))
    assert "cycles per task" in text
    line = text.splitlines()[-1]
    assert line.split()[:4] == ["qwen3-30b", "128", "trace=1:", "l2"]
    assert "10/20" in line and "14/24" in line and line.split()[-2] == "-" and line.endswith(" 7")


def test_versus_puts_the_probe_default_next_to_the_benchmark_paths(tmp_path):
    import json
    probe = {"env": {"commit": "abc"}, "rows": [
        dict(shape="v4-flash", tokens_per_rank=8, variant="default", graph_us=200.0),
        dict(shape="v4-flash", tokens_per_rank=8, variant="tile=64", graph_us=100.0)]}  # not the default: left out
    bench_rows = [dict(shape="v4-flash", tokens_per_rank=8, routing="uniform", format="fp8-block", path=p, e2e_us=us,
                       kernel_us=us - 10, roofline={"roofline_us": 150.0})
                  for p, us in (("sglang", 300.0), ("portable", 500.0), ("chain", 2000.0))]
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    (tmp_path / "bench.json").write_text(json.dumps({"env": {"commit": "def"}, "rows": bench_rows}))
    lines = kp.versus(str(tmp_path / "probe.json"), str(tmp_path / "bench.json")).splitlines()
    assert "commit `abc`" in lines[0] and "commit `def`" in lines[0]
    (row,) = [line for line in lines if line.startswith("| v4-flash")]
    # roofline 150, ours 200 (frac 0.75), sglang 300 [290] -> 1.50x, portable 500, chain 2000 -> 10x
    assert row == "| v4-flash | 8 | 150 | 200 | 0.75 | 300 [290] | 1.50 | 500 | 2000 | 10.00 |"


def test_scoped_env_sets_unsets_and_restores(monkeypatch):
    import os

    from benchmarks.kernel_probe import scoped_env

    monkeypatch.setenv("MEGAMOE_TEST_A", "before")
    monkeypatch.setenv("MEGAMOE_TEST_GONE", "here")
    monkeypatch.delenv("MEGAMOE_TEST_NEW", raising=False)
    try:
        with scoped_env({"MEGAMOE_TEST_A": "inside", "MEGAMOE_TEST_NEW": "1"}, unset=("MEGAMOE_TEST_GONE",)):
            assert os.environ["MEGAMOE_TEST_A"] == "inside" and os.environ["MEGAMOE_TEST_NEW"] == "1"
            assert "MEGAMOE_TEST_GONE" not in os.environ
            raise RuntimeError("the block fails")
    except RuntimeError:
        pass
    assert os.environ["MEGAMOE_TEST_A"] == "before" and os.environ["MEGAMOE_TEST_GONE"] == "here"
    assert "MEGAMOE_TEST_NEW" not in os.environ


def test_task_table_gives_the_clock_and_kilocycles():
    """At prefill the SM clock moves with power, so the per-task table prints it and the K loops'
    kilocycles (us x GHz) beside the microseconds."""
    r = dict(shape="v4-flash", format="fp8-block", tokens_per_rank=8192, variant="default", graph_us=3500.0,
             rel_err_vs_first_variant=0.0, clock_total_us=3400.0, ctas=132, phases_us={},
             task_us={"l1_gemm": 30.0, "l2_gemm": 16.0, "l1_tasks": 8192.0, "l2_tasks": 8192.0, "sm_ghz": 1.5})
    line = [ln for ln in kp.table([r]).splitlines() if "8192/8192" in ln][0]
    assert line.split()[-2:] == ["1.50", "45.0/24.0"]


def test_power_samples_show_when_taken():
    """--power: the table gives rank 0's sampled SM clock and board power per case; rows without
    samples (no --power, or no nvidia-smi) print no such section."""
    sampled = dict(kp.combine_rounds([_round(12.0)]), timed_sm_mhz=1512.0, timed_power_w=698.0, timed_window_s=3.6)
    short = dict(sampled, tokens_per_rank=8, timed_window_s=0.4)
    text = kp.table(kp.merge([[sampled, short]]))
    lines = text.splitlines()
    first = lines.index("while timed (rank 0):  SM MHz  power W  window s") + 1
    assert lines[first].split()[-3:] == ["1512", "698", "3.6"]
    assert lines[first + 1].split()[-5:] == ["698", "0.4", "(short:", "reads", "low)"]
    assert "reads low" not in lines[first] and "reads low" in lines[first + 1]
    plain = dict(kp.combine_rounds([_round(12.0)]), timed_sm_mhz=None, timed_power_w=None)
    assert "while timed" not in kp.table(kp.merge([[plain]]))
