"""Run-time compilation, on-disk caching and launching of the CUDA kernels in csrc/.

Kernels are compiled for one architecture (``sm_90a``) by NVRTC (through cuda-python's
``cuda.bindings.nvrtc``) or by ``nvcc`` when asked for, cached as cubins on disk, loaded with the
driver API and launched on torch's current stream (so CUDA graphs capture the launches).

Settings (vllm_megamoe/settings.py; environment VLLM_MEGAMOE_<KEY> or the VLLM_MEGAMOE_CONFIG file):
  jit_compiler  nvrtc | nvcc | auto (default auto: NVRTC if it loads, else nvcc)
  cache_dir     cubin cache folder (default ~/.cache/vllm_megamoe/jit)
  nvcc          nvcc executable (default: nvcc on PATH, then $CUDA_HOME/bin/nvcc)
  jit_record    a file to which every kernel spec compiled or taken from the cache is appended
                (one JSON line per spec and process; not those of a csrc_dir tree):
                `vllm-megamoe precompile FILE` compiles them elsewhere, without a GPU, into
                cache_dir (e.g. when building a serving image)
  csrc_dir      (developer) where the CUDA sources live (default: the package's csrc)
  jit_lineinfo  (developer) 1 to compile with -lineinfo (for profilers)

cuda-python is imported lazily: importing this module needs neither it nor a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Iterable, Iterator, Sequence

from ..settings import KEYS, setting

# Bumped whenever the way keys or cubins are produced changes, so stale cache entries are ignored.
_CACHE_FORMAT = 1
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")


class KernelCompileError(RuntimeError):
    """A kernel failed to compile; the message carries the compiler's log."""


class CudaDriverError(RuntimeError):
    """A CUDA driver or NVRTC call returned an error."""


# ----------------------------------------------------------------------------- cuda-python access
@functools.lru_cache(maxsize=None)
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "vllm_megamoe's compiled kernels need cuda-python: pip install 'cuda-bindings>=13.0'"
        ) from exc
    return driver


@functools.lru_cache(maxsize=None)
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "NVRTC compilation needs cuda-python: pip install 'cuda-bindings>=13.0' 'nvidia-cuda-nvrtc>=13.0'"
        ) from exc
    return nvrtc


def check_driver(result: Any, what: str) -> Any:
    """Unpacks a cuda.bindings.driver return tuple, raising CudaDriverError on failure."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        text = text.decode() if isinstance(text, bytes) else ""
        raise CudaDriverError(f"{what} failed: {name}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _check_nvrtc(result: Any, what: str, log: str = "") -> Any:
    nvrtc = _nvrtc()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else str(err)
        message = f"{what} failed: {text}"
        if log:
            message += f"\n--- compiler log ---\n{log}"
        raise KernelCompileError(message)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_available() -> bool:
    """True when cuda-python and libnvrtc both load (no GPU needed)."""
    try:
        nvrtc_version()
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    major, minor = _check_nvrtc(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def find_nvcc() -> str | None:
    explicit = setting("nvcc")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise KernelCompileError(f"{KEYS['nvcc'].env}={explicit!r} is not an executable file (point it at nvcc)")
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def choose_compiler() -> str:
    wanted = setting("jit_compiler")  # a ValueError naming the variable unless nvrtc, nvcc or auto
    if wanted == "nvrtc":
        return "nvrtc"
    if wanted == "nvcc":
        if find_nvcc() is None:
            raise KernelCompileError(f"{KEYS['jit_compiler'].env}=nvcc but no nvcc was found (set {KEYS['nvcc'].env})")
        return "nvcc"
    if nvrtc_available():
        return "nvrtc"
    if find_nvcc() is not None:
        return "nvcc"
    raise KernelCompileError(
        "no CUDA compiler: install cuda-python with NVRTC (pip install 'cuda-bindings>=13.0' "
        "'nvidia-cuda-nvrtc>=13.0') or put nvcc on PATH"
    )


# ----------------------------------------------------------------------------- sources and keys
def csrc_dir() -> pathlib.Path:
    explicit = setting("csrc_dir")
    candidates = [pathlib.Path(explicit)] if explicit else []
    package_dir = pathlib.Path(__file__).resolve().parent.parent
    candidates += [package_dir / "csrc", package_dir.parent / "csrc"]
    for candidate in candidates:
        if (candidate / "sm90").is_dir():
            return candidate
    raise FileNotFoundError(
        "CUDA sources not found (looked in " + ", ".join(str(c) for c in candidates) + f"); set {KEYS['csrc_dir'].env}"
    )


def csrc_override() -> str:
    """The csrc_dir setting as an absolute path for KernelSpec.csrc, or "" when unset: a spec
    made with it stays tied to that tree if the setting changes later in the process."""
    explicit = setting("csrc_dir")
    return str(pathlib.Path(explicit).resolve()) if explicit else ""


def _source_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES)


def sources_digest(root: pathlib.Path | None = None) -> str:
    """Hash of every CUDA source under csrc/: any edit to any header changes every key."""
    root = root or csrc_dir()
    digest = hashlib.sha256()
    for path in _source_files(root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compiled variant of a kernel: source file, entry symbol and the defines that shape it."""

    source: str  # path relative to csrc/, e.g. "sm90/grouped_gemm_fp8_kernel.cu"
    name: str  # extern "C" entry symbol
    defines: tuple[tuple[str, str], ...] = ()
    arch: str = "sm_90a"
    extra_options: tuple[str, ...] = ()
    # The source tree it is built from; "": csrc_dir() when compiled. A spec that names its tree
    # is another kernel than the same spec of another tree, also within one process (the kernel
    # probe times two trees side by side).
    csrc: str = ""

    @staticmethod
    def make(source: str, name: str, defines: dict[str, Any] | None = None, **kwargs: Any) -> "KernelSpec":
        items = tuple(sorted((str(k), str(int(v) if isinstance(v, bool) else v)) for k, v in (defines or {}).items()))
        return KernelSpec(source=source, name=name, defines=items, **kwargs)

    def define(self, name: str, default: str | None = None) -> str | None:
        """The value define `name` compiles with (a string), or `default` when the spec has none."""
        return self._define_map.get(name, default)

    @functools.cached_property
    def _define_map(self) -> dict[str, str]:  # built once per spec: the op asks on every call
        return dict(self.defines)


def spec_to_json(spec: KernelSpec) -> str:
    """One line of JSON that spec_from_json turns back into `spec`."""
    fields = dataclasses.asdict(spec)
    fields["defines"] = [list(pair) for pair in spec.defines]
    fields["extra_options"] = list(spec.extra_options)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def spec_from_json(text: str) -> KernelSpec:
    """The spec of a spec_to_json line; a ValueError names what is wrong with it."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    names = {f.name for f in dataclasses.fields(KernelSpec)}
    if not isinstance(fields, dict) or not {"source", "name"} <= set(fields) or not set(fields) <= names:
        raise ValueError(f"a kernel spec has the keys source, name and any of {sorted(names - {'source', 'name'})}")
    kwargs = {k: str(v) for k, v in fields.items() if k not in ("defines", "extra_options")}
    try:
        kwargs["defines"] = tuple((str(k), str(v)) for k, v in fields.get("defines", ()))
    except (TypeError, ValueError):
        raise ValueError("defines must be a list of [name, value] pairs") from None
    kwargs["extra_options"] = tuple(str(o) for o in fields.get("extra_options", ()))
    return KernelSpec(**kwargs)  # absent fields take KernelSpec's defaults


def read_specs(path: str | os.PathLike) -> list[KernelSpec]:
    """The distinct specs of a VLLM_MEGAMOE_JIT_RECORD file, in first-seen order (blank lines skipped)."""
    specs: dict[KernelSpec, None] = {}
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                specs.setdefault(spec_from_json(line), None)
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: {exc}") from None
    return list(specs)


_recorded: set[tuple[str, str]] = set()
_record_lock = threading.Lock()


def _record(spec: KernelSpec) -> None:
    """Appends `spec` to the jit_record file, once per process. One write per line,
    opened for appending: the ranks of a run record into one file without interleaving lines.
    Specs of another source tree (csrc_dir, an A/B's second tree) are left out: the
    tree is a path of this machine."""
    path = setting("jit_record")
    if not path or spec.csrc:
        return
    line = spec_to_json(spec)
    with _record_lock:
        if (path, line) in _recorded:
            return
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        _recorded.add((path, line))


def spec_root(spec: KernelSpec) -> pathlib.Path:
    """The source tree `spec` compiles from: its own `csrc`, or csrc_dir()."""
    if not spec.csrc:
        return csrc_dir()
    root = pathlib.Path(spec.csrc)
    if not (root / "sm90").is_dir():
        raise FileNotFoundError(f"kernel {spec.name}: {root} is not a CUDA source tree (no sm90/ in it)")
    return root


def _common_options(spec: KernelSpec, root: pathlib.Path) -> list[str]:
    options = ["-std=c++17", f"-I{root}", f"-I{(root / spec.source).parent}", "-DNDEBUG"]
    options += [f"-D{k}={v}" for k, v in spec.defines]
    if setting("jit_lineinfo") == "1":
        options.append("-lineinfo")
    options += list(spec.extra_options)
    return options


def compiler_identity(compiler: str) -> str:
    """The compiler and its version, as the cache keys hold them; KernelCompileError when it does not run."""
    if compiler == "nvrtc":
        return "nvrtc-%d.%d" % nvrtc_version()
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelCompileError(f"no nvcc was found (put it on PATH or set {KEYS['nvcc'].env})")
    try:
        return f"nvcc:{nvcc_version(nvcc)}"
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelCompileError(f"{nvcc} --version failed: {exc}") from None


def cache_key(spec: KernelSpec, compiler: str, root: pathlib.Path | None = None) -> str:
    root = root or spec_root(spec)
    digest = hashlib.sha256()
    for part in (
        f"format={_CACHE_FORMAT}",
        f"compiler={compiler_identity(compiler)}",
        f"arch={spec.arch}",
        f"source={spec.source}",
        f"name={spec.name}",
        # Options use absolute include paths; hash them relative to the root so caches travel.
        "options=" + " ".join(o.replace(str(root), "<csrc>") for o in _common_options(spec, root)),
        f"sources={sources_digest(root)}",
    ):
        digest.update(part.encode())
        digest.update(b"\n")
    return digest.hexdigest()


def cache_dir() -> pathlib.Path:
    explicit = setting("cache_dir")
    return pathlib.Path(explicit) if explicit else pathlib.Path.home() / ".cache" / "vllm_megamoe" / "jit"


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Write to a private temporary file in the same folder, then rename over the target:
    many ranks may compile the same kernel at once and readers only ever see whole files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ----------------------------------------------------------------------------- compilation
@dataclasses.dataclass
class CompiledKernel:
    spec: KernelSpec
    cubin: bytes
    log: str  # compiler output (ptxas resource report included)
    key: str
    compiler: str
    from_cache: bool


def _compile_nvrtc(spec: KernelSpec, root: pathlib.Path) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    source_path = root / spec.source
    program = _check_nvrtc(
        nvrtc.nvrtcCreateProgram(source_path.read_bytes(), str(source_path).encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"-arch={spec.arch}", "--ptxas-options=-v"] + _common_options(spec, root)
        encoded = [o.encode() for o in options]
        compile_result = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        log_size = _check_nvrtc(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        log_buffer = b" " * log_size
        _check_nvrtc(nvrtc.nvrtcGetProgramLog(program, log_buffer), "nvrtcGetProgramLog")
        log = log_buffer.rstrip(b"\0 ").decode(errors="replace")
        _check_nvrtc(compile_result, f"NVRTC compilation of {spec.source} ({spec.name}, {dict(spec.defines)})", log)
        size = _check_nvrtc(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check_nvrtc(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _compile_nvcc(spec: KernelSpec, root: pathlib.Path) -> tuple[bytes, str]:
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelCompileError("nvcc not found")
    arch_number = spec.arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory(prefix="megamoe_nvcc_") as tmp:
        out = os.path.join(tmp, "kernel.cubin")
        command = [
            nvcc, "-cubin", f"-gencode=arch=compute_{arch_number},code={spec.arch}", "-O3", "-Xptxas", "-v",
            *_common_options(spec, root), "-o", out, str(root / spec.source),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        log = (result.stdout + result.stderr).strip()
        if result.returncode != 0:
            raise KernelCompileError(
                f"nvcc compilation of {spec.source} ({spec.name}, {dict(spec.defines)}) failed "
                f"(exit {result.returncode})\n$ {' '.join(command)}\n--- compiler log ---\n{log}"
            )
        return pathlib.Path(out).read_bytes(), log


_compile_lock = threading.Lock()


def compile_kernel(spec: KernelSpec, compiler: str | None = None, *, use_cache: bool = True) -> CompiledKernel:
    """Compiles `spec` (or takes it from the disk cache). Needs no GPU."""
    _record(spec)
    compiler = compiler or choose_compiler()
    root = spec_root(spec)
    key = cache_key(spec, compiler, root)
    path = cache_dir() / f"{spec.name}-{key[:40]}.cubin"
    log_path = path.with_suffix(".log")
    if use_cache and path.is_file():
        log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        return CompiledKernel(spec, path.read_bytes(), log, key, compiler, from_cache=True)
    with _compile_lock:
        cubin, log = (_compile_nvrtc if compiler == "nvrtc" else _compile_nvcc)(spec, root)
    if use_cache:
        _atomic_write(log_path, log.encode())
        _atomic_write(path, cubin)
    return CompiledKernel(spec, cubin, log, key, compiler, from_cache=False)


def precompile(specs: Iterable[KernelSpec], compiler: str | None = None) -> Iterator[CompiledKernel]:
    """Compiles each spec into the disk cache (or finds it there), yielding as it goes. Needs no
    GPU: the keys depend on the sources, the spec and the compiler's version only, so a cache
    filled on a build machine serves a GPU machine with the same sources and compiler."""
    compiler = compiler or choose_compiler()
    for spec in specs:
        yield compile_kernel(spec, compiler)


# ----------------------------------------------------------------------------- loading and launching
def _ensure_context(device_index: int) -> Any:
    """Makes the device's primary context (the one torch uses) current on this thread."""
    driver = _driver()
    check_driver(driver.cuInit(0), "cuInit")
    device = check_driver(driver.cuDeviceGet(device_index), "cuDeviceGet")
    context = check_driver(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    current = check_driver(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) != int(context):
        check_driver(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return context


class LoadedKernel:
    """A kernel function loaded into one device's primary context."""

    def __init__(self, compiled: CompiledKernel, device_index: int):
        driver = _driver()
        self.compiled = compiled
        self.device_index = device_index
        _ensure_context(device_index)
        self.module = check_driver(driver.cuModuleLoadData(compiled.cubin), f"cuModuleLoadData({compiled.spec.name})")
        self.function = check_driver(
            driver.cuModuleGetFunction(self.module, compiled.spec.name.encode()),
            f"cuModuleGetFunction({compiled.spec.name})",
        )
        self._dynamic_smem_set = 0

    def read_global_int(self, symbol: str) -> int:
        """Reads an `extern "C" __device__ int` of the module (synchronous: not during graph capture)."""
        driver = _driver()
        pointer, size = check_driver(driver.cuModuleGetGlobal(self.module, symbol.encode()), f"cuModuleGetGlobal({symbol})")
        value = ctypes.c_int32(0)
        check_driver(driver.cuMemcpyDtoH(ctypes.addressof(value), pointer, 4), f"cuMemcpyDtoH({symbol})")
        return int(value.value)

    def launch(self, grid: int | Sequence[int], block: int | Sequence[int], smem_bytes: int, stream: int,
               args: Iterable[Any]) -> None:
        """Launches on `stream` (a raw cudaStream_t, e.g. torch.cuda.current_stream().cuda_stream).

        Each argument is a ctypes scalar/pointer (c_int, c_void_p, ...) or an object with
        getPtr() such as a cuda.bindings CUtensorMap (passed by value, 128 bytes).
        """
        driver = _driver()
        if smem_bytes > 48 * 1024 and smem_bytes != self._dynamic_smem_set:
            check_driver(
                driver.cuFuncSetAttribute(
                    self.function,
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_bytes,
                ),
                f"cuFuncSetAttribute(max dynamic smem = {smem_bytes}) for {self.compiled.spec.name}",
            )
            self._dynamic_smem_set = smem_bytes
        keep_alive = list(args)
        pointers = (ctypes.c_void_p * max(1, len(keep_alive)))()
        for i, arg in enumerate(keep_alive):
            if hasattr(arg, "getPtr"):
                pointers[i] = arg.getPtr()
            else:
                pointers[i] = ctypes.addressof(arg)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3] if not isinstance(grid, int) else (grid, 1, 1)
        bx, by, bz = (tuple(block) + (1, 1))[:3] if not isinstance(block, int) else (block, 1, 1)
        check_driver(
            driver.cuLaunchKernel(
                self.function, gx, gy, gz, bx, by, bz, smem_bytes, driver.CUstream(stream),
                ctypes.addressof(pointers), 0,
            ),
            f"cuLaunchKernel({self.compiled.spec.name}, grid={gx}, block={bx}, smem={smem_bytes})",
        )  # fmt: skip
        del keep_alive  # the driver copied the argument values at launch


_loaded: dict[tuple[str, int], LoadedKernel] = {}
_load_lock = threading.Lock()


def get_kernel(spec: KernelSpec, device_index: int) -> LoadedKernel:
    """Compiled (cached on disk) and loaded (cached per process and device) kernel."""
    compiler = choose_compiler()
    lookup = (f"{compiler}|{spec}", device_index)
    kernel = _loaded.get(lookup)
    if kernel is None:
        with _load_lock:
            kernel = _loaded.get(lookup)
            if kernel is None:
                kernel = LoadedKernel(compile_kernel(spec, compiler), device_index)
                _loaded[lookup] = kernel
    return kernel
