"""Which build of the fused SM90 kernel a call runs: pipeline stages and token tile (every build
runs the TMA mainloop: stages filled by TMA box copies on per-stage mbarriers, warpgroup MMA).

Three sources, strongest first:
1. the developer overrides, each replacing one field for every call (env_overrides, the only
   place that reads them): VLLM_MEGAMOE_SM90_STAGES (2-8), VLLM_MEGAMOE_SM90_TOKEN_TILE (32, 64,
   128 or auto), to force a build, e.g. for benchmarks.kernel_probe's `stages=` / `tile=` variants;
2. the tuning table, configs/sm90_mega_moe.yaml (shipped inside the package; another file with
   VLLM_MEGAMOE_SM90_TUNING): per layer shape, format and EP size, the measured best choice per
   bucket of tokens per rank (a tile of TILE_64_OR_128 where the probes did not time the 128-token
   build: the model below picks), written by `python -m benchmarks.tune_sm90` from kernel_probe runs
   (read once per process: the op consults it on every call). A layer without an entry at its EP
   size takes the tiles of the nearest EP size's entry, by expected rows per local expert, with the
   heuristic's depth (table_entry);
3. the heuristic: 4 stages, 64-token tiles from AUTO_TILE_ROWS_PER_EXPERT[fmt] expected rows per
   local expert, else 32; 128-token tiles where a padding-aware model prefers them (prefers_128).
Per call, too: whether the weight copies take an L2 evict-first policy (weights_evict_first_call; the
32-token builds compile it in, weights_evict_first_build), by tokens per rank and the layer's size.
Ranks with different token counts may pick different builds in one call: the protocol between
ranks does not depend on the build, and every build a layer may use is compiled before the first
call's rank alignment (`choices`).
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..shape import MoEShape, require
from .sm90_smem import fits

# The only mainloop: a tuning table that names another is refused (parse_table).
MAINLOOP = "tma"
TILES = (32, 64, 128)
# Tile "auto": 64 from this many expected rows per local expert, per format. FP8: 48 (its measured
# crossovers lie at 23-45 rows by layer: the EP2 table's entries hold them). BF16: 24 (one H100,
# EP1, docs/kernel_design.md: 64 over 32 took 0.987-0.995x the time at 24 rows in all three
# standard layers, 0.87-0.975x at 32-36, 1.001x at 18).
AUTO_TILE_ROWS_PER_EXPERT = {"fp8-block": 48, "bf16": 24}
# Tile "auto", 64 or 128 (from AUTO_TILE_ROWS_PER_EXPERT[fmt] rows): the one with fewer task-times per
# expert, with an expert's rows Poisson-distributed around the call's expected rows per local expert
# (uniform routing) and every block costing a whole task. Task times in units of a 64-token task,
# measured on one H200 at EP1 (kernel_probe task spans, docs/kernel_design.md, with the current
# epilogues): a 128-token task 1.5-1.6x (FP8 and BF16, full blocks), and ~1.25x when its block
# holds at most 64 rows (tasks of mostly such blocks: 1.35-1.43x). With these the model picks the
# measured side of every case of that probe that is not a tie (graph time 128 over 64, FP8 / BF16:
# 1.12 / 1.01 at 48 rows, 0.95-1.00 / 0.90-0.91 at 64, 0.87 / 0.84 at 96, 0.88-0.93 / 0.92-0.94 at
# 128, 0.98 / 0.97 at 192, 0.88-0.89 / 0.90-0.92 at 256, 0.86 / 0.88 at 512 rows per expert).
# Checked again in steady state once the padding token rows were zeroed (FP8 at 24-96 rows per
# expert, docs/kernel_design.md; the results are in git history at 63d314b): the model still picks
# the faster side or a tie.
# The EP2 table's FP8 entries predate the FP8 128-token build: their prefill buckets say
# TILE_64_OR_128 (below), so this model picks there too.
TILE_128_TASK_TIME = 1.6
TILE_128_HALF_TASK_TIME = 1.25  # a 128-token block of at most 64 rows


@functools.lru_cache(maxsize=4096)
def expected_task_times(rows_per_expert: float, tile: int) -> float:
    """E[task time] of an expert's token blocks (64 or 128 rows) in 64-token task units, its rows
    r ~ Poisson(rows_per_expert): ceil(r / 64) tasks of 1, or ceil(r / 128) tasks of
    TILE_128_TASK_TIME, the last one TILE_128_HALF_TASK_TIME when it holds at most 64 rows."""
    if tile not in (64, 128):
        raise ValueError(f"tile={tile}: the padding model compares 64- and 128-token tiles")
    if rows_per_expert <= 0:
        return 0.0
    log_rate, total = math.log(rows_per_expert), 0.0
    for n in range(1, int(rows_per_expert + 12 * math.sqrt(rows_per_expert)) + tile + 1):
        p = math.exp(n * log_rate - rows_per_expert - math.lgamma(n + 1))
        blocks = -(-n // tile)
        if tile == 64:
            total += p * blocks
        else:
            last_half = n - 128 * (blocks - 1) <= 64
            total += p * ((blocks - 1) * TILE_128_TASK_TIME
                          + (TILE_128_HALF_TASK_TIME if last_half else TILE_128_TASK_TIME))
    return total


def prefers_128(rows_per_expert: float) -> bool:
    """Whether 128-token tiles take less task time per expert than 64-token ones (see above)."""
    return expected_task_times(rows_per_expert, 128) < expected_task_times(rows_per_expert, 64)


# The FP8 128-token build's generation: kernel_probe records it, and benchmarks.tune_sm90 takes FP8
# 128-token timings only from probes that carry it (earlier probes timed a withdrawn swap-AB build).
FP8_TILE128_BUILD = "register-tokens"
TABLE_NAME = "sm90_mega_moe.yaml"
# A table bucket's tile when its probes settled 64 over 32 but never timed the current 128-token
# build: 64 or 128 per call by the padding model (wide_tile); benchmarks.tune_sm90 writes it.
TILE_64_OR_128 = "64-or-128"


@dataclass(frozen=True, order=True)
class Choice:
    stages: int = 4
    tile: int = 32

    def __post_init__(self):
        require(2 <= self.stages <= 8, f"stages={self.stages} must be in [2, 8]")
        require(self.tile in TILES, f"token tile {self.tile} must be one of {TILES}")

    def label(self) -> str:
        return f"{MAINLOOP}/{self.stages}/{self.tile}"


HEURISTIC = Choice(4, 32)  # its tile is chosen per call (auto_tile)


# -- developer overrides ------------------------------------------------------------------------
def env_overrides() -> dict:
    """The fields the developer overrides fix for every call ("tile" may be "auto"): the one place
    that reads VLLM_MEGAMOE_SM90_STAGES and VLLM_MEGAMOE_SM90_TOKEN_TILE."""
    out: dict = {}
    raw = os.environ.get("VLLM_MEGAMOE_SM90_STAGES")
    if raw is not None:
        require(raw.isdigit() and 2 <= int(raw) <= 8, f"VLLM_MEGAMOE_SM90_STAGES={raw!r} must be an integer in [2, 8]")
        out["stages"] = int(raw)
    raw = os.environ.get("VLLM_MEGAMOE_SM90_TOKEN_TILE")
    if raw is not None:
        require(raw in ("32", "64", "128", "auto"), f"VLLM_MEGAMOE_SM90_TOKEN_TILE={raw!r} must be 32, 64, 128 or auto")
        out["tile"] = raw if raw == "auto" else int(raw)
    return out


# -- the weight copies' L2 cache policy ----------------------------------------------------------
EVICT_FIRST_TILES = (32,)  # the builds that serve a few tokens per rank compile the policy in
# The calls that use it, by tokens per rank: up to 128 in layers of at most 2 GiB of expert weights
# per rank, up to 16 in larger ones (one H200, FP8 / BF16, docs/kernel_design.md: Qwen3-like
# 0.97-0.99x at 1-128 tokens; V4-Flash- and DeepSeek-V3-like 0.97-1.00x at 1-16, from 32 tokens on
# DeepSeek-V3-like 1.01-1.015x; all three slower from 256 on).
EVICT_FIRST_SMALL_LAYER_BYTES = 2 << 30
EVICT_FIRST_MAX_TOKENS_SMALL_LAYER = 128
EVICT_FIRST_MAX_TOKENS = 16


def weights_evict_first_build(tile: int, setting: Optional[bool] = None) -> bool:
    """Whether the build can copy its weight boxes with an L2 evict-first policy
    (csrc/sm90/mega/mainloop_smem.cuh kWeightsEvictFirst). `setting`: the build's
    BuildOptions.weights_evict_first (sm90_mega_moe): None (the serving builds: the token tiles
    in EVICT_FIRST_TILES), True (every build) or False (none)."""
    if setting is not None:
        return setting
    return tile in EVICT_FIRST_TILES


@functools.lru_cache(maxsize=None)  # asked on every call
def evict_first_max_tokens(shape: MoEShape, fmt: str, num_ranks: int) -> int:
    """The most tokens per rank of a call that uses the policy by default (see EVICT_FIRST_*)."""
    weight_bytes = shape.experts_per_rank(num_ranks) * 3 * shape.hidden * shape.intermediate * (1 if fmt == "fp8-block" else 2)
    return EVICT_FIRST_MAX_TOKENS_SMALL_LAYER if weight_bytes <= EVICT_FIRST_SMALL_LAYER_BYTES else EVICT_FIRST_MAX_TOKENS


def weights_evict_first_call(num_tokens: int, shape: MoEShape, fmt: str, num_ranks: int,
                             setting: Optional[bool] = None) -> bool:
    """Whether a call of `num_tokens` tokens on this rank uses the policy (where its build has it):
    `setting` (BuildOptions.weights_evict_first) True / False: always / never; None (serving): up
    to evict_first_max_tokens. It keeps the L1 outputs and combine rows in L2 while the weights
    stream past, read once; where the weight stream is the bound (more tokens, larger layers) it
    costs more than that saves."""
    if setting is not None:
        return setting
    return num_tokens <= evict_first_max_tokens(shape, fmt, num_ranks)


def auto_tile(shape: MoEShape, fmt: str, num_tokens: int, num_ranks: int, stages: Optional[int] = None) -> int:
    """64 when this call's expected rows per local expert reach AUTO_TILE_ROWS_PER_EXPERT[fmt], 128
    where prefers_128, else 32."""
    if expected_rows_per_expert(shape, num_tokens, num_ranks) < AUTO_TILE_ROWS_PER_EXPERT[fmt]:
        return 32
    return wide_tile(shape, fmt, num_tokens, num_ranks, stages)


def wide_tile(shape: MoEShape, fmt: str, num_tokens: int, num_ranks: int, stages: Optional[int] = None) -> int:
    """128 where the padding model prefers it and a 128-token build exists for the layer, else 64
    (auto_tile above 32, and a table bucket whose tile is TILE_64_OR_128)."""
    return (128 if auto_tile_128_possible(shape, fmt, num_ranks, stages)
            and prefers_128(expected_rows_per_expert(shape, num_tokens, num_ranks)) else 64)


def expected_rows_per_expert(shape: MoEShape, num_tokens: int, num_ranks: int) -> float:
    """Rows a local expert receives in a call with `num_tokens` on every rank, uniform routing."""
    return num_tokens * num_ranks * shape.topk / shape.num_experts


def auto_tile_128_possible(shape: MoEShape, fmt: str, num_ranks: int, stages: Optional[int] = None) -> bool:
    """Whether auto_tile may pick 128 for this layer: a 128-token build of the format with 3 stages
    that fit (the token-scale table grows with the hidden size); FP8 not under a
    forced depth below 3 (`stages`: VLLM_MEGAMOE_SM90_STAGES; the register-token loop needs 3)."""
    return tile_supported(fmt, 128, stages) and fits(shape, num_ranks, 3, 128)


FP8_TILE128_MIN_STAGES = 3  # the register-token loop keeps one chunk's wgmmas in flight (mainloop_smem.cuh)


def tile_supported(fmt: str, tile: int, stages: Optional[int] = None) -> bool:
    """FP8 128-token tiles run the register-token K loop only (the swap-AB FP8 loops' partial sums
    and per-column scale products do not fit the registers), with at least FP8_TILE128_MIN_STAGES
    stages (`stages`: a depth to check, None for any)."""
    if fmt != "fp8-block" or tile != 128:
        return True
    return stages is None or stages >= FP8_TILE128_MIN_STAGES


# -- the table --------------------------------------------------------------------------------
def table_path() -> Optional[Path]:
    """VLLM_MEGAMOE_SM90_TUNING, else the packaged table, else the repository's configs/."""
    return _table_path_for(os.environ.get("VLLM_MEGAMOE_SM90_TUNING"))


@functools.lru_cache(maxsize=None)
def _table_path_for(raw: Optional[str]) -> Optional[Path]:  # once per setting: the op asks on every call
    if raw:
        path = Path(raw)
        require(path.is_file(), f"VLLM_MEGAMOE_SM90_TUNING={raw!r} is not a file")
        return path
    package = Path(__file__).resolve().parent.parent
    for path in (package / "configs" / TABLE_NAME, package.parent / "configs" / TABLE_NAME):
        if path.is_file():
            return path
    return None


def entry_key(shape: MoEShape, fmt: str, num_ranks: int) -> tuple:
    return (shape.hidden, shape.intermediate, shape.num_experts, shape.topk, fmt, num_ranks)


def parse_table(doc: dict, where: str = "the tuning table") -> dict:
    """{entry_key: [(max_tokens, Choice, tile_rule), ...] ascending} from the YAML document
    (tile_rule: TILE_64_OR_128 for such a bucket, whose Choice holds tile 64; else None); errors
    name the entry that is wrong."""
    require(isinstance(doc, dict) and doc.get("version") == 1, f"{where}: expected a mapping with version: 1")
    table: dict = {}
    for i, entry in enumerate(doc.get("entries") or []):
        what = f"{where}, entry {i}"
        try:
            s = entry["shape"]
            key = (int(s["hidden"]), int(s["intermediate"]), int(s["experts"]), int(s["topk"]),
                   str(entry["format"]), int(entry["ranks"]))
            buckets = sorted((_parse_bucket(b) for b in entry["buckets"]), key=lambda b: b[0])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{what}: {exc}") from exc
        require(bool(buckets), f"{what}: no buckets")
        require(key not in table, f"{what}: a second entry for {key}")
        table[key] = buckets
    return table


@functools.lru_cache(maxsize=8)
def _load(path: str) -> dict:
    from ..strict_yaml import read_yaml_file
    return parse_table(read_yaml_file(path, f"the SM90 tuning table {path}"), path)


def load_table() -> dict:
    """The table in effect, read once per path (edits take effect in a new process)."""
    path = table_path()
    return {} if path is None else _load(str(path))


def _parse_bucket(b: dict) -> tuple:
    # A table from before the kernel had one mainloop names it per bucket: "tma" is accepted,
    # any other is refused (its build no longer exists).
    mainloop = b.get("mainloop", MAINLOOP)
    if mainloop != MAINLOOP:
        raise ValueError(f"bucket max_tokens={b.get('max_tokens')} names mainloop {mainloop!r}: the SM90 kernel has "
                         f"only the {MAINLOOP!r} mainloop now; drop the bucket's mainloop field (or regenerate the "
                         "table with `python -m benchmarks.tune_sm90`)")
    unknown = set(b) - {"max_tokens", "mainloop", "stages", "tile"}
    if unknown:
        raise ValueError(f"bucket max_tokens={b.get('max_tokens')}: unknown fields {sorted(unknown)}")
    wide = b["tile"] == TILE_64_OR_128
    return (int(b["max_tokens"]), Choice(int(b["stages"]), 64 if wide else int(b["tile"])),
            TILE_64_OR_128 if wide else None)


def table_entry(shape: MoEShape, fmt: str, num_ranks: int) -> tuple[list, int]:
    """(buckets, ranks) of the table entry that serves this layer at EP size num_ranks: its own, or
    else the same layer and format's entry at the nearest EP size (the larger of two as near),
    whose buckets then apply by expected rows per local expert (tokens per rank x EP size / the
    entry's EP size: the tile crossovers follow the rows per expert, docs/kernel_design.md) with the
    heuristic's depth (a depth measured at one EP size did not carry over: the EP2 entry's 5 stages
    took 1.003-1.012x the time of 4 at EP1, docs/kernel_design.md); ([], 0) without one."""
    path = table_path()
    return ([], 0) if path is None else _entry_in(str(path), entry_key(shape, fmt, num_ranks))


@functools.lru_cache(maxsize=256)
def _entry_in(path: str, key: tuple) -> tuple[list, int]:  # once per table and layer: the op asks on every call
    table = _load(path)
    if table.get(key):
        return table[key], key[5]
    others = [k[5] for k in table if k[:5] == key[:5]]
    if not others:
        return [], 0
    # nearest by ratio, compared exactly: r / n against n / r as a fraction over 1
    n = key[5]
    ranks = min(others, key=lambda r: (Fraction(max(r, n), min(r, n)), -r))
    return _tiles_only(table[key[:5] + (ranks,)]), ranks


def _tiles_only(buckets: list) -> list:
    """A borrowed entry's buckets with the heuristic's stages, their tiles kept;
    neighbours that become the same merge (the larger max_tokens)."""
    out: list = []
    for max_tokens, choice, rule in buckets:
        bucket = (max_tokens, Choice(HEURISTIC.stages, choice.tile), rule)
        if out and out[-1][1:] == bucket[1:]:
            out[-1] = bucket
        else:
            out.append(bucket)
    return out


def lookup(shape: MoEShape, fmt: str, num_ranks: int, num_tokens: int) -> Optional[tuple]:
    """The table's (Choice, tile_rule) for this layer and tokens per rank (the first bucket whose
    max_tokens is at least num_tokens, in the entry's tokens per rank (table_entry); beyond the
    last bucket, the last), or None without an entry."""
    buckets, ranks = table_entry(shape, fmt, num_ranks)
    if not buckets:
        return None
    tokens = num_tokens * num_ranks / ranks  # the same rows per local expert at the entry's EP size
    for max_tokens, choice, rule in buckets:
        if tokens <= max_tokens:
            return choice, rule
    return buckets[-1][1:]


# -- what a call runs -------------------------------------------------------------------------
def _apply(base: Choice, env: dict, shape: MoEShape, fmt: str, num_tokens: Optional[int], num_ranks: int) -> Choice:
    stages = env.get("stages", base.stages)
    tile = env.get("tile", base.tile)
    if tile == "auto":
        tile = 32 if num_tokens is None else auto_tile(shape, fmt, num_tokens, num_ranks, env.get("stages"))
    elif tile == TILE_64_OR_128:
        tile = 64 if num_tokens is None else wide_tile(shape, fmt, num_tokens, num_ranks, env.get("stages"))
    if "stages" not in env:  # e.g. a table's 5 stages of 32-token tiles under a 64-token override:
        while stages > 2 and not fits(shape, num_ranks, stages, tile):  # as deep as fits
            stages -= 1
    # (an explicit VLLM_MEGAMOE_SM90_STAGES that does not fit gets the op's shared-memory error)
    return Choice(stages, tile)


def _with_env(found: list[tuple]) -> list[tuple[Choice, dict]]:
    """(base, overrides) per table choice (Choice, tile_rule): the environment's overrides, the
    bucket's tile rule where the environment sets no tile; without a table entry, the heuristic
    with its tile chosen per call (an environment tile still wins)."""
    env = env_overrides()
    if not found:
        return [(HEURISTIC, {"tile": "auto", **env})]
    return [(base, {"tile": rule, **env} if rule else env) for base, rule in found]


def choose(shape: MoEShape, fmt: str, num_ranks: int, num_tokens: int) -> Choice:
    """The build for a call with `num_tokens` on this rank."""
    found = lookup(shape, fmt, num_ranks, num_tokens)
    ((base, env),) = _with_env([found] if found else [])
    return _apply(base, env, shape, fmt, num_tokens, num_ranks)


def choices(shape: MoEShape, fmt: str, num_ranks: int) -> list[Choice]:
    """Every build `choose` can return for this layer (any tokens per rank), the family's first."""
    out = []
    for base, env in _with_env([b[1:] for b in table_entry(shape, fmt, num_ranks)[0]]):
        may_128 = auto_tile_128_possible(shape, fmt, num_ranks, env.get("stages"))
        tiles = {"auto": TILES, TILE_64_OR_128: (64, 128)}.get(env.get("tile"), (None,))
        tiles = [t for t in tiles if t != 128 or may_128]  # every tile auto_tile / wide_tile may pick
        for tile in tiles:
            override = dict(env, tile=tile) if tile is not None else env
            c = _apply(base, override, shape, fmt, None, num_ranks)
            if c not in out:
                out.append(c)
    return out
