"""The sha256 check of a converted checkpoint at load (issue 53): the plugin's load_weights wrapper
(vllm_megamoe/plugin/converted.py) hashes the shards vLLM reads, while it reads them, and refuses a
shard that does not match its index; VLLM_MEGAMOE_VERIFY_CHECKPOINT=0 skips it. Run here around a
stand-in for vLLM's DefaultModelLoader (no vLLM needed); tests/plugin/test_vllm_converted.py runs
the same through vLLM."""
from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from convert_checkpoints import make_checkpoint
from vllm_megamoe.convert import convert_checkpoint
from vllm_megamoe.plugin import converted, runtime

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("checksums")
    src = str(root / "src")
    make_checkpoint(src, "qwen", layers=3, shards=2)
    dst = str(root / "dst")
    convert_checkpoint(src, dst, arch="sm90", fmt="bf16", max_shard_bytes=300_000, log=lambda m: None)
    return dst


@pytest.fixture
def fresh_settings(monkeypatch):
    monkeypatch.delenv("VLLM_MEGAMOE_VERIFY_CHECKPOINT", raising=False)
    runtime.STATE.settings = None
    yield monkeypatch
    runtime.STATE.settings = None


@pytest.fixture
def log_lines(caplog):
    logger = logging.getLogger("vllm.plugins.megamoe")  # vLLM's logging config may not propagate it
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="vllm.plugins.megamoe")
    yield caplog
    logger.removeHandler(caplog.handler)


def shards(folder: str) -> list:
    with open(os.path.join(folder, INDEX)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


class FakeModelLoader:
    """The two methods of vLLM's DefaultModelLoader the wrapper relies on."""

    def __init__(self, folder: str, files=None, events=None):
        self.folder, self.files = folder, files
        self.events = [] if events is None else events

    def _prepare_weights(self, *args, **kwargs):
        files = [os.path.join(self.folder, f) for f in (self.files or shards(self.folder))]
        return self.folder, files, True, INDEX

    def load_weights(self, model, model_config):  # the original: resolve the files, read them
        _, files, _, _ = self._prepare_weights(model_config.model, None, None, True, None)
        self.events.append("vLLM reads")
        for path in files:
            with open(path, "rb") as f:
                f.read()
        model.load_weights(iter(()))


class Model(torch.nn.Module):
    def load_weights(self, weights):
        return {name for name, _ in weights}


def load(folder: str, loader=None):
    with open(os.path.join(folder, "config.json")) as f:
        marker = json.load(f)["megamoe"]
    model_config = SimpleNamespace(model=folder, hf_config=SimpleNamespace(megamoe=marker))
    loader = loader or FakeModelLoader(folder)
    converted.wrap_load_weights(type(loader).load_weights)(loader, Model(), model_config)
    return loader


def flipped_copy(src: str, dst: str, shard: str) -> str:
    import shutil
    shutil.copytree(src, dst)
    path = os.path.join(dst, shard)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    return dst


def test_intact_checkpoint_loads_after_a_streamed_check(checkpoint, fresh_settings, log_lines, monkeypatch):
    events = []
    start = converted.ShardChecksums.start
    monkeypatch.setattr(converted.ShardChecksums, "start", lambda self: events.append("hashing starts") or start(self))
    load(checkpoint, FakeModelLoader(checkpoint, events=events))
    assert events == ["hashing starts", "vLLM reads"]  # streamed beside vLLM's reading, not after it
    n = len(shards(checkpoint))
    assert n >= 3
    assert f"megamoe: sha256 of the {n} shard(s) of the converted checkpoint match its index" in log_lines.text


def test_a_flipped_byte_refuses_the_load(checkpoint, tmp_path, fresh_settings, log_lines):
    bad = shards(checkpoint)[1]
    folder = flipped_copy(checkpoint, str(tmp_path / "bad"), bad)
    with pytest.raises(ValueError) as info:
        load(folder)
    message = str(info.value)
    assert message.startswith(f"megamoe: the converted checkpoint {folder} does not match the sha256 checksums of "
                              f"its index, so it is not loaded: {bad}: sha256 mismatch (index has ")
    assert message.endswith(f"the shard is corrupt or was modified; convert again. `vllm-megamoe verify {folder}` "
                            "checks it without vLLM; VLLM_MEGAMOE_VERIFY_CHECKPOINT=0 loads it unchecked")
    # a loader without _prepare_weights: the model directory is checked after the load instead
    class Plain:
        def load_weights(self, model, model_config):
            model.load_weights(iter(()))

    with pytest.raises(ValueError, match=f"{bad}: sha256 mismatch"):
        load(folder, Plain())
    # every shard of the index is checked, also one this worker's loader does not read (with
    # pipeline parallelism each worker reads its own; the split over workers is the index's)
    others = [s for s in shards(folder) if s != bad]
    with pytest.raises(ValueError, match=f"{bad}: sha256 mismatch"):
        load(folder, FakeModelLoader(folder, files=others))
    # the setting skips the check, and says so
    fresh_settings.setenv("VLLM_MEGAMOE_VERIFY_CHECKPOINT", "0")
    runtime.STATE.settings = None
    load(folder)
    assert ("VLLM_MEGAMOE_VERIFY_CHECKPOINT=0: loading the converted checkpoint without checking the sha256 "
            "checksums of its shards") in log_lines.text


def test_an_index_without_checksums_is_refused(checkpoint, tmp_path, fresh_settings):
    import shutil
    folder = str(tmp_path / "nosums")
    shutil.copytree(checkpoint, folder)
    with open(os.path.join(folder, INDEX)) as f:
        index = json.load(f)
    del index["megamoe"]["sha256"]
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=f"{INDEX} has no megamoe sha256 checksums"):
        load(folder)


def test_workers_split_the_hashing():
    sizes = {"a": 50, "b": 40, "c": 30, "d": 20, "e": 10}
    shares = converted.assign_shards(sizes, 2)
    assert shares == [["a", "d", "e"], ["b", "c"]]
    assert converted.assign_shards(sizes, 1) == [["a", "b", "c", "d", "e"]]
    assert converted.assign_shards({"a": 5}, 3) == [["a"], [], []]
