"""The SM90 kernel's performance targets, checked against a results file (pure, no GPU).

The targets (issue "SM90 mega kernel faster than the best public Hopper mega MoE"), per case of
the fused path (`megamoe`) on kernel time from the profiler, as SGLang publishes its numbers:

| tokens per rank | target |
| --- | --- |
| 1 | kernel time <= roofline + 15 us |
| 8-128 | roofline / kernel time >= 0.90, and faster than SGLang's kernel |
| 512-2048 | roofline / kernel time >= 0.75, and faster than SGLang's kernel |
| 4096-8192 | GEMM time at the format's measured ceiling / kernel time >= 0.60, and >= 1.4x SGLang's kernel |
| <= 128 / 4096 | end-to-end >= 5x / >= 3x the unfused chain |

SGLang runs FP8 only: BF16 cases have no SGLang criterion. A bound the roofline itself cannot
reach is marked as such and does not count against the case: the prefill target where the
roofline is bound by something else than the GEMM (e.g. NVLink at 4096 tokens of a small-expert
layer), and a chain ratio where the chain takes less than that many times the roofline.

    python -m benchmarks.targets benchmarks/results/bench_ep2.json     # print the table
    python -m benchmarks.targets benchmarks/results/bench_ep1.json --highlights   # SGLang ratios, misses
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

from benchmarks import report

ONE_TOKEN_SLACK_US = 15.0
DECODE_FRACTION = 0.90
MIDDLE_FRACTION = 0.75
PREFILL_GEMM_FRACTION = 0.60
PREFILL_VS_SGLANG = 1.4


@dataclass
class Criterion:
    """One measured figure against its bound; `met` is None where it cannot be judged."""

    name: str
    value: Optional[float]
    bound: float
    at_least: bool = True   # False: the value must be at most the bound
    note: str = ""          # set where the roofline itself does not reach the bound
    strict: bool = False    # "faster than": the bound itself does not meet it

    @property
    def met(self) -> Optional[bool]:
        if self.value is None:
            return None
        if self.at_least:
            return self.value > self.bound if self.strict else self.value >= self.bound
        return self.value < self.bound if self.strict else self.value <= self.bound

    @property
    def beyond_roofline(self) -> bool:
        """Missed, but for a bound the roofline itself does not reach: not counted against the case."""
        return bool(self.note) and self.met is False

    def cell(self) -> str:
        if self.value is None:
            return f"{self.name}: n/a"
        sign = (">" if self.at_least else "<") + ("" if self.strict else "=")
        verdict = "beyond the roofline" if self.beyond_roofline else {True: "met", False: "MISSED"}[self.met]
        extra = f", {self.note}" if self.note else ""
        return f"{self.name} {self.value:.2f} ({sign} {self.bound:.2f}: {verdict}{extra})"


TOKEN_BUCKETS = ("1", "8-128", "512-2048", "4096-8192")


def bucket(tokens: int) -> Optional[str]:
    """The target's token bucket, None for token counts the targets do not name."""
    if tokens == 1:
        return "1"
    if 8 <= tokens <= 128:
        return "8-128"
    if 512 <= tokens <= 2048:
        return "512-2048"
    if 4096 <= tokens <= 8192:
        return "4096-8192"
    return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def criteria(by_path: dict) -> list[Criterion]:
    """The criteria of one case (`by_path`: path name -> result row of that case)."""
    mine = by_path.get("megamoe")
    if not mine or mine.get("error") or not mine.get("kernel_us"):
        return []
    tokens, kernel = mine["tokens_per_rank"], mine["kernel_us"]
    roof = mine.get("roofline") or {}
    roof_us, gemm_us = roof.get("roofline_us"), roof.get("gemm_us")
    sglang = by_path.get("sglang")
    sglang_kernel = sglang.get("kernel_us") if sglang and not sglang.get("error") else None
    out: list[Criterion] = []
    b = bucket(tokens)
    if b == "1":
        out.append(Criterion("kernel us - roofline us", kernel - roof_us if roof_us else None,
                             ONE_TOKEN_SLACK_US, at_least=False))
    elif b in ("8-128", "512-2048"):
        bound = DECODE_FRACTION if b == "8-128" else MIDDLE_FRACTION
        out.append(Criterion("roofline frac", _ratio(roof_us, kernel), bound))
    elif b == "4096-8192":
        note = ""
        if roof_us and gemm_us and gemm_us / roof_us < PREFILL_GEMM_FRACTION:
            note = f"the {roof.get('bound', '?')} roofline allows at most {gemm_us / roof_us:.2f}"
        out.append(Criterion("GEMM-ceiling frac", _ratio(gemm_us, kernel), PREFILL_GEMM_FRACTION, note=note))
    if b is not None and b != "1" and mine["format"] == "fp8-block":
        if b == "4096-8192":
            out.append(Criterion("x sglang", _ratio(sglang_kernel, kernel), PREFILL_VS_SGLANG))
        else:  # faster than SGLang's kernel: a ratio of exactly 1.0 does not beat it
            out.append(Criterion("x sglang", _ratio(sglang_kernel, kernel), 1.0, strict=True))
    chain = by_path.get("chain")
    chain_e2e = chain.get("e2e_us") if chain and not chain.get("error") else None
    if tokens <= 128 or tokens == 4096:
        bound = 5.0 if tokens <= 128 else 3.0
        note = ""
        if chain_e2e and roof_us and chain_e2e / roof_us < bound:
            note = f"the chain takes {chain_e2e / roof_us:.2f}x the roofline"
        out.append(Criterion("x chain (e2e)", _ratio(chain_e2e, mine.get("e2e_us")), bound, note=note))
    return out


def evaluate(rows: list[dict]) -> list[dict]:
    """One entry per case with a megamoe row: its criteria and whether all that can be judged are met."""
    out = []
    for key, by_path in report.rows_by_case(report.sorted_rows(rows), ("megamoe", "sglang", "chain")).items():
        cs = criteria(by_path)
        if not cs:
            continue
        judged = [c for c in cs if c.met is not None]
        failed = [c for c in judged if c.met is False and not c.beyond_roofline]
        unmeasured = [c.name for c in cs if c.met is None]
        # A criterion whose path did not run (e.g. the chain out of memory) is not met: a case that
        # misses none of the others counts apart, as "not measured".
        out.append(dict(zip(report.CASE_KEYS, key), criteria=cs,
                        met=not failed and not unmeasured, failed=failed, unmeasured=unmeasured,
                        unreachable=any(c.beyond_roofline for c in judged)))
    return out


def _unmeasured_note(results: list[dict]) -> str:
    """"; N more miss no criterion that was measured (not measured: ...)", or ""."""
    partial = [e for e in results if not e["met"] and not e["failed"]]
    if not partial:
        return ""
    names = sorted({n for e in partial for n in e["unmeasured"]})
    return f"; {len(partial)} more miss no criterion that was measured (not measured: {', '.join(names)})"


def markdown(results: list[dict]) -> str:
    if not results:
        return ""
    head = ["shape", "format", "routing", "tokens/rank", "criteria (measured, bound: verdict)", "all met"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for e in results:
        verdict = "yes" if e["met"] else "no"
        if e["met"] and e["unreachable"]:
            verdict = "yes, where the roofline allows"
        elif not e["met"] and not e["failed"]:
            verdict = "not measured: " + ", ".join(e["unmeasured"])
        lines.append("| " + " | ".join([str(e["shape"]), str(e["format"]), str(e["routing"]),
                                         str(e["tokens_per_rank"]), "; ".join(c.cell() for c in e["criteria"]),
                                         verdict]) + " |")
    n_met = sum(e["met"] for e in results)
    lines += ["", f"{n_met} of {len(results)} cases meet every criterion ({summary(results)}){_unmeasured_note(results)}."]
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Cases meeting every criterion per token bucket, e.g. "1: 0/12; 8-128: 9/24"."""
    counts: dict[str, list[int]] = {}
    for e in results:
        c = counts.setdefault(bucket(e["tokens_per_rank"]) or "other", [0, 0])
        c[0] += bool(e["met"])
        c[1] += 1
    return "; ".join(f"{b} tokens: {m}/{n}" for b, (m, n) in counts.items())


def _span(values: list[float], unit: str = "x") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}{unit}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}{unit}"


def highlights(rows: list[dict], results: list[dict]) -> list[str]:
    """What the prose of a results section quotes: SGLang's kernel time over the fused kernel's per
    token bucket (every FP8 case, both routings; also at 1 token, where it is no criterion) and per
    shape at prefill, then every missed criterion, case by case."""
    ratios: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    for key, by_path in report.rows_by_case(report.sorted_rows(rows), ("megamoe", "sglang")).items():
        mine, theirs = by_path.get("megamoe"), by_path.get("sglang")
        b = bucket(key[3])
        if b is None or not mine or not theirs or mine.get("error") or theirs.get("error"):
            continue
        ratio = _ratio(theirs.get("kernel_us"), mine.get("kernel_us"))
        if ratio is None:
            continue
        ratios.setdefault(b, []).append(ratio)
        if b == "4096-8192":
            prefill.setdefault(str(key[0]), []).append(ratio)
    lines = []
    if ratios:
        lines.append("x sglang (kernel time, FP8): " + "; ".join(
            f"{b} tokens {_span(v)}" for b, v in sorted(ratios.items(), key=lambda kv: TOKEN_BUCKETS.index(kv[0]))))
    if prefill:
        lines.append("x sglang at 4096-8192 tokens: " + "; ".join(f"{s} {_span(v)}" for s, v in sorted(prefill.items())))
    missed = [e for e in results if e["failed"]]
    lines.append(f"met: {sum(e['met'] for e in results)} of {len(results)} ({summary(results)})"
                 f"{_unmeasured_note(results)}; missed:")
    for e in missed:
        lines.append(f"  {e['shape']} {e['format']} {e['routing']} {e['tokens_per_rank']}: "
                     + "; ".join(f"{c.name} {c.value:.2f} (bound {c.bound:.2f})" for c in e["failed"]))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--highlights", action="store_true",
                    help="the figures a results section's prose quotes (SGLang ratios per bucket, the misses) "
                    "instead of the table")
    args = ap.parse_args(argv)
    rows, _ = report.load_rows(args.results)
    results = evaluate(rows)
    print("\n".join(highlights(rows, results)) if args.highlights else markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
