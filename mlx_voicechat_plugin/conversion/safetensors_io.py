"""Safetensors read and written one tensor at a time, so a checkpoint of any size
converts in the memory of its largest tensor.

A file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``[begin, end)`` byte range in the data that follows, and
optional ``__metadata__``), then the data. :func:`read_header` checks a file
against its header (a file shorter than the data its header describes is
truncated); :func:`read_tensor` reads one tensor's bytes; :class:`ShardWriter`
writes a header planned in advance and then each tensor's bytes in order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import mlx.core as mx
import numpy as np

# safetensors dtype name -> (MLX dtype, numpy dtype of the same bytes).
_DTYPES: dict[str, tuple[mx.Dtype, Any]] = {
    "BF16": (mx.bfloat16, np.uint16),
    "F16": (mx.float16, np.float16),
    "F32": (mx.float32, np.float32),
    "U32": (mx.uint32, np.uint32),
    "I64": (mx.int64, np.int64),
    "I32": (mx.int32, np.int32),
    "U8": (mx.uint8, np.uint8),
    "I8": (mx.int8, np.int8),
    "BOOL": (mx.bool_, np.bool_),
}
_NAMES = {dtype: name for name, (dtype, _) in _DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20
_ALIGN = 8


class CheckpointFileError(ValueError):
    """A safetensors file that cannot be read as its header says (truncated, corrupt)."""


def dtype_name(dtype: mx.Dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} has no safetensors name")
    return _NAMES[dtype]


def mlx_dtype(name: str) -> mx.Dtype:
    if name not in _DTYPES:
        raise ValueError(f"safetensors dtype {name!r} is not supported; one of {sorted(_DTYPES)}")
    return _DTYPES[name][0]


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of file ``path`` and its metadata; a short or malformed file is a
    :class:`CheckpointFileError` naming the file and what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointFileError(f"{path} is truncated: {size} bytes, no safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise CheckpointFileError(f"{path} is not a safetensors file (header length {length})")
        raw = handle.read(length)
    if len(raw) < length:
        raise CheckpointFileError(f"{path} is truncated: its header needs {length} bytes, "
                                  f"the file has {size - 8}")
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise CheckpointFileError(f"{path}: unreadable safetensors header ({error})") from None
    metadata = header.pop("__metadata__", {}) or {}
    start = 8 + length
    entries = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(path, info["dtype"], tuple(info["shape"]),
                                    start + begin, start + end)
    needed = max((e.end for e in entries.values()), default=start)
    if size < needed:
        raise CheckpointFileError(f"{path} is truncated: its header describes {needed} bytes, "
                                  f"the file has {size}")
    return entries, metadata


def read_tensor(entry: TensorEntry) -> mx.array:
    """One tensor, read from its file (only its own bytes)."""
    dtype, np_dtype = _DTYPES.get(entry.dtype, (None, None))
    if dtype is None:
        raise CheckpointFileError(f"{entry.file}: dtype {entry.dtype!r} is not supported")
    with open(entry.file, "rb") as handle:
        handle.seek(entry.begin)
        data = handle.read(entry.nbytes)
    if len(data) != entry.nbytes:
        raise CheckpointFileError(f"{entry.file} is truncated while reading a tensor")
    array = mx.array(np.frombuffer(data, dtype=np_dtype).reshape(entry.shape))
    return array.view(dtype) if dtype == mx.bfloat16 else array


def tensor_bytes(array: mx.array) -> bytes:
    """An evaluated array's bytes, row-major, as safetensors stores them."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.ascontiguousarray(np.array(array)).tobytes()


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: mx.Dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.size


class ShardWriter:
    """Writes one safetensors file whose tensors are known in advance.

    The header is written at once; :meth:`write` then takes each tensor in the
    planned order and checks it is the planned dtype and shape. Use it as a
    context manager: leaving it closes the file.
    """

    def __init__(self, path: Path, tensors: list[PlannedTensor],
                 metadata: Mapping[str, str] | None = None):
        self.path = path
        self.tensors = tensors
        self.index = 0
        header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for tensor in tensors:
            header[tensor.name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                                   "data_offsets": [offset, offset + tensor.nbytes]}
            offset += tensor.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % _ALIGN)
        self.handle: BinaryIO = open(path, "wb")
        self.handle.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, array: mx.array) -> int:
        """Append tensor ``name``'s bytes; returns how many."""
        planned = self.tensors[self.index]
        if (name, array.dtype, tuple(array.shape)) != (planned.name, planned.dtype, planned.shape):
            raise AssertionError(f"{self.path.name}: expected {planned}, got {name} "
                                 f"{array.dtype} {tuple(array.shape)}")
        data = tensor_bytes(array)
        self.handle.write(data)
        self.index += 1
        return len(data)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        """Close the file; a shard left short without an error is a bug."""
        self.handle.close()
        if kind is None and self.index != len(self.tensors):
            raise AssertionError(f"{self.path.name}: {len(self.tensors) - self.index} tensors "
                                 "not written")
