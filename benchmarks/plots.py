"""PNG plots of a results file: latency and fraction of roofline vs tokens per rank.

One figure per quantity; one panel per (shape, format, routing); one line per path.
    python -m benchmarks.plots RESULTS.json --out-dir DIR [--prefix NAME]
"""
from __future__ import annotations

import argparse
import math
import os

from benchmarks import report

PANEL_KEYS = ("shape", "format", "routing")
QUANTITIES = {
    "latency": ("end-to-end time per call (us)", lambda r: r.get("e2e_us"), True),
    "roofline": ("fraction of roofline (end to end)", lambda r: (r.get("achieved") or {}).get("fraction"), False),
}


def path_color(path: str) -> str:
    """One colour per path in every panel (a panel without SGLang must not recolour the chain)."""
    order = list(report.PATH_ORDER)
    i = order.index(path) if path in order else len(order) + sum(map(ord, path))
    return f"C{i % 10}"


def panels(rows: list[dict]) -> dict:
    """{(shape, format, routing): {path: [(tokens, row), ...] sorted by tokens}}."""
    out: dict = {}
    for r in report.sorted_rows(rows):
        if r.get("error") or r.get("e2e_us") is None:
            continue
        key = tuple(r.get(k) for k in PANEL_KEYS)
        out.setdefault(key, {}).setdefault(r["path"], []).append((r["tokens_per_rank"], r))
    return out


def plot(rows: list[dict], out_dir: str, prefix: str = "bench", title: str = "") -> list[str]:
    """Write {prefix}_latency.png and {prefix}_roofline.png; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = panels(rows)
    if not grid:
        return []
    os.makedirs(out_dir, exist_ok=True)
    n = len(grid)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    written = []
    for name, (ylabel, value, logy) in QUANTITIES.items():
        fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
        for ax, (key, by_path) in zip(axes.flat, grid.items()):
            for path in sorted(by_path, key=lambda p: report.PATH_ORDER.index(p)
                               if p in report.PATH_ORDER else 99):
                pts = [(t, value(r)) for t, r in by_path[path] if value(r) is not None]
                if pts:
                    alias = by_path[path][0][1].get("alias_of")
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linestyle="--" if alias else "-", color=path_color(path),
                            label=f"{path} (= {alias})" if alias else path)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_title(" / ".join(str(k) for k in key), fontsize=9)
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{prefix}_{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--prefix", default=None)
    args = ap.parse_args(argv)
    rows, doc = report.load_rows(args.results)
    prefix = args.prefix or os.path.splitext(os.path.basename(args.results))[0]
    for p in plot(rows, args.out_dir, prefix, title=_title(doc)):
        print(f"wrote {p}")
    return 0


def _title(doc: dict) -> str:
    env = doc.get("env", {})
    return " ".join(str(x) for x in (env.get("gpu", ""), f"x{env.get('gpus', '')}",
                                     "torch " + str(env.get("torch", "")), env.get("commit", "")) if x)


if __name__ == "__main__":
    raise SystemExit(main())
