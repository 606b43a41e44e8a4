"""MARS acceptance: confidence gates and the left-to-right acceptance rules (pure functions).

One forward gives `W` proposals per sample: the token at the last real token
(exact AR) and at each of the `W-1` MASK slots, greedy or drawn
(`mars_jax.decoding.draws`). They are accepted strictly left to right: proposal 0
always, proposal k >= 1 while its gate holds and every proposal before it was
accepted, stopping after an end token (EOS, or one of the sample's stop ids) and at
the sample's remaining token budget:

  proposal k        0    1    2    3    4
  gate holds        -    T    T    F    T
  is an end token   F    F    F    F    F      -> accepted 3 (the F at k=3 stops it)
  is an end token   F    T    F    F    F      -> accepted 2 (the end at k=1 included)
  remaining = 1                                -> accepted 1

Gates, on the proposal's distribution p = softmax(logits) and its token x (the
greedy one, x = argmax p, unless sampling chose another):
  probability  p(x) >= tau                 (greedy: p1, the top probability)
  margin       p(x) - max_{y!=x} p(y) >= tau   (greedy: p1 - p2)
  entropy      H(p) <= tau                 (nats)
When sampling, p is the temperature-scaled softmax(logits / T) before the top-k and
top-p cut, and x the token drawn: the gate asks how likely the model found the token
it proposes, not how peaked the distribution is at its top (docs/design.md, "Sampling").
Softmax is strictly positive, so p(x) < 1 and the margin < 1 in exact arithmetic;
float32 can round them to 1.0, so the probability and margin gates are defined
to fail outright at tau >= 1. That makes tau >= 1 plain AR, exactly.
The gate and tau may differ per sample: `metric` is then an int32 array of
indices into `METRICS`, and `tau` a float32 array, one entry per sample.

Lossless verification (`verify`) uses the same left-to-right rule with exact
checks instead of gates. Drafts d0, d1, ... (earlier MASK proposals, fed as real
tokens in this forward) sit at the positions after the last verified token;
this forward's causal outputs there give the AR tokens g0, g1, ... (greedy, or
drawn with the noise each draft was drawn with):

  draft             d0   d1   d2
  AR token          g0   g1   g2   g3
  match             T    F    .           -> accepted 2: g0 (= d0) and g1, the
                                             correction; d2 is discarded
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.core import choices
from mars_jax.core.choices import Metric

Array = jax.Array

METRICS = choices.values(Metric)  # a sample's metric is an index into this


def metric_ids(metric: Metric | Sequence[Metric], n: int) -> np.ndarray:
  """One gate name, or one per sample -> int32[n] indices into `METRICS`."""
  names = [metric] * n if isinstance(metric, str) else list(metric)
  if len(names) != n:
    raise ValueError(f"{len(names)} metrics for {n} prompts; pass one, or one per prompt.")
  for name in names:
    choices.check(Metric, name, "metric")
  return np.asarray([METRICS.index(m) for m in names], np.int32)


def check_tau(taus: float | Sequence[float], metric: Metric, name: str = "tau") -> None:
  """Raises ValueError on a threshold outside the gate's range: probability and margin
  in [0, 1] (1: exact AR), entropy >= 0 (nats)."""
  values = np.atleast_1d(np.asarray(taus, np.float64))
  high, what = (np.inf, ">= 0 (nats)") if metric == "entropy" else (1.0, "in [0, 1] (1: AR)")
  bad = values[~((values >= 0) & (values <= high))]
  if bad.size:
    raise ValueError(f"{name} {bad[0]:g}: the {metric} gate's threshold must be {what}.")


def greedy(logits: Array) -> Array:
  """argmax over the last axis (the first of equal maxima), as two plain reductions:
  XLA's CPU backend runs `jnp.argmax`'s (value, index) reduction several times slower.
  logits: float32[..., vocab] -> int32[...]."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)


def gate(logits: Array, tau: Array, metric: Metric | Array, chosen: Array | None = None
         ) -> Array:
  """Whether each proposal's distribution passes the gate.

  logits: float32[..., vocab] (temperature-scaled when sampling); tau: float32
  broadcastable to [...]; metric: a name in `METRICS`, or int32 indices into it
  broadcastable to [...]; chosen: int32[...], the proposed tokens (default: the greedy
  ones) -> bool[...].

  With z = exp(logits - max), s = sum(z): the probability and margin gates read the
  chosen token x, p(x) = z_x/s and p(x) - max_{y != x} p(y) (for the greedy x: p1 = 1/s
  and p1 - p2); the entropy gate reads H = log s - sum(z (logits - max))/s.
  """
  if isinstance(metric, str):
    choices.check(Metric, metric, "metric")
  logits = logits.astype(jnp.float32)
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
  z = jnp.exp(shifted)
  total = jnp.sum(z, axis=-1)
  chosen = greedy(logits) if chosen is None else chosen
  p_chosen = jnp.exp(jnp.take_along_axis(shifted, chosen[..., None], axis=-1)[..., 0]) / total
  probability = (p_chosen >= tau) & (tau < 1.0)
  if isinstance(metric, str) and metric == "probability":
    return probability
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  others = jnp.where(index == chosen[..., None], -jnp.inf, shifted)
  margin = (p_chosen - jnp.exp(jnp.max(others, axis=-1)) / total >= tau) & (tau < 1.0)
  if isinstance(metric, str) and metric == "margin":
    return margin
  entropy = jnp.log(total) - jnp.sum(z * shifted, axis=-1) / total <= tau
  if isinstance(metric, str):
    return entropy
  return jnp.where(metric == 0, probability, jnp.where(metric == 1, margin, entropy))


def take(proposals: Array, passes: Array, end_ids: Array,
         remaining: Array) -> tuple[Array, Array]:
  """How many proposals each sample takes, left to right.

  proposals: int32[b, W]; passes: bool[b, W] (proposal k may follow proposal k-1;
  entry 0 is ignored: proposal 0 is always taken); end_ids: int32[e] or int32[b, e],
  the tokens that end a sample (EOS and stop ids; entries < 0 are padding);
  remaining: int32[b] token budget left (0 for finished samples).
  -> (accepted int32[b] in [0, W], hit_end bool[b]: an end token is among the accepted).
  The first refused proposal and the first end token are found with min-reductions (no
  cumulative ops, which XLA's CPU backend runs as slow reduce-windows).
  """
  w = proposals.shape[1]
  k = jnp.arange(w)[None]
  ends = end_ids[None, None] if end_ids.ndim == 1 else end_ids[:, None]
  is_end = jnp.any((proposals[..., None] == ends) & (ends >= 0), axis=-1)
  first_end = jnp.min(jnp.where(is_end, k, w), axis=1)
  ok = (passes | (k == 0)) & (k <= first_end[:, None]) & (k < remaining[:, None])
  accepted = jnp.min(jnp.where(ok, w, k), axis=1).astype(jnp.int32)
  return accepted, first_end < accepted


def accept(logits: Array, proposals: Array, tau: Array, metric: Metric | Array,
           end_ids: Array, remaining: Array) -> tuple[Array, Array]:
  """How many proposals each sample accepts under its gate.

  logits: float32[b, W, vocab], the distributions the proposals came from (slot 0: the
  last real token; slot k: MASK slot k; temperature-scaled when sampling);
  proposals: int32[b, W]; tau: float32[] or float32[b]; metric: a name, or int32[b]
  indices into `METRICS`; end_ids, remaining: as `take`.
  -> (accepted int32[b] in [0, W], hit_end bool[b]).
  """
  b = proposals.shape[0]
  tau = jnp.broadcast_to(jnp.asarray(tau, jnp.float32), (b,))[:, None]
  metric = metric if isinstance(metric, str) else jnp.broadcast_to(metric, (b,))[:, None]
  return take(proposals, gate(logits, tau, metric, proposals), end_ids, remaining)


def verify(greedy: Array, draft: Array, num_draft: Array, end_ids: Array,
           remaining: Array) -> tuple[Array, Array]:
  """Lossless acceptance: the AR tokens up to and including the first mismatch.

  greedy: int32[b, W] (greedy[k]: the AR token after the verified prefix and
  draft[:k]: greedy, or drawn with the noise the draft at its position was drawn
  with, `mars_jax.decoding.draws`); draft: int32[b, W-1]; num_draft: int32[b]
  (drafts fed, <= W-1); end_ids, remaining: as `take`.
  -> (accepted int32[b]: greedy[:accepted] are exact AR tokens, hit_end bool[b]).
  """
  w = greedy.shape[1]
  match = (draft == greedy[:, :w - 1]) & (jnp.arange(w - 1) < num_draft[:, None])
  passes = jnp.concatenate([jnp.ones((greedy.shape[0], 1), bool), match], axis=1)
  return take(greedy, passes, end_ids, remaining)
