"""The tokenized cache: each data file tokenized once into flat memory-mapped arrays,
built in parallel and resumably, read lazily by offset (docs/data.md, "The tokenized
cache").

  files = ensure(paths, tokenizer, settings, cache_dir=default_dir(), workers=0)
  files[0].records, files[0].bad, files[0].example(3)  # -> (tokens, loss_mask)

This module builds; `cache_files.py` opens, checks and reads what it built;
`cache_admin.py` lists and cleans keys.

Layout: one directory per key, `CACHE_DIR/<key>/`, where the key hashes everything
that changes the tokens of one file: the file's content (its size and the sha256 of
all its bytes, or with `data.cache_hash=sample` of its first and last MiB), never its
path or dates, so a copy on another mount or a download of the same bytes finds the
same key; the tokenizer (its whole serialized form, special tokens and chat templates),
`template_kwargs`, `train_on`, the record format, the shard size and
cache_files.FORMAT_VERSION. Not the seed, row length, truncation, packing, held-out
split or process count: those are applied when reading (pipeline.py). A changed file,
tokenizer or template is another key, so old tokens are never read for new inputs. A
file's content hash is computed once per (path, size, mtime, inode) and remembered in
`CACHE_DIR/.stat/` (where it can be written).

  <key>/key.json         what the key hashes, and the path that built it (for people)
  <key>/shard-00000/     records [0, S) of the file (lines of JSONL, rows of tables):
      tokens.npy   int32[T]   every kept example's tokens, untruncated, back to back
      loss_mask.npy bool[T]   targets
      offsets.npy  int64[n+1] example i is tokens[offsets[i]:offsets[i+1]]
      lines.npy    int64[n]   its line (JSONL, from 1) or row (tables, arrays, from 0)
      valid.npy    int64[n]   its index among the shard's well-formed records
      first_target.npy int32[n] its first target's position
      bad.jsonl               the shard's bad records: [kind, line or row, reason]
      meta.json               counts and each file's size and crc32 (written last)
  <key>/index.npz        every example's line, valid index, first target, length,
                         shard and start, for the whole file (one read on open)
  <key>/bad.jsonl        every shard's bad records, in file order
  <key>/manifest.json    the commit: the shards with every file's size and crc32, and
                         the file's totals; written when every shard is
  <key>/last_used        touched by readers (prepare --list)
  <key>/derived/NAME.npy a value per example computed from the cache, e.g. the
                         objective's target-block lengths (FileCache.per_example)

A shard is written into a temporary directory, its files and the directory synced, and
renamed into place, so it exists whole or not at all; the index, the bad records and
then the manifest are written the same way, and the manifest is the commit. A build
killed at any point loses only the shards being written (one per worker); the next
build finds the rest and finishes. A build that fails (a full disk, a worker that
raises) stops the other workers, removes its temporary files and raises what failed.
Opening a committed key checks every file's size against the manifest (every byte's
crc32 after a build and under `prepare --verify`); a damaged key (a manifest that does
not parse, a file of the wrong size) is rebuilt where it can be written and refused
with the fix where it cannot.

Compressed JSONL (.jsonl.gz, .jsonl.zst) and JSON-array files (.json holding one list
of records) are first written out as JSON lines beside the shards being built, and
removed after. Parquet shards are whole row groups (a row group larger than a shard is
one shard, read in batches).

Building: the records of all files are cut into shards of `shard_records`; process p
of k builds shards p, p+k, ... with a pool of `workers` forked processes (0: the CPUs
this process may run on), waits at `barrier` (all processes), then builds any shard
still missing (a cache directory that is not shared between hosts), so every process
reads the union.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import socket
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from mars_jax.data import formats
from mars_jax.data.cache_files import (_BLOCK, BAD, FORMAT_VERSION, INDEX, MANIFEST, META,
                                       CacheError, FileCache, _crc32, _tmp_name, check_files,
                                       read_manifest)
from mars_jax.data.cache_units import Unit, kind_of, materialize, needs_materializing, plan, records
from mars_jax.data.examples import first_target, tokenize_chats
from mars_jax.data.sources import _chat

_LOG = logging.getLogger(__name__)
SHARD_RECORDS = 5_000
KEY_FILE = "key.json"
STAT_DIR = ".stat"
_SAMPLE_BYTES = 1 << 20


def default_dir() -> str:
  """$MARS_JAX_DATA_CACHE, else ~/.cache/mars_jax/data."""
  return os.environ.get("MARS_JAX_DATA_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "mars_jax", "data")


def default_workers() -> int:
  """The CPUs this process may run on (its affinity; a cgroup's quota is not seen)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # no affinity on this OS
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class Settings:
  """What, besides the file and the tokenizer, changes a file's cached tokens."""
  fmt: str = "auto"
  train_on: str = "all"
  template_kwargs: str = "{}"     # JSON, sorted keys
  full_hash: bool = True          # hash every byte of a file, not its first and last MiB
  shard_records: int = SHARD_RECORDS


def tokenizer_fingerprint(tokenizer) -> str:
  """A hash of what decides how the tokenizer tokenizes and renders chats."""
  h = hashlib.sha256()
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is None:
    raise ValueError(f"the data cache needs a fast tokenizer (got {type(tokenizer).__name__});"
                     " set data.cache=False to tokenize in memory instead.")
  template = tokenizer.chat_template or ""   # a dict: several named templates
  for part in (type(tokenizer).__name__, backend.to_str(),
               template if isinstance(template, str) else json.dumps(template, sort_keys=True),
               json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
               json.dumps(sorted(tokenizer.all_special_ids))):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()


def _data_files(path: str) -> list[str]:
  """The files a data path consists of: itself, or a save_to_disk directory's files."""
  if os.path.isdir(path):
    return sorted(os.path.join(path, name) for name in os.listdir(path)
                  if os.path.isfile(os.path.join(path, name)))
  return [path]


def _content_hash(path: str, size: int, full: bool) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    if full or size <= 2 * _SAMPLE_BYTES:
      while block := f.read(_BLOCK):
        h.update(block)
    else:
      h.update(f.read(_SAMPLE_BYTES))
      f.seek(size - _SAMPLE_BYTES)
      h.update(f.read(_SAMPLE_BYTES))
  return h.hexdigest()


def _remembered_hash(name: str, full: bool, stat_dir: str | None) -> str:
  """The content hash of one file, read from `stat_dir` when the file's path, size,
  mtime and inode are those it was hashed at, else computed (and kept there)."""
  st = os.stat(name)
  seen = {"path": os.path.abspath(name), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
          "inode": st.st_ino, "device": st.st_dev, "full": full}
  memo = None
  if stat_dir is not None:
    memo = os.path.join(stat_dir, hashlib.sha256(
        json.dumps(seen, sort_keys=True).encode()).hexdigest()[:32] + ".json")
    with contextlib.suppress(OSError, ValueError):
      with open(memo) as f:
        kept = json.load(f)
      if {k: kept.get(k) for k in seen} == seen:
        return kept["sha256"]
  digest = _content_hash(name, st.st_size, full)
  if memo is not None:
    with contextlib.suppress(OSError):
      os.makedirs(stat_dir, exist_ok=True)
      _write_json(stat_dir, os.path.basename(memo), {**seen, "sha256": digest}, sync=False)
  return digest


def file_identity(path: str, full_hash: bool, stat_dir: str | None = None) -> list[dict]:
  """Size and content hash of each file of a data path (a save_to_disk directory's
  files by name within it): what the key hashes, not where the file is."""
  names = _data_files(path)
  return [{**({"file": os.path.basename(n)} if os.path.isdir(path) else {}),
           "size": os.path.getsize(n), "sha256": _remembered_hash(n, full_hash, stat_dir)}
          for n in names]


def key_of(path: str, tokenizer_id: str, settings: Settings,
           stat_dir: str | None = None) -> tuple[str, dict]:
  """(the key of one data path's cache, the record of what it hashes)."""
  record = {"format_version": FORMAT_VERSION,
            "data": file_identity(path, settings.full_hash, stat_dir),
            "tokenizer": tokenizer_id, **dataclasses.asdict(settings)}
  digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]
  return digest, record


# ---- building one shard ---------------------------------------------------------------


def build_unit(unit: Unit, tokenizer, settings: Settings) -> dict:
  """Tokenizes one shard and commits it (see the module docstring); returns its meta."""
  bad, chats, counts = [], [], {"records": 0, "valid": 0}
  for line, record in records(unit):
    counts["records"] += 1
    if isinstance(record, formats.RecordError):
      bad.append([record.kind, line, record.reason])
      continue
    messages, problem = _chat(record, unit.fmt)
    if problem:
      bad.append([problem[0], line, problem[1]])
      continue
    chats.append(((line, counts["valid"]), messages))
    counts["valid"] += 1
  tokens, masks, lines, valid, firsts = [], [], [], [], []
  for (line, v), out in tokenize_chats(
      tokenizer, chats, train_on=settings.train_on,
      template_kwargs=json.loads(settings.template_kwargs)):
    if isinstance(out, Exception):
      bad.append(["template_error", line, str(out)])
      continue
    tokens.append(out["tokens"])
    masks.append(out["loss_mask"])
    lines.append(line)
    valid.append(v)
    firsts.append(first_target(out["loss_mask"]))
  lengths = np.asarray([len(t) for t in tokens], np.int64)
  arrays = {
      "tokens": np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32),
      "loss_mask": np.concatenate(masks).astype(bool) if masks else np.zeros(0, bool),
      "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
      "lines": np.asarray(lines, np.int64), "valid": np.asarray(valid, np.int64),
      "first_target": np.asarray(firsts, np.int32)}
  bad.sort(key=lambda b: b[1])
  return _commit_shard(unit, arrays, bad, counts)


def _fsync(path: str) -> None:
  """Syncs a file or directory to its storage."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _rename_or_yield(tmp: str, final: str) -> None:
  """Renames the temporary directory into place; if another process committed `final`
  first (it exists, not empty), keeps theirs. Any other error is raised."""
  try:
    os.rename(tmp, final)
  except OSError as e:
    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
      raise
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _removed_on_error(path: str):
  """Removes `path` (a temporary file or directory) if the block raises."""
  try:
    yield
  except BaseException:
    if os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(OSError):
        os.remove(path)
    raise


def _commit_shard(unit: Unit, arrays: dict, bad: list, counts: dict) -> dict:
  tmp = os.path.join(unit.directory, _tmp_name(unit.name))
  with _removed_on_error(tmp):
    os.makedirs(tmp)
    files = {}
    for name, value in arrays.items():
      np.save(os.path.join(tmp, f"{name}.npy"), value)
    with open(os.path.join(tmp, BAD), "w") as f:
      f.write("".join(json.dumps(b) + "\n" for b in bad))
    for name in [f"{a}.npy" for a in arrays] + [BAD]:
      where = os.path.join(tmp, name)
      files[name] = {"size": os.path.getsize(where), "crc32": _crc32(where)}
      _fsync(where)
    meta = {"records": counts["records"], "valid": counts["valid"],
            "examples": len(arrays["lines"]), "tokens": len(arrays["tokens"]),
            "bad": len(bad), "begin": unit.begin, "end": unit.end, "files": files}
    _write_json(tmp, META, meta)
    _fsync(tmp)
    _rename_or_yield(tmp, os.path.join(unit.directory, unit.name))
  _fsync(unit.directory)
  return meta


# ---- the pool ---------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


@contextlib.contextmanager
def _one_core():
  """The tokenizer's batches on one thread (as in a worker), so W processes use W cores."""
  before = os.environ.get("TOKENIZERS_PARALLELISM")
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  try:
    yield
  finally:
    if before is None:
      del os.environ["TOKENIZERS_PARALLELISM"]
    else:
      os.environ["TOKENIZERS_PARALLELISM"] = before


def _init_worker(tokenizer, settings: Settings) -> None:
  os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one core a worker
  _WORKER.update(tokenizer=tokenizer, settings=settings)


def _build_in_worker(unit: Unit) -> dict:
  return build_unit(unit, _WORKER["tokenizer"], _WORKER["settings"])


def _built(unit: Unit, tokenizer, settings: Settings) -> dict:
  """build_unit, an exception noted with the shard and the key it was for."""
  try:
    return build_unit(unit, tokenizer, settings)
  except Exception as e:
    e.add_note(f"while tokenizing {unit.name} (records {unit.begin}-{unit.end}) of "
               f"{unit.path} into {unit.directory}")
    raise


def _build_noted(unit: Unit) -> dict:
  return _built(unit, _WORKER["tokenizer"], _WORKER["settings"])


def _is_committed(unit: Unit) -> bool:
  return os.path.isfile(os.path.join(unit.directory, unit.name, META))


def _run(units: Sequence[Unit], tokenizer, settings: Settings, workers: int,
         progress: Callable[[int, int], None]) -> None:
  """Builds `units` with `workers` processes (in this one when 1). The first failure
  cancels the shards not started, waits for those running, and is raised."""
  if not units:
    return
  if workers <= 1 or len(units) == 1:
    with _one_core():
      for i, unit in enumerate(units):
        _built(unit, tokenizer, settings)
        progress(i + 1, len(units))
    return
  # fork: the workers inherit the tokenizer, and a script without a __main__ guard
  # still works; they run only numpy and the tokenizer, never JAX.
  ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
  with concurrent.futures.ProcessPoolExecutor(
      min(workers, len(units)), mp_context=ctx, initializer=_init_worker,
      initargs=(tokenizer, settings)) as pool, warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
    futures = [pool.submit(_build_noted, u) for u in units]
    try:
      for i, future in enumerate(concurrent.futures.as_completed(futures)):
        future.result()
        progress(i + 1, len(units))
    except BaseException:
      pool.shutdown(wait=True, cancel_futures=True)
      raise


_TMP = re.compile(r"^\.tmp\..*\.(\d+)\.[0-9a-f]{8}(\.\w+)?$")


def clear_stale(directory: str) -> int:
  """Removes the temporary files and shards this host's dead processes left in
  `directory`; returns how many."""
  host, removed = socket.gethostname(), 0
  for name in os.listdir(directory):
    m = _TMP.match(name)
    if not m or f".{host}.{m.group(1)}." not in name:
      continue
    try:
      os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
      where = os.path.join(directory, name)
      if os.path.isdir(where):
        shutil.rmtree(where, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.remove(where)
      removed += 1
    except PermissionError:
      pass
  return removed


def _write_json(directory: str, name: str, value: Any, sync: bool = True) -> None:
  """Writes `name` in `directory` whole or not at all (a temporary file renamed), synced
  to storage with `sync`."""
  tmp = os.path.join(directory, _tmp_name(name))
  with _removed_on_error(tmp):
    with open(tmp, "w") as f:
      json.dump(value, f, indent=1, sort_keys=True)
      if sync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))
  if sync:
    _fsync(directory)


def _write_file(directory: str, name: str, write: Callable[[str], None]) -> dict:
  """`write(tmp)` then the rename into place, synced; -> {"size", "crc32"} of the file."""
  tmp = os.path.join(directory, _tmp_name(name))
  with _removed_on_error(tmp):
    write(tmp)
    _fsync(tmp)
    done = {"size": os.path.getsize(tmp), "crc32": _crc32(tmp)}
    os.replace(tmp, os.path.join(directory, name))
  return done


def _commit(directory: str, units: Sequence[Unit], any_record: bool, path: str) -> None:
  """Writes the key's index, bad records and then the manifest (the commit)."""
  metas, small, bad_lines, base = [], {a: [] for a in _INDEX}, [], 0
  for s, unit in enumerate(units):
    shard = os.path.join(directory, unit.name)
    with open(os.path.join(shard, META)) as f:
      meta = json.load(f)
    metas.append(meta)
    load = lambda a: np.load(os.path.join(shard, f"{a}.npy"))  # noqa: E731
    offsets = load("offsets")
    small["lines"].append(load("lines"))
    small["valid"].append(load("valid") + base)
    small["first_target"].append(load("first_target"))
    small["lengths"].append(np.diff(offsets))
    small["start"].append(offsets[:-1])
    small["shard"].append(np.full(meta["examples"], s, np.int32))
    with open(os.path.join(shard, BAD)) as f:
      bad_lines.append(f.read())
    base += meta["valid"]
  index = {a: np.concatenate(v) if v else np.zeros(0, _INDEX[a]) for a, v in small.items()}

  def save_index(tmp: str) -> None:
    with open(tmp, "wb") as f:
      np.savez(f, **index)

  def save_bad(tmp: str) -> None:
    with open(tmp, "w") as f:
      f.write("".join(bad_lines))

  files = {INDEX: _write_file(directory, INDEX, save_index),
           BAD: _write_file(directory, BAD, save_bad)}
  _write_json(directory, MANIFEST, {
      "format_version": FORMAT_VERSION, "path": path, "empty": not any_record,
      "where": "row" if units and units[0].rows else "line", "files": files,
      "shards": [{"name": u.name, "files": m["files"], "examples": m["examples"]}
                 for u, m in zip(units, metas)],
      "records": sum(m["records"] for m in metas), "valid": sum(m["valid"] for m in metas),
      "examples": sum(m["examples"] for m in metas), "tokens": sum(m["tokens"] for m in metas),
      "bad": sum(m["bad"] for m in metas)})


_INDEX = {"lines": np.int64, "valid": np.int64, "first_target": np.int32,
          "lengths": np.int64, "shard": np.int32, "start": np.int64}


@dataclasses.dataclass
class BuildReport:
  """What `ensure` did: shards built here, shards found built, keys rebuilt because
  they were damaged, seconds."""
  built: int = 0
  reused: int = 0
  repaired: int = 0
  seconds: float = 0.0


def _writable(directory: str) -> bool:
  return os.path.isdir(directory) and os.access(directory, os.W_OK)


def _make_dir(directory: str, writable: bool) -> None:
  """Creates `directory` if missing; with `writable`, it must also be writable (a read-
  only cache directory is fine for keys that are already built)."""
  try:
    os.makedirs(directory, exist_ok=True)
    problem = "not writable" if writable and not _writable(directory) else None
  except OSError as e:
    problem = f"cannot be created ({e})"
  if problem:
    raise ValueError(f"{directory}: {problem}; set data.cache_dir or $MARS_JAX_DATA_CACHE "
                     "to a writable directory, or data.cache=False.")


def _complete(directory: str, report: BuildReport, verify: bool) -> bool:
  """Whether the key in `directory` is committed and whole (sizes; with `verify` every
  byte's crc32); a damaged one is removed (counted in `report.repaired`) where it can
  be, else refused with the fix."""
  try:
    manifest = read_manifest(directory)
    if manifest is None:
      return False
    check_files(directory, manifest, verify=verify)
    return True
  except CacheError as e:
    if not _writable(os.path.dirname(directory)) or not _writable(directory):
      raise CacheError(f"{e} (The cache cannot be written here: build it where it can "
                       "be, or set data.cache_dir to a writable directory.)") from e
    _LOG.warning("data cache: %s; building it again", e)
    graveyard = os.path.join(os.path.dirname(directory), _tmp_name("damaged"))
    with contextlib.suppress(FileNotFoundError):   # another process moved it first
      os.rename(directory, graveyard)
      shutil.rmtree(graveyard, ignore_errors=True)
    report.repaired += 1
    return False


def ensure(paths: Sequence[str], tokenizer, settings: Settings, *, cache_dir: str,
           workers: int = 0, process_index: int = 0, process_count: int = 1,
           barrier: Callable[[], None] = lambda: None,
           report: BuildReport | None = None, verify: bool = False) -> list[FileCache]:
  """The opened, checked caches of `paths` (one per path, in order), building what is
  missing: `workers` processes (0: the CPUs this process may run on); this process's
  share of the shards when `process_count` > 1, then `barrier`, then whatever is still
  missing. Keys built here are checked byte for byte (crc32), and with `verify` those
  found built too (a damaged one is rebuilt); the others by their files' sizes."""
  begin = time.perf_counter()
  report = report if report is not None else BuildReport()
  tok_id = tokenizer_fingerprint(tokenizer)
  _make_dir(cache_dir, writable=False)
  stat_dir = os.path.join(cache_dir, STAT_DIR) if _writable(cache_dir) else None
  keys = [key_of(path, tok_id, settings, stat_dir) for path in paths]
  todo, sources = [], []
  try:
    for path, (key, record) in zip(paths, keys):
      directory = os.path.join(cache_dir, key)
      if any(directory == d for _, d, _, _ in todo) or _complete(directory, report, verify):
        continue
      _make_dir(directory, writable=True)
      clear_stale(directory)
      _write_json(directory, KEY_FILE, {**record, "built_from": os.path.abspath(path)})
      read_path, rows = None, kind_of(path) != "jsonl"
      if needs_materializing(path):
        read_path, rows = materialize(path, directory)
        sources.append(read_path)
      todo.append((path, directory, *plan(path, directory, settings.shard_records,
                                          settings.fmt, read_path, rows)))
    units = [u for _, _, us, _ in todo for u in us]
    mine = [u for i, u in enumerate(units) if i % process_count == process_index]
    missing = [u for u in mine if not _is_committed(u)]
    workers = workers or default_workers()
    if missing:
      _LOG.info("data cache: tokenizing %d shards of %d records with %d workers into %s",
                len(missing), settings.shard_records, min(workers, len(missing)), cache_dir)
    _run(missing, tokenizer, settings, workers, _progress(time.perf_counter()))
    built = len(missing)
    if process_count > 1:
      barrier()
      rest = [u for u in units if not _is_committed(u)]
      if rest:
        _LOG.info("data cache: %d shards other processes built are not here (a cache_dir "
                  "not shared between hosts?); building them", len(rest))
        _run(rest, tokenizer, settings, workers, _progress(time.perf_counter()))
        built += len(rest)
    for path, directory, us, any_record in todo:
      _commit(directory, us, any_record, path)
  finally:
    for source in sources:
      with contextlib.suppress(OSError):
        os.remove(source)
  fresh = {d for _, d, _, _ in todo}   # the others were checked by _complete
  opened = [FileCache(os.path.join(cache_dir, key), path,
                      verify=os.path.join(cache_dir, key) in fresh, check=False)
            for path, (key, _) in zip(paths, keys)]
  report.built += built
  shards = sum(len(f.manifest["shards"]) for f in {f.directory: f for f in opened}.values())
  report.reused += shards - built
  report.seconds += time.perf_counter() - begin
  return opened


def _progress(begin: float) -> Callable[[int, int], None]:
  def show(done: int, total: int) -> None:
    if done == total or done % max(1, total // 10) == 0:
      _LOG.info("data cache: %d/%d shards (%.0f s)", done, total,
                time.perf_counter() - begin)
  return show
