"""Compare the kernel's staged tokens (buffer x / x_scale) with quant.quantize_fp8_tokens."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from mega_cases import SHAPES, global_weights, inputs  # noqa: E402
from vllm_megamoe import SymmBuffer, quant  # noqa: E402
from vllm_megamoe.kernels import sm90_mega_moe  # noqa: E402

shape = SHAPES["small-odd"]
dev = torch.device("cuda", 0)
w = global_weights(shape, "fp8-block", dev)
for tokens in (1, 2, 3, 16):
    buf = SymmBuffer(shape, 16, None, format="fp8-block", device=dev)
    x, idx, tw = inputs(shape, [tokens], "uniform", 3, dev)[0]
    sm90_mega_moe.mega_moe(x, idx, tw, w, buf)
    torch.cuda.synchronize()
    kq, ks = buf.view("x")[:tokens], buf.view("x_scale")[:tokens]
    pq, ps = quant.quantize_fp8_tokens(x.float())
    diff_q = kq.view(torch.uint8) != pq.view(torch.uint8)
    print(f"T={tokens}: scales equal {torch.equal(ks, ps)} (max rel {((ks - ps).abs() / ps).max().item():.2e}); "
          f"fp8 bytes differing {diff_q.float().mean().item():.4f} per token {diff_q.float().mean(1).tolist()}")
    if diff_q.any():
        t, c = diff_q.nonzero()[0].tolist()
        print("   first: token", t, "col", c, "x", x[t, c].item(), "kernel", kq[t, c].float().item(),
              "python", pq[t, c].float().item(), "x/scale", (x[t, c].float() / ps[t, c // 128]).item())
        print("   kernel row0 first 8", kq[t, :8].float().tolist(), "python", pq[t, :8].float().tolist())
    st = buf.view("staging_l1")[: int((idx >= 0).sum())]
    meta = buf.view("staging_meta")[: st.shape[0]].long()
    print("   staged rows equal buffer x rows:", torch.equal(st.view(torch.uint8), kq[meta[:, 1]].view(torch.uint8)))
    buf.destroy()
