"""Compiled kernels: run-time compilation (NVRTC / nvcc), cubin cache, launch wrappers.

Importing this package needs neither cuda-python nor a GPU; the heavy imports happen on first use.
"""

from .jit import CudaDriverError, KernelCompileError, KernelSpec, compile_kernel, nvrtc_available

__all__ = [
    "CudaDriverError",
    "KernelCompileError",
    "KernelSpec",
    "compile_kernel",
    "nvrtc_available",
]
