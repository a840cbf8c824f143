"""What the standalone kernel probes (wgmma_probe, stream_probe) share: a build's ptxas numbers and
the results file with the environment it ran in."""
from __future__ import annotations

import argparse
import json
import re
from typing import Callable, Iterable


def compile_report(log: str) -> dict:
    """Registers, spill bytes and whether ptxas serialized the wgmmas (any of its reasons), from its
    -v log."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
                serialized="instructions are serialized" in log)  # C7510 / C7514 / C7515 ...


def write_results(path: str, rows: list[dict], compile_only: bool) -> None:
    """{env, rows} as JSON: the NVRTC version, and the GPU and torch when the rows were timed."""
    from vllm_megamoe.kernels import jit
    env = dict(nvrtc="%d.%d" % jit.nvrtc_version(), compile_only=compile_only)
    if not compile_only:
        import torch
        env.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(path, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


def report_rows(rows: Iterable[dict], table: Callable[[list[dict]], str], out: str | None, compile_only: bool) -> int:
    """Each row's table line as it comes (a probe's rows compile and run one by one), then the whole
    table, and the results file when `out` is set; the probe's exit status."""
    done: list[dict] = []
    for row in rows:
        done.append(row)
        print(table(done).splitlines()[-1], flush=True)
    print(table(done))
    if out:
        write_results(out, done, compile_only)
    return 0


def probe_arguments(doc: str, configs: tuple, config_help: str, tasks: int) -> argparse.ArgumentParser:
    """The options every probe takes: its configs, stages, K chunks per task, tasks per CTA,
    --compile-only and --out (a probe adds its own)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(configs), help=config_help)
    ap.add_argument("--stages", type=int, default=4, help="shared-memory stages cycled through")
    ap.add_argument("--chunks", type=int, default=32, help="K chunks per task (V4-Flash-like L1: 4096 / 128)")
    ap.add_argument("--tasks", type=int, default=tasks, help="tasks per CTA in the timed launch")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile and report registers")
    ap.add_argument("--out", default=None)
    return ap
