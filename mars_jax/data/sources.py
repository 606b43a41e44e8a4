"""Chat-record sources: local JSONL and Parquet files, and in-memory records.

Each source is a grain `RandomAccessDataSource` (`__len__`, `__getitem__`) of
chat records `{"messages": [{"role", "content"}, ...]}`, the shape of
Dolci-Instruct-SFT and most HF SFT sets. Every record is read and checked with
`validation.check_chat` when the source is built; bad ones are counted in the
shared `DataStats` and skipped (or raise under `on_bad="error"`), so a source
only ever serves valid records, and `where(i)` names the file and line of its
i-th record for later reports.

JSONL sources keep byte offsets, not parsed records, and re-read a line on
access; Parquet sources keep the Arrow `messages` column.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Sequence

import numpy as np
from grain.sources import RandomAccessDataSource

from mars_jax.data.validation import DataStats, check_chat

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class RecordsSource(RandomAccessDataSource):
  """In-memory chat records (e.g. the synthetic task), checked like file records."""

  def __init__(self, records: Sequence[dict], stats: DataStats, *, name: str = "records"):
    self._name = name
    self._keep: list[int] = []
    self._records = records
    for i, record in enumerate(records):
      stats.records += 1
      problem = check_chat(record)
      if problem:
        stats.report_bad(problem[0], f"{name}[{i}]", problem[1])
      else:
        self._keep.append(i)
    if not records:
      stats.report_bad("empty_file", name, "no records")

  def __len__(self) -> int:
    return len(self._keep)

  def __getitem__(self, i: int) -> dict:
    return self._records[self._keep[i]]

  def where(self, i: int) -> str:
    return f"{self._name}[{self._keep[i]}]"


class JsonlSource(RandomAccessDataSource):
  """One JSON-lines file; blank lines are ignored, every other line is a record."""

  def __init__(self, path: str, stats: DataStats):
    self._path = path
    offsets, sizes, lines = [], [], []
    seen = 0
    with open(path, "rb") as f:
      offset = 0
      for line_no, raw in enumerate(f, start=1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
          continue
        seen += 1
        stats.records += 1
        try:
          record = json.loads(raw)
        except ValueError as e:
          stats.report_bad("malformed", f"{path}:{line_no}", f"invalid JSON ({e})")
          continue
        problem = check_chat(record)
        if problem:
          stats.report_bad(problem[0], f"{path}:{line_no}", problem[1])
          continue
        offsets.append(start)
        sizes.append(len(raw))
        lines.append(line_no)
    if not seen:
      stats.report_bad("empty_file", path, "no records")
    self._offsets = np.asarray(offsets, np.int64)
    self._sizes = np.asarray(sizes, np.int64)
    self._lines = np.asarray(lines, np.int64)
    self._fd: int | None = None

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, i: int) -> dict:
    if self._fd is None:
      self._fd = os.open(self._path, os.O_RDONLY)
    return json.loads(os.pread(self._fd, int(self._sizes[i]), int(self._offsets[i])))

  def where(self, i: int) -> str:
    return f"{self._path}:{self._lines[i]}"

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_fd": None}

  def __del__(self):
    if getattr(self, "_fd", None) is not None:
      os.close(self._fd)


class ParquetSource(RandomAccessDataSource):
  """One Parquet file with a `messages` column (list of struct<role, content>)."""

  def __init__(self, path: str, stats: DataStats):
    try:
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow).") from e
    self._path = path
    schema = pq.read_schema(path)
    if "messages" not in schema.names:
      raise ValueError(f"{path}: no 'messages' column (columns: {schema.names}); expected "
                       "chat records with messages=[{role, content}, ...].")
    self._column = pq.read_table(path, columns=["messages"]).column("messages")
    rows = []
    row = 0
    for chunk in self._column.chunks:
      for messages in chunk.to_pylist():
        stats.records += 1
        problem = check_chat({"messages": messages})
        if problem:
          stats.report_bad(problem[0], f"{path}:row {row}", problem[1])
        else:
          rows.append(row)
        row += 1
    if not len(self._column):
      stats.report_bad("empty_file", path, "no records")
    self._rows = np.asarray(rows, np.int64)

  def __len__(self) -> int:
    return len(self._rows)

  def __getitem__(self, i: int) -> dict:
    return {"messages": self._column[int(self._rows[i])].as_py()}

  def where(self, i: int) -> str:
    return f"{self._path}:row {self._rows[i]}"


def expand_paths(spec: str | Sequence[str]) -> list[str]:
  """Files named by `spec`: a path, a glob, a directory, a comma-separated list of
  those, or a list of those; directories contribute their *.jsonl/*.json/*.parquet.
  Sorted within each entry; raises FileNotFoundError for an entry matching nothing.
  """
  entries = spec.split(",") if isinstance(spec, str) else list(spec)
  files: list[str] = []
  for entry in (e.strip() for e in entries):
    if not entry:
      continue
    if os.path.isdir(entry):
      found = sorted(p for p in glob.glob(os.path.join(entry, "*"))
                     if p.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES))
    else:
      found = sorted(glob.glob(entry))
    if not found:
      raise FileNotFoundError(f"{entry}: no such file, or no .jsonl/.json/.parquet files "
                              "match it.")
    files += found
  if not files:
    raise FileNotFoundError(f"no data files in {spec!r}.")
  return files


def open_file(path: str, stats: DataStats) -> JsonlSource | ParquetSource:
  """The source for one file, by suffix (.jsonl/.json lines, .parquet)."""
  if path.endswith(JSONL_SUFFIXES):
    return JsonlSource(path, stats)
  if path.endswith(PARQUET_SUFFIXES):
    return ParquetSource(path, stats)
  raise ValueError(f"{path}: unknown data file type; expected one of "
                   f"{JSONL_SUFFIXES + PARQUET_SUFFIXES}.")
