"""A small single-GPU run of the fused kernel for compute-sanitizer (memcheck, racecheck).

    python tests/gpu/sanitize_probe.py                        # every case
    python tests/gpu/sanitize_probe.py "fp8-block, 128"       # the cases whose label contains an argument
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from mega_cases import EMULATED_BOUND, run_cases  # noqa: E402


def check(fmt, tokens, routing, label, options=None):
    if len(sys.argv) > 1 and not any(arg in label for arg in sys.argv[1:]):
        return
    rows = run_cases(0, 1, None, "small-odd", fmt, [([tokens], routing, 3)], compare_portable=False,
                     options=options)
    worst = max(r["err_emulated"] for r in rows)
    print(f"{label}: worst error vs emulated reference {worst:.2e}", "OK" if worst <= EMULATED_BOUND[fmt] else "FAIL")


if __name__ == "__main__":
    for fmt in ("fp8-block", "bf16"):
        check(fmt, 40, "masked", f"{fmt}, default tiles")
    # 64-token FP8 tiles: full token blocks next to narrow ones (at most 32 rows: half the columns)
    os.environ["VLLM_MEGAMOE_SM90_TOKEN_TILE"] = "64"
    check("fp8-block", 200, "uniform", "fp8-block, 64-token tiles")  # with the epilogue warpgroup
    check("bf16", 200, "uniform", "bf16, 64-token tiles")
    os.environ["VLLM_MEGAMOE_SM90_TOKEN_TILE"] = "128"  # the epilogue tile in a stage
    check("bf16", 300, "uniform", "bf16, 128-token tiles")
    check("fp8-block", 300, "uniform", "fp8-block, 128-token tiles")
    from vllm_megamoe.kernels.sm90_mega_moe import BuildOptions
    wg128 = BuildOptions(epilogue_warpgroup_128=True)  # the hand-off tile (fits this shape)
    check("fp8-block", 300, "uniform", "fp8-block, 128-token tiles, epilogue warpgroup", wg128)
    check("bf16", 300, "uniform", "bf16, 128-token tiles, epilogue warpgroup", wg128)
    torch.cuda.synchronize()
