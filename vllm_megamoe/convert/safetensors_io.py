"""Minimal safetensors reading and streaming writing with bounded memory.

Reading uses positional reads (no mmap), so the converter's resident memory is only what it
holds; the files it writes are plain safetensors (8-byte little-endian header length, JSON
header padded with spaces to 8 bytes, then the tensor bytes) that `safetensors.safe_open` and
vLLM load. The writer knows every tensor's shape and dtype up front, so the header is written
first and tensor bytes (or pieces of them: one expert of a stacked [E, ...] tensor) land at their
offsets with `os.pwrite`, from any thread.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

# safetensors dtype string <-> torch dtype (the ones a checkpoint we convert may hold).
ST_TO_TORCH = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
# Bytes per element of every safetensors dtype (also the ones torch cannot hold: copied raw).
ST_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
HEADER_ALIGN = 8
# The metadata every file we write carries (fixed, so output bytes are deterministic).
FILE_METADATA = {"format": "pt"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
COPY_CHUNK_BYTES = 64 * 1024 * 1024


class CorruptCheckpointError(ValueError):
    """A checkpoint's files cannot be read as what they claim to be: a truncated or malformed
    safetensors file, an index naming a file or tensor that is not there, experts missing. (Plain
    ValueError: the files are fine but hold something the converter does not support.)"""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    file: str        # absolute path
    name: str
    dtype: str       # safetensors dtype string, e.g. "BF16"
    shape: tuple
    begin: int       # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in ST_TO_TORCH:
            raise ValueError(f"tensor {self.name!r} in {os.path.basename(self.file)} has dtype "
                             f"{self.dtype}, which torch cannot load; expected one of "
                             f"{sorted(ST_TO_TORCH)}")
        return ST_TO_TORCH[self.dtype]


def read_header(path: str) -> tuple[dict, dict]:
    """({name: TensorInfo}, metadata) of a safetensors file; raises ValueError if malformed."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptCheckpointError(f"{name}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise CorruptCheckpointError(f"{name}: not a safetensors file (header length {n} is invalid)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{name}: safetensors header is not valid JSON ({exc})") from None
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for tname, entry in header.items():
        dtype, shape = entry.get("dtype"), tuple(entry.get("shape", ()))
        begin, end = entry.get("data_offsets", (0, -1))
        if dtype not in ST_ITEMSIZE:
            raise CorruptCheckpointError(f"tensor {tname!r} in {name} has unknown dtype {dtype!r}")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * ST_ITEMSIZE[dtype] or data_start + end > size:
            raise CorruptCheckpointError(f"tensor {tname!r} in {name}: data offsets {begin}..{end} do not "
                             f"match shape {list(shape)} {dtype} or the file size {size}; the "
                             "file is truncated or corrupt")
        tensors[tname] = TensorInfo(os.path.abspath(path), tname, dtype, shape,
                                    data_start + begin, data_start + end)
    return tensors, metadata


def pread_exact(fd: int, nbytes: int, offset: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CorruptCheckpointError(f"unexpected end of file reading {nbytes} bytes at offset {offset}")
        done += got
    return buf


def _row_range(info: TensorInfo, rows: Optional[slice]) -> tuple[list, int, int]:
    shape = list(info.shape)
    if rows is None:
        return shape, info.begin, info.end
    row_bytes = info.nbytes // shape[0] if shape and shape[0] else 0
    start, stop = rows.start or 0, shape[0] if rows.stop is None else rows.stop
    shape[0] = stop - start
    return shape, info.begin + start * row_bytes, info.begin + stop * row_bytes


def read_into(info: TensorInfo, out: torch.Tensor, rows: Optional[slice] = None) -> torch.Tensor:
    """Read the tensor (or rows [start, stop) of dim 0) straight into `out` (contiguous, same
    dtype and number of elements), without an intermediate copy. Returns out."""
    shape, begin, end = _row_range(info, rows)
    if out.dtype != info.torch_dtype or not out.is_contiguous() or \
            out.numel() * out.element_size() != end - begin:
        raise ValueError(f"cannot read {info.name!r} {info.dtype} {shape} into a "
                         f"{out.dtype} {list(out.shape)} tensor")
    if end == begin:
        return out
    view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    fd = os.open(info.file, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], begin + done)
            if got <= 0:
                raise CorruptCheckpointError(f"{os.path.basename(info.file)} ended while reading "
                                 f"{info.name!r}; the file is truncated")
            done += got
    finally:
        os.close(fd)
    return out


def read_tensor(info: TensorInfo, rows: Optional[slice] = None) -> torch.Tensor:
    """The tensor (or rows [start, stop) of its first dimension) as a fresh torch tensor."""
    shape, _, _ = _row_range(info, rows)
    return read_into(info, torch.empty(shape, dtype=info.torch_dtype), rows)


def copy_bytes(info: TensorInfo, out_fd: int, out_offset: int) -> None:
    """Copy a tensor's raw bytes into an output file at out_offset (bounded chunks)."""
    fd = os.open(info.file, os.O_RDONLY)
    try:
        pos = 0
        while pos < info.nbytes:
            n = min(COPY_CHUNK_BYTES, info.nbytes - pos)
            pwrite_all(out_fd, pread_exact(fd, n, info.begin + pos), out_offset + pos)
            pos += n
    finally:
        os.close(fd)


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (C order), without copying when it is contiguous."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = ST_ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def build_header(tensors: Iterable[OutputTensor]) -> tuple[bytes, dict]:
    """(header bytes incl. the 8-byte length, {name: absolute data offset}).

    Tensors are laid out in the order given; the JSON has sorted keys, so equal input gives
    equal bytes.
    """
    entries, offsets, pos = {}, {}, 0
    for t in tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                           "data_offsets": [pos, pos + t.nbytes]}
        offsets[t.name] = pos
        pos += t.nbytes
    entries["__metadata__"] = dict(FILE_METADATA)
    text = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    header = struct.pack("<Q", len(text)) + text
    return header, {name: len(header) + off for name, off in offsets.items()}


def sha256_file(path: str, chunk: int = COPY_CHUNK_BYTES, stop=None) -> Optional[str]:
    """Hex sha256 of the file, read once in `chunk`-byte pieces (bounded memory; hashlib and the
    reads release the GIL, so it runs beside other threads). `stop`: a threading.Event; once set,
    the hashing ends early and returns None."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(chunk, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while True:
            if stop is not None and stop.is_set():
                return None
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()
