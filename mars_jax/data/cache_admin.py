"""Listing and cleaning the tokenized cache's keys (`python -m mars_jax.data.prepare
--list` and `--clean`; the layout: cache.py's docstring).

  for k in keys(cache_dir): k.name, k.state, k.bytes, k.source, k.last_used
  removed = clean(cache_dir, older_than=None)   # -> the keys removed

Only directories this project wrote (a key.json or manifest.json in them) are ever
removed; anything else in the cache directory is listed as "not a cache key" and left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from mars_jax.data import cache
from mars_jax.data.cache_files import LAST_USED, MANIFEST, CacheError, _tmp_name, read_manifest

UNFINISHED_AFTER_S = 24 * 3600   # an unfinished key untouched this long is abandoned


@dataclasses.dataclass(frozen=True)
class Key:
  """One entry of the cache directory. state: "complete", "unfinished" (no manifest),
  "damaged" (a manifest that does not parse), "old format" (another FORMAT_VERSION:
  never read again) or "not a cache key"."""
  name: str
  path: str
  state: str
  bytes: int
  source: str
  records: int | None
  tokens: int | None
  last_used: float      # last_used's mtime, else the newest file's
  changed: float        # the newest file's mtime


def _walk(path: str) -> tuple[int, float]:
  size, newest = 0, os.stat(path).st_mtime
  for root, _, files in os.walk(path):
    for name in files:
      with_stat = os.stat(os.path.join(root, name))
      size += with_stat.st_size
      newest = max(newest, with_stat.st_mtime)
  return size, newest


def keys(cache_dir: str) -> list[Key]:
  """Every entry of `cache_dir` but its hidden ones (.stat, temporary files), by name."""
  out = []
  for name in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []:
    path = os.path.join(cache_dir, name)
    if name.startswith(".") or not os.path.isdir(path):
      continue
    size, newest = _walk(path)
    ours = any(os.path.isfile(os.path.join(path, f)) for f in (cache.KEY_FILE, MANIFEST))
    manifest, state = None, "not a cache key"
    if ours:
      try:
        manifest = read_manifest(path)
        state = "complete" if manifest else "unfinished"
      except CacheError:
        state = "damaged"
        with open(os.path.join(path, MANIFEST)) as f:   # another format's manifest
          try:
            if json.load(f).get("format_version") != cache.FORMAT_VERSION:
              state = "old format"
          except (ValueError, AttributeError):
            pass
    source = ""
    if os.path.isfile(os.path.join(path, cache.KEY_FILE)):
      try:
        with open(os.path.join(path, cache.KEY_FILE)) as f:
          record = json.load(f)
        source = record.get("built_from") or (record.get("data") or [{}])[0].get("path", "")
      except (ValueError, OSError, AttributeError, IndexError):
        source = "?"
    used = os.path.join(path, LAST_USED)
    out.append(Key(name, path, state, size, source,
                   manifest["records"] if manifest else None,
                   manifest["tokens"] if manifest else None,
                   os.stat(used).st_mtime if os.path.isfile(used) else newest, newest))
  return out


def clean(cache_dir: str, older_than: float | None = None, dry_run: bool = False,
          now: float | None = None) -> list[Key]:
  """Removes the keys no run will read: damaged ones, those of an old format, unfinished
  ones untouched for a day (or since `older_than`), and, with `older_than` (a time),
  complete ones last used before it; also this host's dead builders' temporary files.
  Returns the keys removed (with `dry_run`, that would be)."""
  now = time.time() if now is None else now
  gone = []
  for key in keys(cache_dir):
    if key.state == "not a cache key":
      continue
    stale = key.changed < (older_than if older_than is not None else now - UNFINISHED_AFTER_S)
    if (key.state in ("damaged", "old format") or (key.state == "unfinished" and stale)
        or (key.state == "complete" and older_than is not None
            and key.last_used < older_than)):
      gone.append(key)
      if not dry_run:   # renamed first, so a reader never sees half a key
        grave = os.path.join(cache_dir, _tmp_name("removed"))
        os.rename(key.path, grave)
        shutil.rmtree(grave)
  if not dry_run and os.path.isdir(cache_dir):
    cache.clear_stale(cache_dir)
  return gone


def describe(key: Key) -> str:
  """One line of `prepare --list`."""
  counts = (f"{key.records} records, {key.tokens} tokens" if key.records is not None
            else "-")
  used = time.strftime("%Y-%m-%d %H:%M", time.localtime(key.last_used))
  return (f"{key.name}  {key.state:<15} {key.bytes / 2**20:9.1f} MiB  {counts:<32} "
          f"last used {used}  {key.source}")
