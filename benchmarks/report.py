"""Turning raw benchmark records into result rows, tables and comparisons (pure, no GPU).

A result file (JSON) holds {"env", "args", "ceilings", "rows", "errors"}; one row per
(shape, format, routing, tokens per rank, path) with times in microseconds. The first results
file (benchmarks/results/portable_ep2.json, columns chain_us / portable_graph_us / ...) is read
too: load_rows() converts it to rows.
"""
from __future__ import annotations

import json
import math
from typing import Iterable, Optional

from benchmarks import roofline as rf

CASE_KEYS = ("shape", "format", "routing", "tokens_per_rank")
ROW_KEYS = CASE_KEYS + ("path",)
PATH_ORDER = ("megamoe", "portable", "sglang", "chain", "portable_eager")


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ROW_KEYS)


def case_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in CASE_KEYS)


def _max(vals):
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


# -- records from the ranks -> rows ----------------------------------------------------------------
def merge_rank_records(records: Iterable[dict]) -> tuple[list[dict], dict, list[str]]:
    """Per-rank records ("case", "ceilings", "env", "error") -> (rows, env, errors).

    A call ends when its slowest rank ends: times are the maximum over ranks; each rank's value
    is kept in *_per_rank. Traffic comes from whichever rank recorded it (rank 0).
    """
    cases: dict[tuple, dict[int, dict]] = {}
    order: list[tuple] = []
    env: dict = {}
    errors: list[str] = []
    ceilings: list[dict] = []
    for rec in records:
        kind = rec.get("kind")
        if kind == "env":
            env.setdefault("ranks", {})[str(rec.get("rank"))] = rec.get("env", {})
        elif kind == "ceilings":
            ceilings.append(rec)
        elif kind == "note" and rec.get("rank", 0) == 0:
            env.setdefault("notes", []).append({k: v for k, v in rec.items() if k not in ("kind", "rank")})
        elif kind == "error":
            errors.append(f"rank {rec.get('rank')}: {rec.get('message')}")
        elif kind == "case":
            key = row_key(rec)
            if key not in cases:
                cases[key] = {}
                order.append(key)
            cases[key][rec.get("rank", 0)] = rec
    rows = []
    for key in order:
        by_rank = cases[key]
        ranks = sorted(by_rank)
        first = by_rank[ranks[0]]
        row = {k: v for k, v in first.items()
               if k not in ("kind", "rank", "e2e", "kernel", "traffic_sets")}
        e2e = [by_rank[r].get("e2e") or {} for r in ranks]
        kern = [by_rank[r].get("kernel") or {} for r in ranks]
        row["ranks_reported"] = len(ranks)
        row["e2e_us_per_rank"] = [e.get("median_us") for e in e2e]
        row["e2e_us"] = _max(row["e2e_us_per_rank"])
        row["e2e_min_us"] = _max([e.get("min_us") for e in e2e])
        row["kernel_us_per_rank"] = [k.get("kernel_us") for k in kern]
        row["kernel_us"] = _max(row["kernel_us_per_rank"])
        row["kernels_per_call"] = kern[0].get("kernels_per_call")
        row["top_kernels"] = kern[0].get("top_kernels")
        for r in ranks:
            if by_rank[r].get("traffic_sets"):
                row["traffic_sets"] = by_rank[r]["traffic_sets"]
                break
        errs = [by_rank[r].get("error") for r in ranks if by_rank[r].get("error")]
        row["error"] = errs[0] if errs else None
        rows.append(row)
    if ceilings:
        env["ceilings_per_rank"] = ceilings
    return rows, env, errors


# -- roofline and derived figures --------------------------------------------------------------
def add_derived(rows: list[dict], ceilings: rf.Ceilings) -> list[dict]:
    """Roofline (mean over input sets), TFLOPS, GB/s, fraction of roofline, speed-up vs chain."""
    chain_us = {case_key(r): r.get("e2e_us") for r in rows if r.get("path") == "chain"}
    for row in rows:
        sets = row.get("traffic_sets")
        if sets and row.get("format") in rf.FORMATS:
            shape = rf.Shape(row["hidden"], row["intermediate"], row["experts"], row["topk"])
            traffic = [[rf.RankTraffic(**t) for t in s] for s in sets]
            roof = rf.mean_roofline(shape, row["format"], traffic, ceilings)
            row["roofline"] = roof
            row.update(achieved=rf.achieved(roof, row.get("e2e_us")),
                       kernel_fraction=rf.achieved(roof, row.get("kernel_us"))["fraction"])
        c = chain_us.get(case_key(row))
        row["speedup_vs_chain"] = (c / row["e2e_us"]) if c and row.get("e2e_us") else None
    return rows


# -- the first results file (portable vs chain) -------------------------------------------------
LEGACY_PATHS = {"chain_us": "chain", "portable_graph_us": "portable", "portable_eager_us": "portable_eager"}


def rows_from_legacy(doc: dict, shapes: dict) -> list[dict]:
    """The first recorded run's JSON (benchmarks/results/portable_ep2.json, written by the since-merged bench_portable script) -> rows; traffic is the expected uniform traffic."""
    world = int(doc.get("env", {}).get("gpus") or doc.get("args", {}).get("gpus") or 1)
    rows = []
    for old in doc["rows"]:
        s = shapes[old["shape"]]
        shape = rf.Shape(s.hidden, s.intermediate, s.num_experts, s.topk)
        traffic = [t.to_dict() for t in rf.expected_traffic_uniform(shape, old["tokens_per_rank"], world)]
        for col, path in LEGACY_PATHS.items():
            if old.get(col) is None:
                continue
            rows.append(dict(shape=old["shape"], hidden=s.hidden, intermediate=s.intermediate,
                             experts=s.num_experts, topk=s.topk, format=old["format"],
                             routing="uniform", tokens_per_rank=old["tokens_per_rank"], world=world,
                             path=path, graph=(path == "portable"), e2e_us=old[col], kernel_us=None,
                             rel_err_vs_portable=old.get("portable_vs_chain_rel_err") if path == "chain" else None,
                             traffic_sets=[traffic], traffic_kind="expected (uniform routing)",
                             error=None))
    return rows


def load_rows(path: str, ceilings: Optional[rf.Ceilings] = None) -> tuple[list[dict], dict]:
    """Rows (with derived figures) and the whole document of a results file, old or new."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows", [])
    if rows and "path" not in rows[0]:
        from benchmarks.common import STANDARD_SHAPES
        rows = rows_from_legacy(doc, STANDARD_SHAPES)
        doc.setdefault("ceilings", rf.H200_ANCHORS.to_dict())
    if ceilings is None:
        ceilings = rf.Ceilings.from_dict(doc["ceilings"]) if doc.get("ceilings") else rf.H200_ANCHORS
    return add_derived(rows, ceilings), doc


# -- tables ----------------------------------------------------------------------------------
def _num(v, fmt: str, missing: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    return format(v, fmt)


def sorted_rows(rows: list[dict]) -> list[dict]:
    """Shapes, formats and routings in order of first appearance; then tokens; then path."""
    first: dict = {}
    for r in rows:
        for k in ("shape", "format", "routing"):
            first.setdefault((k, r.get(k)), len(first))

    def key(r):
        p = r.get("path")
        return (first[("shape", r.get("shape"))], first[("format", r.get("format"))],
                first[("routing", r.get("routing"))], r.get("tokens_per_rank") or 0,
                PATH_ORDER.index(p) if p in PATH_ORDER else len(PATH_ORDER), str(p))
    return sorted(rows, key=key)


TABLE_COLUMNS = ("shape", "fmt", "routing", "tok", "path", "e2e us", "kernel us", "TFLOPS",
                 "GB/s", "roof us", "bound", "frac", "x chain", "rel err")


def table_cells(row: dict) -> list[str]:
    roof = row.get("roofline") or {}
    ach = row.get("achieved") or {}
    path = row.get("path", "")
    if row.get("alias_of"):
        path += f"(={row['alias_of']})"
    if row.get("path") in ("portable", "megamoe", "sglang") and row.get("graph") is False:
        path += " eager"
    if row.get("error"):
        return [row.get("shape", ""), row.get("format", ""), row.get("routing", ""),
                str(row.get("tokens_per_rank", "")), path, "error: " + str(row["error"])[:60]]
    return [str(row.get("shape", "")), str(row.get("format", "")), str(row.get("routing", "")),
            str(row.get("tokens_per_rank", "")), path, _num(row.get("e2e_us"), ".0f"),
            _num(row.get("kernel_us"), ".0f"), _num(ach.get("tflops"), ".1f"),
            _num(ach.get("hbm_gbps"), ".0f"), _num(roof.get("roofline_us"), ".0f"),
            roof.get("bound", "-"), _num(ach.get("fraction"), ".2f"),
            _num(row.get("speedup_vs_chain"), ".2f"), _num(row.get("rel_err_vs_portable"), ".1e")]


def text_table(rows: list[dict]) -> str:
    body = [table_cells(r) for r in sorted_rows(rows)]
    full = [c for c in body if len(c) == len(TABLE_COLUMNS)]  # error rows end in one long cell
    widths = [max([len(h)] + [len(c[i]) for c in full]) for i, h in enumerate(TABLE_COLUMNS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(TABLE_COLUMNS, widths))]
    for cells in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def rows_by_case(rows: list[dict], paths: Iterable[str]) -> dict[tuple, dict]:
    """{case_key: {path: row}} of the rows of `paths`, in sorted case order."""
    wanted = set(paths)
    cases: dict[tuple, dict] = {}
    for r in rows:
        if r["path"] in wanted:
            cases.setdefault(case_key(r), {})[r["path"]] = r
    return cases


def markdown_table(rows: list[dict], paths: Optional[Iterable[str]] = None) -> str:
    """One line per case: each path's end-to-end time, fraction of roofline and speed-up."""
    rows = [r for r in sorted_rows(rows) if not r.get("error")]
    wanted = list(paths) if paths else [p for p in PATH_ORDER if any(r["path"] == p for r in rows)]
    cases = rows_by_case(rows, {r["path"] for r in rows})
    head = ["shape (H/I/E/top-k)", "format", "routing", "tokens/rank", "roofline us (bound)"]
    for p in wanted:
        head += [f"{p} us", f"{p} frac"] + ([f"{p} x chain"] if p != "chain" else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, by_path in cases.items():
        any_row = next(iter(by_path.values()))
        roof = any_row.get("roofline") or {}
        dims = f"{any_row['shape']} ({any_row['hidden']}/{any_row['intermediate']}/{any_row['experts']}/{any_row['topk']})"
        cells = [dims, any_row["format"], any_row.get("routing", ""), str(any_row["tokens_per_rank"]),
                 f"{_num(roof.get('roofline_us'), '.0f')} ({roof.get('bound', '-')})"]
        for p in wanted:
            r = by_path.get(p)
            ach = (r or {}).get("achieved") or {}
            cells += [_num((r or {}).get("e2e_us"), ".0f"), _num(ach.get("fraction"), ".2f")]
            if p != "chain":
                cells.append(_num((r or {}).get("speedup_vs_chain"), ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(rows: list[dict], paths: Iterable[str] = ("megamoe", "sglang")) -> str:
    """One line per case: kernel time from the profiler (what published kernel numbers use) of
    `paths`, each one's fraction of the roofline on that time, and the first path's speed-up
    over each of the others (their time / its time, > 1: the first path is faster)."""
    rows = [r for r in sorted_rows(rows) if not r.get("error")]
    wanted = [p for p in paths if any(r["path"] == p for r in rows)]
    if not wanted:
        return ""
    cases = rows_by_case(rows, wanted)
    first = wanted[0]
    head = ["shape", "format", "routing", "tokens/rank", "roofline us"]
    for p in wanted:
        head += [f"{p} kernel us", f"{p} frac"]
    head += [f"{first} x {p}" for p in wanted[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, by_path in cases.items():
        any_row = next(iter(by_path.values()))
        roof = (any_row.get("roofline") or {}).get("roofline_us")
        cells = [any_row["shape"], any_row["format"], any_row.get("routing", ""), str(any_row["tokens_per_rank"]),
                 _num(roof, ".0f")]
        for p in wanted:
            k = (by_path.get(p) or {}).get("kernel_us")
            cells += [_num(k, ".0f"), _num(roof / k if roof and k else None, ".2f")]
        mine = (by_path.get(first) or {}).get("kernel_us")
        for p in wanted[1:]:
            other = (by_path.get(p) or {}).get("kernel_us")
            cells.append(_num(other / mine if other and mine else None, ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- comparing two result files ----------------------------------------------------------------
def compare(rows_a: list[dict], rows_b: list[dict]) -> list[dict]:
    """Per case and path present in both: B / A of end-to-end and kernel time (< 1: B faster)."""
    by_a = {row_key(r): r for r in rows_a}
    out = []
    for rb in sorted_rows(rows_b):
        ra = by_a.get(row_key(rb))
        if ra is None:
            continue

        def ratio(k):
            a, b = ra.get(k), rb.get(k)
            return b / a if a and b else None
        out.append(dict(zip(ROW_KEYS, row_key(rb)), a_e2e_us=ra.get("e2e_us"), b_e2e_us=rb.get("e2e_us"),
                        e2e_ratio=ratio("e2e_us"), a_kernel_us=ra.get("kernel_us"),
                        b_kernel_us=rb.get("kernel_us"), kernel_ratio=ratio("kernel_us")))
    return out


def compare_table(cmp: list[dict]) -> str:
    head = ("shape", "fmt", "routing", "tok", "path", "A e2e us", "B e2e us", "B/A", "A kern us",
            "B kern us", "B/A kern")
    body = [[str(c["shape"]), str(c["format"]), str(c["routing"]), str(c["tokens_per_rank"]), str(c["path"]),
             _num(c["a_e2e_us"], ".0f"), _num(c["b_e2e_us"], ".0f"), _num(c["e2e_ratio"], ".3f"),
             _num(c["a_kernel_us"], ".0f"), _num(c["b_kernel_us"], ".0f"), _num(c["kernel_ratio"], ".3f")]
            for c in cmp]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(b, widths)).rstrip() for b in body]
    ratios = [c["e2e_ratio"] for c in cmp if c["e2e_ratio"]]
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        lines.append(f"{len(ratios)} cases in both; geometric mean of B/A end to end: {geo:.3f}")
    else:
        lines.append("no case in both files")
    return "\n".join(lines)
