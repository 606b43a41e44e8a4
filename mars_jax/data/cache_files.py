"""Reading the tokenized cache that `cache.py` builds: one data file's committed key
directory, checked on open and memory-mapped lazily (its layout: cache.py's docstring).

  f = FileCache(directory, path)   # raises CacheError for a cache that is not whole
  len(f), f.records, f.bad, f.where(e), f.example(e) -> (tokens, loss_mask) copies

Opening reads two files, the manifest and the index of every example, and checks every
shard file's size against the manifest; `verify=True` (`prepare --verify`, and after a
build) also reads every byte for its crc32. The token and mask arrays are memory-mapped
only when an example of their shard is read, at most `MAX_OPEN_SHARDS` shards at a time
(two file descriptors each), so a cache of any size holds a few dozen descriptors.
Nothing is written into the key's directory by reading it except, where it is
writable, `last_used` and `derived/` (both optional): a read-only cache reads.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import zlib
from typing import Callable

import numpy as np

MANIFEST, META, BAD, INDEX = "manifest.json", "meta.json", "bad.jsonl", "index.npz"
LAST_USED = "last_used"   # its mtime: when a reader last opened the key (prepare --list)
DERIVED = "derived"   # per-example values computed from a committed cache (per_example)
# Bump with what a build writes (cache.py folds it into the key): 3 is the content key,
# the one-file index and the manifest holding every shard's sizes.
FORMAT_VERSION = 3
MAX_OPEN_SHARDS = 16
_BLOCK = 16 << 20
_INDEX_ARRAYS = ("lines", "valid", "first_target", "lengths", "shard", "start")
_LOG = logging.getLogger(__name__)


def _tmp_name(what: str) -> str:
  """A temporary sibling's name: host and pid tell a dead writer's leftovers."""
  return f".tmp.{what}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      crc = zlib.crc32(block, crc)
  return crc


def derived_root() -> str:
  """Where per-example values of caches that cannot be written go:
  $MARS_JAX_DERIVED_CACHE, else ~/.cache/mars_jax/derived."""
  return os.environ.get("MARS_JAX_DERIVED_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "mars_jax", "derived")


class CacheError(ValueError):
  """A cache directory that is not whole: a missing, changed or damaged file.
  `damaged`: the key was committed and then broken (rebuilding it is the fix)."""

  def __init__(self, message: str, damaged: bool = True):
    super().__init__(message)
    self.damaged = damaged


def read_manifest(directory: str) -> dict | None:
  """The key's manifest: None when there is none (unfinished); CacheError when it does not
  parse or is of another format version."""
  path = os.path.join(directory, MANIFEST)
  try:
    with open(path) as f:
      manifest = json.load(f)
  except FileNotFoundError:
    return None
  except (ValueError, UnicodeDecodeError) as e:
    raise CacheError(f"{path}: damaged ({e}); delete {directory} and build it again "
                     "(python -m mars_jax.data.prepare).") from e
  if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
    raise CacheError(f"{path}: not a format-{FORMAT_VERSION} manifest; delete {directory} "
                     "and build it again (python -m mars_jax.data.prepare).")
  return manifest


def check_files(directory: str, manifest: dict, verify: bool) -> None:
  """Every file the manifest lists has its size (and with `verify` its crc32)."""
  listed = [(f"{directory}/{s['name']}/{name}", want)   # 7 files a shard: no os.path.join
            for s in manifest["shards"] for name, want in s["files"].items()]
  listed += [(f"{directory}/{name}", manifest["files"][name]) for name in (INDEX, BAD)]
  for where, want in listed:
    try:
      size = os.stat(where).st_size
    except FileNotFoundError:
      size = None
    if size != want["size"] or (verify and _crc32(where) != want["crc32"]):
      raise CacheError(f"{where}: {'missing' if size is None else 'changed'} since it was "
                       f"written (size or crc32 differ); delete {directory} and build it "
                       "again (python -m mars_jax.data.prepare).")


class FileCache:
  """One data path's committed cache, checked on open, its arrays memory-mapped lazily.

  Per example e (in file order): `lines[e]`, `valid[e]` (index among the file's
  well-formed records), `lengths[e]`, `first_target[e]`; `example(e)` -> (tokens
  int32[n], loss_mask bool[n]). `records`, `num_valid` and `bad` ([kind, where, reason]
  in file order) are the file's totals; `path` is the data path as the reader names it
  (the places of reports).
  """

  def __init__(self, directory: str, path: str, verify: bool = False, check: bool = True):
    """`check`: the files' sizes (and with `verify` their bytes); False for a key the
    caller has just checked."""
    self.directory, self.path = directory, path
    manifest = read_manifest(directory)
    if manifest is None:
      raise CacheError(f"{directory}: no {MANIFEST}; the cache was not finished (run "
                       "python -m mars_jax.data.prepare again to finish it).", damaged=False)
    if check or verify:
      check_files(directory, manifest, verify)
    self.manifest = manifest
    self.records, self.num_valid = manifest["records"], manifest["valid"]
    self.empty, self._rows = manifest["empty"], manifest["where"] == "row"
    with open(os.path.join(directory, BAD)) as f:
      self.bad = [[kind, self._where(line), reason] for kind, line, reason in map(json.loads, f)]
    with np.load(os.path.join(directory, INDEX)) as index:
      arrays = {a: index[a] for a in _INDEX_ARRAYS}
    self.lines, self.valid, self.first_target = arrays["lines"], arrays["valid"], arrays[
        "first_target"]
    self.lengths, self._shard, self._start = arrays["lengths"], arrays["shard"], arrays["start"]
    self._maps: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()   # readers on several threads share the LRU
    with contextlib.suppress(OSError):   # a read-only cache keeps no date of use
      with open(os.path.join(directory, LAST_USED), "w") as f:
        f.write(f"{time.time():.0f}\n")

  def __len__(self) -> int:
    return len(self.lengths)

  def _mapped(self, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard s's (tokens, loss_mask) maps; the least recently used past MAX_OPEN_SHARDS
    are dropped (a reader still copying from one keeps it until it is done)."""
    with self._lock:
      if s in self._maps:
        self._maps.move_to_end(s)
        return self._maps[s]
      name = self.manifest["shards"][s]["name"]
      maps = self._maps[s] = tuple(
          np.load(os.path.join(self.directory, name, f"{a}.npy"), mmap_mode="r")
          for a in ("tokens", "loss_mask"))
      while len(self._maps) > MAX_OPEN_SHARDS:   # examples are copies, so nothing else
        self._maps.popitem(last=False)          # holds the maps: their descriptors close
      return maps

  def example(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = self._mapped(int(self._shard[e]))
    a = int(self._start[e])
    b = a + int(self.lengths[e])
    return np.array(tokens[a:b]), np.array(mask[a:b])

  def open_files(self) -> int:
    """How many shards are mapped now (two descriptors each)."""
    return len(self._maps)

  def where(self, e: int) -> str:
    return self._where(int(self.lines[e]))

  def _where(self, line: int) -> str:
    return f"{self.path}:row {line}" if self._rows else f"{self.path}:{line}"

  def per_example(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
                  name: str) -> np.ndarray:
    """fn(loss_mask bool[T], offsets int[n + 1]) over each shard's examples, one value
    per example of the file (`name` must say what fn computes). Kept in the key's
    `derived/<name>.npy`, or, where the key cannot be written (a read-only cache), under
    `derived_root()/<key>/`, and read from there after."""
    places = [os.path.join(self.directory, DERIVED),
              os.path.join(derived_root(), os.path.basename(os.path.normpath(self.directory)))]
    for place in places:
      if os.path.isfile(os.path.join(place, f"{name}.npy")):
        return np.load(os.path.join(place, f"{name}.npy"))
    values = []
    for s, shard in enumerate(self.manifest["shards"]):
      offsets = np.load(os.path.join(self.directory, shard["name"], "offsets.npy"))
      values.append(fn(self._mapped(s)[1], offsets))
    out = np.concatenate(values) if values else np.zeros(0, np.int64)
    for place in places:
      try:
        os.makedirs(place, exist_ok=True)
        tmp = os.path.join(place, _tmp_name(name) + ".npy")
        np.save(tmp, out)
        os.replace(tmp, os.path.join(place, f"{name}.npy"))
        break
      except OSError as e:
        _LOG.info("data cache: cannot keep %s in %s (%s)", name, place, e)
    return out

  def __getstate__(self) -> dict:
    return {k: v for k, v in self.__dict__.items() if k not in ("_maps", "_lock")}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state, _maps=collections.OrderedDict(), _lock=threading.Lock())
