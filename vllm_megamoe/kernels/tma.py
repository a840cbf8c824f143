"""Host-side TMA tensor maps (cuTensorMapEncodeTiled) for the SM90 kernels.

All maps use the 128-byte swizzle that the kernels' wgmma descriptors expect, so the innermost box
extent is always 128 bytes (128 e4m3 or 64 bf16 elements). Out-of-bounds boxes are zero-filled.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .jit import _driver, check_driver

_TMA_DTYPES = {
    torch.float8_e4m3fn: "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    torch.uint8: "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    torch.int8: "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
    torch.float32: "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
}


def make_tensor_map(tensor: torch.Tensor, box: Sequence[int]):
    """Tensor map over a contiguous tensor, dims given innermost first in `box`.

    `box[i]` is the box extent along dimension `ndim-1-i` of the tensor (box[0] = innermost).
    Returns a cuda.bindings CUtensorMap; keep it alive until the launch that uses it returned.
    """
    driver = _driver()
    if not tensor.is_contiguous():
        raise ValueError("TMA tensor maps need a contiguous tensor")
    if tensor.dtype not in _TMA_DTYPES:
        raise ValueError(f"no TMA element type for {tensor.dtype}")
    rank = tensor.dim()
    if len(box) != rank or not 1 <= rank <= 5:
        raise ValueError(f"box {tuple(box)} does not match a tensor of rank {rank}")
    element = tensor.element_size()
    dims = [tensor.shape[rank - 1 - i] for i in range(rank)]
    strides = [tensor.stride(rank - 1 - i) * element for i in range(1, rank)]
    if box[0] * element != 128:
        raise ValueError(f"innermost box must be 128 bytes for the 128B swizzle, got {box[0] * element}")
    if tensor.data_ptr() % 16 or any(s % 16 for s in strides):
        raise ValueError("TMA needs a 16-byte aligned base and 16-byte multiple strides")
    data_type = getattr(driver.CUtensorMapDataType, _TMA_DTYPES[tensor.dtype])
    return check_driver(
        driver.cuTensorMapEncodeTiled(
            data_type,
            rank,
            tensor.data_ptr(),
            [driver.cuuint64_t(d) for d in dims],
            [driver.cuuint64_t(s) for s in strides],
            [driver.cuuint32_t(b) for b in box],
            [driver.cuuint32_t(1)] * rank,
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        f"cuTensorMapEncodeTiled(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, box={tuple(box)})",
    )
