"""What a request to the continuous-batching `Server` is, and what comes back: the
queued `Request`, the `Update`s a step streams, the finished `Completion`; and the
server's own records of a dispatched round (`Round`) and a running request's tokens
(`Stream`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from mars_jax.decoding import loop


@dataclasses.dataclass(frozen=True)
class Request:
  """A queued request: its prompt, budget, `sampling.generate` controls and stops;
  resumed: the tokens it had generated when it was preempted, now the end of its prompt
  (and out of its budget), which its stream already holds (0: never preempted)."""
  request_id: int
  prompt: tuple[int, ...]
  max_new_tokens: int
  controls: dict
  stop: tuple[str, ...]
  resumed: int = 0


@dataclasses.dataclass(frozen=True)
class Update:
  """Tokens a request committed during one `Server.step` (streamed in order).

  tokens: the new tokens; num_tokens, forwards: its totals so far; done: finished;
  finish_reason: "eos", "stop" or "length" once done, else None.
  """
  request_id: int
  tokens: list[int]
  num_tokens: int
  forwards: int
  done: bool
  finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
  """A finished request: its continuation (up to and including its EOS or stop id, or
  the token that completed a stop string), forwards, and why it ended ("eos", "stop",
  "length"); text: as `GenerateResult.texts` when the server has a tokenizer."""
  request_id: int
  tokens: list[int]
  forwards: int
  finish_reason: str = "length"
  text: str | None = None
  drafter_forwards: int = 0  # with a drafter: the drafter forwards it drafted in

  @property
  def tokens_per_forward(self) -> float:
    return len(self.tokens) / max(self.forwards, 1)


class Round(NamedTuple):
  """A dispatched round: its harvest (`loop.Harvest`, on the device), the lengths it
  counts from (int32[b]), the request of each row when it was dispatched, its W."""
  got: loop.Harvest
  since: jax.Array | np.ndarray
  slots: tuple[int | None, ...]
  window: int


@dataclasses.dataclass
class SpecCounts:
  """Speculative decoding's counters with the MARS meaning (`mars_jax.serve.metrics`):
  decoding steps of rows at W > 1 (drafts), their W - 1 MASK proposals (draft_tokens),
  the tokens they committed beyond their first (accepted), and per position j the steps
  that committed more than j + 1."""
  drafts: int = 0
  draft_tokens: int = 0
  accepted: int = 0
  per_position: list[int] = dataclasses.field(default_factory=list)

  def count(self, window: int, committed: int) -> None:
    """One step of a row at `window` that committed `committed` tokens."""
    if window < 2:
      return
    accepted = min(committed, window) - 1
    self.drafts += 1
    self.draft_tokens += window - 1
    self.accepted += accepted
    if len(self.per_position) < window - 1:
      self.per_position += [0] * (window - 1 - len(self.per_position))
    for j in range(accepted):
      self.per_position[j] += 1


@dataclasses.dataclass
class Stream:
  """A running request's tokens so far and the forwards it took part in."""
  tokens: list[int] = dataclasses.field(default_factory=list)
  forwards: int = 0
