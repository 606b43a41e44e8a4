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

A step feeds at most `real_slots` pending tokens; a sample with more pending
(a long prompt chunked over several steps, or W lowered between segments)
writes those K/V and moves its cursor without proposing (a partial step).

Per-sample gates: `tau` and `metric` are arrays in the loop state, one entry per
sample, so one batch mixes exact-AR (tau >= 1) and fast requests in one
compilation. Compilation: one per (batch bucket, prompt-length bucket,
cache-length bucket, W, mode), all powers of two; budgets and gates are traced.

Beyond `decode` (one call to completion), `run_steps` runs the loop for a
bounded number of steps on a state that `insert` can refill row by row and
`regroup` can move to another batch bucket: `mars_jax.serve` builds continuous
batching and the load-aware window (`mars_jax.window_policy`) on them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mars_jax import gates
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.window_policy import FixedWindow, Measure, WindowPolicy

Policy = WindowPolicy | FixedWindow

Array = jax.Array

MIN_PROMPT_BUCKET = 8
EOS_BUCKET = 8
MODES = ("gated", "lossless")


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
  tau: float32[b], metric: int32[b] (index into `gates.METRICS`): each sample's gate.
  done: bool[b]: finished (EOS accepted, budget used, or a padding row).
  forwards: int32[b]: forwards in which the sample proposed tokens.
  steps: int32[]: forwards run for the batch (prefill included).
  """
  seq: Array
  cache: dict[str, Array]
  cursor: Array
  length: Array
  draft: Array
  prompt_len: Array
  limit: Array
  tau: Array
  metric: Array
  done: Array
  forwards: Array
  steps: Array


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """What `generate` returns.

  tokens: one continuation per prompt, up to and including its EOS.
  num_forwards: per prompt, the forwards it took part in (prefill included).
  forwards: forwards run for the whole batch (the longest sample's count).
  windows: forwards run for the batch at each window W.
  """
  tokens: list[list[int]]
  num_forwards: list[int]
  forwards: int
  windows: dict[int, int] = dataclasses.field(default_factory=dict)

  @property
  def num_tokens(self) -> list[int]:
    return [len(t) for t in self.tokens]

  @property
  def tokens_per_forward(self) -> float:
    """Generated tokens per forward of a sample (1.0 for AR), over the batch."""
    return sum(self.num_tokens) / max(sum(self.num_forwards), 1)


def _hidden(config: Qwen2Config, runtime: Runtime, params, tokens, positions, cache,
            write_index, attn_mask):
  """Cached forward up to the final norm: -> (hidden [b, t, embed], updated cache)."""
  return qwen2.Qwen2ForCausalLM(config, runtime).apply(
      {"params": params}, tokens, positions, attn_mask, cache, write_index, method="hidden")


def _advance(config: Qwen2Config, runtime: Runtime, params, state: DecodeState, eos_ids: Array,
             mask_token_id: Array, *, real_slots: int, window: int, mode: str) -> DecodeState:
  """One forward over `real_slots` pending-token slots plus `window-1` MASK slots.

  The pending tokens seq[cursor:length] of each sample, then (lossless) its
  drafts, at most `real_slots` in all, are fed as real inputs and their K/V
  written; the MASK slots follow the last of them. Gated mode accepts the
  `window` proposals by `gates.accept`; lossless mode commits what `gates.verify`
  confirms and keeps the MASK proposals as the next drafts after a full match.
  """
  b, s = state.seq.shape
  w = window
  rows = jnp.arange(b)[:, None]
  active = ~state.done
  c, n = state.cursor, state.length
  pend = n - c
  partial = active & (pend > real_slots)
  d = jnp.zeros_like(n)
  if mode == "lossless":
    d = jnp.where(partial, 0, jnp.clip(jnp.minimum(state.draft, real_slots - pend), 0, w - 1))
  fed = jnp.where(partial, real_slots, pend + d)
  j = jnp.arange(real_slots)[None]
  real = (j < fed[:, None]) & active[:, None]
  real_pos = c[:, None] + j
  pending = jnp.take_along_axis(state.seq, jnp.minimum(real_pos, s - 1), axis=1)
  mask_pos = (n + d - 1)[:, None] + jnp.arange(1, w)[None]
  tokens = jnp.concatenate(
      [pending, jnp.broadcast_to(mask_token_id, (b, w - 1))], axis=1).astype(jnp.int32)
  positions = jnp.concatenate([real_pos, mask_pos], axis=1)
  proposing = active & ~partial
  write = jnp.concatenate([jnp.where(real, real_pos, s),
                           jnp.where(proposing[:, None], mask_pos, s)], axis=1)
  attn_mask = jnp.arange(s)[None, None] <= positions[..., None]
  hidden, cache = _hidden(config, runtime, params, tokens, positions, state.cache, write,
                          attn_mask)

  last = jnp.maximum(pend - 1, 0)[:, None]  # slot of the last verified token
  real_out = last + jnp.arange(w if mode == "lossless" else 1)[None]
  out_idx = jnp.concatenate([jnp.minimum(real_out, real_slots - 1),
                             jnp.broadcast_to(real_slots + jnp.arange(w - 1), (b, w - 1))],
                            axis=1)
  logits = qwen2.unembed(config, params,
                         jnp.take_along_axis(hidden, out_idx[..., None], axis=1),
                         runtime=runtime)
  remaining = jnp.where(proposing, state.limit - n, 0)
  k = jnp.arange(w)[None]
  if mode == "lossless":
    greedy = gates.greedy(logits[:, :w])
    masked = gates.greedy(logits[:, w:])
    drafts = jnp.take_along_axis(
        state.seq, jnp.minimum(n[:, None] + jnp.arange(w - 1)[None], s - 1), axis=1)
    accepted, hit_eos = gates.verify(greedy, drafts, d, eos_ids, remaining)
    length = n + accepted
    full = (accepted == d + 1) & ~hit_eos
    draft = jnp.where(full, jnp.clip(state.limit - length, 0, w - 1), 0)
    out = jnp.concatenate([greedy, masked], axis=1)
    dest = jnp.concatenate([jnp.where(k < accepted[:, None], n[:, None] + k, s),
                            jnp.where(k[:, :w - 1] < draft[:, None],
                                      length[:, None] + k[:, :w - 1], s)], axis=1)
  else:
    out, accepted, hit_eos = gates.accept(logits, state.tau, state.metric, eos_ids, remaining)
    length = n + accepted
    draft = jnp.zeros_like(n)
    dest = jnp.where(k < accepted[:, None], n[:, None] + k, s)
  cursor = jnp.where(partial, c + real_slots,
                     jnp.where(active, n + jnp.minimum(d, accepted - 1), c))
  return state.replace(
      seq=state.seq.at[rows, dest].set(out, mode="drop"), cache=cache,
      cursor=cursor, length=length,
      draft=jnp.where(proposing, draft, state.draft),
      done=state.done | hit_eos | (length >= state.limit),
      forwards=state.forwards + proposing.astype(jnp.int32),
      steps=state.steps + 1)


def new_state(config: Qwen2Config, batch: int, cache_len: int, *,
              runtime: Runtime = DEFAULT_RUNTIME) -> DecodeState:
  """An empty state: `batch` padding rows (done), a zeroed cache of `cache_len` slots."""
  def zeros():  # one buffer per field: `insert` and `run_steps` donate the state
    return jnp.zeros((batch,), jnp.int32)
  return DecodeState(
      seq=jnp.zeros((batch, cache_len), jnp.int32),
      cache=qwen2.init_cache(config, batch, cache_len, runtime=runtime),
      cursor=zeros(), length=zeros(), draft=zeros(), prompt_len=zeros(), limit=zeros(),
      tau=jnp.ones((batch,), jnp.float32), metric=zeros(),
      done=jnp.ones((batch,), bool), forwards=zeros(), steps=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, donate_argnums=0)
def insert(state: DecodeState, rows: Array, prompt: Array, prompt_len: Array,
           max_new_tokens: Array, tau: Array, metric: Array) -> DecodeState:
  """Starts new samples in rows of a state, leaving the other rows as they are.

  rows: int32[k] (entries >= b are ignored); prompt: int32[k, P] right-padded;
  prompt_len: int32[k] (>= 1); max_new_tokens: int32[k] (0: the row stays done);
  tau: float32[k]; metric: int32[k]. The rows' old K/V stay in the cache: a query
  at position p reads slots <= p only, and the new sample's forwards write them first.
  """
  def put(field, value):
    return field.at[rows].set(value.astype(field.dtype), mode="drop")
  p = prompt.shape[1]
  seq = state.seq.at[rows, :p].set(prompt, mode="drop")
  zeros = jnp.zeros_like(prompt_len)
  return state.replace(
      seq=seq, cursor=put(state.cursor, zeros), length=put(state.length, prompt_len),
      draft=put(state.draft, zeros), prompt_len=put(state.prompt_len, prompt_len),
      limit=put(state.limit, prompt_len + max_new_tokens), tau=put(state.tau, tau),
      metric=put(state.metric, metric), done=put(state.done, max_new_tokens <= 0),
      forwards=put(state.forwards, zeros))


@jax.jit
def regroup(state: DecodeState, rows: Array) -> DecodeState:
  """A state of len(rows) rows: row i is old row rows[i], or padding where rows[i] >= b.

  rows: int32[b'] -> the state with batch bucket b' (same cache length).
  """
  b = state.seq.shape[0]
  idx = jnp.minimum(rows, b - 1)
  per_row = {f.name: getattr(state, f.name)[idx] for f in dataclasses.fields(state)
             if f.name not in ("cache", "steps")}
  return state.replace(**{**per_row, "done": per_row["done"] | (rows >= b)},
                       cache=jax.tree.map(lambda a: a[:, idx], state.cache))


@functools.partial(jax.jit, static_argnames=("config", "runtime", "window", "real_slots", "mode"),
                   donate_argnames=("state",))
def run_steps(config: Qwen2Config, params, state: DecodeState, eos_ids: Array,
              mask_token_id: Array, max_steps: Array, stop_on_finish: Array, *,
              window: int, real_slots: int, mode: str,
              runtime: Runtime = DEFAULT_RUNTIME) -> DecodeState:
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

  step = functools.partial(_advance, config, runtime, params, eos_ids=eos_ids,
                           mask_token_id=mask_token_id, real_slots=real_slots,
                           window=window, mode=mode)
  return jax.lax.while_loop(cond, step, state)


@functools.partial(jax.jit, static_argnames=("config", "runtime", "cache_len"))
def start(config: Qwen2Config, prompt: Array, prompt_len: Array, max_new_tokens: Array,
          tau: Array, metric: Array, *, cache_len: int,
          runtime: Runtime = DEFAULT_RUNTIME) -> DecodeState:
  """A state of b = len(prompt) rows starting the prompts (arguments as `insert`;
  rows with max_new_tokens 0 are padding), nothing run yet."""
  b = prompt.shape[0]
  return insert(new_state(config, b, cache_len, runtime=runtime), jnp.arange(b), prompt,
                prompt_len, max_new_tokens, tau, metric)


@functools.partial(jax.jit, static_argnames=("config", "runtime", "window", "mode", "cache_len"))
def decode(config: Qwen2Config, params, prompt: Array, prompt_len: Array,
           max_new_tokens: Array, tau: Array, metric: Array, eos_ids: Array,
           mask_token_id: Array, *, window: int, mode: str, cache_len: int,
           runtime: Runtime = DEFAULT_RUNTIME) -> DecodeState:
  """Prefill, then the decoding loop until every sample is done.

  prompt: int32[b, P] right-padded; prompt_len: int32[b] (>= 1);
  max_new_tokens: int32[b] (0 marks a padding row); tau: float32[b];
  metric: int32[b] (index into `gates.METRICS`); eos_ids: int32[e] (entries < 0
  are padding); mask_token_id: int32[];
  cache_len: S >= max(prompt_len + max_new_tokens) + window - 1.
  -> the final `DecodeState`; sample i generated seq[i, prompt_len[i]:length[i]].
  """
  state = start(config, prompt, prompt_len, max_new_tokens, tau, metric, cache_len=cache_len,
                runtime=runtime)
  step = functools.partial(_advance, config, runtime, params, eos_ids=eos_ids,
                           mask_token_id=mask_token_id, window=window, mode=mode)
  state = step(state, real_slots=prompt.shape[1])
  return jax.lax.while_loop(lambda st: jnp.any(~st.done),
                            functools.partial(step, real_slots=window), state)


def pow2(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def eos_array(eos_token_ids: int | Sequence[int]) -> np.ndarray:
  """EOS ids -> int32[e] padded with -1 to a power of two (>= EOS_BUCKET)."""
  ids = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else list(eos_token_ids)
  out = np.full((pow2(len(ids), EOS_BUCKET),), -1, np.int32)
  out[:len(ids)] = ids
  return out


def per_prompt(value, n: int, name: str, dtype) -> np.ndarray:
  """A scalar, or one value per prompt -> dtype[n]."""
  out = np.broadcast_to(np.asarray(value, dtype), (n,)) if np.ndim(value) == 0 else (
      np.asarray(value, dtype))
  if out.shape != (n,):
    raise ValueError(f"{name}: {len(out)} values for {n} prompts; pass one, or one per "
                     "prompt.")
  return out


def check_args(config: Qwen2Config, *, window: int, mode: str, mask_token_id: int) -> None:
  """Raises ValueError on a window, mode or mask id the sampler rejects."""
  if window < 1:
    raise ValueError(f"window={window}; it must be >= 1 (1 is plain AR decoding).")
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}; expected one of {list(MODES)}.")
  if not 0 <= mask_token_id < config.vocab_size:
    raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary "
                     f"(vocab_size {config.vocab_size}); use hf.load_tokenizer's id.")


def check_prompt_ids(config: Qwen2Config, prompts: Sequence[Sequence[int]]) -> None:
  """Raises ValueError when a prompt holds a token id outside [0, vocab_size)."""
  for i, p in enumerate(prompts):
    ids = np.asarray(p)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt {i}: token ids must be integers, got {ids.dtype}.")
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
      raise ValueError(
          f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, "
          f"{config.vocab_size}); encode prompts with the model's own tokenizer.")


def _check_prompts(config: Qwen2Config, prompts: Sequence[Sequence[int]], max_new_tokens
                   ) -> np.ndarray:
  """-> the per-prompt budgets int32[len(prompts)]; raises on empty prompts or budgets,
  token ids outside the vocabulary, and sequences longer than the model's positions."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts must be a non-empty list of non-empty token lists.")
  budget = per_prompt(max_new_tokens, len(prompts), "max_new_tokens", np.int32)
  if np.any(budget < 1):
    raise ValueError(f"max_new_tokens={budget.tolist()}; it must be >= 1.")
  check_prompt_ids(config, prompts)
  total = np.asarray([len(p) for p in prompts]) + budget
  i = int(np.argmax(total))
  if total[i] > config.max_position_embeddings:
    raise ValueError(
        f"prompt {i}: {len(prompts[i])} prompt tokens + max_new_tokens {int(budget[i])} = "
        f"{int(total[i])} exceeds the model's max_position_embeddings "
        f"({config.max_position_embeddings}); lower max_new_tokens or shorten the prompt.")
  return budget


def _prompt_array(prompts: Sequence[Sequence[int]], b: int) -> tuple[np.ndarray, np.ndarray]:
  """-> (int32[b, P] right-padded, P a power of two >= MIN_PROMPT_BUCKET; lengths int32[b],
  1 on padding rows)."""
  prompt = np.zeros((b, pow2(max(map(len, prompts)), MIN_PROMPT_BUCKET)), np.int32)
  lens = np.ones((b,), np.int32)
  for i, p in enumerate(prompts):
    prompt[i, :len(p)] = p
    lens[i] = len(p)
  return prompt, lens


def decode_batch(config: Qwen2Config, params, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int], mask_token_id: int,
                 eos_token_ids: int | Sequence[int], tau: float | Sequence[float] = 1.0,
                 window: int = 1, metric: str | Sequence[str] = "probability",
                 mode: str = "gated", runtime: Runtime = DEFAULT_RUNTIME) -> DecodeState:
  """Buckets `prompts` and runs `decode`; returns the final state (rows past
  len(prompts) are padding). Arguments as `generate`."""
  n = len(prompts)
  budget = _check_prompts(config, prompts, max_new_tokens)
  check_args(config, window=window, mode=mode, mask_token_id=mask_token_id)
  b = pow2(n)
  prompt, lens = _prompt_array(prompts, b)
  cache_len = pow2(int(np.max(lens[:n] + budget)) + window - 1, prompt.shape[1])
  pad = functools.partial(np.pad, pad_width=(0, b - n))
  return decode(config, params, prompt, lens, pad(budget),
                pad(per_prompt(tau, n, "tau", np.float32), constant_values=1.0),
                pad(gates.metric_ids(metric, n)), eos_array(eos_token_ids),
                np.int32(mask_token_id), window=window, mode=mode, cache_len=cache_len,
                runtime=runtime)


def results(state: DecodeState, n: int, windows: dict[int, int] | None = None
            ) -> GenerateResult:
  """The `GenerateResult` of the first `n` rows of a final `DecodeState`."""
  seq, start, end, fwd, steps = jax.device_get(
      (state.seq, state.prompt_len, state.length, state.forwards, state.steps))
  return GenerateResult(
      tokens=[seq[i, start[i]:end[i]].tolist() for i in range(n)],
      num_forwards=fwd[:n].tolist(), forwards=int(steps), windows=dict(windows or {}))


def step_seconds(config: Qwen2Config, params, *, batch: int, cache_len: int, window: int,
                 mode: str, mask_token_id: int, steps: int = 32, repeats: int = 5,
                 runtime: Runtime = DEFAULT_RUNTIME) -> float:
  """Measured seconds per decoding step of the `run_steps` variant (batch, cache_len,
  window, mode): `batch` rows decoding from a one-token prompt (tau 1), best of
  `repeats` runs of `steps` steps after one that compiles."""
  ones = np.ones((batch,), np.int32)
  best = float("inf")
  for _ in range(repeats + 1):
    state = start(config, ones[:, None], ones, np.full((batch,), cache_len - window, np.int32),
                  ones.astype(np.float32), 0 * ones, cache_len=cache_len, runtime=runtime)
    jax.block_until_ready(state)
    begin = time.perf_counter()
    state = run_steps(config, params, state, eos_array(()), np.int32(mask_token_id),
                      np.int32(steps), np.bool_(False), window=window, real_slots=window,
                      mode=mode, runtime=runtime)
    ran = int(state.steps)
    best = min(best, (time.perf_counter() - begin) / max(ran, 1))
  return best


def measure_fn(config: Qwen2Config, params, *, mode: str, mask_token_id: int,
               runtime: Runtime = DEFAULT_RUNTIME) -> Measure:
  """(batch, cache_len, window) -> seconds per step (one timed run: the policy repeats
  it round-robin over the windows), for `WindowPolicy.choose`."""
  def measure(batch: int, cache_len: int, window: int) -> float:
    return step_seconds(config, params, batch=batch, cache_len=cache_len, window=window,
                        mode=mode, mask_token_id=mask_token_id, repeats=1, runtime=runtime)
  return measure


class Progress(NamedTuple):
  """Host copies of a state's counters: done bool[b], length, forwards int32[b], steps."""
  done: np.ndarray
  length: np.ndarray
  forwards: np.ndarray
  steps: int


def progress(state: DecodeState) -> Progress:
  done, length, forwards, steps = jax.device_get(
      (state.done, state.length, state.forwards, state.steps))
  return Progress(done, length, forwards, int(steps))


def segment(config: Qwen2Config, params, state: DecodeState, policy: Policy, *,
            eos_ids: np.ndarray, mask_token_id: int, mode: str, measure: Measure | None,
            before: Progress | None = None, real_slots: int = 0, wide_steps: int = 1,
            stop_on_finish: bool = False, runtime: Runtime = DEFAULT_RUNTIME
            ) -> tuple[DecodeState, int, Progress]:
  """One policy decision: W for the state's batch, then `policy.segment_steps` steps
  (the first `wide_steps` of them `real_slots` wide when that exceeds W, to prefill
  new rows), and the acceptance seen reported to the policy.
  before: the state's `progress` when the caller has it.
  -> (new state, W, its progress)."""
  b, cache_len = state.seq.shape
  before = before or progress(state)
  window = policy.choose(b, cache_len, int(np.sum(~before.done)), measure)
  call = functools.partial(run_steps, config, params, eos_ids=eos_ids,
                           mask_token_id=np.int32(mask_token_id), window=window, mode=mode,
                           runtime=runtime)
  steps = policy.segment_steps
  if real_slots > window:
    state = call(state=state, max_steps=np.int32(wide_steps), stop_on_finish=np.bool_(False),
                 real_slots=real_slots)
    steps -= wide_steps
  if steps > 0:
    state = call(state=state, max_steps=np.int32(steps),
                 stop_on_finish=np.bool_(stop_on_finish), real_slots=window)
  after = progress(state)
  policy.observe(window, int(np.sum(after.length - before.length)),
                 int(np.sum(after.forwards - before.forwards)))
  return state, window, after


def _generate_policy(config, params, prompts, policy: Policy, *, budget, tau, metric,
                     mask_token_id, eos_token_ids, mode, runtime) -> GenerateResult:
  """`generate` with the window chosen by `policy` before every segment of steps.

  The prefill runs first, at a window that does not depend on the policy's choice
  (so it compiles once per prompt bucket): the largest W in lossless mode (its
  drafts are cut to the W chosen next), 1 in gated mode (accepted tokens would
  otherwise exceed a smaller W's slots)."""
  n = len(prompts)
  b = pow2(n)
  prompt, lens = _prompt_array(prompts, b)
  cache_len = pow2(int(np.max(lens[:n] + budget)) + max(policy.windows) - 1, prompt.shape[1])
  pad = functools.partial(np.pad, pad_width=(0, b - n))
  state = start(config, prompt, lens, pad(budget),
                pad(per_prompt(tau, n, "tau", np.float32), constant_values=1.0),
                pad(gates.metric_ids(metric, n)), cache_len=cache_len, runtime=runtime)
  eos_ids = eos_array(eos_token_ids)
  prefill_window = max(policy.windows) if mode == "lossless" else 1
  state = run_steps(config, params, state, eos_ids, np.int32(mask_token_id), np.int32(1),
                    np.bool_(False), window=prefill_window, real_slots=prompt.shape[1],
                    mode=mode, runtime=runtime)
  measure = measure_fn(config, params, mode=mode, mask_token_id=mask_token_id,
                       runtime=runtime)
  used = {prefill_window: 1}
  now = progress(state)
  while not np.all(now.done[:n]):
    steps0 = now.steps
    state, window, now = segment(config, params, state, policy, eos_ids=eos_ids,
                                 mask_token_id=mask_token_id, mode=mode, measure=measure,
                                 before=now, runtime=runtime)
    used[window] = used.get(window, 0) + now.steps - steps0
  return results(state, n, used)


def generate(config: Qwen2Config, params: Any, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], mask_token_id: int,
             eos_token_ids: int | Sequence[int], tau: float | Sequence[float] = 1.0,
             window: int | str = 1, metric: str | Sequence[str] = "probability",
             mode: str = "gated", policy: WindowPolicy | None = None,
             runtime: Runtime = DEFAULT_RUNTIME) -> GenerateResult:
  """Greedy AR (window=1), MARS, or lossless MARS decoding of a ragged batch of prompts.

  prompts: token id lists (any lengths); max_new_tokens: per-sample budget (one,
  or one per prompt); mask_token_id: the `<|mask|>` id; eos_token_ids: one id or
  several (may be empty); window: W proposals per forward, 1 <= W <= block size
  + 1, or "auto": chosen before every segment of steps by `policy` (a
  `WindowPolicy`; a fresh one, which measures its step costs first, by default);
  tau, metric: the gate (see `mars_jax.gates`), one, or one per prompt;
  mode: "gated" (MASK proposals committed while their gate holds) or "lossless"
  (drafts verified by the next forward; tau and metric unused).
  window=1, tau >= 1 with the probability or margin gate, or mode="lossless" is
  greedy AR token for token. runtime: how the params are computed (their layout
  and compute dtype; `LoadedModel.runtime` for a loaded model).
  """
  if window == "auto" or policy is not None:
    budget = _check_prompts(config, prompts, max_new_tokens)
    policy = policy or WindowPolicy()
    check_args(config, window=max(policy.windows), mode=mode, mask_token_id=mask_token_id)
    return _generate_policy(config, params, prompts, policy, budget=budget, tau=tau,
                            metric=metric, mask_token_id=mask_token_id,
                            eos_token_ids=eos_token_ids, mode=mode, runtime=runtime)
  if not isinstance(window, (int, np.integer)):
    raise ValueError(f"window={window!r}; expected an int >= 1 or 'auto'.")
  state = decode_batch(config, params, prompts, max_new_tokens=max_new_tokens,
                       mask_token_id=mask_token_id, eos_token_ids=eos_token_ids, tau=tau,
                       window=window, metric=metric, mode=mode, runtime=runtime)
  return results(state, len(prompts), {window: int(state.steps)})
