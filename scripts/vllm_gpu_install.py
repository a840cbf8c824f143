#!/usr/bin/env python3
"""Install vLLM on a GPU machine from the parts scripts/vllm_gpu_pack.py made (stdlib + pip only).

    python3 scripts/vllm_gpu_install.py stash .vllm_gpu/partN   # one call a part: checks, keeps it
    python3 scripts/vllm_gpu_install.py assemble                # once every part is stashed
    python3 scripts/vllm_gpu_install.py status                  # what is stashed, what is missing
    source /tmp/megamoe-vllm/env.sh                             # then: python3 -c "import vllm"

Parts are kept under MEGAMOE_VLLM_HOME (default /tmp/megamoe-vllm), outside the working tree, so
they outlive the call while the machine stays warm. `assemble` joins them and checks the sha256 of
every chunk, of the joined payload and of every file in it, and every vLLM file against the wheel's
RECORD; installs vLLM's code and extensions and the carried wheels the machine lacks (a wheel whose
distribution is already installed at a version vLLM accepts is skipped) into HOME/site; registers
this checkout's vllm_megamoe as an installed distribution there (its vLLM plugin entry point), and
ends with `import vllm` and the plugin's entry point found. Any missing or damaged part is an error
that names it. It is idempotent: a second `assemble` of the same payload only re-checks the import.
"""
from __future__ import annotations

import base64
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_gpu_pack import norm, sha256_file  # noqa: E402  (stdlib only, like this script)
HOME = os.environ.get("MEGAMOE_VLLM_HOME", "/tmp/megamoe-vllm")
CHUNKS = os.path.join(HOME, "chunks")
SITE = os.path.join(HOME, "site")
# vLLM pins these to versions the machines do not have; the image's own are used on purpose
# (the extensions use libtorch's stable ABI; see docs/vllm-on-gpu.md).
ACCEPTED_MISMATCHES = {"torch", "torchaudio", "torchvision", "triton"}


class InstallError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"vllm_gpu_install: {message}")


def load_manifest(where: str) -> dict:
    path = os.path.join(where, "manifest.json")
    if not os.path.exists(path):
        raise InstallError(f"no manifest.json in {where}: carry a part made by scripts/vllm_gpu_pack.py")
    with open(path) as f:
        return json.load(f)


def stash(part: str) -> None:
    manifest = load_manifest(part)
    os.makedirs(CHUNKS, exist_ok=True)
    kept = os.path.join(CHUNKS, "manifest.json")
    if os.path.exists(kept) and load_manifest(CHUNKS)["payload_sha256"] != manifest["payload_sha256"]:
        # Parts of another packing: start over (only files this script wrote live here).
        for fn in os.listdir(CHUNKS):
            os.remove(os.path.join(CHUNKS, fn))
    shutil.copy(os.path.join(part, "manifest.json"), kept)
    by_name = {c["name"]: c for c in manifest["chunks"]}
    found = [fn for fn in os.listdir(part) if fn in by_name]
    if not found:
        raise InstallError(f"{part} holds no payload chunk of its manifest")
    for fn in found:
        digest = sha256_file(os.path.join(part, fn))
        if digest != by_name[fn]["sha256"]:
            raise InstallError(f"{part}/{fn} is damaged (sha256 {digest[:12]}, manifest "
                               f"{by_name[fn]['sha256'][:12]}): pack again and re-send that part")
        shutil.copy(os.path.join(part, fn), os.path.join(CHUNKS, fn + ".partial"))
        os.replace(os.path.join(CHUNKS, fn + ".partial"), os.path.join(CHUNKS, fn))
        print(f"stashed {fn} ({by_name[fn]['bytes'] / 2**20:.1f} MiB, sha256 ok)")
    status()


def missing_chunks(manifest: dict) -> list[str]:
    return [c["name"] for c in manifest["chunks"]
            if not os.path.exists(os.path.join(CHUNKS, c["name"]))]


def status() -> None:
    if not os.path.exists(os.path.join(CHUNKS, "manifest.json")):
        print(f"nothing stashed in {CHUNKS}")
        return
    manifest = load_manifest(CHUNKS)
    missing = missing_chunks(manifest)
    have = len(manifest["chunks"]) - len(missing)
    print(f"{have}/{len(manifest['chunks'])} parts stashed"
          + (f"; missing: {', '.join(missing)} (parts {', '.join(str(int(m[-2:]) + 1) for m in missing)})"
             if missing else "; ready to assemble"))


def record_hashes(dist_info: str) -> dict:
    """path -> sha256 hex from a wheel's RECORD."""
    out = {}
    with open(os.path.join(dist_info, "RECORD")) as f:
        for line in f:
            path, digest, _ = line.rstrip("\n").rsplit(",", 2)
            if digest.startswith("sha256="):
                raw = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
                out[path] = raw.hex()
    return out


def dist_version(name: str):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vllm_requirements(dist_info: str) -> dict:
    """normalised name -> specifier string of vLLM's unconditional requirements."""
    Requirement = _requirement_class()
    reqs = {}
    with open(os.path.join(dist_info, "METADATA")) as f:
        for line in f:
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    reqs[norm(req.name)] = req
    return reqs


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def _wheel_requirements(path: str) -> list:
    """Unconditional Requires-Dist of a wheel file."""
    import zipfile
    Requirement = _requirement_class()
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                reqs.append(req)
    return reqs


def install_wheels(wheels_dir: str, reqs: dict) -> None:
    """pip-install the carried wheels the machine lacks, or has at a version vLLM or another
    installed wheel refuses (e.g. pydantic pins pydantic-core exactly)."""
    wheels = {}
    for fn in sorted(os.listdir(wheels_dir)):
        name, version = fn.split("-")[:2]
        wheels[norm(name)] = (os.path.join(wheels_dir, fn), version)

    def accepted(name: str, have, req) -> bool:
        return have is not None and (req is None or req.specifier.contains(have, prereleases=True))

    todo = {n for n in wheels if not accepted(n, dist_version(n), reqs.get(n))}
    grew = True
    while grew:  # a wheel to install may need a newer version of one the machine has
        grew = False
        for n in sorted(todo):
            for req in _wheel_requirements(wheels[n][0]):
                dep = norm(req.name)
                if dep in wheels and dep not in todo and not accepted(dep, dist_version(dep), req):
                    todo.add(dep)
                    grew = True
    skipped = [f"{n} {dist_version(n)}" for n in sorted(wheels) if n not in todo]
    print(f"wheels: {len(todo)} to install, {len(skipped)} already on the machine "
          f"({', '.join(skipped) or 'none'})", flush=True)
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE,
                        *[wheels[n][0] for n in sorted(todo)]], check=True)


def register_megamoe() -> None:
    """A dist-info for this checkout's vllm_megamoe (imported from the working tree, ROOT on
    PYTHONPATH), so vLLM's plugin loader finds its `vllm.general_plugins` entry point."""
    info = os.path.join(SITE, "vllm_megamoe-0.1.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm-megamoe\nVersion: 0.1.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[console_scripts]\nvllm-megamoe = vllm_megamoe.cli:main\n\n"
                "[vllm.general_plugins]\nmegamoe = vllm_megamoe.plugin:register\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("")


def write_env() -> str:
    env = os.path.join(HOME, "env.sh")
    with open(env, "w") as f:
        f.write(f'export PYTHONPATH="{ROOT}:{SITE}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                f'export PATH="{SITE}/bin:$PATH"\n'
                # vLLM's own defaults, restated: no usage reports (no network there), and the
                # NVLink-multicast switches the GPU machines require.
                "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1\n"
                "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1\n")
    return env


def check_import(env_file: str) -> None:
    code = ("import torch, vllm, vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch\n"
            "from importlib.metadata import entry_points\n"
            "eps = [e.value for e in entry_points(group='vllm.general_plugins')]\n"
            "assert 'vllm_megamoe.plugin:register' in eps, eps\n"
            "print('import vllm', vllm.__version__, 'with torch', torch.__version__, '; plugins', eps)\n")
    proc = subprocess.run(["bash", "-c", f'source "{env_file}" && "{sys.executable}" -c "$0"', code],
                          capture_output=True, text=True)
    print(proc.stdout.strip())
    if proc.returncode:
        raise InstallError(f"the installed vLLM does not import:\n{proc.stderr[-3000:]}")


def assemble() -> None:
    manifest = load_manifest(CHUNKS) if os.path.exists(os.path.join(CHUNKS, "manifest.json")) else None
    if manifest is None:
        raise InstallError(f"nothing stashed in {CHUNKS}: run `stash .vllm_gpu/partN` for each part first")
    missing = missing_chunks(manifest)
    if missing:
        raise InstallError(f"parts missing: {', '.join(missing)}; stash them first (status lists them)")
    stamp = os.path.join(SITE, ".megamoe-payload")
    env_file = write_env()
    if os.path.exists(stamp) and open(stamp).read() == manifest["payload_sha256"]:
        print(f"vLLM {manifest['vllm']} already installed in {SITE} from this payload")
        register_megamoe()
        check_import(env_file)
        return
    payload = os.path.join(HOME, "payload.tar")
    h = hashlib.sha256()
    with open(payload, "wb") as out:
        for c in manifest["chunks"]:
            with open(os.path.join(CHUNKS, c["name"]), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != c["sha256"]:
                raise InstallError(f"stashed chunk {c['name']} is damaged: stash its part again")
            h.update(data)
            out.write(data)
    if h.hexdigest() != manifest["payload_sha256"]:
        raise InstallError("the joined payload's sha256 differs from the manifest's: pack again")
    stage = os.path.join(HOME, "stage")
    shutil.rmtree(stage, ignore_errors=True)
    with tarfile.open(payload) as t:
        t.extractall(stage, filter="data")
    for rel, digest in manifest["files"].items():
        path = os.path.join(stage, rel)
        if not os.path.exists(path) or sha256_file(path) != digest:
            raise InstallError(f"payload member {rel} is missing or damaged")
    shutil.rmtree(SITE, ignore_errors=True)
    os.makedirs(SITE)
    with tarfile.open(os.path.join(stage, "vllm-code.tar.xz")) as t:
        t.extractall(SITE, filter="data")
    with open(os.path.join(stage, "extensions.json")) as f:
        extensions = json.load(f)
    for name, rel in extensions.items():
        with lzma.open(os.path.join(stage, "ext", name)) as src, open(os.path.join(SITE, rel), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        os.chmod(os.path.join(SITE, rel), 0o755)
    dist_info = os.path.join(SITE, f"vllm-{manifest['vllm']}.dist-info")
    expected = record_hashes(dist_info)
    checked = 0
    for rel in list(extensions.values()) + [p for p in expected if p.endswith(".py")]:
        path = os.path.join(SITE, rel)
        if rel not in expected:
            continue
        if sha256_file(path) != expected[rel]:
            raise InstallError(f"{rel} differs from the vLLM wheel's RECORD")
        checked += 1
    print(f"vLLM {manifest['vllm']}: {checked} files match the wheel's RECORD "
          f"({len(extensions)} extensions)", flush=True)
    install_wheels(os.path.join(stage, "wheels"), vllm_requirements(dist_info))
    register_megamoe()
    unmet = []
    for name, req in vllm_requirements(dist_info).items():
        have = _version_with(SITE, req.name)
        if name in ACCEPTED_MISMATCHES or (have and req.specifier.contains(have, prereleases=True)):
            continue
        unmet.append(f"{req} (have {have or 'none'})")
    if unmet:
        print("vLLM requirements not met (not carried; fine unless an import fails): "
              + "; ".join(unmet))
    shutil.rmtree(stage, ignore_errors=True)
    os.remove(payload)
    with open(stamp, "w") as f:
        f.write(manifest["payload_sha256"])
    check_import(env_file)
    print(f"installed: source {env_file}")


def _version_with(site: str, name: str):
    """Version of `name` seen with SITE first on the path (what env.sh gives)."""
    from importlib import metadata
    for dist in metadata.distributions(path=[site] + sys.path):
        if norm(dist.metadata["Name"] or "") == norm(name):
            return dist.version
    return None


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("stash", "assemble", "status"):
        raise SystemExit(__doc__)
    cmd = sys.argv[1]
    if cmd == "stash":
        if len(sys.argv) != 3:
            raise SystemExit("usage: vllm_gpu_install.py stash .vllm_gpu/partN")
        stash(sys.argv[2])
    elif cmd == "assemble":
        assemble()
    else:
        status()


if __name__ == "__main__":
    main()
