"""What the fused SM90 kernel's builds compile to, without a GPU: SASS instruction classes per
wgmma loop (the K loops), registers and spills, and whether two source trees give the same SASS.

    python -m benchmarks.sass_census                       # V4-Flash-like FP8, 32- and 64-token tma builds
    python -m benchmarks.sass_census --builds v4-flash:fp8-block:64 deepseek-v3:bf16:128:tma
    python -m benchmarks.sass_census --base-csrc /tmp/base/csrc   # same SASS as another commit's csrc/?
    python -m benchmarks.sass_census --csrc .probe_tid/csrc --base-csrc csrc --table --ranks 1 --tokens 8192 \
        --builds qwen3-30b-a3b:fp8-block:64 v4-flash:fp8-block:128   # a patched tree against this one, one row a build

A build is SHAPE:FORMAT:TILE (shape: a standard name or HIDDENxINTERxEXPERTSxTOPK; EP2
and 4096 tokens of buffer unless --ranks / --tokens say otherwise: the EP1 and EP2 builds of a shape
can spill differently). A loop is a backward branch whose body holds a wgmma (QGMMA / HGMMA);
nested ones (a stage wait's timeout loop, a TMA issue loop) are counted inside the loops that
hold them and listed on their own. Use it to see what a kernel change did to the instruction
stream before spending device time on it, and to check that a refactoring left a GPU-verified
build's SASS unchanged (compared instruction by instruction, addresses and labels ignored).
Needs NVRTC (cuda-python) and nvdisasm (the CUDA toolkit's, or `pip install nvidia-cuda-nvdisasm`).
"""
from __future__ import annotations

import argparse
import collections
import difflib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

DEFAULT_BUILDS = ["v4-flash:fp8-block:32", "v4-flash:fp8-block:64"]
WGMMA_OPCODES = ("QGMMA", "HGMMA")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:(@!?U?P\w+)\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instruction:
    opcode: str   # with modifiers, e.g. QGMMA.64x64x32.F32.E4M3.E4M3
    text: str     # predicate, opcode and operands, whitespace normalised
    label: str | None = None  # the label right before it, if any

    @property
    def base(self) -> str:  # the opcode without modifiers, e.g. QGMMA
        return self.opcode.split(".")[0]


@dataclass
class Loop:
    start: int  # index of the first instruction (the one after the label)
    end: int    # index of the backward branch
    label: str

    def body(self, instructions: list[Instruction]) -> list[Instruction]:
        return instructions[self.start:self.end + 1]


def find_nvdisasm() -> str:
    candidates = [shutil.which("nvdisasm"),
                  os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")]
    for site in sys.path:  # the nvidia-cuda-nvdisasm wheel
        candidates += glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "nvdisasm"))
        candidates += glob.glob(os.path.join(site, "nvidia", "cuda_nvdisasm", "bin", "nvdisasm"))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return candidate
    raise SystemExit("nvdisasm not found: put the CUDA toolkit's bin on PATH, set CUDA_HOME, or "
                     "pip install nvidia-cuda-nvdisasm")


def parse(disassembly: str) -> list[Instruction]:
    """nvdisasm text -> instructions in order (labels attached to the instruction after them)."""
    out, pending = [], None
    for line in disassembly.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending = m.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m:
            predicate, opcode, operands = m.groups()
            text = " ".join(((predicate or "") + " " + opcode + operands).split())
            out.append(Instruction(opcode, text, pending))
            pending = None
    return out


def loops(instructions: list[Instruction]) -> list[Loop]:
    """Every backward branch to a label: the loop from that label to the branch, outermost first."""
    where = {ins.label: i for i, ins in enumerate(instructions) if ins.label}
    found = []
    for i, ins in enumerate(instructions):
        if ins.base != "BRA":
            continue
        m = _BRANCH_TARGET.search(ins.text)
        if m and m.group(1) in where and where[m.group(1)] <= i:
            found.append(Loop(where[m.group(1)], i, m.group(1)))
    return sorted(found, key=lambda lp: (lp.start, -lp.end))


def wgmma_loops(instructions: list[Instruction]) -> list[Loop]:
    return [lp for lp in loops(instructions)
            if any(ins.base in WGMMA_OPCODES for ins in lp.body(instructions))]


def census(instructions: list[Instruction]) -> collections.Counter:
    return collections.Counter(ins.base for ins in instructions)


def same_sass(a: list[Instruction], b: list[Instruction]) -> tuple[bool, int]:
    """Whether two instruction streams are the same (labels and addresses ignored); the index of
    the first difference otherwise (or the shorter length)."""
    ta, tb = [_strip_labels(x.text) for x in a], [_strip_labels(x.text) for x in b]
    if ta == tb:
        return True, -1
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    return False, first


def _strip_labels(text: str) -> str:
    return _BRANCH_TARGET.sub("(label)", text)


# ----------------------------------------------------------------------------- building
def parse_build(spec: str) -> tuple[str, str, int]:
    parts = spec.split(":")
    if len(parts) != 3:
        raise SystemExit(f"build {spec!r}: expected SHAPE:FORMAT:TILE")
    shape, fmt, tile = parts[0], parts[1], int(parts[2])
    return shape, fmt, tile


def compile_build(spec: str, csrc_dir: str | None = None, ranks: int = 2, tokens: int = 4096) -> tuple[bytes, str]:
    """The cubin and ptxas log of a build (NVRTC, no cache), from csrc_dir if given, on a buffer of
    `ranks` ranks and `tokens` tokens per rank."""
    from benchmarks.kernel_probe import probe_shape, scoped_env
    from vllm_megamoe.kernels import jit, sm90_mega_moe

    shape_name, fmt, tile = parse_build(spec)
    shape = probe_shape(shape_name)
    env = {"VLLM_MEGAMOE_SM90_TOKEN_TILE": str(tile)}
    if csrc_dir:
        env["VLLM_MEGAMOE_CSRC_DIR"] = csrc_dir

    with scoped_env(env, unset=() if csrc_dir else ("VLLM_MEGAMOE_CSRC_DIR",)):
        # the layer's first build (its only tile here)
        spec = sm90_mega_moe.layer_kernel_specs([shape], fmt, ranks, tokens)[0]
        compiled = jit.compile_kernel(spec, "nvrtc", use_cache=False)
    return compiled.cubin, compiled.log


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([find_nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def resources(log: str) -> str:
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return f"{regs[0] if regs else '?'} registers, {spills[0] if spills else '?'} bytes spilled"


# ----------------------------------------------------------------------------- report
def summary(instructions: list[Instruction], log: str) -> str:
    """Registers, spilled bytes, spill stores / refills and each K loop's length, in one cell."""
    found = wgmma_loops(instructions)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    stl, ldl = (sum(i.base == op for i in instructions) for op in ("STL", "LDL"))
    regs = re.findall(r"Used (\d+) registers", log)
    return (f"{regs[0] if regs else '?'}, {spills[0] if spills else '?'} B, {stl} / {ldl}; "
            + " ".join(str(lp.end - lp.start + 1) for lp in k_loops(found)))


def describe(spec: str, instructions: list[Instruction], log: str, top: int) -> list[str]:
    lines = [f"== {spec}: {len(instructions)} instructions, {resources(log)}"]
    found = wgmma_loops(instructions)
    for lp in found:
        body = lp.body(instructions)
        counts = census(body)
        wgmma = {op: n for op, n in counts.items() if op in WGMMA_OPCODES}
        inner = sum(1 for o in found if o is not lp and lp.start <= o.start and o.end <= lp.end)
        kind = f"holds {inner} wgmma loops" if inner else "K loop"
        lines.append(f"   {kind} at {lp.label} (instructions {lp.start}-{lp.end}): {len(body)} instructions, "
                     + ", ".join(f"{n} {op}" for op, n in wgmma.items()))
        lines.append("      " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))
    lines.append("   " + local_memory(instructions, found))
    return lines


def k_loops(found: list[Loop]) -> list[Loop]:
    """The K loops among wgmma loops: those holding no other wgmma loop."""
    return [lp for lp in found if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in found)]


def local_memory(instructions: list[Instruction], found: list[Loop]) -> str:
    """Spill stores and refills (STL / LDL) in the whole kernel and inside its K loops (innermost
    wgmma loops): refills outside the K loops still sit on every task's path."""
    inside = {k for lp in k_loops(found) for k in range(lp.start, lp.end + 1)}
    count = {op: [k for k, i in enumerate(instructions) if i.base == op] for op in ("STL", "LDL")}
    return ("local memory: " + ", ".join(f"{len(ks)} {op}" for op, ks in count.items())
            + " (in K loops: " + ", ".join(f"{sum(k in inside for k in ks)} {op}" for op, ks in count.items()) + ")")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", nargs="+", default=DEFAULT_BUILDS, help="SHAPE:FORMAT:TILE")
    ap.add_argument("--base-csrc", help="another tree's csrc/ (e.g. from git archive): compare SASS per build")
    ap.add_argument("--csrc", help="the tree to describe (default: the package's csrc/), e.g. a patched copy")
    ap.add_argument("--table", action="store_true",
                    help="one markdown row per build: registers, spilled bytes, STL / LDL and the K loops' "
                         "instruction counts (of --base-csrc and of this tree)")
    ap.add_argument("--top", type=int, default=14, help="instruction classes listed per loop")
    ap.add_argument("--ranks", type=int, default=2, help="EP size of the builds' buffer (default 2)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the builds' buffer (default 4096)")
    args = ap.parse_args(argv)
    if args.table:
        cells = ["base", "this"] if args.base_csrc else ["this"]
        print(f"| build (EP{args.ranks}, {args.tokens} tokens) | " + " | ".join(cells) + " |")
        print("| --- |" + " --- |" * len(cells))
        for spec in args.builds:
            row = [summary(parse(disassemble(c)), log) for c, log in
                   (compile_build(spec, tree, args.ranks, args.tokens) for tree in
                    ([args.base_csrc] if args.base_csrc else []) + [args.csrc])]
            print(f"| {spec} | " + " | ".join(row) + " |", flush=True)
        return 0
    differ = 0
    for spec in args.builds:
        cubin, log = compile_build(spec, args.csrc, ranks=args.ranks, tokens=args.tokens)
        mine = parse(disassemble(cubin))
        print("\n".join(describe(spec, mine, log, args.top)))
        if args.base_csrc:
            base_cubin, base_log = compile_build(spec, args.base_csrc, args.ranks, args.tokens)
            base = parse(disassemble(base_cubin))
            same, first = same_sass(base, mine)
            if same:
                print(f"   same SASS as {args.base_csrc}")
            else:
                differ += 1
                changed = sum(1 for line in difflib.unified_diff([_strip_labels(x.text) for x in base],
                                                                 [_strip_labels(x.text) for x in mine], n=0, lineterm="")
                              if line[:1] in "+-" and line[:3] not in ("+++", "---"))
                print(f"   DIFFERS from {args.base_csrc} ({len(base)} vs {len(mine)} instructions, {changed} lines "
                      f"of a diff, {resources(base_log)} there); first difference at instruction {first}:")
                print(f"      base: {base[first].text if first < len(base) else '(end)'}")
                print(f"      this: {mine[first].text if first < len(mine) else '(end)'}")
                if [x.opcode for x in base] == [x.opcode for x in mine]:
                    print("   (the same opcodes in the same order: registers / operands differ only)")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
