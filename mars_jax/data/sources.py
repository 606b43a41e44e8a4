"""Chat-record sources: local JSONL (plain, .gz or .zst), JSON arrays, Parquet and Arrow
(`datasets` save_to_disk) data, and in-memory records.

Each source is a grain `RandomAccessDataSource` (`__len__`, `__getitem__`) of chats
`{"messages": [{"role", "content"[, "reasoning_content"]}, ...]}`, converted from the
record shape of its file (mars_jax.data.formats: OpenAI messages, ShareGPT, Alpaca,
prompt/completion; `data.format`, "auto" detects it per file). Every record is read,
converted and checked (`validation.check_messages`) when the source is built; bad ones
are counted in the shared `DataStats` and skipped (or raise under `on_bad="error"`), so
a source only ever serves valid chats, and `where(i)` names the file and line (or row)
of its i-th record for later reports.

JSONL sources keep byte offsets, not parsed records, and re-read a line on access;
table sources keep the Arrow columns of their shape; a compressed file or a JSON array
(a .json file whose text is one list of records, as Alpaca is published) is read into
memory whole.
"""

from __future__ import annotations

import glob
import gzip
import io
import itertools
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np
from grain.sources import RandomAccessDataSource

from mars_jax.data import formats
from mars_jax.data.validation import DataStats, check_messages

JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSED_SUFFIXES = tuple(s + c for s in JSONL_SUFFIXES for c in (".gz", ".zst"))
JSON_SUFFIXES = JSONL_SUFFIXES + COMPRESSED_SUFFIXES   # lines or an array, maybe compressed
PARQUET_SUFFIXES = (".parquet",)
ARROW_STATE = "state.json"            # in a directory `datasets.Dataset.save_to_disk` wrote
ARROW_DICT = "dataset_dict.json"      # in one `datasets.DatasetDict.save_to_disk` wrote


def _chat(record: Any, fmt: str) -> tuple[list[dict] | None, tuple[str, str] | None]:
  """(messages, None) for a usable record of shape `fmt`, else (None, (kind, reason))."""
  try:
    messages = formats.to_messages(record, fmt)
  except formats.RecordError as e:
    return None, (e.kind, e.reason)
  problem = check_messages(messages)
  return (None, problem) if problem else (messages, None)


def _keep(rows: Iterator[tuple[Any, str, Any]], fmt: str, stats: DataStats) -> list:
  """The keys of the usable ones among (key, where, record) rows; the rest are reported.

  A record given as a `formats.RecordError` (e.g. invalid JSON) is bad as it stands."""
  kept = []
  for key, where, record in rows:
    stats.records += 1
    if isinstance(record, formats.RecordError):
      problem = (record.kind, record.reason)
    else:
      problem = _chat(record, fmt)[1]
    if problem:
      stats.report_bad(problem[0], where, problem[1])
    else:
      kept.append(key)
  return kept


def open_bytes(path: str):
  """A binary reader of a JSON file's text: decompressed for .gz and .zst."""
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  if path.endswith(".zst"):
    try:
      import zstandard  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError(f"{path}: reading .zst needs zstandard (pip install zstandard).") from e
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"),
                                                                       closefd=True))
  return open(path, "rb")


def json_kind(path: str) -> str:
  """"array" for a JSON file whose text is one list (its first non-space byte is "["),
  else "lines" (JSON lines)."""
  with open_bytes(path) as f:
    while block := f.read(4096):
      text = block.lstrip()
      if text:
        return "array" if text[:1] == b"[" else "lines"
  return "lines"


def json_records(path: str) -> Iterator[tuple[int, Any]]:
  """(line from 1, record or RecordError) of a JSON-lines file, blank lines out, or
  (index from 0, record) of a JSON array; compressed files decompressed."""
  if json_kind(path) == "array":
    with open_bytes(path) as f:
      try:
        records = json.load(f)
      except ValueError as e:
        raise ValueError(f"{path}: not a JSON array of records ({e}); write one record "
                         "per line (JSONL) or fix the array.") from e
    yield from enumerate(records)
    return
  with open_bytes(path) as f:
    for line_no, raw in enumerate(f, start=1):
      if raw.strip():
        yield line_no, _parse(raw)


def _format_of(fmt: str, sample: Sequence[Any], where: str) -> str:
  return formats.detect_format(sample, where) if fmt == "auto" else fmt


class RecordsSource(RandomAccessDataSource):
  """In-memory records (e.g. the synthetic task), converted and checked like file records."""

  def __init__(self, records: Sequence[Any], stats: DataStats, *, name: str = "records",
               fmt: str = "messages", places: Sequence[str] | None = None):
    self._name = name
    self._records = records
    self._places = places   # where each record is ("file:line"); None: name[i]
    sample = [r for r in records[:formats.DETECT_SAMPLE]
              if not isinstance(r, formats.RecordError)]
    self._fmt = _format_of(fmt, sample, name) if sample else (
        "messages" if fmt == "auto" else fmt)
    self._keep = _keep(((i, self._place(i), r) for i, r in enumerate(records)),
                       self._fmt, stats)
    if not records:
      stats.report_bad("empty_file", name, "no records")

  def __len__(self) -> int:
    return len(self._keep)

  def __getitem__(self, i: int) -> dict:
    return {"messages": _chat(self._records[self._keep[i]], self._fmt)[0]}

  def where(self, i: int) -> str:
    return self._place(self._keep[i])

  def _place(self, i: int) -> str:
    return f"{self._name}[{i}]" if self._places is None else self._places[i]


def _parse(raw: bytes) -> Any:
  try:
    return json.loads(raw)
  except ValueError as e:
    return formats.RecordError("malformed", f"invalid JSON ({e})")


class JsonlSource(RandomAccessDataSource):
  """One JSON-lines file; blank lines are ignored, every other line is a record."""

  def __init__(self, path: str, stats: DataStats, fmt: str = "auto"):
    self._path = path
    with open(path, "rb") as f:
      head = [_parse(raw) for raw in itertools.islice((raw for raw in f if raw.strip()),
                                                      formats.DETECT_SAMPLE)]
    sample = [r for r in head if not isinstance(r, formats.RecordError)]
    self._fmt = _format_of(fmt, sample, path) if sample else "messages"

    def rows():
      with open(path, "rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, start=1):
          start, offset = offset, offset + len(raw)
          if raw.strip():
            yield (line_no, start, len(raw)), f"{path}:{line_no}", _parse(raw)

    kept = np.asarray(_keep(rows(), self._fmt, stats), np.int64).reshape(-1, 3)
    if not head:
      stats.report_bad("empty_file", path, "no records")
    self._lines, self._offsets, self._sizes = kept[:, 0], kept[:, 1], kept[:, 2]
    self._fd: int | None = None

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, i: int) -> dict:
    if self._fd is None:
      self._fd = os.open(self._path, os.O_RDONLY)
    record = json.loads(os.pread(self._fd, int(self._sizes[i]), int(self._offsets[i])))
    return {"messages": _chat(record, self._fmt)[0]}

  def where(self, i: int) -> str:
    return f"{self._path}:{self._lines[i]}"

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_fd": None}

  def __del__(self):
    if getattr(self, "_fd", None) is not None:
      os.close(self._fd)


class TableSource(RandomAccessDataSource):
  """An Arrow table of records (a Parquet file, or a `datasets` save_to_disk directory),
  one record per row; only the columns of its shape are kept."""

  def __init__(self, table, path: str, stats: DataStats, fmt: str = "auto"):
    self._path = path
    names = table.column_names
    sample = table.slice(0, formats.DETECT_SAMPLE).to_pylist()
    self._fmt = _format_of(fmt, sample, path) if len(table) else "messages"
    self._table = table.select([c for c in formats.COLUMNS[self._fmt] if c in names])

    def rows():
      row = 0
      for batch in self._table.to_batches():
        for record in batch.to_pylist():
          yield row, f"{path}:row {row}", record
          row += 1

    self._rows = np.asarray(_keep(rows(), self._fmt, stats), np.int64)
    if not len(table):
      stats.report_bad("empty_file", path, "no records")

  def __len__(self) -> int:
    return len(self._rows)

  def __getitem__(self, i: int) -> dict:
    record = self._table.slice(int(self._rows[i]), 1).to_pylist()[0]
    return {"messages": _chat(record, self._fmt)[0]}

  def where(self, i: int) -> str:
    return f"{self._path}:row {self._rows[i]}"


def _pyarrow():
  try:
    import pyarrow  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("reading Parquet or Arrow data needs pyarrow (pip install pyarrow).") from e
  return pyarrow


def read_parquet(path: str):
  """The Arrow table of one Parquet file."""
  _pyarrow()
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  return pq.read_table(path)


def read_arrow_dataset(path: str):
  """The Arrow table of a directory `datasets.Dataset.save_to_disk` wrote (its
  state.json lists the Arrow stream files, in order)."""
  pa = _pyarrow()
  with open(os.path.join(path, ARROW_STATE)) as f:
    files = [d["filename"] for d in json.load(f).get("_data_files", [])]
  if not files:
    raise ValueError(f"{path}: {ARROW_STATE} lists no data files; save the dataset again "
                     "with datasets' save_to_disk.")
  tables = []
  for name in files:
    with pa.memory_map(os.path.join(path, name)) as source:
      tables.append(pa.ipc.open_stream(source).read_all())
  return pa.concat_tables(tables)


def _dataset_dir_files(entry: str) -> list[str] | None:
  """[entry] for a `datasets` save_to_disk directory, None for another directory.

  A DatasetDict directory is refused with its splits, each of which is a dataset."""
  if os.path.isfile(os.path.join(entry, ARROW_STATE)):
    return [entry]
  if os.path.isfile(os.path.join(entry, ARROW_DICT)):
    with open(os.path.join(entry, ARROW_DICT)) as f:
      splits = json.load(f).get("splits", [])
    raise ValueError(f"{entry}: a DatasetDict with splits {splits}; name the split to "
                     f"train on, e.g. {os.path.join(entry, splits[0] if splits else 'train')}.")
  return None


def expand_paths(spec: str | Sequence[str]) -> list[str]:
  """Data named by `spec`: a path, a glob, a directory, a comma-separated list of
  those, or a list of those; a directory written by `datasets`' save_to_disk is one
  entry, another directory contributes its *.jsonl/*.json/*.parquet.
  Sorted within each entry; raises FileNotFoundError for an entry matching nothing.
  """
  entries = spec.split(",") if isinstance(spec, str) else list(spec)
  files: list[str] = []
  for entry in (e.strip() for e in entries):
    if not entry:
      continue
    if os.path.isdir(entry):
      found = _dataset_dir_files(entry) or sorted(
          p for p in glob.glob(os.path.join(entry, "*"))
          if p.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES))
    else:
      found = sorted(glob.glob(entry))
    if not found:
      raise FileNotFoundError(f"{entry}: no such file, or no .jsonl/.json (maybe .gz or "
                              ".zst) or .parquet files or datasets save_to_disk directory "
                              "match it.")
    files += found
  if not files:
    raise FileNotFoundError(f"no data files in {spec!r}.")
  return files


def open_file(path: str, stats: DataStats, fmt: str = "auto"):
  """The source for one file or dataset directory: .jsonl/.json lines or a JSON array
  (either maybe .gz or .zst), .parquet, or a `datasets` save_to_disk directory; `fmt`
  the record shape (formats.FORMATS)."""
  formats.check_format(fmt)
  if os.path.isdir(path) and _dataset_dir_files(path):
    return TableSource(read_arrow_dataset(path), path, stats, fmt)
  array = path.endswith(JSON_SUFFIXES) and json_kind(path) == "array"
  if array or path.endswith(COMPRESSED_SUFFIXES):
    places, records = [], []
    for where, record in json_records(path):
      places.append(f"{path}:row {where}" if array else f"{path}:{where}")
      records.append(record)
    return RecordsSource(records, stats, name=path, fmt=fmt, places=places)
  if path.endswith(JSONL_SUFFIXES):
    return JsonlSource(path, stats, fmt)
  if path.endswith(PARQUET_SUFFIXES):
    return TableSource(read_parquet(path), path, stats, fmt)
  raise ValueError(f"{path}: unknown data file type; expected one of "
                   f"{JSON_SUFFIXES + PARQUET_SUFFIXES} or a datasets save_to_disk "
                   "directory.")
