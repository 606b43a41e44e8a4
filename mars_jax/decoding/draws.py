"""Which token each slot commits or proposes: greedy, or sampled (pure functions).

A sample's controls: temperature T (0: greedy), top_k (0: off), top_p (1.0: off)
and a seed. The warped distribution q of one slot is, in this order (as
transformers' logits warpers):

  s = logits / T                      temperature
  keep s >= the k-th largest s        top-k (every token tied with the k-th stays)
  keep the nucleus: with p the softmax of the kept s, token i stays when the mass of
  the tokens before it (sorted by s, descending) is < top_p; every token tied with
  the last one kept stays
  q = softmax over the kept s

A draw from q is the Gumbel-max `argmax(kept s + g)`, with `g` Gumbel noise that is
a function of the sample's seed and the position being drawn, nothing else:

  g = gumbel(fold_in(key(seed), position), [vocab])

so a sample's tokens do not depend on its batch, its row or the round of steps, and
two forwards that draw the same position with the same seed share their noise. That
sharing is what lossless sampling builds on (`mars_jax.decoding.gates.verify`): the
draft for position n (drawn from the MASK slot's q) and the verifying draw at n (from
the clean causal distribution p, one forward later) see the same g; the draft stands
when the two draws agree, so the output is AR sampling token for token (docs/design.md,
"Sampling").

The sort that top-k and top-p need, and the noise, run only when some row of the
batch asks for them (`lax.cond`): greedy batches pay nothing for sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mars_jax.decoding import gates

Array = jax.Array


def scale(logits: Array, temperature: Array) -> Array:
  """logits / T where T > 0, the logits as they are where T == 0 (greedy rows).
  logits: float32[b, k, vocab]; temperature: float32[b] -> float32[b, k, vocab]."""
  t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
  return logits.astype(jnp.float32) / t[:, None, None]


def cut(scaled: Array, top_k: Array, top_p: Array) -> Array:
  """The top-k, then top-p cut of temperature-scaled logits: -inf outside the kept set.

  scaled: float32[b, k, vocab]; top_k: int32[b] (0 or >= vocab: off);
  top_p: float32[b] (>= 1: off) -> float32[b, k, vocab].
  """
  vocab = scaled.shape[-1]
  desc = -jnp.sort(-scaled, axis=-1)                              # descending
  k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None, None]
  kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), axis=-1)
  in_k = desc >= kth
  probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
  before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs  # mass of earlier ones
  kept = jnp.sum(in_k & (before < top_p[:, None, None]), axis=-1, keepdims=True)
  last = jnp.take_along_axis(desc, jnp.maximum(kept - 1, 0), axis=-1)
  threshold = jnp.where((top_p < 1.0)[:, None, None], jnp.maximum(kth, last), kth)
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def noise(seed: Array, positions: Array, vocab: int) -> Array:
  """Gumbel noise keyed by (seed, position). seed: uint32[b]; positions: int32[b, k]
  -> float32[b, k, vocab]."""
  def one(s, p):
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(s), p), (vocab,), jnp.float32)
  return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(seed, positions)


def warp(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
  """The warped logits (temperature, then the top-k/top-p cut when any row asks for it).
  Shapes as `cut`; temperature: float32[b]."""
  scaled = scale(logits, temperature)
  needs_cut = jnp.any((temperature > 0) & (((top_k > 0) & (top_k < logits.shape[-1]))
                                           | (top_p < 1.0)))
  return jax.lax.cond(needs_cut, cut, lambda s, k, p: s, scaled, top_k, top_p)


def choose(logits: Array, positions: Array, temperature: Array, top_k: Array, top_p: Array,
           seed: Array) -> Array:
  """The token of every slot: greedy where T == 0, a draw from q where T > 0.

  logits: float32[b, k, vocab]; positions: int32[b, k] (the position each slot's
  token would take); temperature, top_p: float32[b]; top_k: int32[b]; seed: uint32[b]
  -> int32[b, k].
  """
  def sampled(logits):
    drawn = gates.greedy(warp(logits, temperature, top_k, top_p)
                         + noise(seed, positions, logits.shape[-1]))
    return jnp.where((temperature > 0)[:, None], drawn, gates.greedy(logits))
  return jax.lax.cond(jnp.any(temperature > 0), sampled, gates.greedy, logits)
