"""Load-aware window: the W that maximises expected tokens per second for the running batch.

Before every round of decoding steps the sampler asks `WindowPolicy.choose`
for W, given the batch bucket b (the compiled shape), the cache length S and the
number of active samples:

  rate(W) = active * tokens_per_forward(W) / seconds_per_step(b, S, W)

seconds_per_step comes from a `CostTable`, one entry per compiled variant: looked
up, or measured on first need by the `measure` function the sampler passes
(`decoding.timing.measure_fn`: a few timed steps of that very variant), or loaded from a
JSON file written by an earlier run. tokens_per_forward is the running mean of
what the rounds run at W accepted, started from an optimistic prior (W itself,
worth `prior_forwards` forwards), so every W whose cost could pay off is tried
before its measured acceptance decides. W = 1 is always a candidate and yields
exactly one token per forward, so the chosen W is never slower than AR by the
cost table; as the batch grows, steps at W > 1 cost relatively more and the
choice falls back towards 1.

  cost (ms/step)   W=1   W=2   W=3    tokens/fwd (seen)  W=1  W=2  W=3
  b = 4            10    11    12                        1.0  1.7  2.1
  b = 64           40    75    110    ->  b=4: W=3 (175/s/row), b=64: W=1 (25/s/row)

Pure host logic: no JAX here, so the sampler can depend on this module.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Callable, Sequence

Measure = Callable[[int, int, int], float]   # (batch, cache_len, window) -> seconds/step


@dataclasses.dataclass
class CostTable:
  """Seconds per decoding step of each compiled variant, keyed (batch, cache_len, window).

  meta: free-form facts about where the costs were measured (model, device, mode).
  """
  seconds: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
  meta: dict = dataclasses.field(default_factory=dict)

  def put(self, batch: int, cache_len: int, window: int, seconds: float) -> None:
    if not seconds > 0:
      raise ValueError(f"cost of (batch={batch}, cache_len={cache_len}, window={window}) "
                       f"is {seconds}; it must be > 0.")
    self.seconds[(batch, cache_len, window)] = float(seconds)

  def get(self, batch: int, cache_len: int, window: int) -> float | None:
    """The entry for this variant, else the one with the nearest cache length for the
    same (batch, window), else None."""
    if (batch, cache_len, window) in self.seconds:
      return self.seconds[(batch, cache_len, window)]
    near = [(abs(s - cache_len), v) for (b, s, w), v in self.seconds.items()
            if b == batch and w == window]
    return min(near)[1] if near else None

  def to_json(self) -> dict:
    return {"meta": self.meta,
            "entries": [{"batch": b, "cache_len": s, "window": w, "seconds": v}
                        for (b, s, w), v in sorted(self.seconds.items())]}

  def save(self, path: str) -> None:
    """Writes the table to `path` whole or not at all (a temporary file, renamed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(self.to_json(), f, indent=2)
    os.replace(tmp, path)

  @classmethod
  def from_json(cls, data: dict) -> "CostTable":
    table = cls(meta=dict(data.get("meta", {})))
    for e in data["entries"]:
      table.put(int(e["batch"]), int(e["cache_len"]), int(e["window"]), float(e["seconds"]))
    return table

  @classmethod
  def load(cls, path: str) -> "CostTable":
    with open(path) as f:
      try:
        return cls.from_json(json.load(f))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a cost table ({{'entries': [{{batch, cache_len, "
                         f"window, seconds}}, ...]}}): {e}") from e


@dataclasses.dataclass
class AcceptanceStats:
  """Tokens committed and per-sample forwards run at each W, with an optimistic prior.

  tokens_per_forward(W) = (tokens[W] + W * prior_forwards) / (forwards[W] + prior_forwards);
  exactly 1.0 for W = 1.
  """
  prior_forwards: float = 8.0
  tokens: dict[int, int] = dataclasses.field(default_factory=dict)
  forwards: dict[int, int] = dataclasses.field(default_factory=dict)

  def observe(self, window: int, tokens: int, forwards: int) -> None:
    self.tokens[window] = self.tokens.get(window, 0) + tokens
    self.forwards[window] = self.forwards.get(window, 0) + forwards

  def tokens_per_forward(self, window: int) -> float:
    if window == 1:
      return 1.0
    return ((self.tokens.get(window, 0) + window * self.prior_forwards)
            / (self.forwards.get(window, 0) + self.prior_forwards))


class WindowPolicy:
  """Chooses W from `windows` (1 always included) by expected tokens per second.

  costs: a `CostTable`, a JSON path of one, or None (an empty table that `choose`
  fills by measuring); prior_forwards: weight of the optimistic prior of each
  W's tokens per forward; round_steps: decoding steps run between two choices;
  calibration_rounds: timings of each missing variant, taken round-robin over
  the windows (so that other load on the machine hits them alike), best kept.
  """

  def __init__(self, windows: Sequence[int] = (1, 2, 3, 5),
               costs: CostTable | str | None = None, *, prior_forwards: float = 8.0,
               round_steps: int = 16, calibration_rounds: int = 5):
    if any(w < 1 for w in windows):
      raise ValueError(f"windows={list(windows)}; every W must be >= 1.")
    if round_steps < 1 or calibration_rounds < 1:
      raise ValueError(f"round_steps={round_steps}, calibration_rounds="
                       f"{calibration_rounds}; both must be >= 1.")
    self.windows = tuple(sorted({1, *windows}))
    self.costs = CostTable.load(costs) if isinstance(costs, str) else (costs or CostTable())
    self.stats = AcceptanceStats(prior_forwards)
    self.round_steps = round_steps
    self.calibration_rounds = calibration_rounds
    # (batch, active, W) of the latest decisions (bounded: a server decides every round)
    self.choices: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1024)

  def calibrate(self, batch: int, cache_len: int, measure: Measure) -> None:
    """Measures the windows the table has no cost for at (batch, cache_len)."""
    missing = [w for w in self.windows
               if w <= cache_len and self.costs.get(batch, cache_len, w) is None]
    best = {w: float("inf") for w in missing}
    for _ in range(self.calibration_rounds if missing else 0):
      for w in missing:
        best[w] = min(best[w], measure(batch, cache_len, w))
    for w, seconds in best.items():
      self.costs.put(batch, cache_len, w, seconds)

  def expected_rate(self, batch: int, cache_len: int, active: int,
                    window: int) -> float | None:
    """Expected tokens per second at W (None: no cost known for the variant)."""
    seconds = self.costs.get(batch, cache_len, window)
    if seconds is None:
      return None
    return active * self.stats.tokens_per_forward(window) / seconds

  def choose(self, batch: int, cache_len: int, active: int,
             measure: Measure | None = None) -> int:
    """The W with the highest expected rate (the smallest on ties); 1 when nothing is
    active. Raises if W = 1's cost is neither known nor measurable."""
    best, best_rate = 1, None
    if active > 0 and measure is not None:
      self.calibrate(batch, cache_len, measure)
    if active > 0:
      for window in self.windows:
        if window > cache_len:
          continue
        rate = self.expected_rate(batch, cache_len, active, window)
        if window == 1 and rate is None:
          raise ValueError(f"no cost for W=1 at batch {batch}, cache length {cache_len}: "
                           "give a cost table with it, or a measure function.")
        if rate is not None and (best_rate is None or rate > best_rate):
          best, best_rate = window, rate
    self.choices.append((batch, active, best))
    return best

  def observe(self, window: int, tokens: int, forwards: int) -> None:
    """Tokens committed and per-sample forwards run by a round at `window`."""
    self.stats.observe(window, tokens, forwards)


class FixedWindow:
  """The policy interface with one W always: what a fixed `window=W` runs with."""

  def __init__(self, window: int, *, round_steps: int = 16):
    if window < 1 or round_steps < 1:
      raise ValueError(f"window={window}, round_steps={round_steps}; both must be >= 1.")
    self.windows = (window,)
    self.round_steps = round_steps
    self.stats = AcceptanceStats()

  def choose(self, batch: int, cache_len: int, active: int,
             measure: Measure | None = None) -> int:
    return self.windows[0]

  def observe(self, window: int, tokens: int, forwards: int) -> None:
    self.stats.observe(window, tokens, forwards)
