"""Zero-copy reads of ``*.safetensors`` files into numpy (bfloat16 and float8_e4m3fn via
ml_dtypes)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from jaxllm.errors import ModelLoadError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


class SafetensorsFile:
    """Memory-maps one file; ``get(name)`` returns a read-only view without copying."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > os.path.getsize(path) - 8:
                    raise ValueError(f"header length {header_len} exceeds the file size")
                header = json.loads(f.read(header_len))
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + header_len
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r") if header else None

    def names(self) -> Iterator[str]:
        return iter(self._entries)

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported dtype "
                                 f"{entry['dtype']}")
        start, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + start: self._data_start + end]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end < start or raw.size != count * np.dtype(dtype).itemsize:
            raise ModelLoadError(f"{self.path}: tensor {name!r} data is truncated or its "
                                 f"offsets {entry['data_offsets']} do not match its shape")
        return raw.view(dtype).reshape(entry["shape"])


def open_checkpoint(model_dir: str) -> dict[str, SafetensorsFile]:
    """Maps every tensor name of a (possibly sharded) checkpoint to the file holding it."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = {name: SafetensorsFile(os.path.join(model_dir, name))
                 for name in sorted(set(weight_map.values()))}
        return {tensor: files[file] for tensor, file in weight_map.items()}
    shards = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found (only safetensors "
                             "checkpoints are supported; convert .bin files first)")
    mapping: dict[str, SafetensorsFile] = {}
    for shard in shards:
        st = SafetensorsFile(os.path.join(model_dir, shard))
        mapping.update((name, st) for name in st.names())
    return mapping
