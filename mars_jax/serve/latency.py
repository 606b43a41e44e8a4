"""Request latencies as the HTTP process sees them, kept as Prometheus histograms:
time to first token, the time between tokens, and a request's whole time (from its
submission to its last token), each under our name and under vLLM's, so dashboards built
for vLLM read them as they are.

  latency = Latency()
  latency.first_token(0.21); latency.between_tokens(0.09, tokens=3); latency.request(2.4)
  latency.text('model="m"')   # -> Prometheus text lines
"""

from __future__ import annotations

import bisect
import dataclasses

# Bucket bounds (seconds), vLLM's for the same three histograms.
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                       1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
BETWEEN_TOKENS_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclasses.dataclass
class Histogram:
  """Observations counted into buckets of upper bounds `bounds` (+Inf last)."""
  bounds: tuple[float, ...]
  counts: list[int] = dataclasses.field(default_factory=list)
  total: float = 0.0
  count: int = 0

  def __post_init__(self):
    self.counts = [0] * (len(self.bounds) + 1)

  def observe(self, value: float, times: int = 1) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += times
    self.total += value * times
    self.count += times

  def text(self, name: str, help_: str, labels: str) -> list[str]:
    """The histogram in the Prometheus text format (cumulative buckets)."""
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    running = 0
    for bound, n in zip((*self.bounds, float("inf")), self.counts):
      running += n
      le = "+Inf" if bound == float("inf") else repr(bound)
      lines.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
    lines += [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.count}"]
    return lines


# (ours, vLLM's, help, bounds) of each histogram
_NAMES = {
    "first_token": ("mars_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                    "Seconds from a request's submission to its first token.",
                    FIRST_TOKEN_BUCKETS),
    "between_tokens": ("mars_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                       "Seconds between a request's tokens (a round's tokens share its "
                       "time).", BETWEEN_TOKENS_BUCKETS),
    "request": ("mars_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                "Seconds from a request's submission to its last token.", REQUEST_BUCKETS),
}


class Latency:
  """The three histograms of the requests that finished or streamed tokens."""

  def __init__(self):
    self.histograms = {key: Histogram(bounds) for key, (*_, bounds) in _NAMES.items()}

  def first_token(self, seconds: float) -> None:
    self.histograms["first_token"].observe(seconds)

  def between_tokens(self, seconds: float, tokens: int) -> None:
    """`tokens` tokens that came `seconds` after the request's previous ones: each
    counts seconds / tokens."""
    self.histograms["between_tokens"].observe(seconds / tokens, tokens)

  def request(self, seconds: float) -> None:
    self.histograms["request"].observe(seconds)

  def text(self, labels: str, vllm_labels: str | None = None) -> list[str]:
    """Every histogram under both names (vLLM's with `vllm_labels`, default the same),
    Prometheus text lines."""
    lines = []
    for key, (ours, vllm, help_, _) in _NAMES.items():
      lines += self.histograms[key].text(ours, help_, labels)
      lines += self.histograms[key].text(vllm, help_, vllm_labels or labels)
    return lines
