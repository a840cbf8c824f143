"""The implementations a benchmark compares, behind one small interface.

Each path has `name`, `capturable` (time graph replays when True), `call(x, topk_idx,
topk_weights) -> y` (the op as a user calls it, eager), `graph_call` (the same op as captured
in a CUDA graph) and `close()`.
- "megamoe":  vllm_megamoe.mega_moe with the path ops.select_path picks (SM90 kernel when present);
- "portable": vllm_megamoe.portable.mega_moe, graph-captured in padded mode;
- "chain":    the unfused NCCL chain (benchmarks/chain.py), eager (host-synchronised);
- "sglang":   SGLang's SM90 fused Mega MoE when deep_gemm provides it (benchmarks/sglang_baseline.py).
"""
from __future__ import annotations

from vllm_megamoe import ops, portable

PATH_NAMES = ("megamoe", "portable", "chain", "sglang")


class PortablePath:
    name = "portable"
    capturable = True

    def __init__(self, weights, buffer):
        self.weights, self.buffer = weights, buffer

    def call(self, x, topk_idx, topk_weights):
        return portable.mega_moe(x, topk_idx, topk_weights, self.weights, self.buffer)

    def graph_call(self, x, topk_idx, topk_weights):
        return portable.mega_moe(x, topk_idx, topk_weights, self.weights, self.buffer, mode="padded")

    def close(self):
        portable.check_errors(self.buffer)


class MegaMoEPath:
    """The public op; `selected` is the implementation select_path picks here."""

    name = "megamoe"
    capturable = True

    def __init__(self, weights, buffer, selected: str):
        self.weights, self.buffer, self.selected = weights, buffer, selected

    def call(self, x, topk_idx, topk_weights):
        return ops.mega_moe(x, topk_idx, topk_weights, self.weights, self.buffer, path=self.selected)

    graph_call = call

    def close(self):
        if self.selected == "portable":
            portable.check_errors(self.buffer)


class ChainPath:
    name = "chain"
    capturable = False

    def __init__(self, chain):
        self.chain = chain

    def call(self, x, topk_idx, topk_weights):
        return self.chain(x, topk_idx, topk_weights)

    graph_call = call

    def close(self):
        pass
