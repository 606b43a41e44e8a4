"""Two-model decoding: a drafter proposes up to K tokens a round, the target verifies them
in one forward. Jitted kernels over two fixed-shape KV caches, one `lax.while_loop`.

Both models may be AR or MARS. Each round, per row:

  1. draft: the drafter extends the committed prefix (plus the target's own drafts,
     below) to K drafts, with its gated decoding (`loop.advance`): an AR drafter
     (drafter window 1) takes K forwards; a MARS drafter (window W_d > 1) commits
     several proposals a forward while its gate holds (tau, metric), so it needs
     between 1 and K forwards (tau 0: one);
  2. verify: one target forward over its pending token, the drafts, and (a MARS target,
     window W_t > 1) W_t - 1 MASK slots after them. Its causal outputs are the target's
     AR tokens after each draft prefix (greedy, or drawn with the position-keyed noise
     of `mars_jax.decoding.draws`); `gates.verify` commits the longest matching prefix
     plus the correction. After a full match, the MASK slots' proposals that pass the
     gate become the first drafts of the next round, so the drafter drafts fewer.

One row, K = 3, W_t = 3, committed length n = 7 (x6 pending in the target), the target's
drafts from the last round t7, and the drafter's d8, d9:

  target slot      0     1     2     3   |  4     5
  input            x6    t7    d8    d9  |  MASK  MASK
  RoPE position    6     7     8     9   |  10    11
  AR token         g7    g8    g9    g10 |  m11   m12   (next round's drafts)

t7 == g7, d8 == g8, d9 != g9: commit g7, g8 and the correction g9 (n = 10), target cursor
9, drop m11, m12. All three matching: commit g7..g10 (n = 11) and keep m11, m12 while they
pass the gate (at most K: when they fill K, the drafter skips the round).

The drafter's cache follows the committed tokens by the same deferred commitment as the
loop's: each round it is handed the target's sequence, and its cursor is cut back to the
target's, so its K/V at drafts the target refused are overwritten before they are read.

Exact: every committed token is the target's own AR token for its position, greedy, or
drawn with the target's distribution and the noise of (seed, position): the output is
the target's greedy AR output, or its AR sampling with the same seed, token for token,
whatever the drafter proposes. The drafter only changes how many forwards it takes.

Cache slots per row: prompt + budget + K + max(W_t, W_d) - 1. Drafter rows past the
target's vocabulary are clamped (a draft the target cannot embed is simply refused).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mars_jax.decoding import batching, draws, gates, loop
from mars_jax.decoding.batching import Bucket, GenerateResult
from mars_jax.decoding.loop import Controls, DecodeState
from mars_jax.decoding.stops import StopScan
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime

Array = jax.Array


class Model(NamedTuple):
  """A model's static half (hashable, for jit): its config and runtime."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The drafter of `sampling.generate(..., drafter=...)`: any Qwen2/Qwen3 over the
  target's tokenizer (its embedding rows may differ). window: 1 drafts AR, one token a
  forward; W > 1 drafts with MARS, up to W tokens a forward while the gate holds (a
  MARS-trained drafter: W <= B + 1). mask_token_id: its `<|mask|>` id (read at W > 1)."""
  config: Qwen2Config
  params: Any
  mask_token_id: int
  runtime: Runtime = DEFAULT_RUNTIME
  window: int = 1


class Shape(NamedTuple):
  """A round's static sizes: K drafts; target window W_t (W_t - 1 MASK slots in the
  verifying forward; 1: an AR target); drafter window W_d (1: an AR drafter)."""
  draft: int
  target_window: int
  drafter_window: int


@struct.dataclass
class SpecState:
  """target: the committed tokens, the target's cache and cursors, its forwards
  (`DecodeState.draft`: the target's own drafts, seq[length:length+draft]);
  drafter: the drafter's cache and cursor; its seq holds the round's drafts, its
  forwards count the drafter forwards each row drafted in."""
  target: DecodeState
  drafter: DecodeState


def drafter_controls(controls: Controls) -> Controls:
  """The drafter's controls: the target's (gate, sampling, seed, stop ids), uncapped (its
  gated kernel reads no `lossless`)."""
  return controls.replace(window=jnp.zeros_like(controls.window))


def new_state(target: Model, drafter: Model, batch: int, cache_len: int, *,
              stop_ids: int = loop.STOP_BUCKET) -> SpecState:
  """An empty state: `batch` padding rows, both caches zeroed, `cache_len` slots."""
  return SpecState(*(loop.new_state(m.config, batch, cache_len, runtime=m.runtime,
                                    stop_ids=stop_ids) for m in (target, drafter)))


@functools.partial(jax.jit, donate_argnums=0)
def insert(state: SpecState, rows: Array, prompt: Array, prompt_len: Array,
           max_new_tokens: Array, controls: Controls) -> SpecState:
  """Starts new samples in rows of both states (arguments as `loop.insert`)."""
  return SpecState(
      loop.insert(state.target, rows, prompt, prompt_len, max_new_tokens, controls),
      loop.insert(state.drafter, rows, prompt, prompt_len, max_new_tokens,
                  drafter_controls(controls)))


@jax.jit
def regroup(state: SpecState, rows: Array) -> SpecState:
  """Both states regrouped as `loop.regroup`."""
  return SpecState(loop.regroup(state.target, rows), loop.regroup(state.drafter, rows))


@jax.jit
def stop(state: SpecState, rows: Array, keep: Array) -> SpecState:
  """`loop.stop` on the target; the drafter's rows end with it."""
  return SpecState(loop.stop(state.target, rows, keep),
                   state.drafter.replace(done=state.drafter.done | rows))


def _sync(t: DecodeState, d: DecodeState, k: int) -> DecodeState:
  """The drafter's state for a round: the target's tokens and drafts, and the limit of
  K drafts past the committed length (fewer where the budget ends first)."""
  length = t.length + t.draft
  limit = t.length + jnp.minimum(k, jnp.maximum(t.limit - t.length - 1, 0))
  return d.replace(seq=t.seq, length=length, limit=limit,
                   done=t.done | (length >= limit))


def draft(drafter: Model, params, t: DecodeState, d: DecodeState, eos_ids: Array,
          mask_token_id: Array, *, k: int, window: int, real_slots: tuple[int, int]
          ) -> DecodeState:
  """The drafter's round: synced to the target, then gated decoding steps until every row
  holds its drafts. real_slots = (steady, catch-up): a first step `steady` wide feeds what
  a drafting row has not seen since its last round; after rounds it skipped (the
  target's own drafts filled K) a row has more, and `catch-up` wide steps feed that
  first; the later steps are `window` wide. -> the drafter state; its
  seq[t.length:length] are the round's drafts."""
  step = functools.partial(loop.advance, drafter.config, drafter.runtime, params,
                           eos_ids=eos_ids, mask_token_id=mask_token_id, window=window,
                           mode="gated")

  def unseen_above(width):
    return lambda s: jnp.any(~s.done & (s.length - s.cursor > width))
  steady, catch_up = real_slots
  d = _sync(t, d, k)
  d = jax.lax.while_loop(unseen_above(steady), functools.partial(step, real_slots=catch_up),
                         d)
  d = jax.lax.while_loop(unseen_above(window), functools.partial(step, real_slots=steady), d)
  return jax.lax.while_loop(lambda s: jnp.any(~s.done),
                            functools.partial(step, real_slots=window), d)


def verify(target: Model, params, t: DecodeState, d: DecodeState, eos_ids: Array,
           mask_token_id: Array, *, k: int, window: int, real_slots: int) -> DecodeState:
  """The target's forward over its pending tokens, the drafts d.seq[t.length:d.length]
  (at most k) and window - 1 MASK slots; commits what `gates.verify` confirms and keeps
  the MASK proposals that pass the gate as the next drafts after a full match. A row
  with more than `real_slots` tokens to feed writes the first ones' K/V and commits
  nothing (a partial step). -> the target state."""
  batch, slots = t.seq.shape
  rows = jnp.arange(batch)[:, None]
  c = t.controls
  active = ~t.done
  cursor, length = t.cursor, t.length
  pending = length - cursor
  fed = jnp.where(active, jnp.clip(d.length - length, 0, k), 0)
  partial = active & (pending + fed > real_slots)
  fed = jnp.where(partial, 0, fed)
  proposing = active & ~partial
  real_count = jnp.where(partial, real_slots, pending + fed)
  end = length + fed                              # the position after the last draft
  i = jnp.arange(k + 1)[None]                     # the AR token after i drafts
  j = jnp.arange(window - 1)[None]                # MASK slot j: the token at end + 1 + j
  out_slots = jnp.concatenate(
      [jnp.minimum(jnp.maximum(pending - 1, 0)[:, None] + i, real_slots - 1),
       jnp.broadcast_to(real_slots + j, (batch, window - 1))], axis=1)
  hidden, cache = loop.feed(target.config, target.runtime, params,
                            jnp.minimum(d.seq, target.config.vocab_size - 1), t.cache,
                            cursor, real_count, end, active, proposing, mask_token_id,
                            out_slots, real_slots=real_slots, window=window)
  logits = qwen2.unembed(target.config, params, hidden,
                         runtime=target.runtime)
  fills = jnp.concatenate([length[:, None] + i, (end + 1)[:, None] + j], axis=1)
  out = draws.choose(logits, fills, c.temperature, c.top_k, c.top_p, c.seed, c.min_p)
  verified, proposals = out[:, :k + 1], out[:, k + 1:]
  drafts = jnp.take_along_axis(d.seq, jnp.minimum(length[:, None] + i[:, :k], slots - 1),
                               axis=1)
  ends = loop.end_ids(eos_ids, c)
  budget = jnp.where(proposing, t.limit - length, 0)
  accepted, hit_end = gates.verify(verified, drafts, fed, ends, budget)
  new_length = length + accepted
  next_drafts = jnp.zeros_like(length)
  if window > 1:
    passes = gates.gate(draws.scale(logits[:, k + 1:], c.temperature), c.tau[:, None],
                        c.metric[:, None], proposals)
    leading = jnp.min(jnp.where(passes, window - 1, j), axis=1)
    full = proposing & (accepted == fed + 1) & ~hit_end
    next_drafts = jnp.where(full, jnp.minimum(
        jnp.minimum(leading, k), jnp.maximum(t.limit - new_length - 1, 0)), 0)
  committed = jnp.where(i < accepted[:, None], length[:, None] + i, slots)
  dest = jnp.concatenate(
      [committed, jnp.where(j < next_drafts[:, None], new_length[:, None] + j, slots)],
      axis=1)
  forwards = t.forwards + proposing.astype(jnp.int32)
  return t.replace(
      seq=t.seq.at[rows, dest].set(out, mode="drop"), cache=cache,
      cursor=jnp.where(partial, cursor + real_slots,
                       jnp.where(proposing, new_length - 1, cursor)),
      length=new_length, draft=jnp.where(proposing, next_drafts, t.draft),
      done=t.done | hit_end | (new_length >= t.limit), forwards=forwards,
      born=t.born.at[rows, committed].set(
          jnp.broadcast_to(forwards[:, None], committed.shape), mode="drop"),
      steps=t.steps + 1)


def spec_round(target: Model, drafter: Model, target_params, drafter_params,
               state: SpecState, eos_ids: Array, target_mask: Array, drafter_mask: Array,
               *, shape: Shape, target_slots: int, drafter_slots: tuple[int, int]
               ) -> SpecState:
  """One round: draft, verify, and the drafter's cursor cut back to the target's (its
  K/V past it may hold refused drafts)."""
  k = shape.draft
  d = draft(drafter, drafter_params, state.target, state.drafter, eos_ids, drafter_mask,
            k=k, window=shape.drafter_window, real_slots=drafter_slots)
  t = verify(target, target_params, state.target, d, eos_ids, target_mask, k=k,
             window=shape.target_window, real_slots=target_slots)
  return SpecState(t, d.replace(cursor=jnp.minimum(d.cursor, t.cursor)))


def round_slots(shape: Shape) -> tuple[int, tuple[int, int]]:
  """The widths of a steady round's forwards: the target's (its pending token and K
  drafts), and the drafter's first steps (`draft`): steady, what it has not seen after a
  round it drafted in (the tokens its last step accepted, at most min(W_d, K), the
  target's correction or bonus token and its W_t - 1 drafts); catch-up, that plus one
  round it skipped (K + 1 tokens). A row with more takes another catch-up step."""
  steady = min(shape.drafter_window, shape.draft) + shape.target_window
  return shape.draft + 1, (steady, steady + shape.draft + 1)


@functools.partial(jax.jit, static_argnames=("target", "drafter", "shape", "wide"),
                   donate_argnames=("state",))
def run_rounds(target: Model, drafter: Model, target_params, drafter_params,
               state: SpecState, eos_ids: Array, target_mask: Array, drafter_mask: Array,
               max_rounds: Array, stop_on_finish: Array, *, shape: Shape,
               wide: int = 0) -> SpecState:
  """Rounds until every row is done, `max_rounds` ran, or (stop_on_finish) a row
  finished. wide > 0: the first round feeds up to `wide` new tokens per row (a prefill
  after `insert`; prompts of at most `wide` tokens). -> the new state (the old one is
  donated)."""
  done0, rounds0 = state.target.done, state.target.steps
  target_slots, drafter_slots = round_slots(shape)
  one = functools.partial(spec_round, target, drafter, target_params, drafter_params,
                          eos_ids=eos_ids, target_mask=target_mask,
                          drafter_mask=drafter_mask, shape=shape)
  if wide:
    state = one(state=state, target_slots=max(wide + shape.draft, target_slots),
                drafter_slots=tuple(max(wide, n) for n in drafter_slots))

  def cond(s):
    finished = jnp.any(s.target.done & ~done0)
    return (jnp.any(~s.target.done) & (s.target.steps - rounds0 < max_rounds)
            & ~(stop_on_finish & finished))

  return jax.lax.while_loop(
      cond, lambda s: one(state=s, target_slots=target_slots, drafter_slots=drafter_slots),
      state)


ROUNDS_PER_SCAN = 16  # rounds between two looks for stop strings


def check_args(config: Qwen2Config, drafter: Drafter, prompts, max_new_tokens, *,
               draft_window: int, window: int, mask_token_id: int) -> None:
  """Raises ValueError on prompts, a drafter, K, window or mask id (the target's) that
  two-model decoding cannot run with."""
  if not isinstance(draft_window, (int, np.integer)) or draft_window < 1:
    raise ValueError(f"draft_window={draft_window!r}; the drafts per round K must be an int "
                     ">= 1.")
  if not isinstance(window, (int, np.integer)) or window < 1:
    raise ValueError(f"window={window!r}; with a drafter the target's window must be an int "
                     ">= 1 (1: an AR target; W: W - 1 MASK slots in the verifying forward).")
  if drafter.window < 1:
    raise ValueError(f"drafter window={drafter.window}; it must be >= 1 (1: AR drafting).")
  for c in (config, drafter.config):
    batching.check_prompts(c, prompts, max_new_tokens)
  batching.check_args(config, window=window, mode="lossless", mask_token_id=mask_token_id)
  if drafter.window > 1:
    batching.check_args(drafter.config, window=drafter.window, mode="gated",
                        mask_token_id=drafter.mask_token_id)


def generate(config: Qwen2Config, params, n: int, prompts: Bucket, drafter: Drafter, *,
             draft_window: int, window: int, mask_token_id: int, eos_token_ids,
             scan: StopScan | None = None, runtime: Runtime = DEFAULT_RUNTIME
             ) -> GenerateResult:
  """`sampling.generate` with a drafter, for the first `n` rows of `prompts`: rounds in one
  `run_rounds` call, or (stop strings: `scan`) ROUNDS_PER_SCAN at a time with a look for
  them in between. -> the result, with the drafter's forwards."""
  shape = Shape(int(draft_window), int(window), int(drafter.window))
  target, draft_model = Model(config, runtime), Model(drafter.config, drafter.runtime)
  b = len(prompts.prompt_len)
  eos_ids = batching.eos_array(eos_token_ids)
  cache_len = prompts.cache_len(shape.draft + max(shape.target_window, shape.drafter_window),
                                config.max_position_embeddings)
  state = insert(new_state(target, draft_model, b, cache_len,
                           stop_ids=prompts.controls.stop_ids.shape[1]),
                 np.arange(b, dtype=np.int32), prompts.prompt, prompts.prompt_len,
                 prompts.max_new_tokens, prompts.controls)
  stops = scan is not None and any(scan.stops)
  rounds = np.int32(ROUNDS_PER_SCAN if stops else np.iinfo(np.int32).max)
  wide = prompts.prompt.shape[1]
  while True:
    state = run_rounds(target, draft_model, params, drafter.params, state, eos_ids,
                       np.int32(mask_token_id), np.int32(drafter.mask_token_id), rounds,
                       np.bool_(False), shape=shape, wide=wide)
    wide = 0
    found = scan.scan(state.target, np.ones((b,), bool)) if stops else None
    if found is not None:
      state = stop(state, *found)
    if bool(np.all(jax.device_get(state.target.done)[:n])):
      break
  out = batching.results(state.target, n, {shape.target_window: int(state.target.steps)},
                         eos_ids=eos_ids, stopped=scan.stopped[:n] if stops else ())
  drafter_forwards, drafter_steps = jax.device_get((state.drafter.forwards,
                                                    state.drafter.steps))
  return dataclasses.replace(out, drafter_forwards=drafter_forwards[:n].tolist(),
                             drafter_steps=int(drafter_steps))
