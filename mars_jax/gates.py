"""MARS acceptance: confidence gates and the left-to-right acceptance rule (pure functions).

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

METRICS = ("probability", "margin", "entropy")


def gate(logits: Array, tau: Array, metric: str) -> Array:
  """Whether each proposal's distribution passes the gate.

  logits: float32[..., vocab]; tau: float32[] -> bool[...].
  """
  if metric not in METRICS:
    raise ValueError(f"metric={metric!r}; expected one of {list(METRICS)}.")
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if metric == "entropy":
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1) <= tau
  top2 = jnp.exp(jax.lax.top_k(logp, 2)[0])
  score = top2[..., 0] if metric == "probability" else top2[..., 0] - top2[..., 1]
  return (score >= tau) & (tau < 1.0)


def accept(logits: Array, tau: Array, metric: str, eos_ids: Array,
           remaining: Array) -> tuple[Array, Array, Array]:
  """Greedy proposals and how many of them each sample accepts.

  logits: float32[b, W, vocab] (slot 0: the last real token; slot k: MASK slot k);
  tau: float32[]; eos_ids: int32[e] (entries < 0 are padding);
  remaining: int32[b] token budget left (0 for finished samples).
  -> (proposals int32[b, W], accepted int32[b] in [0, W], hit_eos bool[b]:
      an EOS is among the accepted tokens).
  """
  proposals = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  w = proposals.shape[1]
  passes = gate(logits, tau, metric).at[:, 0].set(True)
  is_eos = jnp.any((proposals[..., None] == eos_ids) & (eos_ids >= 0), axis=-1)
  after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
  ok = passes & ~after_eos & (jnp.arange(w) < remaining[:, None])
  taken = jnp.cumprod(ok, axis=1).astype(bool)
  return proposals, jnp.sum(taken, axis=1).astype(jnp.int32), jnp.any(taken & is_eos, axis=1)
