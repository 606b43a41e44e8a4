"""Planning the tokenized cache's build (cache.py): a data path's kind, record shape and
shards, and reading the records of one shard.

  units, any_record = plan(path, directory, shard_records, fmt)
  for where, record in records(unit): ...   # line (from 1) or row (from 0)

JSON lines are cut by byte ranges; a compressed file (.gz, .zst) or a JSON array is
first written out as JSON lines into `directory` (`materialize`; the caller removes it
after the build); Parquet shards are whole row groups, read in batches; a `datasets`
save_to_disk directory is sliced by rows.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from mars_jax.data import formats
from mars_jax.data.cache_files import _BLOCK, _tmp_name
from mars_jax.data.sources import (ARROW_STATE, COMPRESSED_SUFFIXES, JSON_SUFFIXES,
                                   PARQUET_SUFFIXES, _format_of, _parse, json_kind,
                                   json_records, open_bytes, read_arrow_dataset)

_PARQUET_BATCH = 1024   # rows decoded at a time from a row group


@dataclasses.dataclass(frozen=True)
class Unit:
  """One shard's work: records [begin, end) of a file (lines of JSONL, rows of tables);
  for JSONL also the bytes [byte_begin, byte_end) those lines occupy, for Parquet the
  row groups [group_begin, group_end). `rows`: records are named by row (from 0), not
  by line (from 1): tables and JSON arrays."""
  path: str              # the file read: the data file, or its JSON lines written out
  kind: str              # "jsonl" | "parquet" | "arrow"
  fmt: str               # the file's record shape, resolved
  directory: str         # the key's directory
  index: int
  begin: int
  end: int
  byte_begin: int = 0
  byte_end: int = 0
  group_begin: int = 0
  group_end: int = 0
  rows: bool = False

  @property
  def name(self) -> str:
    return f"shard-{self.index:05d}"


def kind_of(path: str) -> str:
  """"arrow" (a save_to_disk directory), "jsonl" (JSON lines or a JSON array, maybe
  compressed) or "parquet"; ValueError for another file."""
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, ARROW_STATE)):
    return "arrow"
  if path.endswith(JSON_SUFFIXES):
    return "jsonl"
  if path.endswith(PARQUET_SUFFIXES):
    return "parquet"
  raise ValueError(f"{path}: unknown data file type; expected one of "
                   f"{JSON_SUFFIXES + PARQUET_SUFFIXES} or a datasets save_to_disk "
                   "directory.")


def needs_materializing(path: str) -> bool:
  """A file that cannot be cut by byte ranges: compressed, or one JSON array."""
  return path.endswith(COMPRESSED_SUFFIXES) or (path.endswith(JSON_SUFFIXES)
                                                and json_kind(path) == "array")


def materialize(path: str, directory: str) -> tuple[str, bool]:
  """(a temporary JSON-lines file in `directory` with the records of `path`, whether
  they are named by row): a compressed file decompressed, a JSON array one record a
  line. The caller removes it."""
  out = os.path.join(directory, _tmp_name("source") + ".jsonl")
  array = json_kind(path) == "array"
  with open(out, "wb") as f:
    if array:
      for _, record in json_records(path):
        f.write(json.dumps(record).encode() + b"\n")
    else:
      with open_bytes(path) as src:
        while block := src.read(_BLOCK):
          f.write(block)
  return out, array


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


def plan(path: str, directory: str, shard_records: int, fmt: str,
         read_path: str | None = None, rows: bool = False) -> tuple[list[Unit], bool]:
  """(the shards of one data path, whether it has any record); `read_path`: the JSON
  lines `materialize` wrote for it. Raises formats.UnknownFormatError for a file whose
  records fit no shape."""
  kind, size = kind_of(path), shard_records
  if kind == "jsonl":
    read = read_path or path
    fmt, any_record = _jsonl_head_format(read, fmt)
    starts = _line_starts(read)
    lines = len(starts) - 1
    return [Unit(read, kind, fmt, directory, i, b, min(b + size, lines), int(starts[b]),
                 int(starts[min(b + size, lines)]), rows=rows)
            for i, b in enumerate(range(0, lines, size))], any_record
  if kind == "parquet":
    return _plan_parquet(path, directory, size, fmt)
  table = read_arrow_dataset(path)
  n, sample = len(table), table.slice(0, formats.DETECT_SAMPLE).to_pylist()
  fmt = _format_of(fmt, sample, path) if n else "messages"
  return [Unit(path, kind, fmt, directory, i, b, min(b + size, n), rows=True)
          for i, b in enumerate(range(0, n, size))], n > 0


def _plan_parquet(path: str, directory: str, size: int, fmt: str) -> tuple[list[Unit], bool]:
  """Shards of whole row groups, each at least `size` rows (but the last) unless one
  row group alone is larger."""
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  pf = pq.ParquetFile(path)
  n = pf.metadata.num_rows
  sample = []
  if n:
    batch = next(pf.iter_batches(batch_size=formats.DETECT_SAMPLE, row_groups=[0]))
    sample = batch.to_pylist()
  fmt = _format_of(fmt, sample, path) if n else "messages"
  units, first_group, first_row, row = [], 0, 0, 0
  for g in range(pf.num_row_groups):
    row += pf.metadata.row_group(g).num_rows
    if row - first_row >= size or g == pf.num_row_groups - 1:
      units.append(Unit(path, "parquet", fmt, directory, len(units), first_row, row,
                        group_begin=first_group, group_end=g + 1, rows=True))
      first_group, first_row = g + 1, row
  return [u for u in units if u.end > u.begin], n > 0


def records(unit: Unit):
  """(line or row, record or RecordError) of the unit's records, blank lines out."""
  if unit.kind == "jsonl":
    with open(unit.path, "rb") as f:
      f.seek(unit.byte_begin)
      raw = f.read(unit.byte_end - unit.byte_begin)
    for line_no, line in enumerate(raw.split(b"\n")[:unit.end - unit.begin],
                                   start=unit.begin + 1):
      if line.strip():
        yield (line_no - 1 if unit.rows else line_no), _parse(line)
    return
  if unit.kind == "parquet":
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    pf = pq.ParquetFile(unit.path)
    columns = [c for c in formats.COLUMNS[unit.fmt] if c in pf.schema_arrow.names]
    batches = pf.iter_batches(batch_size=_PARQUET_BATCH, columns=columns,
                              row_groups=range(unit.group_begin, unit.group_end))
  else:
    table = read_arrow_dataset(unit.path).slice(unit.begin, unit.end - unit.begin)
    batches = table.select([c for c in formats.COLUMNS[unit.fmt]
                            if c in table.column_names]).to_batches()
  row = unit.begin
  for batch in batches:
    for record in batch.to_pylist():
      yield row, record
      row += 1
