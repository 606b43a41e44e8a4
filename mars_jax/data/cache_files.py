"""Reading the tokenized cache that `cache.py` builds: one data file's committed key
directory, checked on open and memory-mapped (its layout: cache.py's docstring).

  f = FileCache(directory, path)   # raises CacheError for a cache that is not whole
  len(f), f.records, f.bad, f.where(e), f.example(e) -> (tokens, loss_mask) views
"""

from __future__ import annotations

import json
import os
import socket
import uuid
import zlib
from typing import Callable

import numpy as np

from mars_jax.data.sources import JSONL_SUFFIXES

MANIFEST, META, BAD = "manifest.json", "meta.json", "bad.jsonl"
DERIVED = "derived"   # per-example values computed from a committed cache (per_example)
_BLOCK = 16 << 20


def _tmp_name(what: str) -> str:
  """A temporary sibling's name: host and pid tell a dead writer's leftovers."""
  return f".tmp.{what}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      crc = zlib.crc32(block, crc)
  return crc


class CacheError(ValueError):
  """A cache directory that is not whole: a missing or changed file."""


class FileCache:
  """One data path's committed cache, checked on open, its arrays memory-mapped.

  Per example e (in file order): `lines[e]`, `valid[e]` (index among the file's
  well-formed records), `lengths[e]`, `first_target[e]`; `example(e)` -> (tokens
  int32[n], loss_mask bool[n]) views of the maps. `records`, `num_valid` and `bad`
  ([kind, where, reason] in file order) are the file's totals; `path` is the data path
  as the reader names it (the places of reports).
  """

  def __init__(self, directory: str, path: str, verify: bool = True):
    self.directory, self.path = directory, path
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
      raise CacheError(f"{directory}: no {MANIFEST}; the cache was not finished (run "
                       "python -m mars_jax.data.prepare again to finish it).")
    with open(manifest_path) as f:
      self.manifest = json.load(f)
    self.records, self.num_valid = self.manifest["records"], self.manifest["valid"]
    self.empty = self.manifest["empty"]
    metas = [self._meta(name, verify) for name in self.manifest["shards"]]
    self.bad: list[list[str]] = []
    for name in self.manifest["shards"]:
      with open(os.path.join(directory, name, BAD)) as f:
        self.bad += [[kind, self._where(line), reason]
                     for kind, line, reason in map(json.loads, f)]
    small = {a: [] for a in ("lines", "valid", "first_target", "lengths", "shard", "start")}
    base = 0
    for s, (name, meta) in enumerate(zip(self.manifest["shards"], metas)):
      load = lambda a: np.load(os.path.join(directory, name, f"{a}.npy"))  # noqa: E731
      offsets = load("offsets")
      small["lines"].append(load("lines"))
      small["valid"].append(load("valid") + base)
      small["first_target"].append(load("first_target"))
      small["lengths"].append(np.diff(offsets))
      small["start"].append(offsets[:-1])
      small["shard"].append(np.full(meta["examples"], s, np.int32))
      base += meta["valid"]
    cat = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in small.items()}
    self.lines, self.valid, self.first_target = cat["lines"], cat["valid"], cat["first_target"]
    self.lengths, self._shard, self._start = cat["lengths"], cat["shard"], cat["start"]
    self._maps: list | None = None

  def _meta(self, name: str, verify: bool) -> dict:
    shard = os.path.join(self.directory, name)
    try:
      with open(os.path.join(shard, META)) as f:
        meta = json.load(f)
    except FileNotFoundError as e:
      raise CacheError(f"{shard}: missing; delete {self.directory} and build it again "
                       "(python -m mars_jax.data.prepare).") from e
    for file, want in meta["files"].items():
      where = os.path.join(shard, file)
      size = os.path.getsize(where) if os.path.isfile(where) else None
      if size != want["size"] or (verify and _crc32(where) != want["crc32"]):
        raise CacheError(f"{where}: {'missing' if size is None else 'changed'} since it "
                         f"was written (size or crc32 differ); delete {self.directory} and "
                         "build it again (python -m mars_jax.data.prepare).")
    return meta

  def __len__(self) -> int:
    return len(self.lengths)

  def _mapped(self) -> list:
    if self._maps is None:
      self._maps = [tuple(np.load(os.path.join(self.directory, name, f"{a}.npy"),
                                  mmap_mode="r") for a in ("tokens", "loss_mask"))
                    for name in self.manifest["shards"]]
    return self._maps

  def example(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = self._mapped()[self._shard[e]]
    a = int(self._start[e])
    b = a + int(self.lengths[e])
    return tokens[a:b], mask[a:b]

  def where(self, e: int) -> str:
    return self._where(int(self.lines[e]))

  def _where(self, line: int) -> str:
    return f"{self.path}:{line}" if self.path.endswith(JSONL_SUFFIXES) else (
        f"{self.path}:row {line}")

  def per_example(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
                  name: str) -> np.ndarray:
    """fn(loss_mask bool[T], offsets int[n + 1]) over each shard's examples, one value
    per example of the file; kept in `derived/<name>.npy` of the key's directory and
    read from there after (`name` must say what fn computes)."""
    where = os.path.join(self.directory, DERIVED, f"{name}.npy")
    if os.path.isfile(where):
      return np.load(where)
    values = []
    for s, shard in enumerate(self.manifest["shards"]):
      offsets = np.load(os.path.join(self.directory, shard, "offsets.npy"))
      values.append(fn(self._mapped()[s][1], offsets))
    out = np.concatenate(values) if values else np.zeros(0, np.int64)
    os.makedirs(os.path.dirname(where), exist_ok=True)
    tmp = os.path.join(os.path.dirname(where), _tmp_name(name) + ".npy")
    np.save(tmp, out)
    os.replace(tmp, where)
    return out

  def __getstate__(self) -> dict:
    return {**self.__dict__, "_maps": None}
