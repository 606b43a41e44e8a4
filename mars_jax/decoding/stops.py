"""Stop strings: found on the decoded text between rounds of steps, across token boundaries.

The loop ends a sample itself at an EOS or stop id (`gates.take`); a stop string is
text, so the host looks for it after every round (`rounds`, `serve.Server`): for each
sample that was live during the round, the text of its new tokens is searched, and a
sample whose text holds a stop string is cut after the token that completed it
(`loop.stop`), which also drops whatever it decoded past that token from its counts.

  tokens     "The" " answer" " is" " 4" ".\\n" "\\nQ" ":"      stop = "\\n\\nQ"
  text       The answer is 4.\\n\\nQ:
  kept       the first 6 tokens (the 6th completes "\\n\\nQ"); text "The answer is 4."

Text is decoded as the user sees it (`skip_special_tokens=True`) and incrementally
(`Detokenizer`): each new token is decoded with a few tokens of context before it, never
the whole completion again, so a round costs what its new tokens cost. The token that
completes a stop string is the first one after which the text holds it; stops split
over several tokens are found. `first_stop` is the same answer by bisection over whole
decodes of prefixes (the reference the tests compare with).
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


class Detokenizer:
  """The text of a growing token list, decoding only the newest tokens.

    d = Detokenizer(tokenizer)
    d.push([17, 42])   # -> "Hel" (the new text); d.text == "Hel"
    d.push([9])        # -> "lo"

  Each push decodes the tokens since the last text it emitted together with the ones
  just before them (`prefix`), and emits the difference: a tokenizer that spaces or
  merges by context (word-level joins, byte-level BPE) gives the text a whole decode
  gives. A trailing U+FFFD (a multibyte character whose bytes span tokens) is held
  until the next tokens complete it.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.tokens: list[int] = []
    self.prefix = 0   # tokens[prefix:read]: the context of the next decode
    self.read = 0     # tokens[:read] are in `text`
    self.text = ""

  def push(self, tokens: Sequence[int]) -> str:
    """Appends tokens -> the text they add ("" while it is not decided yet)."""
    self.tokens.extend(tokens)
    if len(self.tokens) == self.read:
      return ""
    before = decode(self.tokenizer, self.tokens[self.prefix:self.read])
    after = decode(self.tokenizer, self.tokens[self.prefix:])
    if len(after) <= len(before) or after.endswith("\ufffd"):
      return ""
    delta = after[len(before):]
    self.prefix, self.read = self.read, len(self.tokens)
    self.text += delta
    return delta


def found_in_tail(text: str, new: int, stops: Sequence[str]) -> bool:
  """Whether a stop string ends in the last `new` characters of `text`."""
  longest = max(map(len, stops))
  tail = text[max(len(text) - new - longest + 1, 0):]
  return any(s in tail for s in stops)


class StopScan:
  """The host side of stop strings for the rows of one state.

  stops: per row, its stop strings (empty: none); `checked`: per row, how many of its
  tokens have been decoded and hold no stop string; `stopped`: a stop string ended it.
  """

  def __init__(self, tokenizer, stops: Sequence[Sequence[str]]):
    if tokenizer is None and any(stops):
      raise ValueError("stop strings need a tokenizer to decode the text they are found "
                       "in; pass tokenizer= (hf.load_tokenizer's).")
    self.tokenizer = tokenizer
    self.stops: list[tuple[str, ...]] = []
    self.checked: list[int] = []
    self.stopped: list[bool] = []
    self.text: list[Detokenizer | None] = []
    self.grow(len(stops))
    for row, s in enumerate(stops):
      self.reset(row, s)

  def reset(self, row: int, stops: Sequence[str]) -> None:
    """A new sample in `row` (continuous batching)."""
    self.stops[row], self.checked[row], self.stopped[row] = tuple(stops), 0, False
    self.text[row] = Detokenizer(self.tokenizer) if stops else None

  def grow(self, rows: int) -> None:
    """Rows added at the end (rows without stop strings until `reset`)."""
    extra = rows - len(self.stops)
    self.stops += [()] * extra
    self.checked += [0] * extra
    self.stopped += [False] * extra
    self.text += [None] * extra

  def take(self, rows: Sequence[int]) -> "StopScan":
    """A scan of len(rows) rows: row i is this one's row rows[i], or a fresh one where
    rows[i] is None (`loop.regroup`)."""
    scan = StopScan(self.tokenizer, [()] * len(rows))
    for new, old in enumerate(rows):
      if old is not None:
        scan.stops[new], scan.checked[new] = self.stops[old], self.checked[old]
        scan.stopped[new], scan.text[new] = self.stopped[old], self.text[old]
    return scan

  def snapshot(self, row: int) -> tuple:
    """A row's scan as it is (its stops, checked, stopped, text), for `restore`."""
    return self.stops[row], self.checked[row], self.stopped[row], self.text[row]

  def restore(self, row: int, snapshot: tuple) -> None:
    """A row goes on with a scan `snapshot` took (a preempted request resumed)."""
    self.stops[row], self.checked[row], self.stopped[row], self.text[row] = snapshot

  def push(self, row: int, tokens: Sequence[int]) -> int | None:
    """The row's next tokens (those after its `checked` ones) -> how many of all its
    tokens to keep when one of them completes a stop string (the row is then
    `stopped`), else None."""
    if not self.stops[row] or self.stopped[row]:
      return None
    text = self.text[row]
    for token in tokens:
      self.checked[row] += 1
      delta = text.push([token])
      if delta and found_in_tail(text.text, len(delta), self.stops[row]):
        self.stopped[row] = True
        return self.checked[row]
    return None

  def scan(self, state: DecodeState, live: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Looks for stop strings in the rows `live` (bool[b]: decoding during the round)
    -> (rows bool[b], keep int32[b]) for `loop.stop`, or None when none was found."""
    if not any(self.stops[i] for i in np.flatnonzero(live)):
      return None
    seq, start, length = jax.device_get((state.seq, state.prompt_len, state.length))
    rows = np.zeros((len(live),), bool)
    keep = np.zeros((len(live),), np.int32)
    for i in np.flatnonzero(live):
      k = self.push(i, seq[i, start[i] + self.checked[i]:length[i]].tolist())
      if k is not None:
        rows[i], keep[i] = True, k
    return (rows, keep) if rows.any() else None
