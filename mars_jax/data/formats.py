"""Record shapes users have, and their conversion to one chat: a list of messages.

  fmt = detect_format(records, where="train.jsonl")   # or a name from data.format
  messages = to_messages(record, fmt)                  # raises RecordError(kind, reason)

Shapes (`data.format`; "auto" detects one per file from its first records):

  messages           {"messages": [{"role", "content"[, "reasoning_content"]}, ...]}
                     (OpenAI chat; also Dolci-Instruct-SFT, most HF SFT sets). Roles:
                     system, user, assistant, tool. An assistant turn with `tool_calls`
                     is skipped with its count ("tool_calls"): its target would be the
                     call the template writes, not text the data supplies.
  sharegpt           {"conversations": [{"from", "value"}, ...]}: from human/user ->
                     user, gpt/assistant/model -> assistant, system, tool/observation ->
                     tool; function_call -> "tool_calls" (skipped, counted).
  alpaca             {"instruction", "input" (optional), "output"[, "system"]}: one user
                     turn `instruction` (+ "\\n\\n" + `input` when non-empty), one assistant
                     turn `output`.
  prompt_completion  {"prompt", "completion"}: strings (one user turn, one assistant
                     turn) or message lists (TRL's conversational form), concatenated.

A record that does not fit its file's shape is bad input ("malformed"); a file whose
records fit no shape is refused with the keys it has (`UnknownFormatError`).
"""

from __future__ import annotations

import collections
from typing import Any, Iterable

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion")
SHAPES = {
    "messages": '{"messages": [{"role": ..., "content": ...}, ...]}',
    "sharegpt": '{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}',
    "alpaca": '{"instruction": ..., "input": ..., "output": ...}',
    "prompt_completion": '{"prompt": ..., "completion": ...}',
}
COLUMNS = {"messages": ("messages",), "sharegpt": ("conversations",),
           "alpaca": ("instruction", "input", "output", "system"),
           "prompt_completion": ("prompt", "completion")}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool",
                  "function_response": "tool"}
DETECT_SAMPLE = 100


class RecordError(ValueError):
  """A record that cannot be a chat: `kind` (a validation.BAD_KINDS name) and reason."""

  def __init__(self, kind: str, reason: str):
    super().__init__(f"{kind}: {reason}")
    self.kind, self.reason = kind, reason


class UnknownFormatError(ValueError):
  """A data file whose records match no known shape."""


def shape_of(record: Any) -> str | None:
  """The shape a record has by its keys (not yet checked in depth), or None."""
  if not isinstance(record, dict):
    return None
  if "messages" in record:
    return "messages"
  if "conversations" in record:
    return "sharegpt"
  if "instruction" in record and "output" in record:
    return "alpaca"
  if "prompt" in record and "completion" in record:
    return "prompt_completion"
  return None


def detect_format(records: Iterable[Any], where: str) -> str:
  """The most common shape among `records` (the first DETECT_SAMPLE are enough).

  Raises UnknownFormatError naming the keys found and the known shapes when none fits.
  """
  shapes: collections.Counter = collections.Counter()
  keys: collections.Counter = collections.Counter()
  for record in records:
    shape = shape_of(record)
    if shape:
      shapes[shape] += 1
    keys[str(sorted(record)) if isinstance(record, dict) else type(record).__name__] += 1
  if shapes:
    return shapes.most_common(1)[0][0]
  found = "; ".join(f"{k} in {n} records" for k, n in keys.most_common(3)) or "no records"
  known = "\n  ".join(f"{name}: {shape}" for name, shape in SHAPES.items())
  raise UnknownFormatError(
      f"{where}: its records match no known chat shape (keys found: {found}). Known "
      f"shapes (data.format):\n  {known}\nConvert the file to one of them, or set "
      "data.format to the one it is.")


def check_format(fmt: str) -> str:
  if fmt not in FORMATS:
    raise ValueError(f"data.format={fmt!r}; expected one of {FORMATS}.")
  return fmt


def _text(value: Any, what: str) -> str:
  if not isinstance(value, str):
    raise RecordError("malformed", f"{what} is {type(value).__name__}, not a string")
  return value


def _message(m: Any, k: int) -> dict:
  """One OpenAI-style message, checked: role, content (and reasoning_content) strings."""
  if not isinstance(m, dict) or not isinstance(m.get("role"), str):
    raise RecordError("malformed", f"messages[{k}] is not {{'role': str, 'content': str}}")
  if m["role"] == "assistant" and m.get("tool_calls"):
    raise RecordError("tool_calls", f"messages[{k}] is an assistant turn with tool_calls")
  out = {"role": m["role"], "content": _text(m.get("content"), f"messages[{k}].content")}
  reasoning = m.get("reasoning_content")
  if reasoning is not None:
    out["reasoning_content"] = _text(reasoning, f"messages[{k}].reasoning_content")
  return out


def _messages(value: Any, what: str) -> list[dict]:
  if not isinstance(value, list) or not value:
    raise RecordError("malformed", f"no non-empty {what!r} list")
  return [_message(m, k) for k, m in enumerate(value)]


def _sharegpt(turns: Any) -> list[dict]:
  if not isinstance(turns, list) or not turns:
    raise RecordError("malformed", "no non-empty 'conversations' list")
  out = []
  for k, t in enumerate(turns):
    if not isinstance(t, dict) or not isinstance(t.get("from"), str):
      raise RecordError("malformed", f"conversations[{k}] is not {{'from': str, 'value': str}}")
    if t["from"] == "function_call":
      raise RecordError("tool_calls", f"conversations[{k}] is a function_call turn")
    if t["from"] not in SHAREGPT_ROLES:
      raise RecordError("unknown_role", f"conversations[{k}] is from {t['from']!r}; "
                        f"expected one of {sorted(SHAREGPT_ROLES)}")
    out.append({"role": SHAREGPT_ROLES[t["from"]],
                "content": _text(t.get("value"), f"conversations[{k}].value")})
  return out


def _alpaca(record: dict) -> list[dict]:
  instruction = _text(record.get("instruction"), "instruction")
  extra = record.get("input")
  user = instruction if not extra else f"{instruction}\n\n{_text(extra, 'input')}"
  system = record.get("system")
  return ([{"role": "system", "content": _text(system, "system")}] if system else []) + [
      {"role": "user", "content": user},
      {"role": "assistant", "content": _text(record.get("output"), "output")}]


def _prompt_completion(record: dict) -> list[dict]:
  out = []
  for key, role in (("prompt", "user"), ("completion", "assistant")):
    value = record.get(key)
    out += (_messages(value, key) if isinstance(value, list)
            else [{"role": role, "content": _text(value, key)}])
  return out


def to_messages(record: Any, fmt: str) -> list[dict]:
  """The chat of `record` in shape `fmt` (not "auto"): [{"role", "content"
  [, "reasoning_content"]}]. Raises RecordError when the record does not fit."""
  if shape_of(record) != fmt:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise RecordError("malformed", f"a record with keys {keys} in a {fmt}-shaped file "
                      f"(expected {SHAPES[fmt]})")
  if fmt == "messages":
    return _messages(record["messages"], "messages")
  if fmt == "sharegpt":
    return _sharegpt(record["conversations"])
  if fmt == "alpaca":
    return _alpaca(record)
  return _prompt_completion(record)
