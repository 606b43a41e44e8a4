"""Chat formatting and label masking: chat -> {"tokens", "loss_mask"}, by character spans.

The conversation is rendered once with the tokenizer's own chat template (the one
generation uses, with `template_kwargs` such as Qwen3's `enable_thinking`) and that
whole text is tokenized once: the tokens trained on are the tokens the model sees at
inference. The targets are character spans of that text: each assistant turn's
content, and its reasoning (`reasoning_content`, or `<think>...</think>` leading the
content) when the template renders it. A token is a target when any of its characters
lies in a span (so a token that straddles the start of a reply, e.g. the header's
"\n" merged with a reply's leading "\n", is a target), and so is the special token
that starts exactly where a turn's content ends (`<|im_end|>`).

A turn whose reasoning is rendered in a think block (Qwen3:
`<think>\n{reasoning}\n</think>\n\n{reply}`) has one span, from its `<think>` tag
through the end of the reply: after the generation prompt `<|im_start|>assistant\n`
the model writes the tags, their newlines, the reasoning and the reply, so all of it
is its output. (Only whitespace may lie between the tag and the reasoning, and only
`</think>` and whitespace between the reasoning and the reply; a template that puts
anything else there gets a reasoning span and a reply span.) A turn without
reasoning, or whose reasoning the template drops, has its reply only: Qwen3's empty
`<think>\n\n</think>\n\n` is scaffolding (the non-thinking generation prompt writes
it), not output. Everything else (system and user turns, role headers, default system
prompts, that empty block, the newline after `<|im_end|>`) is not a target.
`train_on="last"` keeps only the last assistant turn's spans (the authors' setting).

A two-turn chat with the character tokenizer, one column per token (S = <|im_start|>,
E = <|im_end|>, . = newline, ^ = loss_mask True):

  Suser.HiE.Sassistant.YoE.Suser.Ok?E.Sassistant.NoE.
                       ^^^                       ^^^

The spans are found by asking the template, not by guessing its layout: a piece of a
message (say turn k's content) starts and ends where a sentinel character inserted
at its start or end lands when the conversation is rendered again with it; that
must be the only change, and the text between must be the piece as given, or, when
the template strips the piece (Qwen3 strips replies and reasoning of surrounding
newlines), the piece without its leading and trailing whitespace. Content the
template renders verbatim is one span, `<think>` tags included (ChatML); a template
that splits `<think>r</think>reply` (Qwen3) gives a reasoning span and a reply span,
joined with the tags around them into one span as above. Reasoning the template
drops (Qwen3 strips it from turns before the last user query) is no target; content
it drops or rewrites makes the record a "template_error".
All pieces are first probed in one rendering, a distinct sentinel at each piece's
start and end (`_spans_in_one_probe`); a chat where that is not a pure insertion is
probed piece by piece (`_turn_spans`).

Whole sources of chats become examples in `examples.py` (in memory) and `cache.py`
(the tokenized cache).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

TRAIN_ON = ("all", "last")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
Span = tuple[int, int, bool]     # [start, end) of the text; True: a turn's content


class TemplateError(ValueError):
  """The chat template raised on a chat, or does not render one of its pieces verbatim."""


def render(tokenizer, messages: Sequence[dict], template_kwargs: Mapping[str, Any]) -> str:
  """The whole conversation as the template renders it (no generation prompt)."""
  try:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         **dict(template_kwargs))
  except Exception as e:  # jinja's TemplateError, raise_exception(...), a missing key
    raise TemplateError(f"the chat template raised {type(e).__name__}: {e}") from e


def _free_marks(text: str):
  """Private-use characters (the sentinels) that `text` does not hold, in order."""
  return (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)


def _insertion(text: str, probe: str, mark: str) -> int | None:
  """Where `probe` is `text` with `mark` inserted once, or None if it is not that."""
  at = probe.find(mark)
  if at < 0 or probe.count(mark) != 1 or len(probe) != len(text) + len(mark):
    return None
  return at if probe[:at] == text[:at] and probe[at + len(mark):] == text[at:] else None


class _Probe:
  """Renderings of one chat with a sentinel inserted into one field of one message."""

  def __init__(self, tokenizer, messages: Sequence[dict], template_kwargs, text: str):
    self.tokenizer, self.messages, self.kwargs, self.text = (
        tokenizer, list(messages), template_kwargs, text)
    self.mark = next(_free_marks(text), None)
    if self.mark is None:
      raise TemplateError("the chat holds every private-use character (U+E000..U+F8FF) "
                          "that mars_jax marks its pieces with")

  def at(self, k: int, field: str, index: int) -> tuple[int | None, bool]:
    """(where the sentinel inserted at `index` of messages[k][field] lands when that is
    the only change to the rendering, else None; whether it is rendered at all)."""
    probed = list(self.messages)
    value = probed[k][field]
    probed[k] = {**probed[k], field: value[:index] + self.mark + value[index:]}
    rendered = render(self.tokenizer, probed, self.kwargs)
    return _insertion(self.text, rendered, self.mark), self.mark in rendered

  def span(self, k: int, field: str, begin: int, stop: int) -> tuple[int, int] | None:
    """The characters of the text where messages[k][field][begin:stop] is rendered as
    given, or, failing that, with its leading and trailing whitespace stripped (as
    Qwen3 strips replies and reasoning). None when the template drops the piece;
    raises TemplateError when it renders it otherwise."""
    value = self.messages[k][field]
    piece = value[begin:stop]
    stripped = (begin + len(piece) - len(piece.lstrip()),
                stop - (len(piece) - len(piece.rstrip())))
    rendered = False
    for lo, hi in dict.fromkeys([(begin, stop), stripped]):
      end, shown = self.at(k, field, hi)
      rendered |= shown
      start = self.at(k, field, lo)[0] if end is not None else None
      if start is not None and self.text[start:end] == value[lo:hi]:
        return start, end
    if not rendered:
      return None
    raise TemplateError(
        f"the chat template does not render messages[{k}].{field} verbatim (a character "
        "inserted at its start or end does not appear there in the rendering), so its "
        "targets cannot be found; use a template that renders message content as given.")


def _think_block(text: str, spans: list[Span]) -> list[Span]:
  """A turn's [reasoning, reply] spans as one content span from the `<think>` tag that
  opens the rendered block through the reply's end, when only whitespace lies between
  that tag and the reasoning and only `</think>` and whitespace between the reasoning
  and the reply (Qwen3's `<think>\nr\n</think>\n\nreply`); else `spans` unchanged."""
  if len(spans) != 2 or spans[0][2] or not spans[1][2]:
    return spans
  (r0, r1, _), (c0, c1, _) = spans
  at = r0
  while at > 0 and text[at - 1].isspace():
    at -= 1
  tag = at - len(THINK_OPEN)
  if (r1 <= r0 or tag < 0 or not text.startswith(THINK_OPEN, tag)
      or text[r1:c0].strip() != THINK_CLOSE):
    return spans
  return [(tag, c1, True)]


def _turn_spans(probe: _Probe, k: int) -> list[Span]:
  """The target spans of assistant turn k: its reasoning_content when rendered, and its
  content: one span when rendered verbatim, else its `<think>` reasoning (when the
  template renders it) and the reply after `</think>`, each possibly stripped; a
  rendered think block is then one span (`_think_block`)."""
  m = probe.messages[k]
  out: list[Span] = []
  if m.get("reasoning_content", "").strip():
    span = probe.span(k, "reasoning_content", 0, len(m["reasoning_content"]))
    if span:
      out.append((*span, False))
  content = m["content"]
  cut = content.rfind(THINK_CLOSE)
  whole = None
  if cut >= 0:
    end, _ = probe.at(k, "content", len(content))
    start = probe.at(k, "content", 0)[0] if end is not None else None
    if start is not None and probe.text[start:end] == content:
      whole = (start, end)
  if cut < 0 or whole:
    span = whole or probe.span(k, "content", 0, len(content))
    if span is None:
      raise TemplateError(f"the chat template does not render messages[{k}]'s content")
    return _think_block(probe.text, out + [(*span, True)])
  opened = content.rfind(THINK_OPEN, 0, cut)
  begin = opened + len(THINK_OPEN) if opened >= 0 else 0
  if content[begin:cut].strip():
    span = probe.span(k, "content", begin, cut)
    if span:
      out.append((*span, False))
  span = probe.span(k, "content", cut + len(THINK_CLOSE), len(content))
  if span is None:
    raise TemplateError(f"the chat template does not render messages[{k}]'s reply")
  return _think_block(probe.text, out + [(*span, True)])


def target_spans(tokenizer, messages: Sequence[dict], *, train_on: str = "all",
                 template_kwargs: Mapping[str, Any] | None = None
                 ) -> tuple[str, list[Span]]:
  """(rendered text, [(start, end, is_content)] character spans of the targets).

  Raises TemplateError when the template raises or does not render an assistant
  turn's content verbatim (see the module docstring)."""
  if train_on not in TRAIN_ON:
    raise ValueError(f"data.train_on={train_on!r}; expected one of {TRAIN_ON}.")
  kwargs = template_kwargs or {}
  text = render(tokenizer, messages, kwargs)
  turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
  turns = turns[-1:] if train_on == "last" else turns
  spans = _spans_in_one_probe(tokenizer, messages, turns, kwargs, text)
  if spans is None:
    probe = _Probe(tokenizer, messages, kwargs, text)
    spans = [s for k in turns for s in _turn_spans(probe, k)]
  return text, [s for s in spans if s[1] > s[0]]


def _spans_in_one_probe(tokenizer, messages: Sequence[dict], turns: list[int], kwargs,
                        text: str) -> list[Span] | None:
  """The spans `_turn_spans` finds first (every piece rendered as given), from one
  rendering with a distinct sentinel at the start and the end of every piece at once;
  None when that rendering is anything but `text` with the sentinels inserted (a
  template that strips or splits a piece), and `_turn_spans` must probe piece by piece.
  Reasoning whose two sentinels are both absent is dropped by the template; a rendered
  think block is one span (`_think_block`), as there."""
  free = _free_marks(text)
  probed, turn_pieces = list(messages), []
  for k in turns:
    m, pieces = dict(probed[k]), []
    fields = ([("reasoning_content", False)] if m.get("reasoning_content", "").strip()
              else []) + [("content", True)]
    for field, is_content in fields:
      start, end = next(free, None), next(free, None)
      if end is None:
        return None
      m[field] = start + m[field] + end
      pieces.append((start, end, is_content, messages[k][field]))
    probed[k] = m
    turn_pieces.append(pieces)
  marks = [c for pieces in turn_pieces for start, end, _, _ in pieces for c in (start, end)]
  rendered = render(tokenizer, probed, kwargs)
  if any(rendered.count(c) > 1 for c in marks):
    return None
  stripped = rendered
  for c in marks:   # a few marks: replace beats translate's per-character table here
    stripped = stripped.replace(c, "")
  if stripped != text:
    return None
  found = sorted((rendered.find(c), c) for c in marks if c in rendered)
  at = {c: i - rank for rank, (i, c) in enumerate(found)}   # index in `text`
  spans = []
  for pieces in turn_pieces:
    turn = []
    for start, end, is_content, value in pieces:
      if start not in at and end not in at and not is_content:
        continue
      if start not in at or end not in at or text[at[start]:at[end]] != value:
        return None
      turn.append((at[start], at[end], is_content))
    spans += _think_block(text, turn)
  return spans


def _label(offsets: np.ndarray, ids: np.ndarray, spans: list[Span],
           special_ids: frozenset[int]) -> np.ndarray:
  """loss_mask: bool[n] from token character offsets int[n, 2] and ids int[n]."""
  mask = np.zeros(len(ids), bool)
  starts, ends = offsets[:, 0], offsets[:, 1]
  for start, end, is_content in spans:
    mask |= (starts < end) & (ends > start)
    after = np.searchsorted(starts, end, side="left")
    if (is_content and after < len(ids) and starts[after] == end
        and int(ids[after]) in special_ids):
      mask[after] = True
  return mask


def _label_by_tokens(encoding, ids: Sequence[int], spans: list[Span],
                     special_ids: frozenset[int]) -> np.ndarray | None:
  """`_label`'s mask from a fast tokenizer's Encoding, without every token's offsets:
  a span's tokens run from the first token holding its first character through the
  last token that starts before its end (offsets never decrease); None where a
  character or token has no place (a normalizer that drops characters): use `_label`."""
  n = len(ids)
  mask = np.zeros(n, bool)
  for start, end, is_content in spans:
    first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
    if first is None or last is None:
      return None
    chars = None   # the characters of the token after the span, once found
    while last + 1 < n:
      chars = encoding.token_to_chars(last + 1)
      if chars is None:
        return None
      if chars[0] >= end:
        break
      last += 1
    mask[first:last + 1] = True
    after = last + 1
    if is_content and after < n and chars[0] == end and ids[after] in special_ids:
      mask[after] = True
  return mask


def tokenize_rendered(tokenizer, rendered: Sequence[tuple[str, list[Span]]]
                      ) -> list[dict[str, np.ndarray]]:
  """Tokenizes (text, spans) pairs (`target_spans` output) in one call.

  Returns one {"tokens": int32[n], "loss_mask": bool[n]} per text, n its length."""
  if not rendered:
    return []
  texts = [text for text, _ in rendered]
  enc = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
  special = frozenset(int(i) for i in tokenizer.all_special_ids)
  encodings = enc.encodings or [None] * len(texts)   # None: not a fast tokenizer
  out = []
  for (text, spans), ids, encoding in zip(rendered, enc["input_ids"], encodings):
    mask = _label_by_tokens(encoding, ids, spans, special) if encoding else None
    if mask is None:   # the offsets the encoding holds, or a slow tokenizer's (if any)
      offsets = encoding.offsets if encoding else tokenizer(
          text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
      mask = _label(np.asarray(offsets, np.int64).reshape(-1, 2), np.asarray(ids), spans,
                    special)
    out.append({"tokens": np.asarray(ids, np.int32), "loss_mask": mask})
  return out


def format_chats(tokenizer, chats: Sequence[Sequence[dict]], *, train_on: str = "all",
                 template_kwargs: Mapping[str, Any] | None = None
                 ) -> list[dict[str, np.ndarray]]:
  """Formats validated chats (lists of messages), untruncated.

  Returns one {"tokens": int32[n], "loss_mask": bool[n]} per chat, n its length.
  Raises TemplateError for a chat the template cannot render verbatim."""
  return tokenize_rendered(tokenizer, [
      target_spans(tokenizer, m, train_on=train_on, template_kwargs=template_kwargs)
      for m in chats])


def pad_example(example: dict[str, np.ndarray], length: int,
                pad_id: int) -> dict[str, np.ndarray]:
  """Right-pads (or cuts) one example to `length`: tokens int32[length], loss_mask bool[length].

  Padding positions are `pad_id` with loss_mask False.
  """
  n = min(len(example["tokens"]), length)
  tokens = np.full(length, pad_id, np.int32)
  loss_mask = np.zeros(length, bool)
  tokens[:n] = example["tokens"][:n]
  loss_mask[:n] = example["loss_mask"][:n]
  return {"tokens": tokens, "loss_mask": loss_mask}


def pad_id_of(tokenizer) -> int:
  """The id that fills padding: the tokenizer's pad token, else its eos token."""
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  if pad is None:
    raise ValueError("the tokenizer has neither a pad nor an eos token to pad with.")
  return int(pad)
