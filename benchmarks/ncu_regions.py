"""Where a kernel's warps stall, by source line: Nsight Compute's per-SASS-instruction samples
joined with the cubin's line table, inline chains included.

    ncu ... --section WarpStateStats --section SourceCounters -o rep <command>
    ncu --import rep.ncu-rep --page source --csv --print-source sass > source.csv
    python -m benchmarks.ncu_regions source.csv --cubin kernel.cubin [--top 30]

The cubin must be the one that ran (build it with VLLM_MEGAMOE_JIT_LINEINFO=1; the JIT cache,
VLLM_MEGAMOE_CACHE_DIR, holds it). `nvdisasm -gi` gives, per instruction, the chain of source
lines it was inlined through (innermost first); the samples are summed per innermost line, per
(innermost line, its caller) and per outermost line of the kernel's own source file (its phases).
The instruction sequence of the report and the disassembly must match, which is checked.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess
import sys

from benchmarks.sass_census import find_nvdisasm

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_report(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[start]
    return [dict(zip(head, r)) for r in rows[start + 1:] if len(r) == len(head)]


def line_chains(disassembly: str) -> dict[int, tuple[list[tuple[str, int]], str]]:
    """{instruction offset: (inline chain innermost first as (file, line), opcode)}."""
    out, chain, fresh = {}, [], True
    for text in disassembly.splitlines():
        if "//## File" in text:
            found = re.findall(r'"([^"]+)", line (\d+)', text)
            if found:
                if fresh:
                    chain, fresh = [], False
                chain.append((os.path.basename(found[0][0]), int(found[0][1])))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(@!?U?P\w+\s+)?([A-Z0-9_.]+)", text)
        if m:
            out[int(m.group(1), 16)] = (list(chain), m.group(3))
            fresh = True
    return out


def attribute(report: list[dict], chains: dict) -> dict:
    base = int(report[0]["Address"], 16)
    total = sum(float(r[SAMPLES] or 0) for r in report)
    inner, pair, outer = collections.Counter(), collections.Counter(), collections.Counter()
    mismatches = 0
    for r in report:
        chain, opcode = chains.get(int(r["Address"], 16) - base, ([], "?"))
        words = [w for w in r["Source"].split() if not w.startswith("@")]
        if words and opcode.split(".")[0] != words[0].split(".")[0]:
            mismatches += 1
        samples = float(r[SAMPLES] or 0)
        if not chain:
            inner["?"] += samples
            continue
        inner["%s:%d" % chain[0]] += samples
        caller = "%s:%d" % chain[1] if len(chain) > 1 else "-"
        pair[("%s:%d" % chain[0], caller)] += samples
        outer["%s:%d" % chain[-1]] += samples
    return {"total": total, "inner": inner, "pair": pair, "outer": outer, "mismatches": mismatches,
            "instructions": len(report)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="source.csv of ncu --page source --csv --print-source sass")
    ap.add_argument("--cubin", help="the cubin that ran (disassembled with nvdisasm -gi)")
    ap.add_argument("--sass", help="or its nvdisasm -gi output")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if bool(args.cubin) == bool(args.sass):
        ap.error("give exactly one of --cubin and --sass")
    if args.cubin:
        text = subprocess.run([find_nvdisasm(), "-gi", "-c", args.cubin], check=True, capture_output=True,
                              text=True).stdout
    else:
        with open(args.sass) as f:
            text = f.read()
    result = attribute(read_report(args.report), line_chains(text))
    if result["mismatches"]:
        print(f"warning: {result['mismatches']} of {result['instructions']} opcodes differ between the report "
              "and the disassembly: not the cubin that ran", file=sys.stderr)
    total = result["total"] or 1.0
    print(f"{int(result['total'])} samples over {result['instructions']} instructions")
    print("\nby the kernel's outermost line (its phases):")
    for key, v in result["outer"].most_common(args.top):
        print(f"  {100 * v / total:5.1f} %  {key}")
    print("\nby innermost line:")
    for key, v in result["inner"].most_common(args.top):
        print(f"  {100 * v / total:5.1f} %  {key}")
    print("\nby innermost line and its caller:")
    for (line, caller), v in result["pair"].most_common(args.top):
        print(f"  {100 * v / total:5.1f} %  {line:32s} <- {caller}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
