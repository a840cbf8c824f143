"""The portable path's Triton kernels compile for sm_90 on a machine without a GPU (Triton's
own ptxas), and the combine scatter writes with 16-byte vector stores. Skipped without Triton."""
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
DIV16 = [["tt.divisibility", 16]]


def _compile(fn, signature, constexprs, aligned, **options):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs={(i,): DIV16 for i in aligned})
    try:
        return triton.compile(src, target=SM90, options=options or None)
    except (ImportError, RuntimeError) as exc:  # a Triton build without its CUDA toolchain
        if isinstance(exc, ImportError) or "ptxas" in str(exc):
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise


def test_combine_scatter_compiles_to_vector_stores():
    from vllm_megamoe.portable import combine as portable_combine
    sig = {"out_ptr": "*bf16", "width": "i32", "anchor_ptr": "*bf16", "deltas_ptr": "*i64", "peer_ptr": "*i64",
           "dst_row_ptr": "*i64", "live_ptr": "*i8", "pitch": "i32", "BLOCK": "constexpr"}
    # Triton specialises 16-byte aligned pointers and integers divisible by 16 at run time, as
    # every combine row of a supported layer is (hidden is a multiple of 128).
    ptx = _compile(portable_combine._kernel(), sig, {"BLOCK": 1024}, range(8)).asm["ptx"]
    stores = set(re.findall(r"st\.global[\.\w]*", ptx))
    assert stores == {"st.global.v4.b32"}, stores


def test_grouped_fp8_gemm_compiles_for_sm90():
    from vllm_megamoe.portable import gemm as portable_gemm
    sig = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
           "out_ptr": "*bf16", "ends_ptr": "*i32", "tile_ends_ptr": "*i32", "N": "i32", "K": "i32", "G": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "G_POW2": "constexpr"}
    compiled = _compile(portable_gemm._kernel(), sig,
                        {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "G_POW2": 128}, range(9),
                        num_warps=4, num_stages=3)
    ptx = compiled.asm["ptx"]
    assert re.search(r"\b(wgmma|mma)\.", ptx), "no tensor-core instruction in the grouped GEMM"


def test_swiglu_quantize_compiles_for_sm90():
    from vllm_megamoe import quant
    from vllm_megamoe.portable import activation as portable_activation
    sig = {"gate_up_ptr": "*bf16", "weight_ptr": "*fp32", "ends_ptr": "*i32", "q_ptr": "*fp8e4nv",
           "scale_ptr": "*fp32", "inter": "i32", "num_experts": "i32", "clamp": "fp32", "HAS_CLAMP": "constexpr",
           "GROUP": "constexpr", "AMAX_FLOOR": "constexpr", "FP8_MAX": "constexpr"}
    ptx = _compile(portable_activation._kernel(), sig,
                   {"HAS_CLAMP": True, "GROUP": 128, "AMAX_FLOOR": quant.AMAX_FLOOR, "FP8_MAX": quant.FP8_MAX},
                   range(5), num_warps=1).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the FP8 conversion rounds to nearest, saturating
    assert "div.rn.f32" in ptx                    # the same division as quant.quantize_fp8_tokens


def test_topk_reduce_compiles_for_sm90():
    from vllm_megamoe.portable import combine as portable_combine
    sig = {"combine_ptr": "*bf16", "topk_ptr": "*i32", "y_ptr": "*bf16", "slot_pitch": "i32",
           "row_pitch": "i32", "hidden": "i32", "TOPK": "constexpr", "BLOCK": "constexpr"}
    # Pointers, pitches and hidden are multiples of 16 for every supported layer (Triton
    # specialises them at run time): the slot rows are read with 16-byte vector loads.
    ptx = _compile(portable_combine._reduce_kernel(), sig, {"TOPK": 8, "BLOCK": 1024}, (0, 1, 2, 3, 4, 5)).asm["ptx"]
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)) >= 8, "one vector load per live slot"
    assert "cvt.rn.bf16" in ptx  # one round-to-nearest conversion of the FP32 sums
