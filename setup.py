import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithCsrc(build_py):
    """Ship the CUDA sources (top-level csrc/) and the SM90 tuning table inside the package: the
    sources are JIT-compiled at run time (vllm_megamoe.kernels.jit.csrc_dir() looks for them in
    vllm_megamoe/csrc first), the table is read by vllm_megamoe.kernels.sm90_tuning."""

    def run(self):
        super().run()
        src = os.path.join(ROOT, "csrc")
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(self.build_lib, "vllm_megamoe", "csrc"), dirs_exist_ok=True)
        # The SM90 kernel's tuning table (vllm_megamoe.kernels.sm90_tuning looks there first).
        table = os.path.join(ROOT, "configs", "sm90_mega_moe.yaml")
        if os.path.isfile(table):
            os.makedirs(os.path.join(self.build_lib, "vllm_megamoe", "configs"), exist_ok=True)
            shutil.copy(table, os.path.join(self.build_lib, "vllm_megamoe", "configs"))


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
        # nvdisasm: benchmarks.sass_census (and ncu_regions) read the kernels' SASS.
        "bench": ["matplotlib>=3.7", "nvidia-cuda-nvdisasm>=13.2,<14"],
        "test": ["pytest>=7", "hypothesis>=6", "matplotlib>=3.7", "nvidia-cuda-nvdisasm>=13.2,<14"],
    },
    entry_points={
        "console_scripts": ["vllm-megamoe=vllm_megamoe.cli:main"],
        "vllm.general_plugins": ["megamoe=vllm_megamoe.plugin:register"],
    },
)
