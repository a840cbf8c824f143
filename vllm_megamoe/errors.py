"""Exceptions raised by vllm_megamoe (all derive from MegaMoEError; bad input is ValueError)."""


class MegaMoEError(RuntimeError):
    """Base class of run-time failures (not bad input)."""


class BarrierTimeoutError(MegaMoEError):
    """A rank did not reach a barrier in time; the message names the rank and the phase."""


class PeerAccessError(MegaMoEError):
    """Ranks cannot address each other's memory directly (not one NVLink/P2P domain)."""


class UnsupportedError(MegaMoEError):
    """The requested path cannot run here (GPU architecture, missing package, shape)."""
