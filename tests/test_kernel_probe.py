"""The kernel probe's pure parts: variant parsing, phase rows from a clock, merging ranks."""
import pytest

from benchmarks import kernel_probe as kp
from vllm_megamoe.kernels import phase_clock


def test_variants_map_to_the_kernel_knobs():
    assert kp.variant_env("default") == {}
    assert kp.variant_env("stages=3") == {"VLLM_MEGAMOE_SM90_STAGES": "3"}
    assert kp.variant_env("mainloop=ldg") == {"VLLM_MEGAMOE_SM90_MAINLOOP": "ldg"}
    assert kp.variant_env("mainloop=wgmma,stages=5") == {"VLLM_MEGAMOE_SM90_MAINLOOP": "wgmma",
                                                        "VLLM_MEGAMOE_SM90_STAGES": "5"}
    for bad in ("stages", "depth=3", "stages=", "stages=3,"):
        with pytest.raises(ValueError, match="variant"):
            kp.variant_env(bad)


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
                    rel_err_vs_first_variant=0.0, clock_total_us=us - 5, ctas=132, phases_us={"L1": l1})
    merged = kp.merge([[row(0, 100.0, 40.0)], [row(1, 90.0, 55.0)]])
    assert len(merged) == 1
    m = merged[0]
    assert (m["graph_us"], m["phases_us"]["L1"], m["ranks"], m["clock_total_us"]) == (100.0, 55.0, 2, 95.0)
    assert "rank" not in m and "graph us" in kp.table(merged)


def test_performance_doc_probe_table_is_generated_from_the_json():
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "performance.md")) as f:
        text = f.read()
    start = text.index("<!-- probe-versus-table (generated; do not edit) -->\n")
    body = text[start:text.index("<!-- probe-versus-table:end -->")].split("\n", 1)[1].strip()
    results = os.path.join(root, "benchmarks", "results")
    cwd = os.getcwd()
    os.chdir(root)  # the tables name files relative to the repository
    try:
        bench = os.path.join("benchmarks", "results", "bench_ep2.json")
        want = kp.versus(os.path.join("benchmarks", "results", "probe_v4.json"), bench) + "\n" + "\n".join(
            kp.versus(os.path.join("benchmarks", "results", "probe_shapes.json"), bench).splitlines()[-10:])
    finally:
        os.chdir(cwd)
    assert os.path.isdir(results)
    assert body == want.strip(), "docs/performance.md is stale: regenerate with benchmarks.kernel_probe --report --versus"
