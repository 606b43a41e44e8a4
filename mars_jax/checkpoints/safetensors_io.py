"""Minimal safetensors reader and writer on numpy (bfloat16 through ml_dtypes).

Tensors are read one at a time from a memory map, so loading never holds a whole
file in memory; files are written one shard at a time. The format: 8-byte
little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`,
then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """Lazy view of one .safetensors file; `get(name)` reads one tensor."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header); "
                         "re-download or re-export it.")
      (n,) = struct.unpack("<Q", head)
      if 8 + n > size:
        raise ValueError(f"{path}: truncated safetensors file (header says {n} bytes, file "
                         f"has {size}); re-download or re-export it.")
      try:
        header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e}); re-download or "
                         "re-export it.") from e
    header.pop("__metadata__", None)
    self.header = header
    self.data_start = 8 + n
    end = max((h["data_offsets"][1] for h in header.values()), default=0)
    if self.data_start + end > size:
      raise ValueError(f"{path}: truncated safetensors file (tensors need "
                       f"{self.data_start + end} bytes, file has {size}); re-download or "
                       "re-export it.")

  def keys(self) -> list[str]:
    return list(self.header)

  def get(self, name: str) -> np.ndarray:
    h = self.header[name]
    if h["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {h['dtype']}.")
    dtype = _DTYPES[h["dtype"]]
    start, end = h["data_offsets"]
    count = (end - start) // dtype.itemsize
    arr = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + start,
                    shape=(count,))
    return np.asarray(arr).reshape(h["shape"])


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]],
          metadata: dict[str, str] | None = None) -> None:
  """Writes (name, array) pairs to one .safetensors file."""
  tensors = [(name, np.ascontiguousarray(a)) for name, a in tensors]
  header: dict = {"__metadata__": metadata or {"format": "pt"}}
  offset = 0
  for name, a in tensors:
    if a.dtype not in _NAMES:
      raise ValueError(f"cannot write tensor {name} of dtype {a.dtype} to safetensors.")
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for _, a in tensors:
      f.write(a.tobytes())


def np_dtype(name: str) -> np.dtype:
  """'float32' | 'bfloat16' | 'float16' -> numpy dtype."""
  return {"float32": np.dtype(np.float32), "bfloat16": _DTYPES["BF16"],
          "float16": np.dtype(np.float16)}[name]
