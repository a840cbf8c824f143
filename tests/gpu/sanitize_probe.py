"""A small single-GPU run of the fused kernel for compute-sanitizer (memcheck, racecheck)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from mega_cases import EMULATED_BOUND, run_cases  # noqa: E402

if __name__ == "__main__":
    for fmt in ("fp8-block", "bf16"):
        rows = run_cases(0, 1, None, "small-odd", fmt, [([40], "masked", 3)], compare_portable=False)
        worst = max(r["err_emulated"] for r in rows)
        print(f"{fmt}: worst error vs emulated reference {worst:.2e}", "OK" if worst <= EMULATED_BOUND[fmt] else "FAIL")
    torch.cuda.synchronize()
