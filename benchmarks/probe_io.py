"""What the standalone kernel probes (wgmma_probe, stream_probe) share: a build's ptxas numbers and
the results file with the environment it ran in."""
from __future__ import annotations

import json
import re


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
