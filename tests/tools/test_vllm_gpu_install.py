"""scripts/vllm_gpu_pack.py's parts and scripts/vllm_gpu_install.py's checks, without a GPU: parts
stashed in any order; a missing part or a damaged chunk is an error that names it, before anything
is installed."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import vllm_gpu_pack as pack  # noqa: E402

INSTALL = os.path.join(ROOT, "scripts", "vllm_gpu_install.py")


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A small payload split into 3 parts the way the packer splits vLLM's."""
    payload = tmp_path / "payload.tar"
    member = tmp_path / "member.bin"
    member.write_bytes(os.urandom(300_000))
    with tarfile.open(payload, "w") as t:
        t.add(member, "member.bin")
    out = tmp_path / "parts"
    out.mkdir()
    monkeypatch.setattr(pack, "OUT", str(out))
    manifest = pack.split(str(payload), {"member.bin": pack.sha256_file(str(member))}, 120_000)
    assert len(manifest["chunks"]) == 3
    return out


def install(home, *args):
    env = dict(os.environ, MEGAMOE_VLLM_HOME=str(home))
    return subprocess.run([sys.executable, INSTALL, *args], capture_output=True, text=True, env=env)


def test_a_missing_part_is_named(parts, tmp_path):
    home = tmp_path / "home"
    assert install(home, "stash", str(parts / "part3")).returncode == 0
    done = install(home, "stash", str(parts / "part1"))
    assert done.returncode == 0 and "missing: payload.01 (parts 2)" in done.stdout, done.stdout
    done = install(home, "assemble")
    assert done.returncode != 0 and "parts missing: payload.01" in done.stderr, done.stderr
    assert not (home / "site").exists()


def test_a_damaged_chunk_is_refused_at_stash(parts, tmp_path):
    chunk = parts / "part2" / "payload.01"
    data = bytearray(chunk.read_bytes())
    data[1000] ^= 1
    chunk.write_bytes(bytes(data))
    done = install(tmp_path / "home", "stash", str(parts / "part2"))
    assert done.returncode != 0 and "part2/payload.01 is damaged" in done.stderr, done.stderr


def test_a_part_without_manifest_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    done = install(tmp_path / "home", "stash", str(tmp_path / "empty"))
    assert done.returncode != 0 and "no manifest.json" in done.stderr


def test_every_part_fits_one_call(parts):
    manifest = json.loads((parts / "part1" / "manifest.json").read_text())
    assert all(c["bytes"] <= 120_000 for c in manifest["chunks"])
    assert sum(c["bytes"] for c in manifest["chunks"]) == manifest["payload_bytes"]
