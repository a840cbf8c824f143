"""Plugin tunables: `VLLM_MEGAMOE_*` environment variables and an optional YAML file.

Every key has an environment variable (`VLLM_MEGAMOE_<KEY>`, upper case) and may also be set
in the YAML file named by `VLLM_MEGAMOE_CONFIG` (a mapping of key -> value; `-` and `_` are
interchangeable in keys). The environment wins over the file. An unknown key in the file, or an
unknown `VLLM_MEGAMOE_*` variable, is an error that names it (and the closest known key), so a
typo never silently does nothing.

Keys the core package reads from the environment itself (path, timeout_s, shm_dir, JIT
settings) are exported to the environment when they come from the file, so the core sees the
same value. This module imports neither vLLM nor torch.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..env_flags import parse_auto_flag, parse_flag

ENV_PREFIX = "VLLM_MEGAMOE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"


def _positive_int(v: Any) -> int:
    n = int(str(v).strip())
    if n <= 0:
        raise ValueError("must be a positive integer")
    return n


def _int_in(low: int, high: int) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        n = int(str(v).strip())
        if not low <= n <= high:
            raise ValueError(f"must be an integer in [{low}, {high}]")
        return n
    return parse


def _non_negative_int(v: Any) -> int:
    n = int(str(v).strip())
    if n < 0:
        raise ValueError("must be 0 or a positive integer")
    return n


def _positive_float(v: Any) -> float:
    try:
        x = float(str(v).strip())
    except ValueError:
        raise ValueError("must be a positive, finite number") from None
    if not 0 < x < float("inf"):
        raise ValueError("must be a positive, finite number")
    return x


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in choices:
            raise ValueError(f"must be one of {list(choices)}")
        return s
    parse.choices = choices  # what the core accepts: tests/test_sm90_tuning.py compares the lists
    return parse


def _auto_or_flag(v: Any) -> str:
    """'auto', or a flag's spelling (parse_auto_flag) as '1' / '0'."""
    on = parse_auto_flag(v)
    return "auto" if on is None else "1" if on else "0"


def _text(v: Any) -> str:
    s = str(v).strip()
    if not s:
        raise ValueError("must not be empty")
    return s


def _flag(v: Any) -> str:
    if not str(v).strip():
        return "0"
    return "1" if parse_flag(v) else "0"


@dataclass(frozen=True)
class Key:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    core_env: bool = False  # read from the environment by the core package itself

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


KEYS: dict[str, Key] = {k.name: k for k in (
    Key("max_tokens_per_rank", _positive_int, None,
        "Tokens one rank may send through the buffer in one forward. Default: vLLM's "
        "--max-num-batched-tokens. A larger batch is an error naming this key."),
    Key("verify_checkpoint", _flag, "1",
        "1 (default): loading a checkpoint converted by `vllm-megamoe convert`, each worker hashes its share "
        "of the index's shards (sha256, streamed while vLLM reads them; every shard by one worker) and the "
        "load fails, naming the shard, when one does not match its checksum; 0: load it unchecked "
        "(docs/conversion.md gives the cost)."),
    Key("path", _choice("auto", "portable", "sm90", "sm100"), "auto",
        "Which implementation runs: auto (best for the GPU), or force portable/sm90/sm100.",
        core_env=True),
    Key("fallback", _choice("portable", "error"), "portable",
        "When a GPU has no usable megamoe kernel for a layer: run the portable path (logged), "
        "or fail at startup (on SM100 without DeepGEMM only an explicit portable allows it).",
        core_env=True),  # the SM100 path reads it from the environment
    Key("timeout_s", _positive_float, 60.0,
        "Seconds a rank waits at a buffer barrier before failing with the missing ranks.",
        core_env=True),
    Key("shm_dir", _text, "/dev/shm", "Directory of the CPU shared-memory buffer files.",
        core_env=True),
    Key("cache_dir", _text, None, "Where compiled kernels are cached (default: ~/.cache/vllm_megamoe/jit).",
        core_env=True),
    Key("csrc_dir", _text, None, "CUDA sources to JIT-compile (default: the packaged ones).",
        core_env=True),
    Key("jit_compiler", _text, None, "JIT compiler: nvrtc, nvcc or auto (default: NVRTC when it loads, "
        "else nvcc).", core_env=True),
    Key("nvcc", _text, None, "nvcc binary for the JIT (default: nvcc on PATH, else "
        "$CUDA_HOME / $CUDA_PATH / /usr/local/cuda bin/nvcc).", core_env=True),
    Key("jit_lineinfo", _flag, "0", "Compile kernels with line info (profiling).", core_env=True),
    Key("jit_record", _text, None, "A file to which every kernel the run compiles or takes from the "
        "cache is appended (one JSON line each): `vllm-megamoe precompile FILE` compiles them into "
        "the cache elsewhere, without a GPU.", core_env=True),
    Key("num_sms", _positive_int, None,
        "CTAs of the SM90 kernel's persistent grid (default: every SM); lower it when other "
        "kernels (e.g. NCCL) keep SMs busy.", core_env=True),
    Key("sm90_mainloop", _choice("ldg", "smem", "wgmma", "tma"), None,
        "GEMM mainloop of the SM90 kernel, overriding the tuning table: tma (swizzled stages filled "
        "by TMA + warpgroup MMA; the table's and the heuristic's choice), wgmma (the same stages "
        "filled with cp.async), smem (padded stages + mma.sync) or ldg (direct loads).", core_env=True),
    Key("portable_scatter", _choice("auto", "torch", "triton"), None,
        "How the portable path's CUDA-graph (padded) mode writes combine rows: triton (one kernel, "
        "live rows only, vector stores), torch (index_put per peer) or auto (triton when it "
        "imports; the default).", core_env=True),
    Key("portable_activation", _choice("auto", "torch", "triton"), None,
        "How the portable path computes SwiGLU x weight and the FP8 requantization between its "
        "GEMMs (FP8 weights on CUDA): triton (one kernel), torch (elementwise ops) or auto (triton "
        "when it imports; the default).", core_env=True),
    Key("portable_reduce", _choice("auto", "torch", "triton"), None,
        "How the portable path sums a token's top-k combine slots on CUDA: triton (one kernel), "
        "torch or auto (triton when it imports; the default).", core_env=True),
    Key("sm90_token_tile", _choice("32", "64", "128", "auto"), None,
        "Rows per token block of the SM90 kernel's GEMM tasks, overriding the tuning table: 32, 64 "
        "or 128 (wgmma / tma only; each weight tile streamed 2x / 4x less often in prefill; 128 "
        "runs at most 4 stages) or auto (64 from 48 expected rows per expert in FP8, 24 in BF16).", core_env=True),
    Key("sm90_tuning", _text, None,
        "YAML tuning table of the SM90 kernel (default: the packaged configs/sm90_mega_moe.yaml).",
        core_env=True),
    Key("sm90_stages", _int_in(2, 8), None,
        "Pipeline depth of the SM90 kernel's shared-memory mainloops (2-8; default from the tuning "
        "table, else 4).", core_env=True),
    Key("sm90_epilogue_warpgroup", _flag, None,
        "1 (default): the SM90 kernel's 32- and 64-token TMA builds run their GEMM epilogues on a "
        "third warpgroup while the other two run the next task's K loop (0.89-0.97x the time at "
        "1024-8192 tokens per rank, Qwen3-like decode 0.90-0.98x, docs/kernel_notes.md v18); 0: on "
        "the MMA warpgroups (A/B only).",
        core_env=True),
    Key("sm90_epilogue_warpgroup_128", _flag, None,
        "0 (default): the SM90 kernel's 128-token TMA builds run their epilogues on the MMA warpgroups; "
        "1: where the 64 KB hand-off tile fits beside 3 stages (Qwen3-like layers), on a third warpgroup "
        "as the 32- and 64-token builds do (A/B only: 1.01-1.06x the time on one H200, docs/kernel_notes.md v31).",
        core_env=True),
    Key("sm90_weights_evict_first", _auto_or_flag, None,
        "auto (default): the SM90 kernel's 32-token TMA builds copy their weight boxes with an L2 "
        "evict-first policy in calls of at most 128 tokens per rank (16 in layers of more than 2 GiB of "
        "expert weights per rank), so that the weight stream, read once per call, leaves the L1 outputs and "
        "combine rows the call reads again in the L2 cache (0.97-0.99x the time there on one H200, slower "
        "with more tokens); 1 / 0: every TMA build and call does / none does (A/B).",
        core_env=True),
    Key("sm90_ablate", _text, None,
        "Profiling only, outputs are wrong (but with keep_padding alone, an A/B build): SM90 builds without part "
        "of the GEMM mainloop "
        "('+'-joined: promotion, mma, token_rows, weight_rows, tma, tma_warm, narrow, half_rows, epilogue, keep_padding, stores, transpose, task_scales) to time what "
        "is left (benchmarks/kernel_probe.py).",
        core_env=True),
    Key("sm90_chunk_trace", _flag, "0",
        "Profiling only: SM90 builds whose FP8 K loop records clock values into a phase clock "
        "(benchmarks/kernel_probe.py trace=1); serving passes no clock, so it only adds instructions.",
        core_env=True),
    Key("sm90_chunk_trace_task", _non_negative_int, None,
        "Profiling only: which of a CTA's L1 tasks a chunk-trace build traces, counted from 0 (default "
        "2; 0 at a few tokens per rank, where a CTA runs one L1 task).", core_env=True),
)}


@dataclass(frozen=True)
class Settings:
    values: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)  # key -> "env" | file path | "default"

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def describe(self) -> str:
        return ", ".join(f"{k}={self.values[k]!r} ({self.sources[k]})"
                         for k in KEYS if self.sources.get(k, "default") != "default") or "defaults"


def _closest(name: str, known) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _read_yaml(path: str) -> dict:
    try:
        import yaml  # noqa: F401
    except ImportError as e:  # PyYAML is a dependency of vllm and of this package
        raise ValueError(f"{CONFIG_ENV}={path}: reading it needs PyYAML (pip install pyyaml)") from e
    from ..strict_yaml import read_yaml_file
    data = read_yaml_file(path, f"{CONFIG_ENV}={path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_ENV}={path}: expected a mapping of key: value, got "
                         f"{type(data).__name__}")
    return data


def unknown_environment_names(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why the environment is refused: a `VLLM_MEGAMOE_*` variable that is no known key (a typo
    would otherwise do nothing), named with the closest key; None when every one is known. The
    core's SymmBuffer asks too, for callers that never load the plugin."""
    env = os.environ if environ is None else environ
    known_env = {k.env: k for k in KEYS.values()}
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var != CONFIG_ENV and var not in known_env:
            near = _closest(var, known_env)
            known = "" if near else f"; known: {sorted(known_env) + [CONFIG_ENV]}"
            return f"unknown environment variable {var}{near}: rename or unset it{known}"
    return None


def load_settings(environ: Optional[Mapping[str, str]] = None, *, export: bool = True) -> Settings:
    """Read and validate every tunable; raise ValueError naming the offending key.

    export: copy file-provided values of core-read keys into os.environ (only when `environ`
    is os.environ and the variable is not set already).
    """
    env = os.environ if environ is None else environ
    problem = unknown_environment_names(env)
    if problem is not None:
        raise ValueError(problem)

    file_values: dict[str, Any] = {}
    first_spelling: dict[str, Any] = {}
    path = env.get(CONFIG_ENV)
    if path:
        for raw_key, value in _read_yaml(path).items():
            key = str(raw_key).strip().replace("-", "_").lower()
            if key not in KEYS:
                raise ValueError(f"{path}: unknown key {raw_key!r}{_closest(key, KEYS)}; known "
                                 f"keys: {sorted(KEYS)}")
            if key in file_values:  # e.g. max-tokens-per-rank and max_tokens_per_rank
                raise ValueError(f"{path}: {key} is set twice (as {first_spelling[key]!r} and {raw_key!r})")
            file_values[key], first_spelling[key] = value, raw_key

    values, sources = {}, {}
    for key in KEYS.values():
        if key.env in env:
            raw, src, where = env[key.env], "env", key.env
        elif key.name in file_values:
            raw, src, where = file_values[key.name], path, f"{path}: {key.name}"
        else:
            values[key.name], sources[key.name] = key.default, "default"
            continue
        try:
            values[key.name] = None if raw is None else key.parse(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}={raw!r}: {e}") from None
        sources[key.name] = src
        if (export and environ is None and src == path and key.core_env
                and values[key.name] is not None):
            os.environ[key.env] = str(values[key.name])
    return Settings(values, sources)


def core_setting(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """One core key from the environment (the file's value arrives there through load_settings'
    export), parsed and refused as load_settings does: the core's one reader of these variables."""
    key = KEYS[name]
    env = os.environ if environ is None else environ
    raw = env.get(key.env)
    if raw is None:
        return key.default
    try:
        return key.parse(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key.env}={raw!r}: {e}") from None


def env_help() -> str:
    """Markdown table of the keys (docs/serving.md quotes it)."""
    rows = ["| key (YAML) | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    for k in KEYS.values():
        rows.append(f"| `{k.name}` | `{k.env}` | `{k.default}` | {k.help} |")
    return "\n".join(rows)
