"""Bad input: what counts as bad, the per-kind counts, and the skip/error policy.

Every record is checked when its source is loaded (structure) or indexed
(length, after tokenization), never hours into training. A bad record is
either skipped and counted (`on_bad="skip"`) or stops the run with its file
and line (`on_bad="error"`). Nothing is dropped without being counted: the
`DataStats` of a pipeline holds the count of each kind and the location and
reason of the first few, and `summary()` prints them.

Kinds:
  malformed        not a JSON object / not of its file's shape (mars_jax.data.formats)
                   / a message without string `role` and `content`
  unknown_role     a role outside ROLES
  empty_content    a user or tool turn whose content is empty or whitespace
  empty_assistant  an assistant turn whose content is empty or whitespace
  no_assistant     no assistant turn at all: nothing to learn from
  assistant_first  the first turn after any system turns is the assistant's: a reply
                   to no prompt
  tool_calls       an assistant turn that calls tools (see formats.py)
  template_error   the chat template raised on the record, or does not render one
                   of its assistant turns verbatim (the reason says which)
  too_long         longer than max_length with truncation off, or with
                   truncation on, no assistant token left after truncating
  empty_file       a file with no records
Truncated records (truncation on, some target left) are kept and counted in
`truncated`, not as bad.
"""

from __future__ import annotations

import dataclasses

ROLES = ("system", "user", "assistant", "tool")
BAD_KINDS = ("malformed", "unknown_role", "empty_content", "empty_assistant", "no_assistant",
             "assistant_first", "tool_calls", "template_error", "too_long", "empty_file")
POLICIES = ("skip", "error")


class BadInputError(ValueError):
  """A bad record under `on_bad="error"`; the message starts with `file:line`."""


@dataclasses.dataclass
class DataStats:
  """Counts of a load: records read, kept, truncated, and bad ones per kind.

  `examples` holds "where: kind: reason" of the first `max_examples` bad records,
  `bad_records` that line of every one (the trainer writes them to the run's
  bad_records.txt).
  """
  on_bad: str = "skip"
  max_examples: int = 5
  records: int = 0
  kept: int = 0
  truncated: int = 0
  counts: dict[str, int] = dataclasses.field(
      default_factory=lambda: {kind: 0 for kind in BAD_KINDS})
  examples: list[str] = dataclasses.field(default_factory=list)
  bad_records: list[str] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.on_bad not in POLICIES:
      raise ValueError(f"on_bad={self.on_bad!r}; expected one of {POLICIES}.")

  @property
  def bad(self) -> int:
    return sum(self.counts.values())

  def report_bad(self, kind: str, where: str, reason: str) -> None:
    """Counts one bad record (or file); raises BadInputError under `on_bad="error"`."""
    if kind not in self.counts:
      raise ValueError(f"unknown bad-input kind {kind!r}; expected one of {BAD_KINDS}.")
    line = f"{where}: {kind}: {reason}"
    if self.on_bad == "error":
      raise BadInputError(f"{line} (on_bad='error'; set on_bad='skip' to skip and count "
                          "bad records instead)")
    self.counts[kind] += 1
    self.bad_records.append(line)
    if len(self.examples) < self.max_examples:
      self.examples.append(line)

  def summary(self) -> str:
    """One paragraph: totals, non-zero counts per kind, then the first bad records."""
    head = (f"data: {self.records} records read, {self.kept} kept, {self.truncated} "
            f"truncated, {self.bad} bad")
    if not self.bad:
      return head + "."
    kinds = ", ".join(f"{kind}={n}" for kind, n in self.counts.items() if n)
    lines = [f"{head} ({kinds}; skipped, on_bad='skip'). First bad records:"]
    lines += [f"  {e}" for e in self.examples]
    return "\n".join(lines)


def check_messages(messages: list[dict]) -> tuple[str, str] | None:
  """None if `messages` (formats.to_messages' output) is a usable chat, else (kind, reason).

  A usable chat has roles in ROLES, no empty user, tool or assistant turn, a first
  non-system turn that is not the assistant's, and at least one assistant turn.
  """
  has_assistant = False
  for k, m in enumerate(messages):
    if m["role"] not in ROLES:
      return "unknown_role", f"messages[{k}] has role {m['role']!r}; expected one of {ROLES}"
    if m["role"] == "assistant":
      if not m["content"].strip():
        return "empty_assistant", f"messages[{k}] is an empty assistant turn"
      has_assistant = True
    elif m["role"] != "system" and not m["content"].strip():
      return "empty_content", f"messages[{k}] is an empty {m['role']} turn"
  first = next((m["role"] for m in messages if m["role"] != "system"), None)
  if first == "assistant":
    return "assistant_first", "the conversation starts with the assistant's turn (no prompt)"
  if not has_assistant:
    return "no_assistant", "no assistant turn to learn from"
  return None
