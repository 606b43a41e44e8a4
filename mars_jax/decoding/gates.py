"""MARS acceptance: confidence gates and the left-to-right acceptance rules (pure functions).

One forward gives `W` proposals per sample: the argmax at the last real token
(exact AR) and at each of the `W-1` MASK slots. They are accepted strictly left
to right: proposal 0 always, proposal k >= 1 while its gate holds and every
proposal before it was accepted, stopping after an EOS and at the sample's
remaining token budget:

  proposal k        0    1    2    3    4
  gate holds        -    T    T    F    T
  is EOS            F    F    F    F    F      -> accepted 3 (the F at k=3 stops it)
  is EOS            F    T    F    F    F      -> accepted 2 (EOS at k=1 included)
  remaining = 1                                -> accepted 1

Gates, on the proposal's distribution p = softmax(logits):
  probability  p1 >= tau            (p1: the top probability)
  margin       p1 - p2 >= tau       (p2: the second one)
  entropy      H(p) <= tau          (nats)
Softmax is strictly positive, so p1 < 1 and p1 - p2 < 1 in exact arithmetic;
float32 can round them to 1.0, so the probability and margin gates are defined
to fail outright at tau >= 1. That makes tau >= 1 plain greedy AR, exactly.
The gate and tau may differ per sample: `metric` is then an int32 array of
indices into `METRICS`, and `tau` a float32 array, one entry per sample.

Lossless verification (`verify`) uses the same left-to-right rule with exact
checks instead of gates. Drafts d0, d1, ... (earlier MASK proposals, fed as real
tokens in this forward) sit at the positions after the last verified token;
this forward's causal outputs there are the greedy AR tokens g0, g1, ...:

  draft             d0   d1   d2
  greedy AR         g0   g1   g2   g3
  match             T    F    .           -> accepted 2: g0 (= d0) and g1, the
                                             correction; d2 is discarded
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax import choices
from mars_jax.choices import Metric

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


def greedy(logits: Array) -> Array:
  """argmax over the last axis (the first of equal maxima), as two plain reductions:
  XLA's CPU backend runs `jnp.argmax`'s (value, index) reduction several times slower.
  logits: float32[..., vocab] -> int32[...]."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)


def gate(logits: Array, tau: Array, metric: Metric | Array) -> Array:
  """Whether each proposal's distribution passes the gate.

  logits: float32[..., vocab]; tau: float32 broadcastable to [...];
  metric: a name in `METRICS`, or int32 indices into it broadcastable to [...]
  -> bool[...].

  With z = exp(logits - max), s = sum(z): p1 = 1/s, p2 = exp(second - max)/s (the
  largest logit once the greedy one is set aside), H = log s - sum(z (logits - max))/s.
  """
  if isinstance(metric, str):
    choices.check(Metric, metric, "metric")
  logits = logits.astype(jnp.float32)
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
  z = jnp.exp(shifted)
  total = jnp.sum(z, axis=-1)
  p1 = 1.0 / total
  probability = (p1 >= tau) & (tau < 1.0)
  if isinstance(metric, str) and metric == "probability":
    return probability
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  others = jnp.where(index == greedy(logits)[..., None], -jnp.inf, shifted)
  margin = (p1 - jnp.exp(jnp.max(others, axis=-1)) / total >= tau) & (tau < 1.0)
  if isinstance(metric, str) and metric == "margin":
    return margin
  entropy = jnp.log(total) - jnp.sum(z * shifted, axis=-1) / total <= tau
  if isinstance(metric, str):
    return entropy
  return jnp.where(metric == 0, probability, jnp.where(metric == 1, margin, entropy))


def take(proposals: Array, passes: Array, eos_ids: Array,
         remaining: Array) -> tuple[Array, Array]:
  """How many proposals each sample takes, left to right.

  proposals: int32[b, W]; passes: bool[b, W] (proposal k may follow proposal k-1;
  entry 0 is ignored: proposal 0 is always taken); eos_ids: int32[e] (entries
  < 0 are padding); remaining: int32[b] token budget left (0 for finished samples).
  -> (accepted int32[b] in [0, W], hit_eos bool[b]: an EOS is among the accepted).
  The first refused proposal and the first EOS are found with min-reductions (no
  cumulative ops, which XLA's CPU backend runs as slow reduce-windows).
  """
  w = proposals.shape[1]
  k = jnp.arange(w)[None]
  is_eos = jnp.any((proposals[..., None] == eos_ids) & (eos_ids >= 0), axis=-1)
  first_eos = jnp.min(jnp.where(is_eos, k, w), axis=1)
  ok = (passes | (k == 0)) & (k <= first_eos[:, None]) & (k < remaining[:, None])
  accepted = jnp.min(jnp.where(ok, w, k), axis=1).astype(jnp.int32)
  return accepted, first_eos < accepted


def accept(logits: Array, tau: Array, metric: Metric | Array, eos_ids: Array,
           remaining: Array) -> tuple[Array, Array, Array]:
  """Greedy proposals and how many of them each sample accepts under its gate.

  logits: float32[b, W, vocab] (slot 0: the last real token; slot k: MASK slot k);
  tau: float32[] or float32[b]; metric: a name, or int32[b] indices into `METRICS`;
  eos_ids: int32[e]; remaining: int32[b].
  -> (proposals int32[b, W], accepted int32[b] in [0, W], hit_eos bool[b]).
  """
  proposals = greedy(logits)
  b = proposals.shape[0]
  tau = jnp.broadcast_to(jnp.asarray(tau, jnp.float32), (b,))[:, None]
  metric = metric if isinstance(metric, str) else jnp.broadcast_to(metric, (b,))[:, None]
  accepted, hit_eos = take(proposals, gate(logits, tau, metric), eos_ids, remaining)
  return proposals, accepted, hit_eos


def verify(greedy: Array, draft: Array, num_draft: Array, eos_ids: Array,
           remaining: Array) -> tuple[Array, Array]:
  """Lossless acceptance: the greedy AR tokens up to and including the first mismatch.

  greedy: int32[b, W] (greedy[k]: the AR token after the verified prefix and
  draft[:k]); draft: int32[b, W-1]; num_draft: int32[b] (drafts fed, <= W-1);
  eos_ids, remaining: as `take`.
  -> (accepted int32[b]: greedy[:accepted] are exact greedy AR tokens, hit_eos bool[b]).
  """
  w = greedy.shape[1]
  match = (draft == greedy[:, :w - 1]) & (jnp.arange(w - 1) < num_draft[:, None])
  passes = jnp.concatenate([jnp.ones((greedy.shape[0], 1), bool), match], axis=1)
  return take(greedy, passes, eos_ids, remaining)
