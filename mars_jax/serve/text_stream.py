"""Streamed text: the deltas of a request's decoded text as its tokens come in, never a
character that the final answer will not hold.

  stream = TextStream(tokenizer, stops=("\\n\\n",))
  stream.push([17, 42])      # -> "Hel"    (the text so far, less what is held back)
  stream.push([9])           # -> "lo"
  stream.finish(final_text)  # -> the rest of the final text

Two things are held back until more tokens decide them: a trailing U+FFFD (a multibyte
character whose bytes span tokens), and the longest tail of the text that starts a stop
string (it may complete one, and the answer ends before a stop string). The final text
(`stops.text`: without the ending EOS or stop id, cut before the first stop string)
then extends what was sent, so the concatenated deltas equal the non-streamed answer.
"""

from __future__ import annotations

import logging
from typing import Sequence

from mars_jax.decoding import stops as stop_strings

log = logging.getLogger(__name__)


def held_back(text: str, stops: Sequence[str]) -> int:
  """How many trailing characters of `text` are not safe to send yet."""
  keep = len(text)
  while keep and text[keep - 1] == "\ufffd":
    keep -= 1
  tail = 0
  for s in stops:
    for k in range(min(len(s) - 1, keep), 0, -1):
      if text[keep - k:keep] == s[:k]:
        tail = max(tail, k)
        break
  return len(text) - keep + tail


class TextStream:
  """The text deltas of one request (see the module doc)."""

  def __init__(self, tokenizer, stops: Sequence[str] = (), end_ids: Sequence[int] = ()):
    self.stops, self.end_ids = tuple(stops), set(end_ids)
    self.text = stop_strings.Detokenizer(tokenizer)
    self.ended = False
    self.sent = ""

  def push(self, tokens: Sequence[int]) -> str:
    """New tokens -> the text that may be sent now ("" when nothing new is safe). An end
    token (EOS or stop id: `end_ids`) ends the tokens, and its text is never sent."""
    tokens = list(tokens)
    if self.ended or not tokens:
      return ""
    if tokens[-1] in self.end_ids:
      tokens, self.ended = tokens[:-1], True
    new = len(self.text.push(tokens))
    text = self.text.text
    if self.stops and new:
      start = max(len(self.sent) - max(map(len, self.stops)) + 1, 0)
      text = text[:start] + stop_strings.cut(text[start:], self.stops)
    safe = text[:len(text) - held_back(text[len(self.sent):], self.stops)]
    if len(safe) <= len(self.sent):
      return ""
    delta, self.sent = safe[len(self.sent):], safe
    return delta

  def finish(self, final_text: str) -> str:
    """The rest of the final text (what the non-streamed answer holds past `sent`)."""
    if not final_text.startswith(self.sent):  # a tokenizer whose decode rewrites the past
      log.warning("streamed text %r is not a prefix of the final text %r", self.sent,
                  final_text)
    rest, self.sent = final_text[len(self.sent):], final_text
    return rest
