"""vllm-megamoe: a fused expert-parallel MoE layer (dispatch, expert MLP, combine in one op).

The core package imports with torch alone; vLLM integration lives in `vllm_megamoe.plugin`.
Public API:
    MoEShape, ExpertWeights, transform_weights_for_mega_moe   (shapes and weights)
    quant, transforms, reference                                (formats and the oracle)
    BufferLayout, SymmBuffer                                    (the symmetric buffer)
    mega_moe                                                    (the op; picks the path)
"""
from .errors import BarrierTimeoutError, MegaMoEError, PeerAccessError, UnsupportedError
from .layout import BufferLayout
from .shape import MoEShape
from .weights import ExpertWeights, transform_weights_for_mega_moe
from .buffer import SymmBuffer
from .ops import mega_moe, select_path

__version__ = "0.1.0"

__all__ = [
    "BarrierTimeoutError", "BufferLayout", "ExpertWeights", "MegaMoEError", "MoEShape",
    "PeerAccessError", "SymmBuffer", "UnsupportedError", "mega_moe", "select_path",
    "transform_weights_for_mega_moe", "__version__",
]
