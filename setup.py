import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithCsrc(build_py):
    """Ship the CUDA sources (top-level csrc/) inside the package: they are JIT-compiled at run
    time, and vllm_megamoe.kernels.jit.csrc_dir() looks for them in vllm_megamoe/csrc first."""

    def run(self):
        super().run()
        src = os.path.join(ROOT, "csrc")
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(self.build_lib, "vllm_megamoe", "csrc"), dirs_exist_ok=True)


setup(
    name="vllm-megamoe",
    version="0.1.0",
    description="Fused expert-parallel MoE (dispatch + expert MLP + combine in one kernel) for vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_megamoe", "vllm_megamoe.*"]),
    cmdclass={"build_py": BuildPyWithCsrc},
    install_requires=[
        "torch>=2.6",
        "numpy",  # torch.distributed's object collectives (buffer set-up) need it
        "safetensors>=0.4",
        "PyYAML>=6",
        "tqdm>=4.60",
    ],
    extras_require={
        # GPU kernels: NVRTC + driver API through cuda-python (imported lazily).
        "cuda": ["cuda-bindings>=13.0,<14", "nvidia-cuda-nvrtc>=13.0,<14"],
        "vllm": ["vllm>=0.32"],
        "bench": ["matplotlib>=3.7"],
        "test": ["pytest>=7", "hypothesis>=6", "matplotlib>=3.7"],
    },
    entry_points={
        "console_scripts": ["vllm-megamoe=vllm_megamoe.cli:main"],
        "vllm.general_plugins": ["megamoe=vllm_megamoe.plugin:register"],
    },
)
