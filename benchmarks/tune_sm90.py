"""Write the SM90 kernel's tuning table (configs/sm90_mega_moe.yaml) from kernel_probe runs.

    # on the GPUs: time the builds worth comparing, per shape and tokens per rank
    python3 -m benchmarks.kernel_probe --gpus 2 --shapes v4-flash --tokens 1 8 128 1024 8192 \
        --variants default tile=64 stages=5 tile=64,stages=5 --out probe.json
    # anywhere: the fastest correct build per (shape, format, EP size, tokens) -> table
    python3 -m benchmarks.tune_sm90 probe.json [more.json ...] --out configs/sm90_mega_moe.yaml

For every layer the probes cover, the tokens per rank they measured become buckets: each
measured point owns the tokens up to the geometric middle between it and the next point, and
neighbouring buckets with the same build merge. A build whose output is further than
--max-err from the probe's first variant never wins, and a build other than the heuristic's
depth (sm90_tuning.HEURISTIC) wins only when it beats that build's best time at the
point by more than --min-gain (run-to-run noise alone must not change the table). Entries of layers the probes do not cover
are kept from the existing table. A point won by a 64-token build where no current 128-token build
was timed gets the tile TILE_64_OR_128: 64 over 32 is measured, 64 against 128 is left to the
padding model per call (sm90_tuning.wide_tile). Rows of builds the kernel no longer has (another
mainloop than tma, in probes recorded before it had one) are skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os

from vllm_megamoe.kernels.sm90_tuning import FP8_TILE128_BUILD, HEURISTIC, MAINLOOP, TILE_64_OR_128, parse_table, tile_supported

LAST_BUCKET = 1 << 20


def _dims(row: dict) -> tuple[int, int, int, int]:
    if "hidden" in row:
        return row["hidden"], row["intermediate"], row["experts"], row["topk"]
    from benchmarks.common import STANDARD_SHAPES
    s = STANDARD_SHAPES[row["shape"]]
    return s.hidden, s.intermediate, s.num_experts, s.topk


def _is_heuristic_build(label: str) -> bool:
    _mainloop, stages, _tile = label.split("/")
    return int(stages) == HEURISTIC.stages


def _winner(times: dict, min_gain: float) -> tuple[str, float]:
    """(label, us) of the fastest build, or of the heuristic's fastest within min_gain of it."""
    fastest = min(times.items(), key=lambda kv: kv[1])
    usual = [kv for kv in times.items() if _is_heuristic_build(kv[0])]
    if usual:
        usual_best = min(usual, key=lambda kv: kv[1])
        if usual_best[1] <= fastest[1] * (1.0 + min_gain):
            return usual_best
    return fastest


def best_builds(probes: list[dict], max_err: float, min_gain: float = 0.0) -> dict:
    """{(hidden, inter, experts, topk, format, ranks): {tokens: (label, us)}} of the winning build."""
    times: dict = {}  # key -> tokens -> label -> best us over the probes
    for probe in probes:
        ranks = int(probe["env"]["gpus"])
        fp8_128_current = probe["env"].get("fp8_tile128") == FP8_TILE128_BUILD
        for r in probe["rows"]:
            if not r.get("mainloop") or r.get("graph_us") is None or r["rel_err_vs_first_variant"] > max_err:
                continue
            loop, tile = r["mainloop"].split("/")[0], int(r["mainloop"].split("/")[2])
            if loop != MAINLOOP or (r["format"] == "fp8-block" and tile == 128 and not fp8_128_current):
                continue  # a build withdrawn since (another mainloop; earlier FP8 128-token probes timed a swap-AB build)
            point = times.setdefault((*_dims(r), r["format"], ranks), {}).setdefault(r["tokens_per_rank"], {})
            point[r["mainloop"]] = min(point.get(r["mainloop"], float("inf")), r["graph_us"])
    return {key: {tokens: _with_tile_rule(_winner(builds, min_gain), builds, key[4]) for tokens, builds in points.items()}
            for key, points in times.items()}


def _with_tile_rule(winner: tuple[str, float], builds: dict, fmt: str) -> tuple[str, float]:
    """A 64-token winner where no 128-token build ran: its label with the tile TILE_64_OR_128."""
    mainloop, stages, tile = winner[0].split("/")
    if (tile == "64" and tile_supported(fmt, 128)
            and not any(label.endswith("/128") for label in builds)):
        return f"{mainloop}/{stages}/{TILE_64_OR_128}", winner[1]
    return winner


def buckets(points: dict) -> list[dict]:
    """{tokens: (label, us)} -> merged buckets [{max_tokens, stages, tile}, ...]."""
    tokens = sorted(points)
    out: list[dict] = []
    for i, t in enumerate(tokens):
        edge = LAST_BUCKET if i + 1 == len(tokens) else int(math.sqrt(t * tokens[i + 1]))
        _mainloop, stages, tile = points[t][0].split("/")
        b = dict(max_tokens=edge, stages=int(stages), tile=tile if tile == TILE_64_OR_128 else int(tile))
        if out and {k: v for k, v in out[-1].items() if k != "max_tokens"} == \
                {k: v for k, v in b.items() if k != "max_tokens"}:
            out[-1]["max_tokens"] = edge
        else:
            out.append(b)
    return out


def table(probes: list[dict], existing: dict | None, max_err: float, min_gain: float = 0.0) -> dict:
    entries = {}
    for e in (existing or {}).get("entries") or []:
        s = e["shape"]
        for b in e.get("buckets") or []:  # a table from before the one mainloop: drop its "tma" column
            if b.get("mainloop") == MAINLOOP:
                del b["mainloop"]
        entries[(s["hidden"], s["intermediate"], s["experts"], s["topk"], e["format"], e["ranks"])] = e
    for key, points in best_builds(probes, max_err, min_gain).items():
        h, i, experts, topk, fmt, ranks = key
        entries[key] = dict(shape=dict(hidden=h, intermediate=i, experts=experts, topk=topk), format=fmt,
                            ranks=ranks, buckets=buckets(points))
    return dict(version=1, entries=[entries[k] for k in sorted(entries)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probes", nargs="+", help="kernel_probe --out files")
    ap.add_argument("--out", default="configs/sm90_mega_moe.yaml")
    ap.add_argument("--max-err", type=float, default=2e-2, help="largest relative error vs the first variant")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="how much faster than the heuristic's depth another build must be")
    args = ap.parse_args(argv)
    import yaml

    from vllm_megamoe.strict_yaml import load_strict_yaml
    probes = []
    for path in args.probes:
        with open(path) as f:
            probes.append(json.load(f))
    existing = None
    if os.path.exists(args.out):
        with open(args.out) as f:
            existing = load_strict_yaml(f)
    doc = table(probes, existing, args.max_err, args.min_gain)
    parse_table(doc, "the generated table")  # never write a table the op would refuse
    sources = ", ".join(f"{os.path.relpath(p)} (commit {probe['env'].get('commit') or '?'})"
                        for p, probe in zip(args.probes, probes))
    with open(args.out, "w") as f:
        f.write("# Generated by `python -m benchmarks.tune_sm90` from kernel_probe runs; regenerate, do not edit.\n")
        f.write(f"# Sources: {sources}\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    print(f"wrote {args.out}: {len(doc['entries'])} layer(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
