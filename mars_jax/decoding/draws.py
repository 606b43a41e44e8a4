"""Which token each slot commits or proposes: greedy, or sampled (pure functions).

A sample's controls: temperature T (0: greedy), top_k (0: off), top_p (1.0: off),
min_p (0: off) and a seed. The warped distribution q of one slot is, in this order (as
transformers' logits warpers):

  s = logits / T                      temperature
  keep s >= the k-th largest s        top-k (every token tied with the k-th stays)
  keep the nucleus: with p the softmax of the kept s, token i stays when the mass of
  the tokens before it (sorted by s, descending) is < top_p; every token tied with
  the last one kept stays
  keep s >= max s + log(min_p)        min-p (tokens at least min_p times as likely as
                                      the likeliest)
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

The cut does not sort the vocabulary. `lax.top_k` takes each slot's CANDIDATES
largest logits, in order. The k-th of them is the top-k threshold; the running mass
of their softmax, normalised over the whole top-k kept set (a sum over the
vocabulary, no sort), finds the last token of the nucleus; the cut is `s >= threshold`
over the whole vocabulary, so the ties beyond the candidates stay. One slot of 8
logits, 4 candidates:

  s, in descending order     4.0  3.0  3.0  2.0  2.0  1.0  0.5  0.0
  the candidates             4.0  3.0  3.0  2.0
  top_k = 4                  threshold 2.0: 5 tokens kept, the 2.0 tied beyond too
  p (5 kept) before a token  0    .50  .68  .87  (.93)
  top_p = 0.7                the nucleus ends at the second 3.0 (.68 < .7):
                             threshold 3.0, 3 tokens kept
  top_p = 0.9                the nucleus takes the last candidate (.87 < .9), and
                             every candidate passed top-k: tokens beyond them may
                             belong to it, so the candidates do not decide it

The candidates decide the threshold unless top_k > CANDIDATES (the k-th is not
among them), or, as above, the nucleus takes the last candidate while every
candidate passed top-k. A slot they do not decide takes the sort of the whole
vocabulary (`sorted_threshold`, the definition as written), under a `lax.cond` that
runs it only when some slot of the batch needs it. Where the candidates decide it,
the two give the same threshold from the same sorted values and the same running
sums; only the normaliser adds the vocabulary in another order, so the two could
end a nucleus one token apart when its mass falls within float32 rounding of top_p.

The cut and the noise run only when some row of the batch samples (`lax.cond`):
greedy batches pay nothing for sampling. In a sampled step the noise (a Gumbel draw
per token of the vocabulary, per slot) costs more than the cut.
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


CANDIDATES = 128  # logits `lax.top_k` takes per slot to find the cut's threshold


def cut(scaled: Array, top_k: Array, top_p: Array) -> Array:
  """The top-k, then top-p cut of temperature-scaled logits: -inf outside the kept set.
  The threshold comes from the CANDIDATES largest logits, or from the sort when some
  slot needs it.

  scaled: float32[b, k, vocab]; top_k: int32[b] (0 or >= vocab: off);
  top_p: float32[b] (>= 1: off) -> float32[b, k, vocab].
  """
  threshold, decided = candidate_threshold(scaled, top_k, top_p)
  threshold = jax.lax.cond(jnp.all(decided), lambda: threshold,
                           lambda: sorted_threshold(scaled, top_k, top_p))
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def candidate_threshold(scaled: Array, top_k: Array, top_p: Array) -> tuple[Array, Array]:
  """The cut's threshold from each slot's CANDIDATES largest logits, and whether they
  decide it (where not, the threshold is meaningless). Shapes as `cut`
  -> (float32[b, k, 1], bool[b, k, 1])."""
  vocab = scaled.shape[-1]
  n = min(CANDIDATES, vocab)
  # descending: [b, k, n]. XLA (CPU) expands top_k into a sort of the vocabulary and a [0:n]
  # slice, and makes that a TopK call again only while no other slice merges into it.
  top = jax.lax.optimization_barrier(jax.lax.top_k(scaled, n)[0])
  k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None, None]
  kth = jnp.where(k <= n, jnp.take_along_axis(
      top, jnp.broadcast_to(jnp.minimum(k, n) - 1, top.shape[:-1] + (1,)), axis=-1), -jnp.inf)
  total = jnp.sum(jnp.where(scaled >= kth, jnp.exp(scaled - top[..., :1]), 0.0), axis=-1,
                  keepdims=True)
  in_k = top >= kth
  probs = jnp.where(in_k, jnp.exp(top - top[..., :1]), 0.0) / total
  before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs  # as `sorted_threshold`
  p = top_p[:, None, None]
  kept = jnp.sum(in_k & (before < p), axis=-1, keepdims=True)
  last = jnp.take_along_axis(top, jnp.maximum(kept - 1, 0), axis=-1)
  # The nucleus is open when it takes the last candidate and every candidate passed top-k:
  # tokens beyond them may pass too.
  open_nucleus = (p < 1.0) & (before[..., -1:] < p) & in_k[..., -1:] & (n < vocab)
  return (jnp.where(p < 1.0, jnp.maximum(kth, last), kth),
          ((k <= n) | (k == vocab)) & ~open_nucleus)


def sorted_threshold(scaled: Array, top_k: Array, top_p: Array) -> Array:
  """The cut's threshold by a sort of the whole vocabulary (the fallback).
  Shapes as `cut` -> float32[b, k, 1]."""
  vocab = scaled.shape[-1]
  desc = -jnp.sort(-scaled, axis=-1)                              # descending
  k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None, None]
  kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), axis=-1)
  in_k = desc >= kth
  probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
  before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs  # mass of earlier ones
  kept = jnp.sum(in_k & (before < top_p[:, None, None]), axis=-1, keepdims=True)
  last = jnp.take_along_axis(desc, jnp.maximum(kept - 1, 0), axis=-1)
  return jnp.where((top_p < 1.0)[:, None, None], jnp.maximum(kth, last), kth)


def noise(seed: Array, positions: Array, vocab: int) -> Array:
  """Gumbel noise keyed by (seed, position). seed: uint32[b]; positions: int32[b, k]
  -> float32[b, k, vocab]."""
  def one(s, p):
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(s), p), (vocab,), jnp.float32)
  return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(seed, positions)


def min_p_cut(scaled: Array, min_p: Array) -> Array:
  """-inf where a token is less than min_p times as likely as the slot's likeliest
  (min_p 0: nothing cut). scaled: float32[b, k, vocab]; min_p: float32[b]."""
  floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None, None]
  return jnp.where((min_p > 0)[:, None, None] & (scaled < floor), -jnp.inf, scaled)


def warp(logits: Array, temperature: Array, top_k: Array, top_p: Array,
         min_p: Array | None = None) -> Array:
  """The warped logits (temperature, then the top-k/top-p cut, then min-p, each when any
  row asks for it; greedy rows, T == 0, are not cut). Shapes as `cut`; temperature,
  min_p: float32[b] (min_p None: off)."""
  scaled = scale(logits, temperature)
  top_k = jnp.where(temperature > 0, top_k, 0)
  top_p = jnp.where(temperature > 0, top_p, 1.0)
  needs_cut = jnp.any(((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0))
  warped = jax.lax.cond(needs_cut, cut, lambda s, k, p: s, scaled, top_k, top_p)
  if min_p is None:
    return warped
  min_p = jnp.where(temperature > 0, min_p, 0.0)
  return jax.lax.cond(jnp.any(min_p > 0), min_p_cut, lambda s, m: s, warped, min_p)


def choose(logits: Array, positions: Array, temperature: Array, top_k: Array, top_p: Array,
           seed: Array, min_p: Array | None = None) -> Array:
  """The token of every slot: greedy where T == 0, a draw from q where T > 0.

  logits: float32[b, k, vocab]; positions: int32[b, k] (the position each slot's
  token would take); temperature, top_p: float32[b]; top_k: int32[b]; seed: uint32[b];
  min_p: float32[b] (None: off) -> int32[b, k].
  """
  def sampled(logits):
    drawn = gates.greedy(warp(logits, temperature, top_k, top_p, min_p)
                         + noise(seed, positions, logits.shape[-1]))
    return jnp.where((temperature > 0)[:, None], drawn, gates.greedy(logits))
  return jax.lax.cond(jnp.any(temperature > 0), sampled, gates.greedy, logits)
