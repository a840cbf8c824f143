"""benchmarks/targets.py: the kernel's performance targets judged from result rows (CPU only)."""
import random

import pytest

from benchmarks import targets

TOKENS = (1, 8, 128, 512, 1024, 4096, 8192)


def _rows(rng, fmt, tokens, with_sglang=True, with_chain=True):
    roof = rng.uniform(10, 3000)
    gemm = roof * rng.uniform(0.2, 1.0)
    bound = "gemm" if gemm == roof else rng.choice(["hbm", "nvlink"])
    base = dict(shape="s", format=fmt, routing="uniform", tokens_per_rank=tokens, error=None)
    mine = dict(base, path="megamoe", kernel_us=roof / rng.uniform(0.2, 1.2), e2e_us=roof / rng.uniform(0.15, 1.0),
                roofline=dict(roofline_us=roof, gemm_us=gemm, bound=bound))
    rows = [mine]
    if with_sglang:
        rows.append(dict(base, path="sglang", kernel_us=mine["kernel_us"] * rng.uniform(0.7, 1.6)))
    if with_chain:
        rows.append(dict(base, path="chain", e2e_us=roof * rng.uniform(1.5, 12)))
    return rows


def _expected(rows):
    """The issue's table, written out case by case (independent of targets.criteria)."""
    by = {r["path"]: r for r in rows}
    m, t = by["megamoe"], by["megamoe"]["tokens_per_rank"]
    k, roof, gemm = m["kernel_us"], m["roofline"]["roofline_us"], m["roofline"]["gemm_us"]
    fp8 = m["format"] == "fp8-block"
    s = by.get("sglang", {}).get("kernel_us")
    c = by.get("chain", {}).get("e2e_us")
    checks = []  # (met, reachable)
    if t == 1:
        checks.append((k <= roof + 15, True))
    elif t <= 128:
        checks.append((roof / k >= 0.9, True))
        if fp8:
            checks.append((s > k, True))
    elif 512 <= t <= 2048:
        checks.append((roof / k >= 0.75, True))
        if fp8:
            checks.append((s > k, True))
    else:
        checks.append((gemm / k >= 0.6, gemm / roof >= 0.6))
        if fp8:
            checks.append((s / k >= 1.4, True))
    if t <= 128 or t == 4096:
        need = 5 if t <= 128 else 3
        checks.append((c / m["e2e_us"] >= need, c / roof >= need))
    return all(met or not reachable for met, reachable in checks), len(checks)


@pytest.mark.parametrize("seed", range(5))
def test_verdicts_match_the_issue_table_on_random_rows(seed):
    rng = random.Random(seed)
    rows, expected = [], {}
    for fmt in ("fp8-block", "bf16"):
        for t in TOKENS:
            case = _rows(rng, fmt, t, with_sglang=fmt == "fp8-block")
            for r in case:
                r["routing"] = f"r{seed}"
            rows += case
            expected[(fmt, t)] = _expected(case)
    results = targets.evaluate(rows)
    assert len(results) == len(expected)
    for e in results:
        met, n = expected[(e["format"], e["tokens_per_rank"])]
        assert e["met"] == met, (e["format"], e["tokens_per_rank"], [c.cell() for c in e["criteria"]])
        assert len(e["criteria"]) == n
    text = targets.markdown(results)
    assert f"{sum(e['met'] for e in results)} of {len(results)} cases" in text


def _case(tokens, kernel, roof, gemm=None, sglang=None, chain=None, e2e=None, fmt="fp8-block"):
    base = dict(shape="s", format=fmt, routing="uniform", tokens_per_rank=tokens, error=None)
    rows = [dict(base, path="megamoe", kernel_us=kernel, e2e_us=e2e or kernel,
                 roofline=dict(roofline_us=roof, gemm_us=gemm or roof, bound="gemm" if gemm in (None, roof) else "nvlink"))]
    if sglang:
        rows.append(dict(base, path="sglang", kernel_us=sglang))
    if chain:
        rows.append(dict(base, path="chain", e2e_us=chain))
    return rows


def test_one_token_allows_fifteen_microseconds_over_the_roofline():
    assert targets.evaluate(_case(1, 55.0, 40.0, chain=1000))[0]["met"]
    assert not targets.evaluate(_case(1, 55.1, 40.0, chain=1000))[0]["met"]


def test_equal_to_sglang_is_not_faster():
    (e,) = targets.evaluate(_case(1024, 100.0, 95.0, sglang=100.0))
    assert not e["met"] and "MISSED" in e["criteria"][1].cell()
    assert targets.evaluate(_case(1024, 100.0, 95.0, sglang=100.5))[0]["met"]


def test_prefill_needs_both_the_gemm_fraction_and_1_4x_sglang():
    assert targets.evaluate(_case(8192, 100.0, 61.0, sglang=141.0))[0]["met"]
    assert not targets.evaluate(_case(8192, 100.0, 61.0, sglang=139.0))[0]["met"]
    assert not targets.evaluate(_case(8192, 100.0, 59.0, sglang=200.0))[0]["met"]


def test_a_target_above_the_roofline_is_reported_not_counted():
    # NVLink-bound: the GEMM alone is 0.4 of the roofline, so 0.60 of the GEMM ceiling cannot be reached
    (e,) = targets.evaluate(_case(8192, 100.0, 90.0, gemm=36.0, sglang=150.0))
    assert e["met"] and e["unreachable"]
    assert "beyond the roofline" in e["criteria"][0].cell() and "nvlink roofline allows at most 0.40" in e["criteria"][0].cell()
    # the chain within 5x of the roofline: 5x the chain is beyond it
    (e,) = targets.evaluate(_case(128, 100.0, 95.0, sglang=120.0, chain=400.0))
    assert e["met"] and "chain takes 4.21x the roofline" in e["criteria"][-1].cell()
    # reachable but missed still fails the case
    assert not targets.evaluate(_case(128, 100.0, 95.0, sglang=120.0, chain=480.0))[0]["met"]  # 4.8x, 5.05x roofline


def test_bf16_has_no_sglang_criterion_and_missing_paths_are_not_judged():
    (e,) = targets.evaluate(_case(128, 100.0, 95.0, fmt="bf16", chain=600.0))
    assert [c.name for c in e["criteria"]] == ["roofline frac", "x chain (e2e)"]
    (e,) = targets.evaluate(_case(128, 100.0, 95.0))  # FP8 without SGLang or chain rows
    assert [c.met for c in e["criteria"]] == [True, None, None]
    assert "x sglang: n/a" in targets.markdown([e])
    # what did not run is not met: the case counts apart, as met on what was measured
    assert not e["met"] and not e["failed"] and e["unmeasured"] == ["x sglang", "x chain (e2e)"]
    text = targets.markdown([e])
    assert "| not measured: x sglang, x chain (e2e) |" in text
    assert "0 of 1 cases meet every criterion" in text
    assert "1 more miss no criterion that was measured (not measured: x chain (e2e), x sglang)" in text
    assert targets.highlights([], [e])[-1].endswith("; missed:")  # not listed as a miss
    # a missed criterion beside an unmeasured one fails the case outright
    (e,) = targets.evaluate(_case(128, 100.0, 80.0, chain=600.0))
    assert not e["met"] and [c.name for c in e["failed"]] == ["roofline frac"]
    # nothing measured at all (no roofline, no baselines): not measured, not a miss
    (e,) = targets.evaluate(_case(128, 100.0, None))
    assert not e["met"] and not e["failed"] and "| not measured: roofline frac, x sglang, x chain (e2e) |" in targets.markdown([e])


def test_failed_or_absent_megamoe_rows_give_no_verdict():
    rows = _case(128, 100.0, 95.0, sglang=120.0)
    rows[0]["error"] = "timeout"
    assert targets.evaluate(rows) == []
    assert targets.evaluate(rows[1:]) == []
    assert targets.markdown([]) == ""


def test_buckets():
    assert [targets.bucket(t) for t in (1, 2, 8, 128, 256, 512, 2048, 4096, 8192, 16384)] == \
        ["1", None, "8-128", "8-128", None, "512-2048", "512-2048", "4096-8192", "4096-8192", None]


def test_bench_report_prints_the_targets(tmp_path, capsys):
    import json

    from benchmarks import bench
    rows = _case(8, 100.0, 95.0, sglang=120.0, chain=600.0) + _case(1, 70.0, 40.0, chain=900.0)
    for r in rows:
        r.setdefault("e2e_us", r.get("kernel_us"))
    (tmp_path / "r.json").write_text(json.dumps({"env": {}, "args": {}, "ceilings": {}, "rows": rows, "errors": []}))
    assert bench.main(["--report", str(tmp_path / "r.json"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "against its targets" in out and "1 of 2 cases meet every criterion" in out


def test_highlights_quote_sglang_ratios_per_bucket_and_the_misses():
    """--highlights: SGLang's kernel time over the fused kernel's, min-max per token bucket (FP8 only,
    1 token included) and per shape at prefill, and each missed criterion named with its value."""
    def case(shape, tokens, kernel, sglang, roof, gemm=None, routing="uniform"):
        base = dict(shape=shape, format="fp8-block", routing=routing, tokens_per_rank=tokens, error=None)
        return [dict(base, path="megamoe", kernel_us=kernel, e2e_us=kernel,
                     roofline=dict(roofline_us=roof, gemm_us=gemm or roof, bound="hbm")),
                dict(base, path="sglang", kernel_us=sglang),
                dict(base, path="chain", e2e_us=roof * 20)]
    rows = (case("a", 1, 30.0, 60.0, 20.0) + case("a", 8, 100.0, 150.0, 95.0)
            + case("a", 128, 100.0, 110.0, 80.0, routing="skewed")  # 0.80 of the roofline: missed
            + case("a", 8192, 1000.0, 1500.0, 700.0, gemm=700.0) + case("b", 8192, 1000.0, 1250.0, 500.0, gemm=500.0))
    bf16 = [dict(r, format="bf16") for r in case("a", 8, 10.0, 99.0, 9.5) if r["path"] != "sglang"]
    lines = targets.highlights(rows + bf16, targets.evaluate(rows + bf16))
    assert lines[0] == "x sglang (kernel time, FP8): 1 tokens 2.00x; 8-128 tokens 1.10-1.50x; 4096-8192 tokens 1.25-1.50x"
    assert lines[1] == "x sglang at 4096-8192 tokens: a 1.50x; b 1.25x"
    assert lines[2] == "met: 4 of 6 (1 tokens: 1/1; 8-128 tokens: 2/3; 4096-8192 tokens: 1/2); missed:"
    assert lines[3:] == ["  a fp8-block skewed 128: roofline frac 0.80 (bound 0.90)",
                         "  b fp8-block uniform 8192: GEMM-ceiling frac 0.50 (bound 0.60); x sglang 1.25 (bound 1.40)"]
