"""Stage-by-stage comparison of the fused kernel with Python math, read back from the buffer.

    python3 tests/gpu/diagnose_stages.py [shape] [format] [tokens]
Prints, for the staged rows, how the kernel's pulled rows, L1 outputs (SwiGLU, requantized) and
L2 outputs (combine rows) compare with Python computed from the kernel's own inputs to each stage.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from mega_cases import SHAPES, global_weights, inputs  # noqa: E402
from vllm_megamoe import SymmBuffer, quant, reference  # noqa: E402
from vllm_megamoe.kernels import sm90_mega_moe  # noqa: E402


def main(shape_name="qwen3-30b-a3b", fmt="fp8-block", tokens=128):
    shape = SHAPES[shape_name]
    dev = torch.device("cuda", 0)
    w = global_weights(shape, fmt, dev)
    w13f, w2f = w.dequantize()
    buf = SymmBuffer(shape, tokens, None, format=fmt, device=dev)
    x, idx, tw = inputs(shape, [tokens], "uniform", 3, dev)[0]
    y = sm90_mega_moe.mega_moe(x, idx, tw, w, buf)
    torch.cuda.synchronize()
    rows = int((idx >= 0).sum())
    meta = buf.view("staging_meta")[:rows].long()
    fp8 = fmt == "fp8-block"
    l1 = buf.view("staging_l1")[:rows]
    x_rows = quant.dequantize_fp8_tokens(l1, buf.view("staging_l1_scale")[:rows, :shape.hidden // 128]) if fp8 else l1.float()
    # 1. pulled rows vs the quantized tokens they claim to be
    xq = quant.dequantize_fp8_tokens(*quant.quantize_fp8_tokens(x.float())) if fp8 else x.float()
    print("pull: rows", rows, "max |diff| vs staged tokens", (x_rows - xq[meta[:, 1]]).abs().max().item())
    print("pull: weights match", torch.equal(buf.view("staging_weight")[:rows], tw[meta[:, 1], meta[:, 2]]),
          "experts match", torch.equal(meta[:, 3], idx[meta[:, 1], meta[:, 2]]))
    # 2. L1: SwiGLU of the kernel's own rows
    gate_up = torch.einsum("rh,rnh->rn", x_rows, w13f[meta[:, 3]])
    act = reference.swiglu(gate_up, None, round_to_bf16=True) * buf.view("staging_weight")[:rows, None]
    l2 = buf.view("staging_l2")[:rows]
    k_act = quant.dequantize_fp8_tokens(l2, buf.view("staging_l2_scale")[:rows, :shape.intermediate // 128]) if fp8 else l2.float()
    emu = quant.dequantize_fp8_tokens(*quant.quantize_fp8_tokens(act)) if fp8 else act.to(torch.bfloat16).float()
    print("L1: rel err vs float act", reference.relative_error(k_act, act),
          "| vs emulated act", reference.relative_error(k_act, emu),
          "| elements differing from emulation", (k_act != emu).float().mean().item())
    if fp8:
        k_scale, e_scale = buf.view("staging_l2_scale")[:rows, :shape.intermediate // 128], quant.quantize_fp8_tokens(act)[1]
        print("L1: scale rel err", reference.relative_error(k_scale, e_scale))
        bad = (k_act != emu)
        print("L1: differing elements per 128-channel group", bad.reshape(rows, -1, 128).float().mean((0, 2)).tolist())
        print("L1: differing fraction by row (first 16)", bad.float().mean(1)[:16].tolist())
    # 3. L2 of the kernel's own activations vs the combine rows it wrote
    out = torch.einsum("ri,rhi->rh", k_act, w2f[meta[:, 3]]).to(torch.bfloat16).float()
    comb = buf.view("combine")[meta[:, 2], meta[:, 1]].float()
    print("L2: rel err of combine rows vs Python on kernel acts", reference.relative_error(comb, out))
    ref = reference.moe_forward(x, idx, tw, w13f, w2f, emulate="fp8" if fp8 else "bf16")
    print("y: rel err vs emulated reference", reference.relative_error(y, ref))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b", sys.argv[2] if len(sys.argv) > 2 else "fp8-block",
         int(sys.argv[3]) if len(sys.argv) > 3 else 128)
