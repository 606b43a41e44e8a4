"""Chat formatting and label masking: chat record -> {"tokens", "loss_mask"}.

The conversation is rendered with the tokenizer's own chat template (the one
generation uses), tokenized once, and every assistant turn is a target: its
content tokens and the special token that closes it (`<|im_end|>` in ChatML).
Everything else (system and user turns, role headers, the newline after
`<|im_end|>`) is not. A two-turn chat with the character tokenizer, one column per
token (S = <|im_start|>, E = <|im_end|>, . = newline, ^ = loss_mask True):

  Suser.HiE.Sassistant.YoE.Suser.Ok?E.Sassistant.NoE.
                       ^^^                       ^^^

Targets are found on the text: for assistant turn k, the template renders
messages[:k] with `add_generation_prompt=True` as a prefix of the full text,
followed by the turn's content; a token is a target when it starts inside that
content, or is the special token right after it. A template that does not
render this way is rejected with a clear error.

`TokenizedSource` formats a whole list of sources once, at index time, into
flat arrays (~5 bytes per token), so that lengths are checked before training
and the training map only slices and pads.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from grain.sources import RandomAccessDataSource

from mars_jax.data.validation import DataStats


def target_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
  """(rendered text, [(start, end) character span of each assistant turn's content])."""
  text = tokenizer.apply_chat_template(list(messages), tokenize=False)
  spans = []
  for k, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prefix = tokenizer.apply_chat_template(list(messages[:k]), tokenize=False,
                                           add_generation_prompt=True)
    start = len(prefix)
    if not text.startswith(prefix) or text[start:start + len(m["content"])] != m["content"]:
      raise ValueError(
          "the tokenizer's chat template does not render an assistant turn as "
          "render(messages[:k], add_generation_prompt=True) + content; mars_jax needs such "
          f"a template (ChatML, as in Qwen2.5) to find the targets. Turn {k} of {messages!r}.")
    spans.append((start, start + len(m["content"])))
  return text, spans


def _label(starts: np.ndarray, ids: np.ndarray, spans: list[tuple[int, int]],
           special_ids: np.ndarray) -> np.ndarray:
  """loss_mask: bool[n] from token start offsets int[n] and ids int[n]."""
  mask = np.zeros(len(ids), bool)
  for start, end in spans:
    mask |= (starts >= start) & (starts < end)
    after = np.searchsorted(starts, end, side="left")
    if after < len(ids) and np.isin(ids[after], special_ids):
      mask[after] = True
  return mask


def format_chats(tokenizer, chats: Sequence[Sequence[dict]]) -> list[dict[str, np.ndarray]]:
  """Formats validated chats (lists of messages), untruncated.

  Returns one {"tokens": int32[n], "loss_mask": bool[n]} per chat, n its length.
  """
  rendered = [target_spans(tokenizer, messages) for messages in chats]
  enc = tokenizer([text for text, _ in rendered], add_special_tokens=False,
                  return_offsets_mapping=True)
  special = np.asarray(sorted(tokenizer.all_special_ids), np.int64)
  out = []
  for (_, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
    ids = np.asarray(ids, np.int32)
    starts = np.asarray([s for s, _ in offsets], np.int64)
    out.append({"tokens": ids, "loss_mask": _label(starts, ids, spans, special)})
  return out


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


class TokenizedSource(RandomAccessDataSource):
  """Formatted, length-checked examples of `sources`, built once.

  Item i: {"tokens": int32[n_i], "loss_mask": bool[n_i]} with n_i <= max_length.
  A record longer than `max_length` is cut to it and counted in `stats.truncated`
  when `truncate`; it is bad ("too_long") when not, or when no target survives
  the cut. Sources need `__len__`, `__getitem__` -> chat record, and `where(i)`.
  """

  def __init__(self, sources: Sequence, tokenizer, stats: DataStats, *, max_length: int,
               truncate: bool = True, chunk_size: int = 1024):
    if max_length < 2:
      raise ValueError(f"max_length={max_length}; expected at least 2.")
    tokens, masks, lengths = [], [], []
    for source in sources:
      for begin in range(0, len(source), chunk_size):
        idx = range(begin, min(begin + chunk_size, len(source)))
        examples = format_chats(tokenizer, [source[i]["messages"] for i in idx])
        for i, ex in zip(idx, examples):
          n = len(ex["tokens"])
          if n > max_length:
            if not truncate:
              stats.report_bad("too_long", source.where(i),
                               f"{n} tokens > max_length {max_length} (truncate=False)")
              continue
            if not ex["loss_mask"][:max_length].any():
              stats.report_bad("too_long", source.where(i),
                               f"{n} tokens; no assistant token within max_length "
                               f"{max_length}")
              continue
            ex = {k: v[:max_length] for k, v in ex.items()}
            stats.truncated += 1
          tokens.append(ex["tokens"])
          masks.append(ex["loss_mask"])
          lengths.append(len(ex["tokens"]))
    stats.kept += len(lengths)
    self.max_length = max_length
    self.lengths = np.asarray(lengths, np.int64)
    self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
    self._tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
    self._masks = np.concatenate(masks) if masks else np.zeros(0, bool)

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    a, b = self._offsets[i], self._offsets[i + 1]
    return {"tokens": self._tokens[a:b], "loss_mask": self._masks[a:b]}

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())
