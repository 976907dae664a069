"""A GGUF file's header, read straight from a memory map: metadata and tensor views.

The ``gguf`` package's reader makes a numpy view for every part of every metadata item; the
~100k vocabulary and merge strings of a tokenizer make that ~5 s of every load of the
embedded model (and of every process that only reads its config). Here the header is parsed
with ``struct`` (~0.1 s). Tensor data stay zero-copy views into the map, in the shapes and
dtypes ``gguf``'s reader gives them, so ``gguf.quants.dequantize`` takes them as before.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np

# GGUF value type -> its little-endian struct format (numpy reads the same codes as dtypes).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # a view into the file: float32/float16 values, or the raw bytes


@dataclasses.dataclass(frozen=True)
class GGUFContents:
    metadata: dict[str, Any]  # python values; None where a string is not UTF-8
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.offset = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        size = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + size
        if self.offset > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return self.buf[start:self.offset]

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.raw_string().decode("utf-8")
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind in _SCALARS:
            items = np.frombuffer(self.buf, _SCALARS[item_kind], count, self.offset)
            self.offset += items.nbytes
            return items.tolist()
        values, undecodable = [], None
        for _ in range(count):  # every item is consumed, so the fields after it still parse
            try:
                values.append(self.value(item_kind))
            except UnicodeDecodeError as e:
                undecodable = e
        if undecodable is not None:
            raise undecodable
        return values


def read_gguf(path: str) -> GGUFContents:
    """Parses ``path``'s header; raises ``ValueError`` (or ``OSError``) for what is not a
    little-endian GGUF file of version 2 or 3."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    try:
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        cur.offset = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian or unsupported); "
                             "versions 2 and 3 are read")
        tensor_count, kv_count = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {"GGUF.version": version,
                                    "GGUF.tensor_count": tensor_count,
                                    "GGUF.kv_count": kv_count}
        for _ in range(kv_count):
            key = cur.raw_string().decode("utf-8")
            try:
                metadata[key] = cur.value(cur.unpack("<I"))
            except UnicodeDecodeError:
                metadata[key] = None  # as gguf's reader: unreadable text, not a broken file
        infos = []
        for _ in range(tensor_count):
            name = cur.raw_string().decode("utf-8")
            dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        data_start = -(-cur.offset // alignment) * alignment
    except struct.error as e:
        raise ValueError(f"truncated GGUF header ({e})") from None

    q = GGMLQuantizationType
    plain = {q.F32: np.float32, q.F16: np.float16, q.F64: np.float64, q.I8: np.int8,
             q.I16: np.int16, q.I32: np.int32, q.I64: np.int64}
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name} appears twice")
        names.add(name)
        block_size, type_size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        if kind in plain:
            dtype = plain[kind]
        else:
            dtype, shape = np.uint8, quant_shape_to_byte_shape(shape, kind)
            count = count * type_size // block_size
        start = data_start + offset
        if start + count * np.dtype(dtype).itemsize > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(buf, dtype, count, start).reshape(shape)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return GGUFContents(metadata, tensors)
