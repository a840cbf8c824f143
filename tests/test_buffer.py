"""SymmBuffer devices and lifetime (issue 53): a buffer made with device="cuda" serves the cuda:0
tensors of its calls, and a destroyed CPU buffer is not kept alive (with its peers' mappings) by
its exit hook until the process ends."""
import gc
import os
import subprocess
import sys
import weakref

import torch

from vllm_megamoe import MoEShape, SymmBuffer, buffer as buffer_module
from vllm_megamoe.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=4, topk=2)


def test_cuda_device_without_index_is_normalised(monkeypatch):
    """torch.device("cuda") != torch.device("cuda:0"): the buffer's device is always indexed (the
    current device), so the kernel's `buffer.device == x.device` check accepts cuda:0 tensors."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert buffer_module.normalize_device("cuda") == torch.device("cuda:0")
    assert buffer_module.normalize_device(torch.device("cuda", 1)) == torch.device("cuda:1")
    assert buffer_module.normalize_device("cpu:0") == torch.device("cpu")
    # no GPU here: the local buffer's allocation is stood in for on the CPU
    monkeypatch.setattr(SymmBuffer, "_create_local", lambda self: setattr(
        self, "_peer_buffers", [torch.zeros(self.layout.total_bytes, dtype=torch.uint8)]))
    for device in ("cuda", torch.device("cuda"), "cuda:0"):
        buf = SymmBuffer(SHAPE, 8, format="bf16", device=device)
        assert buf.device == torch.device("cuda:0") and buf.device.index == 0, device
        x_device = torch.device("cuda:0")  # what a cuda:0 tensor reports
        assert buf.device == x_device  # the check of kernels.sm90_mega_moe that refused it
    assert SymmBuffer(SHAPE, 8, format="bf16").device == torch.device("cpu")


def _buffers_are_freed(rank, world, group):
    freed = []
    for destroy in (True, False):
        buf = SymmBuffer(SHAPE, 8, group, format="bf16")
        assert buf.backend == "cpu"
        buf.view("x", rank=1 - rank)  # a peer's mapping in use
        ref = weakref.ref(buf)
        if destroy:
            buf.destroy()
        del buf
        gc.collect()
        freed.append(ref() is None)
    return freed


def test_cpu_buffers_are_not_kept_alive():
    """Its exit hook (which removes the buffer's file should a peer never map it) held every CPU
    buffer, and with it the peers' shared-memory mappings, until the process ended."""
    assert run_ranks(_buffers_are_freed, 2, timeout_s=120) == [[True, True], [True, True]]


SHUTDOWN_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
os.environ["VLLM_MEGAMOE_SHM_DIR"] = {shm!r}
from vllm_megamoe import MoEShape, SymmBuffer
from vllm_megamoe.launch import run_ranks

def main(rank, world, group):
    buf = SymmBuffer(MoEShape(256, 128, 4, 2), 8, group, format="bf16")
    return buf.backend   # exits without destroy(), as a server does

if __name__ == "__main__":
    print(run_ranks(main, 2, timeout_s=120))
"""


def test_cpu_buffer_shutdown_leaves_nothing_behind(tmp_path):
    """The 'leaked shared_memory objects' warning at vLLM's shutdown is vLLM's (its shm_broadcast
    message queues, with or without megamoe: docs/serving.md); the CPU SymmBuffer's files are not
    multiprocessing shared memory, are unlinked once every rank mapped them, and processes that
    exit without destroy() leave no file and no resource_tracker warning."""
    shm = tmp_path / "shm"
    shm.mkdir()
    script = tmp_path / "shutdown_probe.py"  # a file: spawned ranks import their function from it
    script.write_text(SHUTDOWN_SCRIPT.format(repo=REPO, shm=str(shm)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['cpu', 'cpu']"
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr
    assert os.listdir(shm) == []
