"""The AR model's log-probabilities over a token sequence: what the server's `logprobs`,
`top_logprobs` and `echo` report (`mars_jax.serve.app`).

  got = token_logprobs(config, params, ids, runtime=runtime, top=5)
  got.logprob[i]          # log p(ids[i + 1] | ids[:i + 1]), i < len(ids) - 1
  got.top_ids[i], got.top_logprobs[i]   # the `top` likeliest tokens there, best first

One uncached causal forward of the clean (AR) model over the sequence, padded to a power
of two (one compiled program per length bucket), through the blockwise attention with
its per-token mask (`flash.causal`, `attention_impl="flash"` whatever the model's
runtime says), so nothing is [T, T]; the vocabulary's logits are built `CHUNK`
positions at a time. The log-probabilities are the raw model's (log-softmax of its logits: no
temperature or cut), as vLLM reports them by default. Decoding is lossless (or exact at
tau = 1), so for those requests these are the log-probabilities of the model that chose
each token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.decoding import batching
from mars_jax.models import flash, qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime

MAX_TOP = 20       # alternatives computed per position (the most a request may ask)
MIN_BUCKET = 16    # the shortest padded length
CHUNK = 256        # positions unembedded at once


class Scores(NamedTuple):
  """Per position i < n - 1 of an n-token sequence: logprob float32[n - 1] of token
  i + 1; top_ids int32[n - 1, top], top_logprobs float32[n - 1, top], best first."""
  logprob: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnames=("config", "runtime"))
def _scores(params, tokens, length, *, config: Qwen2Config, runtime: Runtime):
  """tokens: int32[1, t] (t a power of two, right-padded); length: int32[] real tokens
  -> (logprob float32[t], top ids int32[t, MAX_TOP], top logprobs float32[t, MAX_TOP]),
  position p scoring tokens[p + 1] (the last real position and the padding: garbage)."""
  t = tokens.shape[1]
  segment = (jnp.arange(t)[None] < length).astype(jnp.int32)
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  hidden = qwen2.forward_hidden(config, params, tokens, positions, flash.causal(segment),
                                runtime=runtime)[0]
  c = min(CHUNK, t)
  hs = hidden.reshape(t // c, c, hidden.shape[-1])
  ys = jnp.roll(tokens[0], -1).reshape(t // c, c)

  def chunk(_, xs):
    h, y = xs
    logits = qwen2.unembed(config, params, h[None], runtime=runtime)[0].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, min(MAX_TOP, logp.shape[-1]))
    return None, (jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0], top_ids, top_lp)

  _, (lp, ids, lps) = jax.lax.scan(chunk, None, (hs, ys))
  return lp.reshape(t), ids.reshape(t, -1), lps.reshape(t, -1)


def check(config: Qwen2Config, ids: Sequence[int], top: int) -> None:
  """Raises ValueError on a sequence `token_logprobs` cannot score: under two tokens, ids
  outside the vocabulary, more than MAX_TOP alternatives."""
  if len(ids) < 2:
    raise ValueError("scoring needs at least two tokens (the first has no logprob).")
  if not 0 <= top <= MAX_TOP:
    raise ValueError(f"top={top}; at most {MAX_TOP} alternatives per token.")
  outside = [t for t in ids if not 0 <= t < config.vocab_size]
  if outside:
    raise ValueError(f"token ids {outside[:4]} are outside the vocabulary [0, "
                     f"{config.vocab_size}).")


def token_logprobs(config: Qwen2Config, params, ids: Sequence[int], *,
                   runtime: Runtime = DEFAULT_RUNTIME, top: int = 0) -> Scores:
  """The log-probability of each token of `ids` after the first, and the `top`
  likeliest tokens at each of those positions (module doc); `check`'s ValueError."""
  check(config, ids, top)
  t = batching.pow2(len(ids), MIN_BUCKET)
  tokens = np.zeros((1, t), np.int32)
  tokens[0, :len(ids)] = ids
  lp, top_ids, top_lp = jax.device_get(_scores(
      params, tokens, np.int32(len(ids)), config=config,
      runtime=dataclasses.replace(runtime, attention_impl="flash")))
  n = len(ids) - 1
  return Scores(lp[:n], top_ids[:n, :top], top_lp[:n, :top])
