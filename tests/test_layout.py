import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm_megamoe import BufferLayout, MoEShape
from vllm_megamoe.layout import ALIGN_BYTES, NVL_ARRIVED_RANKS, WORKSPACE_INTS, WORKSPACE_SLOTS


@st.composite
def layouts(draw):
    ranks = draw(st.sampled_from([1, 2, 3, 4, 8, 72]))
    el = draw(st.integers(1, 9))
    shape = MoEShape(hidden=128 * draw(st.integers(1, 56)), intermediate=128 * draw(st.integers(1, 24)),
                     num_experts=ranks * el, topk=draw(st.integers(1, min(8, ranks * el))))
    return BufferLayout(shape, ranks, draw(st.integers(1, 5000)),
                        draw(st.sampled_from(["fp8-block", "bf16"])),
                        shared_expert=draw(st.booleans()),
                        ring_rows=draw(st.one_of(st.none(), st.integers(1, 10000))))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_regions_aligned_disjoint_and_sized(lay):
    regs = sorted(lay.regions.values(), key=lambda r: r.offset)
    end = 0
    for reg in regs:
        assert reg.offset % ALIGN_BYTES == 0, reg
        assert reg.offset >= end, f"{reg.name} overlaps the region before it"
        end = reg.offset + reg.nbytes
    assert end <= lay.total_bytes and lay.total_bytes % ALIGN_BYTES == 0
    s, t = lay.shape, lay.tokens
    assert t >= lay.max_tokens_per_rank and t % 8 == 0
    assert lay.region("combine").shape == (s.topk + lay.shared_expert, t, s.hidden)
    assert lay.region("expert_recv_count").shape == (lay.num_ranks, s.num_experts // lay.num_ranks)
    assert lay.staging_rows <= max(lay.max_received_pairs, 8)
    if lay.ring_rows is not None:
        assert lay.staging_rows <= lay.ring_rows + 7
    x = lay.region("x")
    assert x.dtype == (torch.float8_e4m3fn if lay.format == "fp8-block" else torch.bfloat16)
    # staging scale rows: one float per 128 values, padded to whole 16-byte groups of 4 (the SM90
    # kernel copies them 16 bytes at a time); the pitch the kernel is compiled with is the region's
    defines = lay.c_defines()
    for region, n, define in (("staging_l1_scale", s.hidden, "MEGAMOE_L1_SCALE_PITCH"),
                              ("staging_l2_scale", s.intermediate, "MEGAMOE_L2_SCALE_PITCH")):
        pitch = defines[define]
        assert pitch % 4 == 0 and n // 128 <= pitch < n // 128 + 4
        want = (lay.staging_rows, pitch) if lay.format == "fp8-block" else (0,)
        assert lay.region(region).shape == want


def test_views_and_header():
    lay = BufferLayout(MoEShape(256, 128, 8, 2), 2, 30)
    buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    x = lay.view(buf, "x")
    assert x.shape == (32, 256) and x.dtype == torch.float8_e4m3fn
    x.view(torch.uint8).fill_(7)
    off = lay.region("x").offset
    assert buf[off:off + 32 * 256].eq(7).all() and buf[:off].eq(0).all()
    hdr = lay.c_header()
    for reg in lay.regions.values():
        assert f"constexpr uint64_t kOffset_{reg.name} = {reg.offset}ull;" in hdr
    assert f"constexpr uint32_t kSlot_num_tokens = {WORKSPACE_SLOTS.index('num_tokens')};" in hdr
    assert "kMaxTokens = 32;" in hdr
    assert "kL1ScalePitch = 4;" in hdr and "kL2ScalePitch = 4;" in hdr  # 2 and 1 scales, padded to 16 bytes
    with pytest.raises(ValueError, match="unknown buffer region"):
        lay.view(buf, "nope")
    with pytest.raises(ValueError, match="bytes, layout needs"):
        lay.view(buf[:100], "x")


def test_nvlink_arrival_slots_are_one_block_per_barrier():
    """The SM90 kernel addresses nvl_arrived_<barrier>_<rank> as first slot + barrier * ranks + rank
    (csrc/sm90/mega/config.cuh derives the stride from the slots), so they must be consecutive,
    barrier-major, one per rank the kernel supports, and fit the workspace."""
    first = WORKSPACE_SLOTS.index("nvl_arrived_0_0")
    for b in range(2):
        for r in range(NVL_ARRIVED_RANKS):
            assert WORKSPACE_SLOTS.index(f"nvl_arrived_{b}_{r}") == first + b * NVL_ARRIVED_RANKS + r
    named = [s for s in WORKSPACE_SLOTS if s is not None]
    assert len(named) == len(set(named)) and len(WORKSPACE_SLOTS) <= WORKSPACE_INTS
    from vllm_megamoe.kernels import sm90_mega_moe
    assert sm90_mega_moe.MAX_RANKS == NVL_ARRIVED_RANKS


def test_phase_counts_have_a_cache_line_each():
    """Every CTA adds to pulled_warps and l1_tiles_done while others load the task counters: each
    count sits alone on its 128-byte line, the padding is unnamed (no define, no slot lookup), and
    the workspace region is 128-byte aligned so that slot lines are cache lines."""
    lay = BufferLayout(MoEShape(256, 128, 8, 2), 2, 30)
    assert lay.region("workspace").offset % ALIGN_BYTES == 0
    assert lay.region("workspace").shape == (WORKSPACE_INTS,)
    line = lambda i: i * 4 // ALIGN_BYTES
    for name in ("pulled_warps", "l1_tiles_done"):
        i = lay.workspace_slot(name)
        mates = [s for j, s in enumerate(WORKSPACE_SLOTS) if s is not None and j != i and line(j) == line(i)]
        assert mates == [], f"{name} shares its line with {mates}"
    defines = lay.c_defines()
    assert defines["MEGAMOE_SLOT_pulled_warps"] == lay.workspace_slot("pulled_warps")
    assert not any("None" in k for k in defines) and "kSlot_None" not in lay.c_header()
    with pytest.raises(ValueError, match="unknown workspace slot"):
        lay.workspace_slot(None)


def test_memory_grows_as_documented():
    base = BufferLayout(MoEShape(1024, 512, 16, 4), 2, 1024)
    double_t = BufferLayout(MoEShape(1024, 512, 16, 4), 2, 2048)
    ring = BufferLayout(MoEShape(1024, 512, 16, 4), 2, 2048, ring_rows=512)
    assert 1.9 < double_t.total_bytes / base.total_bytes < 2.1
    assert ring.total_bytes < double_t.total_bytes
    assert ring.region("staging_l1").shape[0] == 512


@pytest.mark.parametrize("kwargs,match", [
    (dict(shape=MoEShape(100, 128, 8, 2)), "hidden=100"),
    (dict(shape=MoEShape(128, 96, 8, 2)), "intermediate=96"),
    (dict(shape=MoEShape(128, 128, 9, 2)), "divisible by num_ranks"),
    (dict(shape=MoEShape(128, 128, 64, 33)), "topk=33"),
    (dict(shape=MoEShape(128, 128, 2, 4), num_ranks=1), "must not exceed num_experts"),
    (dict(shape=MoEShape(128, 128, 146, 2), num_ranks=73), "num_ranks=73"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank=0"),
    (dict(format="fp4"), "format='fp4'"),
    (dict(shape=MoEShape(256.0, 128, 8, 2)), "hidden=256.0 must be an integer"),
    (dict(shape=MoEShape(128, 128, 8, True)), "topk=True must be an integer"),
    (dict(max_tokens_per_rank=1.5), "max_tokens_per_rank=1.5 must be an integer"),
    (dict(max_tokens_per_rank="16"), "max_tokens_per_rank='16' must be an integer"),
])
def test_layout_bad_input(kwargs, match):
    args = dict(shape=MoEShape(128, 128, 8, 2), num_ranks=2, max_tokens_per_rank=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BufferLayout(**args)


def test_numpy_integers_are_sizes_too():
    import numpy as np
    lay = BufferLayout(MoEShape(np.int64(128), 128, 8, 2), 2, np.int32(16))
    assert lay.total_bytes == BufferLayout(MoEShape(128, 128, 8, 2), 2, 16).total_bytes
