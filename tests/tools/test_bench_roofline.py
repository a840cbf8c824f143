"""CPU tests of the benchmark's arithmetic and reporting (benchmarks/roofline.py, report.py, ...)."""
import json
import os
import re

import pytest
import torch

from benchmarks import report
from benchmarks import roofline as rf
from benchmarks.timing import drop_first_call, stats_us, summarize_kernel_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEGACY = os.path.join(ROOT, "benchmarks", "results", "portable_ep2.json")
V4 = rf.Shape(4096, 2048, 256, 6)


# -- bytes per format ------------------------------------------------------------------------
def test_bytes_per_format():
    # 3*H*I weights + float32 128x128 block scales: (2I/128 * H/128 + H/128 * I/128) * 4
    assert rf.expert_weight_bytes(V4, "fp8-block") == 3 * 4096 * 2048 + 4 * (32 * 32 + 32 * 16)
    assert rf.expert_weight_bytes(V4, "bf16") == 2 * 3 * 4096 * 2048
    assert rf.activation_bytes_per_row(4096, "fp8-block") == 4096 + 4 * 32
    assert rf.activation_bytes_per_row(4096, "bf16") == 8192
    with pytest.raises(ValueError):
        rf.expert_weight_bytes(V4, "fp4")


# -- traffic from routing --------------------------------------------------------------------
def test_routing_traffic_hand_case():
    # 2 ranks, 4 experts (rank 0 owns 0-1, rank 1 owns 2-3); -1 is masked.
    rank0 = torch.tensor([[0, 2], [1, -1]])
    rank1 = torch.tensor([[3, 2]])
    t0, t1 = rf.routing_traffic([rank0, rank1], num_experts=4)
    assert t0 == rf.RankTraffic(pairs_received=2, experts_touched=2, remote_pairs_in=0, remote_pairs_out=1)
    assert t1 == rf.RankTraffic(pairs_received=3, experts_touched=2, remote_pairs_in=1, remote_pairs_out=0)


def test_routing_traffic_counts_each_expert_once_and_checks_range():
    (t,) = rf.routing_traffic([[[5, 5], [5, 1]]], num_experts=8)
    assert (t.pairs_received, t.experts_touched, t.remote_pairs_in) == (4, 2, 0)
    with pytest.raises(ValueError):
        rf.routing_traffic([[[8]]], num_experts=8)
    with pytest.raises(ValueError):
        rf.routing_traffic([[[0]], [[1]], [[2]]], num_experts=8)  # 8 experts over 3 ranks


def test_expected_uniform_traffic_hand_case_and_sampling():
    s = rf.Shape(256, 128, 4, 2)
    (t, _) = rf.expected_traffic_uniform(s, tokens_per_rank=1, world=2)
    # per source 1*2/2 = 1 pair to each rank; an expert is missed by a token w.p. 1/2, by both 1/4
    assert (t.pairs_received, t.remote_pairs_in, t.remote_pairs_out) == (2, 1, 1)
    assert t.experts_touched == pytest.approx(2 * 0.75)

    from benchmarks.common import routing
    from vllm_megamoe import MoEShape
    shape, world, tokens = MoEShape(256, 128, 64, 6), 2, 8
    gen = torch.Generator().manual_seed(0)
    trials = [rf.routing_traffic([routing(shape, tokens, "cpu", gen)[0] for _ in range(world)], 64)
              for _ in range(300)]
    exp = rf.expected_traffic_uniform(rf.Shape(256, 128, 64, 6), tokens, world)[0]
    mean_touched = sum(t[0].experts_touched for t in trials) / len(trials)
    mean_pairs = sum(t[0].pairs_received for t in trials) / len(trials)
    assert mean_touched == pytest.approx(exp.experts_touched, rel=0.03)
    assert mean_pairs == pytest.approx(exp.pairs_received, rel=0.03)


def test_skewed_routing_is_skewed_but_spread_over_ranks():
    from benchmarks.common import ROUTINGS, expert_probs, routing
    from vllm_megamoe import MoEShape
    p = expert_probs(256, ROUTINGS["skewed"], "cpu")
    assert p.max() / p.min() > 100                      # hot and cold experts
    assert 0.3 < float(p[:128].sum() / p.sum()) < 0.7   # not all on one rank of two
    idx, w = routing(MoEShape(256, 128, 256, 8), 64, "cpu", torch.Generator().manual_seed(1), 1.0)
    assert idx.shape == (64, 8) and all(len(set(r.tolist())) == 8 for r in idx)
    assert torch.allclose(w.sum(-1), torch.ones(64))


# -- roofline --------------------------------------------------------------------------------
def test_rank_roofline_hand_case_each_bound():
    s = rf.Shape(256, 128, 4, 2)
    t = rf.RankTraffic(pairs_received=10, experts_touched=2, remote_pairs_in=4, remote_pairs_out=6)
    c = rf.Ceilings(hbm_bytes_per_s=1e9, fp8_flops_per_s=1e15, bf16_flops_per_s=1e12, nvlink_bytes_per_s=1e7)
    r = rf.rank_roofline(s, "bf16", t, c)
    assert r["weight_bytes"] == 2 * 3 * 256 * 128 * 2                  # 393216
    assert r["activation_bytes"] == 10 * (512 + 2 * 256 + 512)          # 15360
    assert r["flops"] == 2 * 10 * 256 * 128 * 3                         # 1966080
    assert r["nvlink_bytes"] == 4 * 512 + 6 * 512                       # 5120 both ways
    assert r["hbm_us"] == pytest.approx(408.576)
    assert r["gemm_us"] == pytest.approx(1.96608)
    assert r["nvlink_us"] == pytest.approx(512.0)
    assert (r["bound"], r["roofline_us"]) == ("nvlink", pytest.approx(512.0))
    fast_link = rf.Ceilings(1e9, 1e15, 1e12, 1e12)
    assert rf.rank_roofline(s, "bf16", t, fast_link)["bound"] == "hbm"
    slow_gemm = rf.Ceilings(1e12, 1e15, 1e9, 1e12)
    assert rf.rank_roofline(s, "bf16", t, slow_gemm)["bound"] == "gemm"
    with pytest.raises(ValueError):  # cross-rank bytes need an NVLink figure
        rf.rank_roofline(s, "bf16", t, rf.Ceilings(1e9, 1e15, 1e12, None))


def test_roofline_reproduces_anchor_figures():
    # anchors.md, SGLang SM90 run: V4-Flash FP8, 39 experts / 48 pairs -> 234 us (HBM);
    # 24542 pairs / 128 experts -> 923 us (FP8 GEMM at 1339 TFLOPS). NVLink was not counted there.
    c = rf.Ceilings(4.19e12, 1339e12, 767e12, None)
    small = rf.rank_roofline(V4, "fp8-block", rf.RankTraffic(48, 39, 0, 0), c)
    assert small["bound"] == "hbm" and small["roofline_us"] == pytest.approx(234, abs=1.5)
    big = rf.rank_roofline(V4, "fp8-block", rf.RankTraffic(24542, 128, 0, 0), c)
    assert big["bound"] == "gemm" and big["roofline_us"] == pytest.approx(923, abs=1.5)


def test_case_roofline_takes_the_slowest_rank_and_mean_averages_sets():
    c = rf.H200_ANCHORS
    light, heavy = rf.RankTraffic(10, 5, 5, 5), rf.RankTraffic(40, 20, 5, 5)
    case = rf.case_roofline(V4, "fp8-block", [light, heavy], c)
    assert case["critical_rank"] == 1
    assert case["roofline_us"] == rf.rank_roofline(V4, "fp8-block", heavy, c)["roofline_us"]
    mean = rf.mean_roofline(V4, "fp8-block", [[light, heavy], [heavy, heavy]], c)
    assert mean["roofline_us"] == pytest.approx(case["roofline_us"])
    mixed = rf.mean_roofline(V4, "fp8-block", [[light], [heavy]], c)
    assert mixed["roofline_us"] == pytest.approx(
        (rf.case_roofline(V4, "fp8-block", [light], c)["roofline_us"] + case["roofline_us"]) / 2)


def test_achieved():
    roof = dict(flops=2e12, hbm_bytes=4e9, roofline_us=500.0)
    a = rf.achieved(roof, 1000.0)
    assert a == dict(tflops=pytest.approx(2000.0), hbm_gbps=pytest.approx(4000.0), fraction=0.5)
    assert rf.achieved(roof, None)["fraction"] is None


# -- timing helpers --------------------------------------------------------------------------
def test_summarize_kernel_events_and_stats():
    events = [("gemm", 30.0), ("copy", 5.0), ("gemm", 30.0), ("copy", 5.0), ("nccl", 10.0)]
    s = summarize_kernel_events(events, calls=2)
    assert s["kernel_us"] == pytest.approx(40.0)
    assert s["kernels_per_call"] == 2.5
    assert s["top_kernels"][0] == ["gemm", 30.0]
    assert summarize_kernel_events([], calls=3)["kernel_us"] is None
    st = stats_us([1.0, 3.0, 2.0])
    assert (st["median_us"], st["min_us"], st["n"]) == (2000.0, 1000.0, 3)


def test_profiled_first_call_is_dropped():
    # Three calls of (copy, kernel); the first kernel waited 250 ms for a peer's profiler.
    events = [(0.0, "copy", 2.0), (5.0, "mega", 250000.0), (250010.0, "copy", 2.0), (250015.0, "mega", 100.0),
              (250200.0, "copy", 2.0), (250210.0, "mega", 104.0)]
    kept = drop_first_call(list(reversed(events)), calls=2)
    assert kept == [("copy", 2.0), ("mega", 100.0), ("copy", 2.0), ("mega", 104.0)]
    assert summarize_kernel_events(kept, calls=2)["kernel_us"] == pytest.approx(104.0)
    # Calls that launch different numbers of activities cannot be told apart: all are kept.
    assert len(drop_first_call(events[:5], calls=2)) == 5


# -- records -> rows -> table / compare --------------------------------------------------------
def _rec(rank, path, e2e, kernel=None, **kw):
    case = dict(kind="case", rank=rank, shape="t", hidden=256, intermediate=128, experts=4, topk=2,
                format="bf16", routing="uniform", tokens_per_rank=2, world=2, path=path,
                e2e=dict(median_us=e2e, min_us=e2e - 1), kernel=dict(kernel_us=kernel, kernels_per_call=3))
    traffic = [[dict(pairs_received=2, experts_touched=2, remote_pairs_in=1, remote_pairs_out=1)] * 2]
    case["traffic_sets"] = traffic if rank == 0 else None
    case.update(kw)
    return case


def test_merge_rank_records_and_derived_figures():
    records = [_rec(0, "portable", 100.0, 60.0), _rec(1, "portable", 120.0, 50.0),
               _rec(0, "chain", 300.0), _rec(1, "chain", 240.0),
               dict(kind="error", rank=1, message="boom"), dict(kind="env", rank=0, env=dict(gpu="X"))]
    rows, env, errors = report.merge_rank_records(records)
    assert errors == ["rank 1: boom"] and env["ranks"]["0"]["gpu"] == "X"
    port = next(r for r in rows if r["path"] == "portable")
    assert port["e2e_us"] == 120.0 and port["e2e_us_per_rank"] == [100.0, 120.0]
    assert port["kernel_us"] == 60.0 and port["traffic_sets"]
    report.add_derived(rows, rf.H200_ANCHORS)
    assert port["speedup_vs_chain"] == pytest.approx(300.0 / 120.0)
    assert port["achieved"]["fraction"] == pytest.approx(port["roofline"]["roofline_us"] / 120.0)
    table = report.text_table(rows)
    assert "portable" in table and "2.50" in table
    md = report.markdown_table(rows)
    assert md.count("\n") == 2 and "| 120 |" in md


def test_kernel_table_puts_the_fused_paths_side_by_side():
    rows = [_rec(0, "megamoe", 100.0, 80.0), _rec(1, "megamoe", 110.0, 90.0),
            _rec(0, "sglang", 150.0, 120.0), _rec(1, "sglang", 140.0, 135.0), _rec(0, "chain", 900.0)]
    merged, _, _ = report.merge_rank_records(rows)
    report.add_derived(merged, rf.H200_ANCHORS)
    table = report.kernel_table(merged)
    head, _, line = table.splitlines()
    assert head.startswith("| shape |") and "megamoe x sglang" in head and "chain" not in table
    cells = [c.strip() for c in line.strip("|").split("|")]
    roof = next(r for r in merged if r["path"] == "megamoe")["roofline"]["roofline_us"]
    assert cells[5] == "90" and cells[7] == "135" and cells[9] == "1.50"   # slowest rank; 135 / 90
    assert cells[6] == f"{roof / 90:.2f}"
    assert report.kernel_table([r for r in merged if r["path"] == "chain"]) == ""


def test_compare_ratios():
    a = [dict(shape="s", format="f", routing="u", tokens_per_rank=8, path="p", e2e_us=100.0, kernel_us=50.0)]
    b = [dict(a[0], e2e_us=80.0, kernel_us=None), dict(a[0], path="other", e2e_us=1.0)]
    cmp = report.compare(a, b)
    assert len(cmp) == 1 and cmp[0]["e2e_ratio"] == pytest.approx(0.8) and cmp[0]["kernel_ratio"] is None
    assert "geometric mean of B/A end to end: 0.800" in report.compare_table(cmp)


def test_legacy_results_file_loads_with_expected_roofline():
    rows, doc = report.load_rows(LEGACY)
    assert len(rows) == 3 * len(doc["rows"])
    r = next(r for r in rows if r["shape"] == "v4-flash" and r["format"] == "fp8-block"
             and r["tokens_per_rank"] == 8 and r["path"] == "portable")
    assert r["e2e_us"] == pytest.approx(1103.392, abs=0.01)
    assert r["speedup_vs_chain"] == pytest.approx(2.333, abs=0.001)
    assert r["roofline"]["bound"] == "hbm" and 230 < r["roofline"]["roofline_us"] < 255


def test_docs_table_is_generated_from_the_recorded_json():
    from benchmarks import docs_table
    with open(docs_table.DEFAULT_DOC) as f:
        text = f.read()
    found = docs_table.sections(text)
    assert "" in found and "ep1" in found, found
    for section, source in found.items():
        assert source.startswith("benchmarks/results/")
        table = docs_table.render(os.path.join(ROOT, source), source)
        assert docs_table.replace_section(text, table, section) == text, \
            f"docs/performance.md is stale: python -m benchmarks.docs_table {source} --section {section}"


def test_docs_table_sections_are_separate():
    from benchmarks import docs_table
    begin, end = docs_table.markers("ep1")
    assert begin != docs_table.BEGIN and "[ep1]" in begin and "[ep1]" in end
    text = f"a\n{docs_table.BEGIN}\nSource: `x.json`\n{docs_table.END}\nb\n{begin}\nSource: `y.json`\n{end}\nc"
    assert docs_table.sections(text) == {"": "x.json", "ep1": "y.json"}
    out = docs_table.replace_section(text, "NEW", "ep1")
    assert "Source: `x.json`" in out and "Source: `y.json`" not in out and out.count("NEW") == 1
    with pytest.raises(ValueError, match="ep2x"):
        docs_table.replace_section(text, "NEW", "ep2x")
    # Without --section: the section whose table names the file, else the unnamed one.
    assert docs_table.section_for(text, "y.json") == "ep1"
    assert docs_table.section_for(text, "x.json") == ""
    assert docs_table.section_for(text, "z.json") == ""


def test_docs_table_writes_a_named_runs_table_into_its_own_section(tmp_path):
    from benchmarks import docs_table
    begin, end = docs_table.markers("ep1")
    results = os.path.relpath(os.path.join(ROOT, "benchmarks", "results", "bench_ep1.json"))
    doc = tmp_path / "performance.md"
    doc.write_text(f"a\n{docs_table.BEGIN}\nSource: `other.json`\n{docs_table.END}\nb\n"
                   f"{begin}\nSource: `{results}`\n{end}\nc")
    assert docs_table.main([results, "--doc", str(doc)]) == 0
    out = doc.read_text()
    assert "Source: `other.json`" in out  # the unnamed section untouched
    ep1 = out.split(begin, 1)[1].split(end, 1)[0]
    assert f"Source: `{results}`: 1 x" in ep1 and "| qwen3-30b-a3b |" in ep1


def test_plots_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plots
    rows, _ = report.load_rows(LEGACY)
    written = plots.plot(rows, str(tmp_path), "legacy")
    assert [os.path.basename(p) for p in written] == ["legacy_latency.png", "legacy_roofline.png"]
    assert all(os.path.getsize(p) > 10_000 for p in written)


def test_plot_colours_are_fixed_per_path():
    from benchmarks import plots
    colours = [plots.path_color(p) for p in report.PATH_ORDER]
    assert len(set(colours)) == len(colours)  # distinct
    assert plots.path_color("chain") == "C3"   # the same in a panel without SGLang


def test_ceilings_merge_and_complete():
    from benchmarks import ceilings as C
    per_rank = [dict(copy_bytes_per_s=4.1e12, fp8_flops_per_s=1.3e15, nvlink_read_bytes_per_s=3.7e11),
                dict(copy_bytes_per_s=4.2e12, nvlink_write_bytes_per_s=3.9e11, errors={"bf16": "x"})]
    m = C.merge(per_rank)
    assert m["hbm_bytes_per_s"] == 4.2e12 and m["nvlink_bytes_per_s"] == 3.9e11 and m["bf16_flops_per_s"] is None
    full = C.complete(m, rf.H200_ANCHORS)
    assert full["bf16_flops_per_s"] == rf.H200_ANCHORS.bf16_flops_per_s and "bf16_flops_per_s" in full["source"]
    assert rf.Ceilings.from_dict(full).hbm_bytes_per_s == 4.2e12


@pytest.mark.slow
def test_bench_dry_run_on_cpu(tmp_path):
    """The whole multi-rank flow (gloo, 2 CPU ranks, tiny shape): records, merge, JSON, table."""
    from benchmarks import bench
    out = tmp_path / "dry.json"
    rc = bench.main(["--backend", "gloo", "--gpus", "2", "--shapes", "256x128x8x2", "--formats", "bf16",
                     "--tokens", "1", "7", "--iters", "2", "--warmup", "1", "--profile-calls", "1",
                     "--ceilings", "anchors", "--out", str(out), "--no-plots", "--timeout", "240"])
    doc = json.loads(out.read_text())
    assert rc == 0, doc["errors"]
    paths = {(r["routing"], r["tokens_per_rank"], r["path"]) for r in doc["rows"]}
    for routing in ("uniform", "skewed"):
        for tok in (1, 7):
            assert {(routing, tok, p) for p in ("megamoe", "portable", "chain")} <= paths
    chain = [r for r in doc["rows"] if r["path"] == "chain"]
    assert all(r["error"] is None and r["rel_err_vs_portable"] < 2e-2 for r in chain)
    assert all(r["roofline"]["roofline_us"] > 0 for r in doc["rows"])
    assert any("sglang" in n["notes"] for n in doc["env"]["notes"])
