"""Chats -> tokenized examples, the row-length rule, and the two grain sources of
examples the pipeline trains on: `TokenizedSource` (tokenized in memory at load) and
`CachedSource` (read lazily from the tokenized cache, `cache.py`).

  for key, out in tokenize_chats(tok, [(key, messages), ...], train_on="all",
                                 template_kwargs={}):
    out    # {"tokens": int32[n], "loss_mask": bool[n]}, or a chat.TemplateError
  problem = length_problem(n, first_target(mask), max_length, truncate)

Both sources serve item i as {"tokens": int32[n_i], "loss_mask": bool[n_i]} with
n_i <= max_length, and name its origin with `where(i)`; for the same records, settings
and tokenizer they serve the same items in the same order.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from grain.sources import RandomAccessDataSource

from mars_jax.data.chat import TemplateError, target_spans, tokenize_rendered
from mars_jax.data.validation import DataStats


def tokenize_chats(tokenizer, chats: Iterable[tuple[Hashable, list[dict]]], *,
                   train_on: str, template_kwargs: Mapping[str, Any] | None,
                   chunk_size: int = 1024
                   ) -> Iterator[tuple[Hashable, dict[str, np.ndarray] | TemplateError]]:
  """(key, validated chat) pairs -> (key, untruncated example or the TemplateError of a
  chat the template cannot render verbatim), in order; the tokenizer sees
  `chunk_size` texts per call."""
  chats = iter(chats)
  while chunk := list(itertools.islice(chats, chunk_size)):
    outcomes: list[Any] = []
    rendered = []
    for _, messages in chunk:
      try:
        rendered.append(target_spans(tokenizer, messages, train_on=train_on,
                                     template_kwargs=template_kwargs))
        outcomes.append(None)
      except TemplateError as e:
        outcomes.append(e)
    examples = iter(tokenize_rendered(tokenizer, rendered))
    for (key, _), outcome in zip(chunk, outcomes):
      yield key, outcome if outcome is not None else next(examples)


def first_target(loss_mask: np.ndarray) -> int:
  """The position of the first target token of bool[n] (n when there is none)."""
  hits = np.flatnonzero(loss_mask)
  return int(hits[0]) if len(hits) else len(loss_mask)


def length_problem(n: int, first: int, max_length: int, truncate: bool) -> str | None:
  """Why an example of n tokens whose first target is at `first` cannot fill a row of
  `max_length` ("too_long"'s reason), or None: it fits, or (truncate) is cut to it with
  a target left."""
  if n <= max_length:
    return None
  if not truncate:
    return f"{n} tokens > max_length {max_length} (truncate=False)"
  if first >= max_length:
    return f"{n} tokens; no assistant token within max_length {max_length}"
  return None


class TokenizedSource(RandomAccessDataSource):
  """Formatted, length-checked examples of `sources`, tokenized now, in memory.

  A chat the template cannot render verbatim is bad ("template_error"); one longer
  than `max_length` is cut to it and counted in `stats.truncated` when `truncate`, and
  bad ("too_long") when not or when no target survives the cut (`length_problem`).
  Sources need `__len__`, `__getitem__` -> chat record, and `where(i)`.
  """

  def __init__(self, sources: Sequence, tokenizer, stats: DataStats, *, max_length: int,
               truncate: bool = True, train_on: str = "all",
               template_kwargs: Mapping[str, Any] | None = None):
    if max_length < 2:
      raise ValueError(f"max_length={max_length}; expected at least 2.")
    tokens, masks = [], []
    chats = ((source.where(i), source[i]["messages"])
             for source in sources for i in range(len(source)))
    for where, ex in tokenize_chats(tokenizer, chats, train_on=train_on,
                                    template_kwargs=template_kwargs):
      if isinstance(ex, TemplateError):
        stats.report_bad("template_error", where, str(ex))
        continue
      n = len(ex["tokens"])
      problem = length_problem(n, first_target(ex["loss_mask"]), max_length, truncate)
      if problem:
        stats.report_bad("too_long", where, problem)
        continue
      if n > max_length:
        stats.truncated += 1
      tokens.append(ex["tokens"][:max_length])
      masks.append(ex["loss_mask"][:max_length])
    stats.kept += len(tokens)
    self.lengths = np.asarray([len(t) for t in tokens], np.int64)
    self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
    self._tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
    self._masks = np.concatenate(masks) if masks else np.zeros(0, bool)

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    a, b = self._offsets[i], self._offsets[i + 1]
    return {"tokens": self._tokens[a:b], "loss_mask": self._masks[a:b]}

  def per_example(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
                  name: str) -> np.ndarray:  # pylint: disable=unused-argument
    """fn(loss_mask bool[T], offsets int[n + 1]) -> one value per example, in item
    order (`CachedSource.per_example` keeps it on disk under `name`)."""
    return fn(self._masks, self._offsets)

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())


class CachedSource(RandomAccessDataSource):
  """Examples `picks[f]` of each cached file `files[f]` (`cache.FileCache`), in order,
  cut to `max_length`, read from the memory-mapped cache when indexed; the length
  rule is applied here: too-long examples are reported to `stats` and left out."""

  def __init__(self, files: Sequence, picks: Sequence[np.ndarray], stats: DataStats, *,
               max_length: int, truncate: bool = True):
    self._files, self.max_length = list(files), max_length
    which, examples = [], []
    for f, (file, ids) in enumerate(zip(self._files, picks)):
      n, first = file.lengths[ids], file.first_target[ids]
      over = n > max_length
      bad = over if not truncate else over & (first >= max_length)
      for e in ids[bad]:
        stats.report_bad("too_long", file.where(int(e)), length_problem(
            int(file.lengths[e]), int(file.first_target[e]), max_length, truncate))
      stats.truncated += int((over & ~bad).sum())
      examples.append(ids[~bad])
      which.append(np.full(len(examples[-1]), f, np.int32))
    self._which = np.concatenate(which) if which else np.zeros(0, np.int32)
    self._examples = np.concatenate(examples) if examples else np.zeros(0, np.int64)
    self.lengths = np.minimum(np.concatenate(
        [file.lengths[e] for file, e in zip(self._files, examples)]) if examples
        else np.zeros(0, np.int64), max_length)
    stats.kept += len(self._examples)

  def __len__(self) -> int:
    return len(self._examples)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    tokens, mask = self._files[self._which[i]].example(int(self._examples[i]))
    return {"tokens": np.array(tokens[:self.max_length]),
            "loss_mask": np.array(mask[:self.max_length])}

  def where(self, i: int) -> str:
    return self._files[self._which[i]].where(int(self._examples[i]))

  def per_example(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
                  name: str) -> np.ndarray:
    """fn over each cached file's examples (untruncated), one value per example, in
    item order; each file keeps the result of `name` (which must say what fn computes)
    on disk, so a later start reads it."""
    values = [f.per_example(fn, name) for f in self._files]
    return np.concatenate([values[f][self._examples[self._which == f]]
                           for f in range(len(self._files))]) if values else np.zeros(0)

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())
