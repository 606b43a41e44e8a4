"""AR and MARS decoding: one jitted `lax.while_loop` over a fixed-shape KV cache.

Each step runs one forward over `2W-1` slots per sample: the tokens accepted by
the previous step (their K/V are written now: deferred commitment), padded to
`W` slots, then `W-1` MASK slots after the last accepted token. The output at
the last real token (exact AR) and at each MASK slot gives `W` proposals, which
`mars_jax.gates.accept` takes left to right. Every sample keeps its own cursors
and advances by its own accepted count; finished samples drop their writes.

One sample, W = 3, cursor c = 5 (slots 0..4 hold committed K/V), length n = 7
(x5, x6 were accepted last step; their K/V are not written yet):

  slot j           0     1     2   |  3     4
  input            x5    x6    -   |  MASK  MASK
  RoPE position    5     6     -   |  7     8
  cache write      5     6    drop |  7     8
  proposal for     .     x7    .   |  x8    x9

Cache slot s always holds RoPE position s. A query at position p reads the
slots s <= p, which this forward or an earlier one has written:

  cache slot       0..4  5  6  7  8
  x5   (p=5)        1    1  .  .  .
  x6   (p=6)        1    1  1  .  .
  MASK (p=7)        1    1  1  1  .      MASK slots see the committed prefix and
  MASK (p=8)        1    1  1  1  1      the earlier MASK slots, causally.

After accepting `a` tokens: c = 7, n = 7 + a. The MASK K/V at slots 7, 8 lie
past the new cursor; the next forward overwrites them (real tokens at 7..6+a,
MASK slots after) before any query can read them, so no copy of the cache is
ever made. The prefill is the same forward with the whole prompt as the pending
tokens (c = 0, n = prompt length), so it already yields the first proposals.

With W = 1 there are no MASK slots and every step is a plain cached AR step.

Compilation: one per (batch bucket, prompt-length bucket, cache-length bucket,
W, metric), all powers of two; `max_new_tokens` and `tau` are traced values.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mars_jax import gates
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import Qwen2Config

Array = jax.Array

MIN_PROMPT_BUCKET = 8
EOS_BUCKET = 8


@struct.dataclass
class DecodeState:
  """Loop state (b: batch bucket, S: cache slots).

  seq: int32[b, S]: token at each position (prompt, then accepted tokens).
  cache: {"k","v"}: [layers, b, S, kv_heads, head_dim]; slot s holds position s.
  cursor: int32[b]: slots [0, cursor) hold committed K/V.
  length: int32[b]: tokens committed so far; [cursor, length) are pending
    (accepted, K/V written by the next forward).
  prompt_len: int32[b].
  limit: int32[b]: prompt_len + max_new_tokens (the length at which a sample stops).
  done: bool[b]: finished (EOS accepted, budget used, or a padding row).
  forwards: int32[b]: forwards in which the sample was still generating.
  steps: int32[]: forwards run for the batch (prefill included).
  """
  seq: Array
  cache: dict[str, Array]
  cursor: Array
  length: Array
  prompt_len: Array
  limit: Array
  done: Array
  forwards: Array
  steps: Array


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """What `generate` returns.

  tokens: one continuation per prompt, up to and including its EOS.
  num_forwards: per prompt, the forwards it took part in (prefill included).
  forwards: forwards run for the whole batch (the longest sample's count).
  """
  tokens: list[list[int]]
  num_forwards: list[int]
  forwards: int

  @property
  def num_tokens(self) -> list[int]:
    return [len(t) for t in self.tokens]

  @property
  def tokens_per_forward(self) -> float:
    """Generated tokens per forward of a sample (1.0 for AR), over the batch."""
    return sum(self.num_tokens) / max(sum(self.num_forwards), 1)


def _hidden(config: Qwen2Config, params, tokens, positions, cache, write_index, attn_mask):
  """Cached forward up to the final norm: -> (hidden [b, t, embed], updated cache)."""
  return qwen2.Qwen2ForCausalLM(config).apply(
      {"params": params}, tokens, positions, attn_mask, cache, write_index, method="hidden")


def _advance(config: Qwen2Config, params, state: DecodeState, tau: Array, eos_ids: Array,
             mask_token_id: Array, *, real_slots: int, window: int,
             metric: str) -> DecodeState:
  """One forward over `real_slots` pending-token slots plus `window-1` MASK slots.

  The pending tokens seq[cursor:length] of each sample (at most `real_slots`) are
  fed as real inputs and their K/V written; the MASK slots follow position
  length-1. The `window` proposals are accepted by `gates.accept`.
  """
  b, s = state.seq.shape
  active = ~state.done
  c, n = state.cursor[:, None], state.length[:, None]
  j = jnp.arange(real_slots)[None]
  real = (j < n - c) & active[:, None]
  real_pos = c + j
  pending = jnp.take_along_axis(state.seq, jnp.minimum(real_pos, s - 1), axis=1)
  mask_pos = n - 1 + jnp.arange(1, window)[None]
  tokens = jnp.concatenate(
      [pending, jnp.broadcast_to(mask_token_id, (b, window - 1))], axis=1).astype(jnp.int32)
  positions = jnp.concatenate([real_pos, mask_pos], axis=1)
  write = jnp.concatenate([jnp.where(real, real_pos, s),
                           jnp.where(active[:, None], mask_pos, s)], axis=1)
  attn_mask = jnp.arange(s)[None, None] <= positions[..., None]
  hidden, cache = _hidden(config, params, tokens, positions, state.cache, write, attn_mask)

  last_real = jnp.maximum(n - c - 1, 0)
  out_idx = jnp.concatenate(
      [last_real, jnp.broadcast_to(real_slots + jnp.arange(window - 1), (b, window - 1))],
      axis=1)
  out = jnp.take_along_axis(hidden, out_idx[..., None], axis=1)
  logits = qwen2.unembed(config, params, out)
  remaining = jnp.where(active, state.limit - state.length, 0)
  proposals, accepted, hit_eos = gates.accept(logits, tau, metric, eos_ids, remaining)

  k = jnp.arange(window)[None]
  dest = jnp.where(k < accepted[:, None], n + k, s)
  seq = state.seq.at[jnp.arange(b)[:, None], dest].set(proposals, mode="drop")
  length = state.length + accepted
  return state.replace(
      seq=seq, cache=cache,
      cursor=jnp.where(active, state.length, state.cursor),
      length=length,
      done=state.done | hit_eos | (length >= state.limit),
      forwards=state.forwards + active.astype(jnp.int32),
      steps=state.steps + 1)


@functools.partial(jax.jit, static_argnames=("config", "window", "metric", "cache_len"))
def decode(config: Qwen2Config, params, prompt: Array, prompt_len: Array,
           max_new_tokens: Array, tau: Array, eos_ids: Array, mask_token_id: Array, *,
           window: int, metric: str, cache_len: int) -> DecodeState:
  """Prefill, then the decoding loop until every sample is done.

  prompt: int32[b, P] right-padded; prompt_len: int32[b] (>= 1);
  max_new_tokens: int32[b] (0 marks a padding row); tau: float32[];
  eos_ids: int32[e] (entries < 0 are padding); mask_token_id: int32[];
  cache_len: S >= max(prompt_len + max_new_tokens) + window - 1.
  -> the final `DecodeState`; sample i generated seq[i, prompt_len[i]:length[i]].
  """
  b, p = prompt.shape
  seq = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompt)
  state = DecodeState(
      seq=seq,
      cache=qwen2.init_cache(config, b, cache_len),
      cursor=jnp.zeros((b,), jnp.int32),
      length=prompt_len,
      prompt_len=prompt_len,
      limit=prompt_len + max_new_tokens,
      done=max_new_tokens <= 0,
      forwards=jnp.zeros((b,), jnp.int32),
      steps=jnp.zeros((), jnp.int32))
  step = functools.partial(_advance, config, params, tau=tau, eos_ids=eos_ids,
                           mask_token_id=mask_token_id, window=window, metric=metric)
  state = step(state, real_slots=p)
  return jax.lax.while_loop(lambda st: jnp.any(~st.done),
                            functools.partial(step, real_slots=window), state)


def _pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def _eos_array(eos_token_ids: int | Sequence[int]) -> np.ndarray:
  ids = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else list(eos_token_ids)
  out = np.full((_pow2(len(ids), EOS_BUCKET),), -1, np.int32)
  out[:len(ids)] = ids
  return out


def decode_batch(config: Qwen2Config, params, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int, mask_token_id: int,
                 eos_token_ids: int | Sequence[int], tau: float = 1.0, window: int = 1,
                 metric: str = "probability") -> DecodeState:
  """Buckets `prompts` and runs `decode`; returns the final state (rows past
  len(prompts) are padding). Arguments as `generate`."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts must be a non-empty list of non-empty token lists.")
  if window < 1:
    raise ValueError(f"window={window}; it must be >= 1 (1 is plain AR decoding).")
  if metric not in gates.METRICS:
    raise ValueError(f"metric={metric!r}; expected one of {list(gates.METRICS)}.")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}; it must be >= 1.")
  if not 0 <= mask_token_id < config.vocab_size:
    raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary "
                     f"(vocab_size {config.vocab_size}); use hf.load_tokenizer's id.")
  b = _pow2(len(prompts))
  longest = max(len(p) for p in prompts)
  prompt = np.zeros((b, _pow2(longest, MIN_PROMPT_BUCKET)), np.int32)
  cache_len = _pow2(longest + max_new_tokens + window - 1, prompt.shape[1])
  lens = np.ones((b,), np.int32)
  budget = np.zeros((b,), np.int32)
  for i, p in enumerate(prompts):
    prompt[i, :len(p)] = p
    lens[i] = len(p)
    budget[i] = max_new_tokens
  return decode(config, params, prompt, lens, budget, np.float32(tau),
                _eos_array(eos_token_ids), np.int32(mask_token_id), window=window,
                metric=metric, cache_len=cache_len)


def results(state: DecodeState, n: int) -> GenerateResult:
  """The `GenerateResult` of the first `n` rows of a final `DecodeState`."""
  seq, start, end, fwd, steps = jax.device_get(
      (state.seq, state.prompt_len, state.length, state.forwards, state.steps))
  return GenerateResult(
      tokens=[seq[i, start[i]:end[i]].tolist() for i in range(n)],
      num_forwards=fwd[:n].tolist(), forwards=int(steps))


def generate(config: Qwen2Config, params: Any, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, mask_token_id: int, eos_token_ids: int | Sequence[int],
             tau: float = 1.0, window: int = 1,
             metric: str = "probability") -> GenerateResult:
  """Greedy AR (window=1) or MARS decoding of a ragged batch of prompts.

  prompts: token id lists (any lengths); max_new_tokens: per-sample budget;
  mask_token_id: the `<|mask|>` id; eos_token_ids: one id or several (may be
  empty); window: W proposals per forward, 1 <= W <= block size + 1;
  tau, metric: the gate (see `mars_jax.gates`). window=1, or tau >= 1 with the
  probability or margin gate, is greedy AR token for token.
  """
  state = decode_batch(config, params, prompts, max_new_tokens=max_new_tokens,
                       mask_token_id=mask_token_id, eos_token_ids=eos_token_ids, tau=tau,
                       window=window, metric=metric)
  return results(state, len(prompts))
