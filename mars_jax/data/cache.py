"""The tokenized cache: each data file tokenized once into flat memory-mapped arrays,
built in parallel and resumably, read lazily by offset (docs/data.md, "The tokenized
cache").

  files = ensure(paths, tokenizer, settings, cache_dir=default_dir(), workers=0)
  files[0].records, files[0].bad, files[0].example(3)  # -> (tokens, loss_mask) views

This module builds; `cache_files.py` opens, checks and reads what it built.

Layout: one directory per key, `CACHE_DIR/<key>/`, where the key hashes everything
that changes the tokens of one file: the file's identity (path, size, mtime and a hash
of its bytes: the first and last MiB, or all of them with `full_hash`), the
tokenizer (its whole serialized form, special tokens and chat template),
`template_kwargs`, `train_on`, the record format, the shard size and FORMAT_VERSION.
Not the seed, row length, truncation, packing, held-out split or process count:
those are applied when reading (pipeline.py). A changed file, tokenizer or template
is another key, so old tokens are never read for new inputs.

  <key>/key.json         what the key hashes (for people)
  <key>/shard-00000/     records [0, S) of the file (lines of JSONL, rows of tables):
      tokens.npy   int32[T]   every kept example's tokens, untruncated, back to back
      loss_mask.npy bool[T]   targets
      offsets.npy  int64[n+1] example i is tokens[offsets[i]:offsets[i+1]]
      lines.npy    int64[n]   its line (JSONL, from 1) or row (tables, from 0)
      valid.npy    int64[n]   its index among the shard's well-formed records
      first_target.npy int32[n] its first target's position
      bad.jsonl               the shard's bad records: [kind, line or row, reason]
      meta.json               counts and each file's size and crc32 (written last)
  <key>/manifest.json    the shards and the file's totals: written when every shard is
  <key>/derived/NAME.npy a value per example computed from the cache, e.g. the
                         objective's target-block lengths (FileCache.per_example)

A shard is written into a temporary directory and renamed into place, so it exists
whole or not at all; the manifest, written last the same way, is the commit. A build
killed at any point loses only the shards being written (one per worker); the next
build finds the rest and finishes. Opening a committed key checks every array's size
and crc32 against its shard's meta.json.

Building: the records of all files are cut into shards of `shard_records`; process p
of k builds shards p, p+k, ... with a pool of `workers` forked processes, waits at
`barrier` (all processes), then builds any shard still missing (a cache directory
that is not shared between hosts), so every process reads the union.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import socket
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from mars_jax.data import formats
from mars_jax.data.cache_files import _BLOCK, BAD, MANIFEST, META, FileCache, _crc32, _tmp_name
from mars_jax.data.examples import first_target, tokenize_chats
from mars_jax.data.sources import (ARROW_STATE, JSONL_SUFFIXES, PARQUET_SUFFIXES, _chat,
                                   _format_of, _parse, read_arrow_dataset)

_LOG = logging.getLogger(__name__)
# In the key: bump it when what a build writes changes. 2: Qwen3 thinking turns are
# targets from <think> through the reply (chat.py).
FORMAT_VERSION = 2
SHARD_RECORDS = 5_000
KEY_FILE = "key.json"
_SAMPLE_BYTES = 1 << 20


def default_dir() -> str:
  """$MARS_JAX_DATA_CACHE, else ~/.cache/mars_jax/data."""
  return os.environ.get("MARS_JAX_DATA_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "mars_jax", "data")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What, besides the file and the tokenizer, changes a file's cached tokens."""
  fmt: str = "auto"
  train_on: str = "all"
  template_kwargs: str = "{}"     # JSON, sorted keys
  full_hash: bool = False         # hash every byte of a file, not its first and last MiB
  shard_records: int = SHARD_RECORDS


def tokenizer_fingerprint(tokenizer) -> str:
  """A hash of what decides how the tokenizer tokenizes and renders chats."""
  h = hashlib.sha256()
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is None:
    raise ValueError(f"the data cache needs a fast tokenizer (got {type(tokenizer).__name__});"
                     " set data.cache=False to tokenize in memory instead.")
  for part in (type(tokenizer).__name__, backend.to_str(), tokenizer.chat_template or "",
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


def file_identity(path: str, full_hash: bool) -> list[dict]:
  """Path, size, mtime and content hash of each file of a data path."""
  out = []
  for name in _data_files(path):
    st = os.stat(name)
    out.append({"path": os.path.abspath(name), "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "sha256": _content_hash(name, st.st_size, full_hash)})
  return out


def key_of(path: str, tokenizer_id: str, settings: Settings) -> tuple[str, dict]:
  """(the key of one data path's cache, the record of what it hashes)."""
  record = {"format_version": FORMAT_VERSION, "data": file_identity(path, settings.full_hash),
            "tokenizer": tokenizer_id, **dataclasses.asdict(settings)}
  digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]
  stem = os.path.basename(os.path.normpath(path)).replace(".", "_")[:40]
  return f"{stem}-{digest}", record


# ---- planning: a file's kind, format and shards ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Unit:
  """One shard's work: records [begin, end) of a file (lines of JSONL, rows of tables);
  for JSONL also the bytes [byte_begin, byte_end) those lines occupy."""
  path: str
  kind: str              # "jsonl" | "parquet" | "arrow"
  fmt: str               # the file's record shape, resolved
  directory: str         # the key's directory
  index: int
  begin: int
  end: int
  byte_begin: int = 0
  byte_end: int = 0

  @property
  def name(self) -> str:
    return f"shard-{self.index:05d}"


def _kind(path: str) -> str:
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, ARROW_STATE)):
    return "arrow"
  if path.endswith(JSONL_SUFFIXES):
    return "jsonl"
  if path.endswith(PARQUET_SUFFIXES):
    return "parquet"
  raise ValueError(f"{path}: unknown data file type; expected one of "
                   f"{JSONL_SUFFIXES + PARQUET_SUFFIXES} or a datasets save_to_disk "
                   "directory.")


def _line_starts(path: str) -> np.ndarray:
  """int64[lines + 1]: where each line of a file starts, then the file's size."""
  starts, base = [np.zeros(1, np.int64)], 0
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      starts.append(np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + base + 1)
      base += len(block)
  out = np.concatenate(starts)
  return out if out[-1] == base else np.append(out, base)


def _jsonl_head_format(path: str, fmt: str) -> tuple[str, bool]:
  """(the file's record shape, whether it has any record), as JsonlSource decides."""
  head = []
  with open(path, "rb") as f:
    for raw in f:
      if raw.strip():
        head.append(_parse(raw))
        if len(head) == formats.DETECT_SAMPLE:
          break
  sample = [r for r in head if not isinstance(r, formats.RecordError)]
  return (_format_of(fmt, sample, path) if sample else "messages"), bool(head)


def _read_table(path: str, kind: str, begin: int = 0, end: int | None = None):
  """Rows [begin, end) of a Parquet file or save_to_disk directory as an Arrow table."""
  if kind == "arrow":
    table = read_arrow_dataset(path)
    return table.slice(begin, (len(table) if end is None else end) - begin)
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  pf = pq.ParquetFile(path)
  end = pf.metadata.num_rows if end is None else end
  groups, first, row = [], None, 0
  for g in range(pf.num_row_groups):
    n = pf.metadata.row_group(g).num_rows
    if row < end and row + n > begin:
      groups.append(g)
      first = row if first is None else first
    row += n
  if not groups:
    return pf.schema_arrow.empty_table()
  return pf.read_row_groups(groups).slice(begin - first, end - begin)


def plan(path: str, directory: str, settings: Settings) -> tuple[list[Unit], bool]:
  """(the shards of one data path, whether it has any record). Raises
  formats.UnknownFormatError for a file whose records fit no shape."""
  kind, size = _kind(path), settings.shard_records
  if kind == "jsonl":
    fmt, any_record = _jsonl_head_format(path, settings.fmt)
    starts = _line_starts(path)
    lines = len(starts) - 1
    return [Unit(path, kind, fmt, directory, i, b, min(b + size, lines), int(starts[b]),
                 int(starts[min(b + size, lines)]))
            for i, b in enumerate(range(0, lines, size))], any_record
  table = _read_table(path, kind, 0, None) if kind == "arrow" else None
  if kind == "parquet":
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    rows = pq.ParquetFile(path).metadata.num_rows
    sample = _read_table(path, kind, 0, min(rows, formats.DETECT_SAMPLE)).to_pylist()
  else:
    rows, sample = len(table), table.slice(0, formats.DETECT_SAMPLE).to_pylist()
  fmt = _format_of(settings.fmt, sample, path) if rows else "messages"
  return [Unit(path, kind, fmt, directory, i, b, min(b + size, rows))
          for i, b in enumerate(range(0, rows, size))], rows > 0


# ---- building one shard ---------------------------------------------------------------


def _records(unit: Unit):
  """(line or row, record or RecordError) of the unit's records, blank lines out."""
  if unit.kind == "jsonl":
    with open(unit.path, "rb") as f:
      f.seek(unit.byte_begin)
      raw = f.read(unit.byte_end - unit.byte_begin)
    for line_no, line in enumerate(raw.split(b"\n")[:unit.end - unit.begin],
                                   start=unit.begin + 1):
      if line.strip():
        yield line_no, _parse(line)
    return
  table = _read_table(unit.path, unit.kind, unit.begin, unit.end)
  table = table.select([c for c in formats.COLUMNS[unit.fmt] if c in table.column_names])
  row = unit.begin
  for batch in table.to_batches():
    for record in batch.to_pylist():
      yield row, record
      row += 1


def build_unit(unit: Unit, tokenizer, settings: Settings) -> dict:
  """Tokenizes one shard and commits it (see the module docstring); returns its meta."""
  bad, chats, counts = [], [], {"records": 0, "valid": 0}
  for line, record in _records(unit):
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


def _commit_shard(unit: Unit, arrays: dict, bad: list, counts: dict) -> dict:
  tmp = os.path.join(unit.directory, _tmp_name(unit.name))
  os.makedirs(tmp)
  files = {}
  for name, value in arrays.items():
    np.save(os.path.join(tmp, f"{name}.npy"), value)
  with open(os.path.join(tmp, BAD), "w") as f:
    f.write("".join(json.dumps(b) + "\n" for b in bad))
  for name in [f"{a}.npy" for a in arrays] + [BAD]:
    where = os.path.join(tmp, name)
    files[name] = {"size": os.path.getsize(where), "crc32": _crc32(where)}
  meta = {"records": counts["records"], "valid": counts["valid"],
          "examples": len(arrays["lines"]), "tokens": len(arrays["tokens"]),
          "bad": len(bad), "begin": unit.begin, "end": unit.end, "files": files}
  with open(os.path.join(tmp, META), "w") as f:
    json.dump(meta, f)
  try:
    os.rename(tmp, os.path.join(unit.directory, unit.name))
  except OSError:   # another process committed this shard first: keep theirs
    shutil.rmtree(tmp, ignore_errors=True)
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


def _is_committed(unit: Unit) -> bool:
  return os.path.isfile(os.path.join(unit.directory, unit.name, META))


def _run(units: Sequence[Unit], tokenizer, settings: Settings, workers: int,
         progress: Callable[[int, int], None]) -> None:
  """Builds `units` with `workers` processes (in this one when 1)."""
  if not units:
    return
  if workers <= 1 or len(units) == 1:
    with _one_core():
      for i, unit in enumerate(units):
        build_unit(unit, tokenizer, settings)
        progress(i + 1, len(units))
    return
  # fork: the workers inherit the tokenizer, and a script without a __main__ guard
  # still works; they run only numpy and the tokenizer, never JAX.
  ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
  with concurrent.futures.ProcessPoolExecutor(
      min(workers, len(units)), mp_context=ctx, initializer=_init_worker,
      initargs=(tokenizer, settings)) as pool, warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
    for i, future in enumerate(concurrent.futures.as_completed(
        [pool.submit(_build_in_worker, u) for u in units])):
      future.result()
      progress(i + 1, len(units))


def _clear_stale(directory: str) -> None:
  """Removes temporary shards this host's dead processes left in `directory`."""
  host = socket.gethostname()
  for name in os.listdir(directory):
    parts = name.split(".")
    if name.startswith(".tmp.") and len(parts) >= 5 and parts[-3] == host:
      try:
        os.kill(int(parts[-2]), 0)
      except ProcessLookupError:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
      except (PermissionError, ValueError):
        pass


def _write_json(directory: str, name: str, value: Any) -> None:
  tmp = os.path.join(directory, _tmp_name(name))
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(directory, name))


def _commit(directory: str, units: Sequence[Unit], any_record: bool, path: str) -> None:
  metas = []
  for unit in units:
    with open(os.path.join(directory, unit.name, META)) as f:
      metas.append(json.load(f))
  _write_json(directory, MANIFEST, {
      "path": path, "shards": [u.name for u in units], "empty": not any_record,
      "records": sum(m["records"] for m in metas), "valid": sum(m["valid"] for m in metas),
      "examples": sum(m["examples"] for m in metas), "tokens": sum(m["tokens"] for m in metas),
      "bad": sum(m["bad"] for m in metas)})


@dataclasses.dataclass
class BuildReport:
  """What `ensure` did: shards built here, shards found built, seconds."""
  built: int = 0
  reused: int = 0
  seconds: float = 0.0


def ensure(paths: Sequence[str], tokenizer, settings: Settings, *, cache_dir: str,
           workers: int = 0, process_index: int = 0, process_count: int = 1,
           barrier: Callable[[], None] = lambda: None,
           report: BuildReport | None = None) -> list[FileCache]:
  """The opened, checked caches of `paths` (one per path, in order), building what is
  missing: `workers` processes (0: every core); this process's share of the shards
  when `process_count` > 1, then `barrier`, then whatever is still missing."""
  begin = time.perf_counter()
  report = report if report is not None else BuildReport()
  tok_id = tokenizer_fingerprint(tokenizer)
  try:
    os.makedirs(cache_dir, exist_ok=True)
  except OSError as e:
    raise ValueError(f"data.cache_dir={cache_dir}: cannot create it ({e}); set "
                     "data.cache_dir or $MARS_JAX_DATA_CACHE to a writable directory, "
                     "or data.cache=False.") from e
  todo, keys = [], [key_of(path, tok_id, settings) for path in paths]
  for path, (key, record) in zip(paths, keys):
    directory = os.path.join(cache_dir, key)
    if os.path.isfile(os.path.join(directory, MANIFEST)) or any(
        directory == d for _, d, _, _ in todo):
      continue
    os.makedirs(directory, exist_ok=True)
    if not os.access(directory, os.W_OK):
      raise ValueError(f"{directory}: not writable; set data.cache_dir or "
                       "$MARS_JAX_DATA_CACHE to a writable directory, or data.cache=False.")
    _clear_stale(directory)
    _write_json(directory, KEY_FILE, record)
    todo.append((path, directory, *plan(path, directory, settings)))
  units = [u for _, _, us, _ in todo for u in us]
  mine = [u for i, u in enumerate(units) if i % process_count == process_index]
  missing = [u for u in mine if not _is_committed(u)]
  workers = workers or os.cpu_count() or 1
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
  opened = [FileCache(os.path.join(cache_dir, key), path) for path, (key, _) in zip(paths, keys)]
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
