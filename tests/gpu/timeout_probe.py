"""Run by test_missing_peer_times_out_with_a_message: rank 1 skips the call rank 0 makes."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from vllm_megamoe.launch import RankFailed, run_ranks  # noqa: E402


def _rank(rank, world, group, timeout_s):
    from mega_cases import SHAPES, global_weights, inputs
    from vllm_megamoe import SymmBuffer
    from vllm_megamoe.kernels import sm90_mega_moe
    shape = SHAPES["small-odd"]
    dev = torch.device("cuda", torch.cuda.current_device())
    weights = global_weights(shape, "fp8-block", dev)
    buf = SymmBuffer(shape, 16, group, format="fp8-block", device=dev, timeout_s=timeout_s)
    x, idx, tw = inputs(shape, [16, 16], "uniform", 1, dev)[rank]
    # Both ranks compile first (the first call's host-side alignment is a collective too).
    sm90_mega_moe.load_kernel(shape, buf)
    if rank == 1:
        import time
        time.sleep(timeout_s * 4)  # alive but never launching: rank 0 must give up by itself
        return "skipped"
    sm90_mega_moe.mega_moe(x, idx, tw, weights.experts(0, 12), buf)
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        from vllm_megamoe.kernels import error_record
        print("REPORT:", error_record.report(dev), flush=True)  # readable after the trap
        raise
    return "returned"


if __name__ == "__main__":
    # argv: the kernel's timeout in seconds, then the group backend (gloo: both ranks on GPU 0)
    backend = sys.argv[2] if len(sys.argv) > 2 else "nccl"
    res = run_ranks(_rank, 2, (float(sys.argv[1]),), backend=backend, timeout_s=180, allow_failures=True)
    print("RANK0_FAILED" if isinstance(res[0], RankFailed) else f"RANK0_OK {res[0]}", flush=True)
    print(res[0])
