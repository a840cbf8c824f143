"""The package's settings: `VLLM_MEGAMOE_*` environment variables and an optional YAML file.

One registry (KEYS) and one reader (`setting`) for the whole package; the vLLM plugin loads them
all at start-up (`load_settings`). Every key has an environment variable (`VLLM_MEGAMOE_<KEY>`,
upper case) and may also be set in the YAML file named by `VLLM_MEGAMOE_CONFIG` (a mapping of
key -> value; `-` and `_` are interchangeable in keys). The environment wins over the file; an
empty or blank variable counts as unset. An unknown key in the file, or an unknown
`VLLM_MEGAMOE_*` variable, is an error that names it (and the closest known key), so a typo never
silently does nothing.

Two kinds of keys:
- serving keys (`developer=False`): what a vLLM user may need to set; docs/serving.md lists them
  (`env_help()`).
- developer keys (`developer=True`): implementation choices, forced tunings and source trees for
  kernel work and profiling; accepted the same way, documented here (`env_help(developer=True)`),
  not in the serving docs.

File values are exported to the environment by `load_settings` (when the variable is not set
already), so code that still reads a variable itself sees the same value. This module imports
neither vLLM nor torch.
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .env_flags import parse_flag

ENV_PREFIX = "VLLM_MEGAMOE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"


# ----------------------------------------------------------------------------- value parsers
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


def _jit_compiler(v: Any) -> str:
    s = str(v).strip().lower()
    if s not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"must be nvrtc, nvcc or auto, not {s!r}")
    return s


def _text(v: Any) -> str:
    s = str(v).strip()
    if not s:
        raise ValueError("must not be empty")
    return s


def _flag(v: Any) -> str:
    if not str(v).strip():
        return "0"
    return "1" if parse_flag(v) else "0"


# The portable path's optional Triton kernels on CUDA, one developer key for all of them.
PORTABLE_KERNELS = ("scatter", "activation", "reduce")
KERNEL_CHOICES = ("auto", "torch", "triton")


def _portable_kernels(v: Any) -> str:
    """'auto' | 'torch' | 'triton' for every kernel, or a ','-joined list of kernel=choice (a bare
    choice first sets every kernel); returned as the full canonical list."""
    out = dict.fromkeys(PORTABLE_KERNELS, "auto")
    for part in str(v).strip().lower().split(","):
        part = part.strip()
        if not part:
            continue
        op, eq, choice = (s.strip() for s in part.partition("="))
        if not eq:
            if op not in KERNEL_CHOICES:
                raise ValueError(f"{op!r} must be one of {list(KERNEL_CHOICES)}, or kernel=choice with a kernel "
                                 f"of {list(PORTABLE_KERNELS)}")
            out = dict.fromkeys(PORTABLE_KERNELS, op)
            continue
        if op not in PORTABLE_KERNELS:
            raise ValueError(f"unknown kernel {op!r}{_closest(op, PORTABLE_KERNELS)}: one of {list(PORTABLE_KERNELS)}")
        if choice not in KERNEL_CHOICES:
            raise ValueError(f"{op}={choice!r} must be one of {list(KERNEL_CHOICES)}")
        out[op] = choice
    return ",".join(f"{op}={out[op]}" for op in PORTABLE_KERNELS)


_portable_kernels.choices = KERNEL_CHOICES


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Key:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    developer: bool = False  # kernel work and profiling only: not in docs/serving.md
    shown_default: Optional[str] = None  # the default as the docs' table shows it (else `default`)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


KEYS: dict[str, Key] = {k.name: k for k in (
    # ---- serving
    Key("max_tokens_per_rank", _positive_int, None,
        "Tokens one rank may send through the buffer in one forward; must be >= "
        "`--max-num-batched-tokens`. A larger batch is an error naming this key.",
        shown_default="vLLM's `--max-num-batched-tokens`"),
    Key("path", _choice("auto", "portable", "sm90", "sm100"), "auto",
        "Which implementation runs: `auto` (the best one for the GPU), or force `portable` / `sm90` / "
        "`sm100` (an impossible choice is an error)."),
    Key("fallback", _choice("portable", "error"), "portable",
        "When a GPU has no usable megamoe kernel for a layer: `portable` runs the portable path "
        "(logged), `error` fails at startup. On SM100 without DeepGEMM only an explicit `portable` "
        "allows the fallback."),
    Key("verify_checkpoint", _flag, "1",
        "`1`: loading a checkpoint converted by `vllm-megamoe convert`, the workers hash its shards "
        "(sha256, each shard by one worker, streamed while vLLM reads them) and the load fails, naming "
        "the shard, when one does not match its index; `0`: load it unchecked (docs/conversion.md: "
        "cost and message)."),
    Key("timeout_s", _positive_float, 60.0,
        "Seconds a rank waits at a buffer barrier before failing and naming the missing ranks."),
    Key("num_sms", _positive_int, None,
        "CTAs of the SM90 kernel's persistent grid; lower it when other kernels (e.g. NCCL) keep "
        "SMs busy.", shown_default="every SM"),
    Key("shm_dir", _text, "/dev/shm", "Directory of the CPU shared-memory buffer files (CPU serving)."),
    Key("cache_dir", _text, None, "Where JIT-compiled kernels are cached (`vllm-megamoe precompile` "
        "fills it ahead of time, below).", shown_default="`~/.cache/vllm_megamoe/jit`"),
    Key("jit_compiler", _jit_compiler, "auto", "Kernel compiler: `nvrtc`, `nvcc` or `auto` (NVRTC "
        "when it loads, else nvcc)."),
    Key("nvcc", _text, None, "nvcc binary for the JIT.", shown_default="`nvcc` on `PATH`, else "
        "`$CUDA_HOME` / `$CUDA_PATH` / `/usr/local/cuda` `bin/nvcc`"),
    Key("jit_record", _text, None, "A file to which every kernel the run compiles or takes from the "
        "cache is appended, one JSON line each; `vllm-megamoe precompile FILE` compiles them into "
        "the cache elsewhere, without a GPU (below)."),
    # ---- developer
    Key("csrc_dir", _text, None, "CUDA sources to JIT-compile instead of the packaged ones (A/B of a "
        "second source tree; such builds are not recorded by jit_record).", developer=True),
    Key("jit_lineinfo", _flag, "0", "1: compile kernels with -lineinfo (source lines in profilers).",
        developer=True),
    Key("portable_kernels", _portable_kernels, "auto",
        "The portable path's Triton kernels on CUDA: auto (each one where Triton imports; the default), torch "
        "(elementwise torch ops everywhere), triton, or per kernel, e.g. `activation=torch,reduce=triton`; "
        "kernels: scatter (combine writes of the padded mode), activation (SwiGLU x weight + FP8 "
        "requantization), reduce (the top-k sum).", developer=True),
    Key("sm90_tuning", _text, None,
        "YAML tuning table of the SM90 kernel (default: the packaged configs/sm90_mega_moe.yaml).",
        developer=True),
    Key("sm90_token_tile", _choice("32", "64", "128", "auto"), None,
        "Rows per token block of the SM90 kernel's GEMM tasks, overriding the tuning table: 32, 64 "
        "or 128 (128 runs at most 4 stages) or auto (64 from 48 expected rows per expert in FP8, 24 "
        "in BF16).", developer=True),
    Key("sm90_stages", _int_in(2, 8), None,
        "Pipeline depth of the SM90 kernel's shared-memory mainloops (2-8; default from the tuning "
        "table, else 4).", developer=True),
)}

USER_KEYS = {n: k for n, k in KEYS.items() if not k.developer}
DEVELOPER_KEYS = {n: k for n, k in KEYS.items() if k.developer}


# ----------------------------------------------------------------------------- reading
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
    from .strict_yaml import read_yaml_file
    data = read_yaml_file(path, f"{CONFIG_ENV}={path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_ENV}={path}: expected a mapping of key: value, got "
                         f"{type(data).__name__}")
    return data


def _file_values(path: str) -> dict[str, Any]:
    """{key: raw value} of the YAML file; unknown or repeated keys are errors naming them."""
    values: dict[str, Any] = {}
    first_spelling: dict[str, Any] = {}
    for raw_key, value in _read_yaml(path).items():
        key = str(raw_key).strip().replace("-", "_").lower()
        if key not in KEYS:
            raise ValueError(f"{path}: unknown key {raw_key!r}{_closest(key, KEYS)}; known "
                             f"keys: {sorted(KEYS)}")
        if key in values:  # e.g. max-tokens-per-rank and max_tokens_per_rank
            raise ValueError(f"{path}: {key} is set twice (as {first_spelling[key]!r} and {raw_key!r})")
        values[key], first_spelling[key] = value, raw_key
    return values


@functools.lru_cache(maxsize=8)
def _cached_file_values(path: str, stamp: tuple) -> dict[str, Any]:
    return _file_values(path)


def _file_values_now(path: str) -> dict[str, Any]:
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None  # _read_yaml names the problem
    return _cached_file_values(path, stamp)


def _blank(raw: Any) -> bool:
    return raw is None or (isinstance(raw, str) and not raw.strip())


def _parse(key: Key, raw: Any, where: str) -> Any:
    try:
        return key.parse(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}={raw!r}: {e}") from None


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
    """Read and validate every key; raise ValueError naming the offending one.

    export: copy file-provided values into os.environ (only when `environ` is os.environ and the
    variable is not set already), for code that reads a variable itself.
    """
    env = os.environ if environ is None else environ
    problem = unknown_environment_names(env)
    if problem is not None:
        raise ValueError(problem)
    path = env.get(CONFIG_ENV)
    file_values = _file_values(path) if path else {}

    values, sources = {}, {}
    for key in KEYS.values():
        if not _blank(env.get(key.env)):
            raw, src, where = env[key.env], "env", key.env
        elif key.name in file_values and file_values[key.name] is not None:
            raw, src, where = file_values[key.name], path, f"{path}: {key.name}"
        else:
            values[key.name], sources[key.name] = key.default, "default"
            continue
        values[key.name], sources[key.name] = _parse(key, raw, where), src
        if export and environ is None and src == path and values[key.name] is not None:
            os.environ[key.env] = str(values[key.name])
    return Settings(values, sources)


def setting(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of key `name`: its environment variable, else the VLLM_MEGAMOE_CONFIG file's
    value, else the default; parsed and refused as load_settings does. The package's one reader of
    these variables."""
    key = KEYS[name]
    env = os.environ if environ is None else environ
    raw = env.get(key.env)
    if not _blank(raw):
        return _parse(key, raw, key.env)
    path = env.get(CONFIG_ENV)
    if path:
        raw = _file_values_now(path).get(name)
        if raw is not None:
            return _parse(key, raw, f"{path}: {name}")
    return key.default


# ----------------------------------------------------------------------------- portable kernels
@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def portable_kernel(kernel: str) -> str:
    """"triton" or "torch" for the portable path's `kernel` (one of PORTABLE_KERNELS) on CUDA, from
    the portable_kernels key; errors name the variable."""
    value = setting("portable_kernels")
    choice = dict(part.split("=") for part in _portable_kernels(value).split(","))[kernel]
    if choice == "auto":
        return "triton" if triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise ValueError(f"{KEYS['portable_kernels'].env}: {kernel}=triton needs the triton package "
                         f"(pip install triton), or set {kernel}=torch")
    return choice


# ----------------------------------------------------------------------------- documentation
def env_help(developer: bool = False) -> str:
    """Markdown table of the serving keys (docs/serving.md quotes it), or of the developer keys."""
    rows = ["| key (YAML) | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    for k in (DEVELOPER_KEYS if developer else USER_KEYS).values():
        shown = k.shown_default or ("unset" if k.default is None else f"`{k.default}`")
        rows.append(f"| `{k.name}` | `{k.env}` | {shown} | {k.help} |")
    return "\n".join(rows)
