"""Stop strings: found on the decoded text between rounds of steps, across token boundaries.

The loop ends a sample itself at an EOS or stop id (`gates.take`); a stop string is
text, so the host looks for it after every round (`rounds`, `serve.Server`): for each
sample that was live during the round, the text of its new tokens is searched, and a
sample whose text holds a stop string is cut after the token that completed it
(`loop.stop`), which also drops whatever it decoded past that token from its counts.

  tokens     "The" " answer" " is" " 4" ".\\n" "\\nQ" ":"      stop = "\\n\\nQ"
  text       The answer is 4.\\n\\nQ:
  kept       the first 6 tokens (the 6th completes "\\n\\nQ"); text "The answer is 4."

The token that completes a stop string is found by bisection over prefixes of the
tokens (does the text of the first k hold a stop?), each decoded as the user sees it
(`skip_special_tokens=True`), so stops split over several tokens are found.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from mars_jax.decoding.loop import DecodeState


def check_stops(stop: str | Sequence[str] | Sequence[Sequence[str]] | None, n: int
                ) -> list[tuple[str, ...]]:
  """One stop string, one list for every prompt, or one list per prompt -> n tuples."""
  if stop is None or isinstance(stop, str):
    stop = [] if stop is None else [stop]
  stop = list(stop)
  if all(isinstance(s, str) for s in stop):
    rows = [tuple(stop)] * n
  elif len(stop) == n:
    rows = [tuple([s] if isinstance(s, str) else s) for s in stop]
  else:
    raise ValueError(f"stop: {len(stop)} lists for {n} prompts; pass one list of strings, "
                     "or one list per prompt.")
  for row in rows:
    if any(not isinstance(s, str) or not s for s in row):
      raise ValueError(f"stop={list(row)}: stop strings must be non-empty strings.")
  return rows


def decode(tokenizer, tokens: Sequence[int]) -> str:
  return tokenizer.decode(list(tokens), skip_special_tokens=True)


def cut(text: str, stops: Sequence[str]) -> str:
  """`text` up to the first occurrence of any stop string."""
  ends = [i for i in (text.find(s) for s in stops) if i >= 0]
  return text[:min(ends)] if ends else text


def first_stop(tokenizer, tokens: Sequence[int], stops: Sequence[str], since: int = 0
               ) -> int | None:
  """The fewest leading tokens whose text holds a stop string, or None when the text of
  all of them holds none. since: a count whose text is known to hold none."""
  def holds(k):
    text = decode(tokenizer, tokens[:k])
    return any(s in text for s in stops)
  if not stops or len(tokens) <= since or not holds(len(tokens)):
    return None
  lo, hi = since, len(tokens)      # holds(lo) is False, holds(hi) is True
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if holds(mid) else (mid, hi)
  return hi


def text(tokenizer, tokens: Sequence[int], stops: Sequence[str], *, reason: str,
         stopped: bool) -> str:
  """What a user reads: the tokens' text, without the final token when it is the EOS or
  stop id that ended them (reason "eos", or "stop" when no stop string did: `stopped`
  False), cut before the first stop string."""
  ended_by_token = reason == "eos" or (reason == "stop" and not stopped)
  return cut(decode(tokenizer, tokens[:-1] if ended_by_token else tokens), stops)


class StopScan:
  """The host side of stop strings for the rows of one state.

  stops: per row, its stop strings (empty: none); a row's `checked` count is how many
  of its tokens are known to hold no stop string.
  """

  def __init__(self, tokenizer, stops: Sequence[Sequence[str]]):
    if tokenizer is None and any(stops):
      raise ValueError("stop strings need a tokenizer to decode the text they are found "
                       "in; pass tokenizer= (hf.load_tokenizer's).")
    self.tokenizer = tokenizer
    self.stops = [tuple(s) for s in stops]
    self.checked = [0] * len(self.stops)
    self.stopped = [False] * len(self.stops)

  def reset(self, row: int, stops: Sequence[str]) -> None:
    """A new sample in `row` (continuous batching)."""
    self.stops[row], self.checked[row], self.stopped[row] = tuple(stops), 0, False

  def grow(self, rows: int) -> None:
    """Rows added at the end (rows without stop strings until `reset`)."""
    extra = rows - len(self.stops)
    self.stops += [()] * extra
    self.checked += [0] * extra
    self.stopped += [False] * extra

  def scan(self, state: DecodeState, live: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Looks for stop strings in the rows `live` (bool[b]: decoding during the round)
    -> (rows bool[b], keep int32[b]) for `loop.stop`, or None when none was found."""
    if not any(self.stops[i] for i in np.flatnonzero(live)):
      return None
    seq, start, length = jax.device_get((state.seq, state.prompt_len, state.length))
    rows = np.zeros((len(live),), bool)
    keep = np.zeros((len(live),), np.int32)
    for i in np.flatnonzero(live):
      if not self.stops[i] or self.stopped[i]:
        continue
      tokens = seq[i, start[i]:length[i]].tolist()
      k = first_stop(self.tokenizer, tokens, self.stops[i], self.checked[i])
      self.checked[i] = len(tokens)
      if k is not None:
        rows[i], keep[i], self.stopped[i] = True, k, True
        self.checked[i] = k
    return (rows, keep) if rows.any() else None
