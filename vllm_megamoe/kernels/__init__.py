"""Compiled kernels: run-time compilation (NVRTC / nvcc), cubin cache, launch wrappers.

Importing this package needs neither cuda-python nor a GPU; the heavy imports happen on first use.
"""

from .jit import CudaDriverError, KernelCompileError, KernelSpec, compile_kernel, nvrtc_available

__all__ = [
    "CudaDriverError",
    "KernelCompileError",
    "KernelSpec",
    "compile_kernel",
    "grouped_gemm_bf16",
    "grouped_gemm_fp8_block",
    "nvrtc_available",
]


def __getattr__(name):
    if name in ("grouped_gemm_fp8_block", "grouped_gemm_bf16"):  # import torch only when asked
        from . import sm90_grouped_gemm

        return getattr(sm90_grouped_gemm, name)
    raise AttributeError(name)
