"""Offline conversion of Hugging Face MoE checkpoints to the megamoe kernel layout.

    convert_checkpoint(src, dst, arch="sm90", fmt=None)          write a converted checkpoint
                                                                   (fmt None: the source's precision)
    inspect_checkpoint(dir) / format_inspection(info)             summarise one
    verify_checkpoint(dir, source=None, samples=8)                list its problems
    to_kernel_layout(w13, w2, arch=, fmt=, ...)                   the per-arch layout (also used
                                                                   by the plugin at load time)
    read_megamoe_marker(config) / check_marker_matches(marker, arch, fmt)
See docs/conversion.md.
"""
from .checkpoint import ConvertResult, convert_checkpoint
from .inspection import format_inspection, inspect_checkpoint
from .layouts import (ARCH_FORMATS, LAYOUT_VERSION, KernelExperts, check_arch_format,
                      default_format, tensor_specs, to_kernel_layout)
from .marker import check_marker_matches, read_megamoe_marker
from .plan import parse_size
from .verify import verify_checkpoint

__all__ = [
    "ARCH_FORMATS", "LAYOUT_VERSION", "ConvertResult", "KernelExperts",
    "check_arch_format", "check_marker_matches", "convert_checkpoint", "default_format", "format_inspection",
    "inspect_checkpoint", "parse_size", "read_megamoe_marker", "tensor_specs",
    "to_kernel_layout", "verify_checkpoint",
]
