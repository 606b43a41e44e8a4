"""How often lossless sampling's drafts stand: the shared-noise coupling we decode with,
against the speculative-sampling rule (accept x ~ q with probability min(1, p(x)/q(x))).

Both are exact (the output is distributed as AR sampling); they differ in how often a
draft is kept. On AR-sampled sequences (`sampling.generate`, window 1, the given seeds),
at every position n and every MASK slot j = 1..W-1 of a forward whose last real token
is at n - 1, with uncached forwards:

  q_j   the warped distribution at MASK slot j (the draft for position n + j)
  p     the warped causal distribution at n + j, given the sequence before it
  coupling   kept when the draft drawn from q_j with the noise of (seed, n + j) equals the
             token AR sampling drew there from p with the same noise (`draws`)
  rule       kept with probability sum_x min(p(x), q_j(x)), the rule's acceptance

Each slot's figures are averaged over the same contexts (the AR sequence before the
slot), so they compare the two rules on equal drafts, slot by slot.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.decoding import sampler as sampling
from mars_jax.decoding import draws
from mars_jax.models import qwen2


def draft_acceptance(config, params, prompts: Sequence[Sequence[int]], *, window: int,
                     mask_token_id: int, temperature: float, top_k: int = 0,
                     top_p: float = 1.0, max_new_tokens: int = 32,
                     runtime: qwen2.Runtime = qwen2.DEFAULT_RUNTIME) -> dict:
  """-> {"coupling": [W-1 rates], "rule": [W-1 rates], "drafts": count per slot}."""
  seeds = list(range(len(prompts)))
  out = sampling.generate(config, params, prompts, max_new_tokens=max_new_tokens,
                          mask_token_id=mask_token_id, eos_token_ids=(),
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seeds,
                          runtime=runtime)
  seqs = [list(p) + t for p, t in zip(prompts, out.tokens)]
  width = max(map(len, seqs)) + window - 1
  rows, starts, row_seed = [], [], []
  for seq, prompt, seed in zip(seqs, prompts, seeds):
    for n in range(len(prompt), len(seq) - window + 1):
      rows.append(seq[:n] + [mask_token_id] * (window - 1))
      starts.append(n)
      row_seed.append(seed)
  tokens = np.zeros((len(rows) + len(seqs), width), np.int32)
  for i, r in enumerate(rows + seqs):
    tokens[i, :len(r)] = r
  causal = jnp.tril(jnp.ones((width, width), bool))[None]
  logits = jax.jit(lambda t: qwen2.forward(config, params, t, jnp.arange(width)[None],
                                           causal, runtime=runtime))(tokens)
  k = len(rows)
  n = np.asarray(starts)
  slot = np.arange(1, window)[None]
  q_logits = jnp.take_along_axis(logits[:k], jnp.asarray(n[:, None] - 1 + slot)[..., None],
                                 axis=1)                                  # [k, W-1, V]
  owner = np.repeat(np.arange(len(seqs)), [len(s) - len(p) - window + 1
                                           for s, p in zip(seqs, prompts)])
  p_logits = logits[k:][owner[:, None], n[:, None] + slot - 1]             # [k, W-1, V]
  fills = jnp.asarray(n[:, None] + slot, jnp.int32)
  control = [jnp.full((k,), v, d) for v, d in ((temperature, jnp.float32),
                                               (top_k, jnp.int32), (top_p, jnp.float32))]
  seed = jnp.asarray(row_seed, jnp.uint32)
  draft = draws.choose(q_logits, fills, *control, seed)
  verified = tokens[k + owner[:, None], n[:, None] + slot]
  q = jax.nn.softmax(draws.warp(q_logits, *control), axis=-1)
  p = jax.nn.softmax(draws.warp(p_logits, *control), axis=-1)
  rule = jnp.sum(jnp.minimum(p, q), axis=-1)
  return {"coupling": np.mean(np.asarray(draft) == verified, axis=0).tolist(),
          "rule": np.mean(np.asarray(rule), axis=0).tolist(), "drafts": k}
