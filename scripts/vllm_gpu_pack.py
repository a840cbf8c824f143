#!/usr/bin/env python3
"""Pack vLLM 0.33.0 for the GPU machines, on this (CPU) machine, in parts that each fit one call.

The GPU machines have torch 2.11, Python 3.12 and no vLLM and no network; a device call carries at
most 64 MiB (the working tree included). vLLM's compiled extensions use libtorch's stable ABI and
load on torch 2.11 (docs/vllm-on-gpu.md says what was checked), so this script gathers:
  - the vLLM 0.33.0 wheel's Python code and dist-info (xz), without the extensions Hopper does not
    need (FlashAttention 2, the Rust frontend binary);
  - every other extension of the wheel, each xz-compressed (_C_stable_libtorch, _moe_C, FA3,
    DeepGEMM, cumem_allocator for sleep mode, ...);
  - the cp312 wheels of vLLM's requirements that the GPU image may lack (resolved by pip against
    vLLM's Requires-Dist, less the CUDA/torch stack the image has and a few packages it is known to
    have); the installer skips any whose installed version already satisfies vLLM;
into one payload.tar, split into chunks under .vllm_gpu/partN/ (ignored by git), each with a copy of
manifest.json (sha256 of every chunk, of the payload and of every file in it).

    python3 scripts/vllm_gpu_pack.py            # ~4 minutes the first time (downloads ~390 MB)
    python3 scripts/vllm_gpu_pack.py --plan     # print the device calls for the current parts

Then, on the device, one call a part (carry [".vllm_gpu/partN"]), consecutive calls on one warm
machine (files outside the tree stay while it is held):
    python3 scripts/vllm_gpu_install.py stash .vllm_gpu/partN      # each part
    python3 scripts/vllm_gpu_install.py assemble                   # with the last part
    source /tmp/megamoe-vllm/env.sh                                # PYTHONPATH with vLLM
docs/vllm-on-gpu.md has the whole sequence and its cost in device time.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, ".vllm_gpu")
VLLM_VERSION = "0.33.0"
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]
CALL_LIMIT = 64 * 2**20
MARGIN = 3 * 2**20  # the tree may grow a little between packing and the calls

# Members of the vLLM wheel left behind: FA2 (FA3 serves Hopper; 130 MB) and the opt-in Rust
# frontend binary (VLLM_RUST_FRONTEND_PATH).
SKIP_MEMBERS = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
# Requirements not carried: the torch/CUDA stack of the image (torch 2.11 stays: vLLM pins 2.14,
# but its extensions need only the stable ABI), kernels Hopper's offline path does not import, and
# extras of the API server that are large (opencv for image inputs, the OTLP exporter, numba for
# n-gram speculation).
NOT_CARRIED_REQS = ("torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec",
                    "flashinfer-python", "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend",
                    "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl",
                    "quack-kernels", "tokenspeed-mla", "humming-kernels", "numba",
                    "opencv-python-headless", "opentelemetry-exporter-otlp")
# Resolved dependencies not carried: on the image (KINDS.md's pip list: torch 2.11, triton 3.6,
# numpy 2.5, transformers 5.17, tokenizers 0.23.2, safetensors 0.8, huggingface_hub 1.33,
# sentencepiece, tiktoken, pillow for torchvision) or large and needed only by extras above.
NOT_CARRIED_DISTS = ("torch", "triton", "numpy", "sympy", "mpmath", "networkx", "setuptools",
                     "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet",
                     "sentencepiece", "tiktoken", "pillow", "pycountry", "cryptography",
                     "apache-tvm-ffi")
NOT_CARRIED_PREFIXES = ("nvidia-", "cuda-")


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--only-binary=:all:", "--python-version", PYTHON,
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)]]
    subprocess.run(cmd, check=True)


def download_vllm(cache: str) -> str:
    wheel = os.path.join(cache, f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl")
    if not os.path.exists(wheel):
        pip("download", "-q", "--no-deps", "-d", cache, f"vllm=={VLLM_VERSION}")
    return wheel


def requirements(wheel: str) -> list[str]:
    """vLLM's unconditional requirements, less those not carried (NOT_CARRIED_REQS)."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"vllm-{VLLM_VERSION}.dist-info/METADATA").decode()
    reqs = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        req = line.split(":", 1)[1].strip()
        name = norm(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0]
                    .split("!")[0].strip())
        if name in NOT_CARRIED_REQS:
            continue
        if "s390x" in req and "!=" not in req and "==" in req.split(";")[0]:
            continue  # protobuf's s390x pin
        req = req.replace("mistral_common[image]", "mistral_common").replace("fastapi[standard]", "fastapi")
        reqs.append(req)
    return reqs + ["uvicorn"]  # `vllm serve` (fastapi[standard] brought it)


def download_requirements(wheel: str, cache: str) -> list[str]:
    """cp312 wheels of the resolved requirements that are carried; returns their paths."""
    report = os.path.join(cache, "resolution.json")
    reqs_file = os.path.join(cache, "requirements.txt")
    with open(reqs_file, "w") as f:
        f.write("\n".join(requirements(wheel)) + "\n")
    if not os.path.exists(report):
        pip("install", "-q", "--dry-run", "--ignore-installed", "--target", os.path.join(cache, "unused"),
            "--report", report, "-r", reqs_file)
    with open(report) as f:
        resolved = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.load(f)["install"]]
    wanted = [f"{n}=={v}" for n, v in resolved
              if norm(n) not in NOT_CARRIED_DISTS and not norm(n).startswith(NOT_CARRIED_PREFIXES)]
    wheels_dir = os.path.join(cache, "wheels")
    os.makedirs(wheels_dir, exist_ok=True)
    want_file = os.path.join(cache, "carried.txt")
    with open(want_file, "w") as f:
        f.write("\n".join(wanted) + "\n")
    pip("download", "-q", "--no-deps", "-d", wheels_dir, "-r", want_file)
    names = {norm(w.split("==")[0]) + "==" + w.split("==")[1] for w in wanted}
    paths = []
    for fn in sorted(os.listdir(wheels_dir)):
        parts = fn.split("-")
        if fn.endswith(".whl") and f"{norm(parts[0])}=={parts[1]}" in names:
            paths.append(os.path.join(wheels_dir, fn))
    missing = len(names) - len(paths)
    if missing:
        raise SystemExit(f"vllm_gpu_pack: {missing} of the {len(names)} requirement wheels were not "
                         f"downloaded into {wheels_dir}; see {want_file}")
    return paths


def xz(src_bytes: bytes, dst: str) -> None:
    with lzma.open(dst, "wb", preset=6) as f:
        f.write(src_bytes)


def build_payload(wheel: str, wheel_paths: list[str], work: str) -> tuple[str, dict]:
    """payload.tar (members already compressed) and the per-member sha256 table."""
    stage = os.path.join(work, "stage")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(os.path.join(stage, "ext"))
    os.makedirs(os.path.join(stage, "wheels"))
    with zipfile.ZipFile(wheel) as z:
        members = [i for i in z.infolist() if not i.is_dir() and i.filename not in SKIP_MEMBERS]
        ext = [i for i in members if i.filename.endswith(".so")]
        code = [i for i in members if not i.filename.endswith(".so")]
        with tarfile.open(os.path.join(stage, "vllm-code.tar.xz"), "w:xz") as t:
            for i in code:
                data = z.read(i)
                info = tarfile.TarInfo(i.filename)
                info.size, info.mode = len(data), 0o644
                t.addfile(info, io.BytesIO(data))
        extensions = {}
        for i in ext:
            name = i.filename.replace("/", "__") + ".xz"
            print(f"  xz {i.filename} ({i.file_size / 2**20:.0f} MiB)", flush=True)
            xz(z.read(i), os.path.join(stage, "ext", name))
            extensions[name] = i.filename
    for p in wheel_paths:
        shutil.copy(p, os.path.join(stage, "wheels"))
    with open(os.path.join(stage, "extensions.json"), "w") as f:
        json.dump(extensions, f, indent=1)
    files = {}
    for dirpath, _, fns in os.walk(stage):
        for fn in fns:
            full = os.path.join(dirpath, fn)
            files[os.path.relpath(full, stage)] = sha256_file(full)
    payload = os.path.join(work, "payload.tar")
    with tarfile.open(payload, "w") as t:
        for rel in sorted(files):
            t.add(os.path.join(stage, rel), rel)
    return payload, files


def tree_bytes() -> int:
    """Bytes of what a device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    total = 0
    for rel in filter(None, out.split("\0")):
        path = os.path.join(ROOT, rel)
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def split(payload: str, files: dict, chunk: int) -> dict:
    for name in os.listdir(OUT):
        if name.startswith("part"):
            shutil.rmtree(os.path.join(OUT, name))
    chunks = []
    with open(payload, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data:
                break
            chunks.append({"name": f"payload.{len(chunks):02d}", "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
            part = os.path.join(OUT, f"part{len(chunks)}")
            os.makedirs(part)
            with open(os.path.join(part, chunks[-1]["name"]), "wb") as g:
                g.write(data)
    manifest = {"vllm": VLLM_VERSION, "python": PYTHON, "payload_sha256": sha256_file(payload),
                "payload_bytes": os.path.getsize(payload), "chunks": chunks, "files": files}
    for i in range(len(chunks)):
        with open(os.path.join(OUT, f"part{i + 1}", "manifest.json"), "w") as g:
            json.dump(manifest, g, indent=1)
    return manifest


def plan() -> None:
    parts = sorted((p for p in os.listdir(OUT) if p.startswith("part")), key=lambda p: int(p[4:]))
    if not parts:
        raise SystemExit("vllm_gpu_pack: no parts in .vllm_gpu/: run `python3 scripts/vllm_gpu_pack.py` first")
    tree = tree_bytes()
    print(f"working tree {tree / 2**20:.1f} MiB; {len(parts)} device calls, one warm machine:")
    for i, p in enumerate(parts):
        size = sum(os.path.getsize(os.path.join(OUT, p, f)) for f in os.listdir(os.path.join(OUT, p)))
        over = "  OVER THE 64 MiB OF A CALL: pack again" if tree + size > CALL_LIMIT else ""
        last = " && python3 scripts/vllm_gpu_install.py assemble" if i == len(parts) - 1 else ""
        print(f"  carry [\".vllm_gpu/{p}\"] ({(tree + size) / 2**20:.1f} MiB): "
              f"python3 scripts/vllm_gpu_install.py stash .vllm_gpu/{p}{last}{over}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="only print the device calls of the parts there are")
    ap.add_argument("--chunk-mib", type=float, default=None,
                    help="bytes a part holds (default: 64 MiB less the working tree and a 3 MiB margin)")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if a.plan:
        return plan()
    cache = os.path.join(OUT, "cache")
    os.makedirs(cache, exist_ok=True)
    wheel = download_vllm(cache)
    wheel_paths = download_requirements(wheel, cache)
    print(f"{len(wheel_paths)} requirement wheels, "
          f"{sum(map(os.path.getsize, wheel_paths)) / 2**20:.1f} MiB", flush=True)
    payload, files = build_payload(wheel, wheel_paths, cache)
    chunk = int(a.chunk_mib * 2**20) if a.chunk_mib else CALL_LIMIT - tree_bytes() - MARGIN
    if chunk < 8 * 2**20:
        raise SystemExit(f"vllm_gpu_pack: the working tree leaves {chunk / 2**20:.1f} MiB of a call's "
                         "64 MiB: make it smaller (ignored build outputs do not travel)")
    manifest = split(payload, files, chunk)
    print(f"payload {manifest['payload_bytes'] / 2**20:.1f} MiB in {len(manifest['chunks'])} parts")
    plan()


if __name__ == "__main__":
    main()
