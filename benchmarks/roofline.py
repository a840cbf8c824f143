"""Roofline arithmetic of one expert-parallel MoE call (pure: no GPU, unit-tested on CPU).

Per rank r, from the routing of every rank:
- pairs received P_r: (token, top-k slot) pairs, from any rank, routed to experts r owns;
- experts touched E_r: local experts that receive at least one pair;
- remote pairs in / out: pairs r receives from other ranks / sends to experts of other ranks.

Bytes and FLOPs of rank r (format "fp8-block" or "bf16"; a = bytes per activation element:
1 for FP8 plus one float32 scale per 128 channels, 2 for BF16):
- HBM bytes   = E_r * expert weight bytes                     (gate+up [2I, H] and down [H, I])
              + P_r * (H*a  + I*a + I*a + H*2)                (L1 input read, L1 output written,
                                                               L2 input read, BF16 output written)
- FLOPs       = 2 * P_r * H * I * 3                          (L1 is 2I x H, L2 is H x I)
- NVLink bytes = max(bytes into r, bytes out of r), full duplex, where
      into r = remote pairs in  * H*a  (token rows r pulls) + remote pairs out * H*2 (results back)
      out of r = remote pairs out * H*a                        + remote pairs in * H*2
Roofline time of rank r = max(HBM bytes / HBM bandwidth, FLOPs / GEMM ceiling of the format,
NVLink bytes / NVLink bandwidth); a call ends when its slowest rank ends, so the case's roofline
is the maximum over ranks ("critical rank"), and achieved TFLOPS and GB/s are that rank's
FLOPs and HBM bytes over the measured time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

FORMATS = ("fp8-block", "bf16")
SCALE_GROUP = 128  # FP8 activations: one float32 scale per 128 channels; weights per 128x128


@dataclass(frozen=True)
class Shape:
    """Sizes of one MoE layer (global: num_experts counts every rank's experts)."""

    hidden: int
    intermediate: int
    num_experts: int
    topk: int


@dataclass(frozen=True)
class Ceilings:
    """Measured (or assumed) limits of one GPU, in bytes/s and FLOP/s."""

    hbm_bytes_per_s: float
    fp8_flops_per_s: float
    bf16_flops_per_s: float
    nvlink_bytes_per_s: Optional[float] = None  # None: one rank, no cross-rank traffic
    source: str = ""

    def gemm_flops_per_s(self, fmt: str) -> float:
        _check_format(fmt)
        return self.fp8_flops_per_s if fmt == "fp8-block" else self.bf16_flops_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        keys = ("hbm_bytes_per_s", "fp8_flops_per_s", "bf16_flops_per_s", "nvlink_bytes_per_s",
                "source")
        return cls(**{k: d[k] for k in keys if k in d})


# H200 SXM figures measured with torch 2.11 (shared/reference/anchors.md): a device copy
# 4.19 TB/s, rowwise FP8 _scaled_mm 8192^3 1339 TFLOPS, BF16 matmul 8192^3 767 TFLOPS,
# NVLink peer copy ~380 GB/s per direction on a 2xH200 (NV18) machine.
H200_ANCHORS = Ceilings(4.19e12, 1339e12, 767e12, 380e9, "anchors.md (H200, torch 2.11)")


@dataclass(frozen=True)
class RankTraffic:
    """What one rank receives and sends in one call (floats allowed: expected values)."""

    pairs_received: float
    experts_touched: float
    remote_pairs_in: float
    remote_pairs_out: float

    def to_dict(self) -> dict:
        return asdict(self)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {FORMATS}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def activation_bytes_per_row(width: int, fmt: str) -> float:
    """Bytes of one activation row of `width` channels in `fmt` (FP8 rows carry their scales)."""
    _check_format(fmt)
    if fmt == "bf16":
        return 2.0 * width
    return float(width + 4 * _ceil_div(width, SCALE_GROUP))


def expert_weight_bytes(shape: Shape, fmt: str) -> float:
    """Bytes of one expert's weights: w13 [2I, H] and w2 [H, I] (+ 128x128 float32 block scales)."""
    _check_format(fmt)
    h, i = shape.hidden, shape.intermediate
    elements = 3 * h * i
    if fmt == "bf16":
        return 2.0 * elements
    scales = (_ceil_div(2 * i, SCALE_GROUP) * _ceil_div(h, SCALE_GROUP)
              + _ceil_div(h, SCALE_GROUP) * _ceil_div(i, SCALE_GROUP))
    return float(elements + 4 * scales)


def rank_bytes_and_flops(shape: Shape, fmt: str, t: RankTraffic) -> dict:
    h, i = shape.hidden, shape.intermediate
    act_h, act_i = activation_bytes_per_row(h, fmt), activation_bytes_per_row(i, fmt)
    weight = t.experts_touched * expert_weight_bytes(shape, fmt)
    activations = t.pairs_received * (act_h + 2 * act_i + 2.0 * h)
    into = t.remote_pairs_in * act_h + t.remote_pairs_out * 2.0 * h
    out_of = t.remote_pairs_out * act_h + t.remote_pairs_in * 2.0 * h
    return dict(weight_bytes=weight, activation_bytes=activations, hbm_bytes=weight + activations,
                flops=2.0 * t.pairs_received * h * i * 3, nvlink_bytes=max(into, out_of))


def rank_roofline(shape: Shape, fmt: str, traffic: RankTraffic, ceilings: Ceilings) -> dict:
    """Bytes, FLOPs and the three time floors (us) of one rank; `bound` names the largest."""
    r = rank_bytes_and_flops(shape, fmt, traffic)
    floors = {"hbm": r["hbm_bytes"] / ceilings.hbm_bytes_per_s * 1e6,
              "gemm": r["flops"] / ceilings.gemm_flops_per_s(fmt) * 1e6,
              "nvlink": 0.0}
    if r["nvlink_bytes"] > 0:
        if not ceilings.nvlink_bytes_per_s:
            raise ValueError("cross-rank traffic but no NVLink bandwidth in the ceilings")
        floors["nvlink"] = r["nvlink_bytes"] / ceilings.nvlink_bytes_per_s * 1e6
    bound = max(floors, key=floors.get)
    r.update({f"{k}_us": v for k, v in floors.items()}, roofline_us=floors[bound], bound=bound)
    return r


def case_roofline(shape: Shape, fmt: str, traffic: Sequence[RankTraffic], ceilings: Ceilings) -> dict:
    """The critical (slowest-bound) rank's roofline, plus which rank that is."""
    if not traffic:
        raise ValueError("no ranks")
    per_rank = [rank_roofline(shape, fmt, t, ceilings) for t in traffic]
    crit = max(range(len(per_rank)), key=lambda r: per_rank[r]["roofline_us"])
    return dict(per_rank[crit], critical_rank=crit)


def mean_roofline(shape: Shape, fmt: str, traffic_sets: Sequence[Sequence[RankTraffic]],
                  ceilings: Ceilings) -> dict:
    """Average of case_roofline over the rotating input sets (numbers averaged, bound by vote)."""
    cases = [case_roofline(shape, fmt, t, ceilings) for t in traffic_sets]
    if not cases:
        raise ValueError("no input sets")
    out = {}
    for k, v in cases[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "critical_rank":
            out[k] = sum(c[k] for c in cases) / len(cases)
    bounds = [c["bound"] for c in cases]
    out["bound"] = max(set(bounds), key=bounds.count)
    out["critical_rank"] = cases[0]["critical_rank"]
    return out


def achieved(roof: dict, time_us: Optional[float]) -> dict:
    """TFLOPS, HBM GB/s and fraction of roofline reached by a measured time (us)."""
    if not time_us or time_us <= 0:
        return dict(tflops=None, hbm_gbps=None, fraction=None)
    return dict(tflops=roof["flops"] / time_us / 1e6, hbm_gbps=roof["hbm_bytes"] / time_us / 1e3,
                fraction=roof["roofline_us"] / time_us)


# -- traffic from routing ----------------------------------------------------------------------
def routing_traffic(topk_per_rank: Sequence, num_experts: int) -> list[RankTraffic]:
    """Exact traffic of every rank from every rank's top-k ids ([T_r, K] ints, -1 = masked).

    Accepts torch tensors (any device) or nested lists. Expert e lives on rank e // (E / R).
    """
    import torch

    world = len(topk_per_rank)
    if world == 0 or num_experts % world:
        raise ValueError(f"num_experts={num_experts} must split evenly over {world} ranks")
    el = num_experts // world
    received = torch.zeros(world, world, dtype=torch.int64)   # [src, dst]
    touched = torch.zeros(num_experts, dtype=torch.bool)
    for src, idx in enumerate(topk_per_rank):
        ids = torch.as_tensor(idx).reshape(-1).to("cpu", torch.int64)
        ids = ids[ids >= 0]
        if ids.numel() and int(ids.max()) >= num_experts:
            raise ValueError(f"expert id {int(ids.max())} out of range [0, {num_experts})")
        received[src] += torch.bincount(ids // el, minlength=world)
        touched[ids] = True
    out = []
    for r in range(world):
        remote_in = int(received[:, r].sum() - received[r, r])
        remote_out = int(received[r, :].sum() - received[r, r])
        out.append(RankTraffic(pairs_received=int(received[:, r].sum()),
                               experts_touched=int(touched[r * el:(r + 1) * el].sum()),
                               remote_pairs_in=remote_in, remote_pairs_out=remote_out))
    return out


def expected_traffic_uniform(shape: Shape, tokens_per_rank: int, world: int) -> list[RankTraffic]:
    """Expected traffic per rank for uniform top-k routing without repeats (same on every rank).

    A token picks K distinct experts of E: a given expert is missed with probability 1 - K/E, so
    it is touched by none of the R*T tokens with probability (1 - K/E)^(R*T).
    """
    e, k, t = shape.num_experts, shape.topk, tokens_per_rank
    if world <= 0 or e % world:
        raise ValueError(f"num_experts={e} must split evenly over {world} ranks")
    el = e // world
    per_source = t * k / world               # pairs one rank sends to each rank (itself too)
    touched = el * (1.0 - (1.0 - k / e) ** (world * t))
    remote = per_source * (world - 1)
    return [RankTraffic(pairs_received=per_source * world, experts_touched=touched,
                        remote_pairs_in=remote, remote_pairs_out=remote) for _ in range(world)]
