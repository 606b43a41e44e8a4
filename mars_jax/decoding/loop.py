"""The decoding loop's jitted kernels: one `lax.while_loop` over a fixed-shape KV cache.

Each step runs one forward over `2W-1` slots per sample: the tokens accepted by
the previous step (their K/V are written now: deferred commitment), padded to
`W` slots, then `W-1` MASK slots after the last accepted token. The output at
the last real token (exact AR) and at each MASK slot gives `W` proposals, which
`mars_jax.decoding.gates.accept` takes left to right. Every sample keeps its own cursors
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

Lossless mode (`mode="lossless"`) takes every MASK proposal as a draft instead of
gating it. The drafts are fed as real tokens by the next forward, right after the
last verified token, whose causal outputs are then the exact greedy AR tokens
(`gates.verify`). W = 3, verified length n = 7 (x6's K/V pending), drafts d7, d8:

  slot j           0     1     2   |  3     4
  input            x6    d7    d8  |  MASK  MASK
  RoPE position    6     7     8   |  9     10
  greedy AR        g7    g8    g9  |  d10   d11   (the next drafts)

d7 == g7, d8 != g8: commit g7 and the correction g8 (n = 9), discard the MASK
proposals, cursor = 8 (the K/V of x6, d7 are valid; d8's are stale and get
overwritten). All drafts matching: commit g7, g8, g9 and take d10, d11 as the
next drafts. The output is greedy AR, token for token, at every W.

Sampling (temperature > 0, per sample): every slot's token is drawn from its warped
distribution with noise keyed by the sample's seed and the position it fills
(`mars_jax.decoding.draws`), so the MASK slot's draft for position n and the next
forward's verifying draw at n share their noise, and lossless mode commits the
tokens of AR sampling with the same seed, token for token, at every W.

A step feeds at most `real_slots` pending tokens; a sample with more pending
(a long prompt chunked over several steps, or W lowered between rounds)
writes those K/V and moves its cursor without proposing (a partial step).

Per-sample controls (`Controls`: the gate, the sampling controls, the seed, the stop
ids, a cap on the tokens per forward and, for the lossless kernel, gated or lossless)
are arrays in the loop state, one entry per sample, so one batch mixes exact-AR
(tau >= 1), fast, greedy, sampled, gated and lossless requests, each at its own window
up to W, in one compilation.
Compilation: one per (batch bucket, prompt-length bucket, cache-length bucket, W,
mode), all powers of two (the cache capped at the model's context + W - 1);
budgets and controls are traced.

Beyond `decode` (one call to completion), `run_steps` runs the loop for a
bounded number of steps (a round) on a state that `insert` can refill row by row
and `regroup` can move to another batch bucket: `mars_jax.decoding.rounds` and
`mars_jax.serve` build the load-aware window and continuous batching on them.
The host side (buckets, checks, results) is `mars_jax.decoding.batching`.

On a mesh (`mesh=`, static: one compilation per mesh) every kernel traces the
model under `sharding.DECODE_RULES` and pins the state it returns (`pin`): rows
on the batch axes (data, fsdp), the cache also on kv_heads (tensor). The weights
come in placed (`mars_jax.decoding.mesh`); mesh=None is one device, unconstrained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from mars_jax.parallel import sharding
from mars_jax.core.choices import Mode
from mars_jax.decoding import draws, gates
from mars_jax.models import cached, layers, qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime

Array = jax.Array
ROW_AXES = P("activation_batch")
SEQ_AXES = P("activation_batch", "activation_length")
CACHE_AXES = P(None, "activation_batch", "activation_kv_heads", "activation_length", None)
STOP_AXES = P("activation_batch", None)
STOP_BUCKET = 8  # stop ids per row in a state, unless its maker asks for more
PREFILL_CHUNK = 512  # prompt tokens a prefill step feeds (`prefill`)


@struct.dataclass
class Controls:
  """Each sample's decoding controls (b rows, E stop ids per row).

  tau: float32[b], metric: int32[b] (index into `gates.METRICS`): the gate.
  temperature: float32[b] (0: greedy); top_k: int32[b] (0: off); top_p: float32[b]
  (1.0: off); seed: uint32[b] (`mars_jax.decoding.draws`).
  stop_ids: int32[b, E]: tokens that end the sample besides EOS (-1: padding).
  window: int32[b]: the most tokens the sample commits per forward (0: the step's W);
    a cap below W gives the tokens the sample gets at that W (the MASK slots attend
    causally, so the first ones see what they would see alone).
  lossless: bool[b]: the sample is verified (lossless) rather than gated; read by the
    lossless kernel only, so one batch mixes both modes (a gated kernel treats every
    sample as gated: run it only when no sample is lossless).
  min_p: float32[b]: the min-p cut (0: off; `draws.warp`).
  ignore_eos: bool[b]: EOS does not end the sample (its stop ids still do).
  """
  tau: Array
  metric: Array
  temperature: Array
  top_k: Array
  top_p: Array
  seed: Array
  stop_ids: Array
  window: Array
  lossless: Array
  min_p: Array
  ignore_eos: Array


def control_axes() -> Controls:
  per_row = {f.name: ROW_AXES for f in dataclasses.fields(Controls) if f.name != "stop_ids"}
  return Controls(stop_ids=STOP_AXES, **per_row)


@struct.dataclass
class DecodeState:
  """Loop state (b: batch bucket, S: cache slots).

  seq: int32[b, S]: token at each position (prompt, accepted tokens, drafts).
  cache: {"k","v"}: [layers, b, kv_heads, S, head_dim]; slot s holds position s.
  cursor: int32[b]: slots [0, cursor) hold committed K/V.
  length: int32[b]: tokens committed so far; [cursor, length) are pending
    (accepted, K/V written by the next forward).
  draft: int32[b]: lossless mode: seq[length:length+draft] are unverified drafts
    (0 in gated mode).
  prompt_len: int32[b].
  limit: int32[b]: prompt_len + max_new_tokens (the length at which a sample stops).
  controls: each sample's `Controls`.
  done: bool[b]: finished (an end token accepted, budget used, stopped, or padding).
  forwards: int32[b]: forwards in which the sample proposed tokens.
  born: int32[b, S]: the sample's forward (its `forwards` count) that committed
    seq[s], for cutting a sample short after the fact (`stop`).
  steps: int32[]: forwards run for the batch (prefill included).
  """
  seq: Array
  cache: dict[str, Array]
  cursor: Array
  length: Array
  draft: Array
  prompt_len: Array
  limit: Array
  controls: Controls
  done: Array
  forwards: Array
  born: Array
  steps: Array


def state_axes() -> DecodeState:
  """The logical axes of every field (a `DecodeState` of `PartitionSpec`s)."""
  per_row = {f.name: ROW_AXES for f in dataclasses.fields(DecodeState)
             if f.name not in ("seq", "cache", "controls", "born", "steps")}
  return DecodeState(seq=SEQ_AXES, cache={"k": CACHE_AXES, "v": CACHE_AXES},
                     controls=control_axes(), born=SEQ_AXES, steps=P(), **per_row)


def pin(state: DecodeState) -> DecodeState:
  """`state` with every field pinned to its logical axes (`layers.constrain`: a no-op
  unless traced `on_mesh`)."""
  axes = state_axes()
  if set(state.cache) != set(axes.cache):   # a page pool (`ragged`): one device, unpinned
    axes = axes.replace(cache={k: P() for k in state.cache})
  return jax.tree.map(lambda x, axes: layers.constrain(x, tuple(axes)), state, axes)


def on_mesh(mesh: Mesh | None):
  """The context a kernel traces in: `mesh` and the decoding rules bound, or nothing."""
  return (contextlib.nullcontext() if mesh is None
          else sharding.activation_sharding(mesh, sharding.DECODE_RULES))


def feed(config: Qwen2Config, runtime: Runtime, params, seq: Array, cache, cursor: Array,
         real_count: Array, mask_start: Array, active: Array, proposing: Array,
         mask_token_id: Array, out_slots: Array, *, real_slots: int, window: int
         ) -> tuple[Array, dict]:
  """The cached forward of a step: per row, `real_slots` slots of seq[cursor:] (the first
  `real_count` real: their K/V written at their positions), then window - 1 MASK slots at
  positions mask_start, mask_start + 1, ... (written where `proposing`); a slot attends
  the cache slots at or before its position.

  seq: int32[b, S]; cursor, real_count, mask_start: int32[b]; active, proposing: bool[b];
  out_slots: int32[b, o], the slots whose outputs the step reads
  -> (final-normed hidden at out_slots [b, o, embed], the updated cache)."""
  batch, slots = seq.shape
  slot = jnp.arange(real_slots)[None]
  is_real = (slot < real_count[:, None]) & active[:, None]
  real_pos = cursor[:, None] + slot
  real_tokens = jnp.take_along_axis(seq, jnp.minimum(real_pos, slots - 1), axis=1)
  mask_pos = mask_start[:, None] + jnp.arange(window - 1)[None]
  tokens = jnp.concatenate(
      [real_tokens, jnp.broadcast_to(mask_token_id, (batch, window - 1))],
      axis=1).astype(jnp.int32)
  positions = jnp.concatenate([real_pos, mask_pos], axis=1)
  write_slots = jnp.concatenate([jnp.where(is_real, real_pos, slots),
                                 jnp.where(proposing[:, None], mask_pos, slots)], axis=1)
  attn_mask = jnp.arange(slots)[None, None] <= positions[..., None]
  hidden, cache = qwen2.Qwen2ForCausalLM(config, runtime).apply(
      {"params": params}, tokens, positions, attn_mask, cache, write_slots, method="hidden")
  return jnp.take_along_axis(hidden, out_slots[..., None], axis=1), cache


def end_ids(eos_ids: Array, c: Controls) -> Array:
  """The tokens that end each sample: EOS (unless it ignores EOS) and its stop ids.
  eos_ids: int32[e]; -> int32[b, e + E] (-1: none)."""
  batch = c.stop_ids.shape[0]
  eos = jnp.where(c.ignore_eos[:, None], -1, jnp.broadcast_to(eos_ids, (batch,) + eos_ids.shape))
  return jnp.concatenate([eos, c.stop_ids], axis=1)


def advance(config: Qwen2Config, runtime: Runtime, params, state: DecodeState, eos_ids: Array,
            mask_token_id: Array, *, real_slots: int | Array, window: int, mode: Mode,
            forward=feed, runs: Array | None = None, auto_window: Array | None = None
            ) -> DecodeState:
  """One forward over `real_slots` pending-token slots plus `window-1` MASK slots.

  real_slots: one width for every row, or int32[b], each row's own (the ragged engine);
  forward: the step's forward (`feed`'s arguments and result; the ragged engine's runs
  a flat batch over a page pool); runs: bool[b], the rows this forward runs (None: all;
  the others are left as they are); auto_window: int32[], the window of rows that fix
  none (None: `window`).

  The pending tokens seq[cursor:length] of each sample, then (lossless) its
  drafts, at most `real_slots` in all, are fed as real inputs and their K/V
  written; the MASK slots follow the last of them. A sample with more pending
  tokens than `real_slots` takes a partial step (writes K/V, proposes nothing).
  Every output's token is chosen by `draws.choose` (greedy, or drawn for the
  position it fills). Gated mode accepts the `window` proposals by `gates.accept`;
  lossless mode commits what `gates.verify` confirms and keeps the MASK proposals as
  the next drafts after a full match.
  """
  batch, slots = state.seq.shape
  rows = jnp.arange(batch)[:, None]
  active = ~state.done if runs is None else ~state.done & runs
  cursor, length = state.cursor, state.length
  pending = length - cursor                       # accepted, K/V not written yet
  partial = active & (pending > real_slots)
  c = state.controls
  auto = window if auto_window is None else auto_window
  cap = jnp.where(c.window > 0, jnp.minimum(c.window, window), auto)  # tokens per forward
  drafts_fed = jnp.zeros_like(length)
  if mode == "lossless":
    drafts_fed = jnp.where(partial | ~c.lossless, 0,
                           jnp.clip(jnp.minimum(state.draft, real_slots - pending), 0, cap - 1))
  real_count = jnp.where(partial, real_slots, pending + drafts_fed)
  proposing = active & ~partial
  last_verified = jnp.maximum(pending - 1, 0)[:, None]  # input slot of the last real token
  real_out = last_verified + jnp.arange(window if mode == "lossless" else 1)[None]
  widths = jnp.broadcast_to(jnp.asarray(real_slots, jnp.int32), (batch,))[:, None]
  out_slots = jnp.concatenate(
      [jnp.minimum(real_out, widths - 1),
       jnp.broadcast_to(widths + jnp.arange(window - 1), (batch, window - 1))], axis=1)
  hidden, cache = forward(config, runtime, params, state.seq, state.cache, cursor, real_count,
                          length + drafts_fed, active, proposing, mask_token_id, out_slots,
                          real_slots=real_slots, window=window)
  logits = qwen2.unembed(config, params, hidden, runtime=runtime)
  budget_left = jnp.where(proposing, state.limit - length, 0)
  proposal = jnp.arange(window)[None]
  ends = end_ids(eos_ids, c)
  # The position each output's token fills: the verifying outputs (lossless) or the
  # proposals (gated) from `length` on; lossless MASK slot j's draft at
  # length + drafts_fed + j (the first position after a full match, and on).
  fills = length[:, None] + proposal
  if mode == "lossless":
    fills = jnp.concatenate([fills, (length + drafts_fed)[:, None] + proposal[:, 1:]], axis=1)
  out = draws.choose(logits, fills, c.temperature, c.top_k, c.top_p, c.seed, c.min_p)
  gated_budget = jnp.minimum(budget_left, cap)
  if mode == "lossless":
    verified = out[:, :window]
    drafts = jnp.take_along_axis(
        state.seq, jnp.minimum(length[:, None] + jnp.arange(window - 1)[None], slots - 1),
        axis=1)
    accepted, hit_end = gates.verify(verified, drafts, drafts_fed, ends, budget_left)
    # Gated samples in this batch: the proposal at the last real token and the MASK
    # proposals, under their gates (skipped when every sample is lossless).
    gated_out = jnp.concatenate([out[:, :1], out[:, window:]], axis=1)
    gated = proposing & ~c.lossless
    accepted_g, hit_end_g = jax.lax.cond(
        jnp.any(gated),
        lambda: gates.accept(draws.scale(jnp.concatenate([logits[:, :1], logits[:, window:]],
                                                         axis=1), c.temperature),
                             gated_out, c.tau, c.metric, ends, gated_budget),
        lambda: (jnp.zeros_like(accepted), jnp.zeros_like(hit_end)))
    accepted = jnp.where(c.lossless, accepted, accepted_g)
    hit_end = jnp.where(c.lossless, hit_end, hit_end_g)
    new_length = length + accepted
    full_match = c.lossless & (accepted == drafts_fed + 1) & ~hit_end
    next_drafts = jnp.where(full_match, jnp.clip(state.limit - new_length, 0, cap - 1), 0)
    dest = jnp.concatenate(
        [jnp.where((proposal < accepted[:, None]) & c.lossless[:, None],
                   length[:, None] + proposal, slots),
         jnp.where(proposal[:, :window - 1] < next_drafts[:, None],
                   new_length[:, None] + proposal[:, :window - 1], slots)], axis=1)
    dest_g = jnp.where((proposal < accepted[:, None]) & ~c.lossless[:, None],
                       length[:, None] + proposal, slots)
    dest, out = (jnp.concatenate([dest, dest_g], axis=1),
                 jnp.concatenate([out, gated_out], axis=1))
  else:
    accepted, hit_end = gates.accept(draws.scale(logits, c.temperature), out, c.tau,
                                     c.metric, ends, gated_budget)
    new_length = length + accepted
    next_drafts = jnp.zeros_like(length)
    dest = jnp.where(proposal < accepted[:, None], length[:, None] + proposal, slots)
  new_cursor = jnp.where(partial, cursor + real_slots,
                         jnp.where(active, length + jnp.minimum(drafts_fed, accepted - 1),
                                   cursor))
  forwards = state.forwards + proposing.astype(jnp.int32)
  return pin(state.replace(
      seq=state.seq.at[rows, dest].set(out, mode="drop"), cache=cache,
      cursor=new_cursor, length=new_length,
      draft=jnp.where(proposing, next_drafts, state.draft),
      done=state.done | hit_end | (new_length >= state.limit),
      forwards=forwards,
      born=state.born.at[rows, dest].set(jnp.broadcast_to(forwards[:, None], dest.shape),
                                         mode="drop"),
      steps=state.steps + 1))


def new_controls(batch: int, stop_ids: int = STOP_BUCKET) -> Controls:
  """Controls of padding rows: greedy exact AR, no stop ids (numpy, int32[batch] etc.)."""
  ones = np.ones((batch,), np.float32)
  zeros = np.zeros((batch,), np.int32)
  return Controls(tau=ones, metric=zeros, temperature=0 * ones, top_k=zeros, top_p=ones,
                  seed=zeros.astype(np.uint32),
                  stop_ids=np.full((batch, stop_ids), -1, np.int32), window=zeros,
                  lossless=np.zeros((batch,), bool), min_p=0 * ones,
                  ignore_eos=np.zeros((batch,), bool))


def new_state(config: Qwen2Config, batch: int, cache_len: int, *,
              runtime: Runtime = DEFAULT_RUNTIME, stop_ids: int = STOP_BUCKET) -> DecodeState:
  """An empty state: `batch` padding rows (done), a zeroed cache of `cache_len` slots,
  room for `stop_ids` stop ids per row."""
  def zeros():  # one buffer per field: `insert` and `run_steps` donate the state
    return jnp.zeros((batch,), jnp.int32)
  return DecodeState(
      seq=jnp.zeros((batch, cache_len), jnp.int32),
      cache=cached.init_cache(config, batch, cache_len, runtime=runtime),
      cursor=zeros(), length=zeros(), draft=zeros(), prompt_len=zeros(), limit=zeros(),
      controls=jax.tree.map(jnp.array, new_controls(batch, stop_ids)),
      done=jnp.ones((batch,), bool), forwards=zeros(),
      born=jnp.zeros((batch, cache_len), jnp.int32), steps=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("mesh",))
def insert(state: DecodeState, rows: Array, prompt: Array, prompt_len: Array,
           max_new_tokens: Array, controls: Controls, start: Array | None = None,
           forwards: Array | None = None, *, mesh: Mesh | None = None) -> DecodeState:
  """Starts new samples in rows of a state, leaving the other rows as they are.

  rows: int32[k] (entries >= b are ignored); prompt: int32[k, P] right-padded;
  prompt_len: int32[k] (>= 1); max_new_tokens: int32[k] (0: the row stays done);
  controls: `Controls` of k rows (stop ids as wide as the state's). The rows' old K/V
  stay in the cache: a query at position p reads slots <= p only, and the new
  sample's forwards write them first. start: int32[k], the prompt tokens whose K/V the
  cache holds already (a prefix cache's hit; None: none); forwards: int32[k], the
  forwards the samples count from (a preempted request resumed; None: 0).
  """
  def put(field, value):
    return field.at[rows].set(value.astype(field.dtype), mode="drop")
  p = prompt.shape[1]
  seq = state.seq.at[rows, :p].set(prompt, mode="drop")
  zeros = jnp.zeros_like(prompt_len)
  with on_mesh(mesh):
    return pin(state.replace(
        seq=seq, cursor=put(state.cursor, zeros if start is None else start),
        length=put(state.length, prompt_len),
        draft=put(state.draft, zeros), prompt_len=put(state.prompt_len, prompt_len),
        limit=put(state.limit, prompt_len + max_new_tokens),
        controls=jax.tree.map(put, state.controls, controls),
        done=put(state.done, max_new_tokens <= 0),
        forwards=put(state.forwards, zeros if forwards is None else forwards)))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("mesh",))
def stop(state: DecodeState, rows: Array, keep: Array, *, mesh: Mesh | None = None
         ) -> DecodeState:
  """Ends the samples in `rows` after their first `keep` generated tokens (a stop string
  found on the host); their forwards are counted up to the one that committed the last
  token kept. rows: bool[b]; keep: int32[b] (>= 1 where rows), ignored elsewhere."""
  b = state.seq.shape[0]
  length = jnp.where(rows, jnp.minimum(state.prompt_len + keep, state.length), state.length)
  last = state.born[jnp.arange(b), jnp.maximum(length - 1, 0)]
  with on_mesh(mesh):
    return pin(state.replace(length=length, done=state.done | rows,
                             forwards=jnp.where(rows, last, state.forwards)))


class Harvest(NamedTuple):
  """What the host reads of a state after a round (`harvest`): per row, the tokens
  committed since `since` and the forward that committed each, and the counters.

  tokens, born: int32[b, width] (valid up to length - since); length, forwards: int32[b];
  done: bool[b]; steps: int32[].
  """
  tokens: Array
  born: Array
  length: Array
  forwards: Array
  done: Array
  steps: Array


@functools.partial(jax.jit, static_argnames=("width",))
def harvest(state: DecodeState, since: Array, *, width: int) -> Harvest:
  """The `Harvest` of each row from position since[i] on (int32[b]): at most `width`
  tokens, which a round's steps x W bounds; one small device-to-host copy, whatever the
  cache length."""
  idx = jnp.minimum(since[:, None] + jnp.arange(width)[None], state.seq.shape[1] - 1)
  return Harvest(jnp.take_along_axis(state.seq, idx, axis=1),
                 jnp.take_along_axis(state.born, idx, axis=1), state.length,
                 state.forwards, state.done, state.steps)


@jax.jit
def copy_lengths(length: Array) -> Array:
  """A copy of the rows' committed lengths (int32[b]): taken before a round, which
  donates the state, for that round's `harvest`."""
  return length + 0


@functools.partial(jax.jit, static_argnames=("mesh",))
def regroup(state: DecodeState, rows: Array, *, mesh: Mesh | None = None) -> DecodeState:
  """A state of len(rows) rows: row i is old row rows[i], or padding where rows[i] >= b.

  rows: int32[b'] -> the state with batch bucket b' (same cache length).
  """
  b = state.seq.shape[0]
  idx = jnp.minimum(rows, b - 1)
  per_row = {f.name: jax.tree.map(lambda a: a[idx], getattr(state, f.name))
             for f in dataclasses.fields(state) if f.name not in ("cache", "steps")}
  with on_mesh(mesh):
    return pin(state.replace(**{**per_row, "done": per_row["done"] | (rows >= b)},
                             cache=jax.tree.map(lambda a: a[:, idx], state.cache)))


@functools.partial(jax.jit, static_argnames=("config", "runtime", "window", "real_slots", "mode",
                                             "mesh"),
                   donate_argnames=("state",))
def run_steps(config: Qwen2Config, params, state: DecodeState, eos_ids: Array,
              mask_token_id: Array, max_steps: Array, stop_on_finish: Array, *,
              window: int, real_slots: int, mode: Mode,
              runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None) -> DecodeState:
  """Decoding steps on `state` until every row is done, `max_steps` forwards ran,
  or (stop_on_finish) some row finished; each step feeds up to `real_slots`
  pending tokens per row (after `insert`, a wide first call prefills).

  eos_ids: int32[e] (entries < 0 are padding); mask_token_id, max_steps: int32[];
  stop_on_finish: bool[] -> the new state (the old one is donated).
  """
  done0, steps0 = state.done, state.steps

  def cond(st):
    finished = jnp.any(st.done & ~done0)
    return jnp.any(~st.done) & (st.steps - steps0 < max_steps) & ~(stop_on_finish & finished)

  step = functools.partial(advance, config, runtime, params, eos_ids=eos_ids,
                           mask_token_id=mask_token_id, real_slots=real_slots,
                           window=window, mode=mode)
  with on_mesh(mesh):
    return jax.lax.while_loop(cond, step, pin(state))


@functools.partial(jax.jit, static_argnames=("config", "runtime", "cache_len", "mesh"))
def start(config: Qwen2Config, prompt: Array, prompt_len: Array, max_new_tokens: Array,
          controls: Controls, *, cache_len: int,
          runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None) -> DecodeState:
  """A state of b = len(prompt) rows starting the prompts (arguments as `insert`;
  rows with max_new_tokens 0 are padding), nothing run yet."""
  b = prompt.shape[0]
  return insert(new_state(config, b, cache_len, runtime=runtime,
                          stop_ids=controls.stop_ids.shape[1]),
                jnp.arange(b), prompt, prompt_len, max_new_tokens, controls, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("config", "runtime", "window", "mode", "cache_len",
                                             "mesh", "prefill_chunk"))
def prefill(config: Qwen2Config, params, prompt: Array, prompt_len: Array,
            max_new_tokens: Array, controls: Controls, eos_ids: Array,
            mask_token_id: Array, *, window: int, mode: Mode, cache_len: int,
            runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None,
            prefill_chunk: int = PREFILL_CHUNK) -> DecodeState:
  """`start`, then the prompts fed through the cache `prefill_chunk` tokens a step, the
  last step of each row its first forward, so it yields the first `window` proposals
  too (arguments as `decode`) -> the state once every row has proposed.

  A prompt longer than the chunk takes partial steps (`advance`) until at most a chunk
  is pending; a row whose prompt is done first goes on decoding meanwhile (its tokens
  do not depend on the steps' width). No step scores more than [chunk + W - 1] queries
  against this step's keys and the cache's blocks, whatever the prompt's length.
  """
  if prefill_chunk < window:
    raise ValueError(f"prefill_chunk={prefill_chunk} is below the window ({window}).")
  state = start(config, prompt, prompt_len, max_new_tokens, controls, cache_len=cache_len,
                runtime=runtime, mesh=mesh)
  chunk = min(prompt.shape[1], prefill_chunk)
  step = functools.partial(advance, config, runtime, params, eos_ids=eos_ids,
                           mask_token_id=mask_token_id, real_slots=chunk, window=window,
                           mode=mode)
  with on_mesh(mesh):
    if chunk < prompt.shape[1]:
      state = jax.lax.while_loop(
          lambda st: jnp.any(~st.done & (st.length - st.cursor > chunk)), step, state)
    return step(state)


@functools.partial(jax.jit, static_argnames=("config", "runtime", "window", "mode", "cache_len",
                                             "mesh", "prefill_chunk"))
def decode(config: Qwen2Config, params, prompt: Array, prompt_len: Array,
           max_new_tokens: Array, controls: Controls, eos_ids: Array,
           mask_token_id: Array, *, window: int, mode: Mode, cache_len: int,
           runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None,
           prefill_chunk: int = PREFILL_CHUNK) -> DecodeState:
  """Prefill, then the decoding loop until every sample is done.

  prompt: int32[b, P] right-padded; prompt_len: int32[b] (>= 1);
  max_new_tokens: int32[b] (0 marks a padding row); controls: `Controls` of b rows;
  eos_ids: int32[e] (entries < 0 are padding); mask_token_id: int32[];
  cache_len: S >= max(prompt_len + max_new_tokens) + window - 1;
  prefill_chunk: prompt tokens a prefill step feeds (`prefill`);
  mesh: None (one device), or the mesh the params are placed on (rows split over
  data x fsdp: b divisible by their size).
  -> the final `DecodeState`; sample i generated seq[i, prompt_len[i]:length[i]].
  """
  state = prefill(config, params, prompt, prompt_len, max_new_tokens, controls, eos_ids,
                  mask_token_id, window=window, mode=mode, cache_len=cache_len,
                  runtime=runtime, mesh=mesh, prefill_chunk=prefill_chunk)
  step = functools.partial(advance, config, runtime, params, eos_ids=eos_ids,
                           mask_token_id=mask_token_id, window=window, mode=mode,
                           real_slots=window)
  with on_mesh(mesh):
    return jax.lax.while_loop(lambda st: jnp.any(~st.done), step, state)
