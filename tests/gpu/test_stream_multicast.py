"""The stream probe on a Hopper GPU (csrc/sm90/probe/stream_rate.cu): every chunk's boxes land
whole in every CTA that consumes them, alone and in 2-CTA clusters whose CTAs multicast half of
one box each (the checksum of each CTA's consumed words against the host's, from the tensors'
rows). A half multicast to one CTA only or a box at the wrong rows changes a CTA's checksum; a
missing arrival times out with a trap that names the wait."""
import pytest
import torch

from benchmarks import stream_probe as sp

pytestmark = pytest.mark.gpu


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (SM90) GPU")


@requires_sm90
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
@pytest.mark.parametrize("config", ["128:1:0", "128:2:0", "128:2:1", "128:2:2", "64:2:1", "32:2:2"])
def test_every_chunk_lands_whole(config, tiled):
    cfg = sp.parse_config(config)
    torch.manual_seed(0)
    row = sp.run(cfg, stages=3, chunks=5, tasks=7, tiles=6, blocks=4, checksum=True, tiled=tiled)
    assert row["checksum_ok"], f"{config}: a CTA consumed other bytes than its tasks' boxes"
    assert row["cycles_per_chunk"] > 0
