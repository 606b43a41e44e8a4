"""The messages between the engine process and the HTTP process (`mars_jax.serve.engine`),
pickled through their pipe: what the engine sends about each request (`Accepted`,
`Tokens`, `Done`, `Scored`, `Error`), about itself (`Loaded`, `Ready`, `Failed`) and
after each round (`Round`, with the `Metrics` that /metrics reads)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mars_jax.serve.latency import REQUEST_BUCKETS, Histogram
from mars_jax.serve.requests import SpecCounts


@dataclasses.dataclass(frozen=True)
class Accepted:
  """The engine queued the request."""


@dataclasses.dataclass(frozen=True)
class Tokens:
  tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Done:
  completion: Any   # a `server.Completion`


@dataclasses.dataclass(frozen=True)
class Scored:
  """The answer to a score command: the AR model's logprobs (`scoring.Scores`)."""
  scores: Any


@dataclasses.dataclass(frozen=True)
class Error:
  """The request ended without an answer: refused (status 400: what `Server.submit`
  raised), failed (500: its round raised), or cancelled by a shutdown (503)."""
  message: str
  status: int = 500


@dataclasses.dataclass
class Metrics:
  """Counters of the engine (read by `GET /metrics`)."""
  requests: dict[str, int] = dataclasses.field(default_factory=dict)  # by finish reason
  cancelled: int = 0
  failed: int = 0
  failed_rounds: int = 0
  last_failure: str = ""
  prompt_tokens: int = 0
  generated_tokens: int = 0
  request_forwards: int = 0   # sum over requests of the forwards each took part in
  drafter_forwards: int = 0   # likewise, the drafter forwards (a server with a drafter)
  steps: int = 0              # forwards run for the batch
  rounds: int = 0
  running: int = 0
  queued: int = 0
  window: int = 0             # the W of the last round
  batch: int = 0              # the batch bucket of the last round
  compiles_after_ready: int = 0
  forward_tokens: int = 0     # flat-batch tokens the forwards ran (the ragged engine)
  preemptions: int = 0        # rows preempted for want of pages (resumed later)
  kv_pages_used: int = 0      # pool pages held by requests now
  kv_pages_cached: int = 0    # pool pages holding a prefix-cache entry now
  kv_pages: int = 0           # pool pages in all
  prefix_query_tokens: int = 0
  prefix_hit_tokens: int = 0
  tokens_streamed: int = 0    # tokens generated, counted as each round commits them
  queue_time: Histogram = dataclasses.field(
      default_factory=lambda: Histogram(REQUEST_BUCKETS))  # seconds requests waited for a row
  spec: SpecCounts = dataclasses.field(default_factory=SpecCounts)


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What the HTTP side needs of the model: tokenizer, EOS ids, the most tokens one
  request may hold (prompt + completion), the largest window a request may fix,
  whether a drafter decodes, the batch rows, the model's vocabulary."""
  tokenizer: Any
  eos_token_ids: tuple[int, ...]
  context_room: int
  max_window: int
  drafter: bool
  max_batch: int
  vocab_size: int | None = None


@dataclasses.dataclass(frozen=True)
class Ready:
  startup_s: float     # from the process start to ready
  warmup_s: float      # of which compiling (or loading) and timing the variants
  programs_loaded: int = 0     # saved executables the warmup loaded
  programs_compiled: int = 0   # and those it compiled (and saved)


@dataclasses.dataclass(frozen=True)
class Round:
  """One round's events [(request id, event)] and the counters after it."""
  events: list[tuple[int, Any]]
  metrics: Metrics


@dataclasses.dataclass(frozen=True)
class Failed:
  """The engine could not start (the model did not load, warmup raised)."""
  message: str
