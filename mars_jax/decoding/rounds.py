"""Rounds of decoding steps at a window the policy chooses: the host loop between the
jitted kernels (`mars_jax.decoding.loop`) and the load-aware window
(`mars_jax.decoding.window_policy`).

A round is one policy decision: W for the state's batch bucket, then
`policy.round_steps` steps of `loop.run_steps` (the first ones wider when new rows
need a prefill), then the acceptance seen reported back to the policy. Each round
ends in one host round trip (`progress`), where stop strings are looked for
(`mars_jax.decoding.stops`). `generate_with_policy` runs rounds until
every prompt is done, each twice as long as the one before while W stays the same;
`mars_jax.serve` runs one per `Server.step`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from mars_jax.core.choices import Mode
from mars_jax.decoding import batching, loop, programs, timing
from mars_jax.decoding.batching import Bucket, GenerateResult
from mars_jax.decoding.loop import DecodeState
from mars_jax.decoding.stops import StopScan
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.decoding.window_policy import FixedWindow, Measure, WindowPolicy

Policy = WindowPolicy | FixedWindow
MAX_ROUND_GROWTH = 8  # generate_with_policy: rounds grow to at most 8 x policy.round_steps


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


def dispatch(config: Qwen2Config, params, state: DecodeState, policy: Policy, *, active: int,
             eos_ids: np.ndarray, mask_token_id: int, mode: Mode, measure: Measure | None,
             real_slots: int = 0, wide_steps: int = 1, wide_window: int | None = None,
             stop_on_finish: bool = False, steps: int | None = None, min_window: int = 1,
             runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None,
             call=programs.direct) -> tuple[DecodeState, int]:
  """The kernels of one round, dispatched without waiting for them: W for the state's
  batch and `active` live rows (the policy's, or min_window when larger: rows that
  fixed their own window), then `steps` steps (`policy.round_steps` by default; the
  first `wide_steps` of them `real_slots` wide when that exceeds W, to prefill new
  rows, at W = wide_window when given: a fixed one keeps the compiled prefill variants
  from multiplying with the windows). call: how `loop.run_steps` is called
  (`programs.direct`, or a server's `Programs`). -> (new state, W)."""
  b, cache_len = state.seq.shape
  window = max(policy.choose(b, cache_len, active, measure), min_window)
  call = functools.partial(call, loop.run_steps, config, params, eos_ids=eos_ids,
                           mask_token_id=np.int32(mask_token_id), mode=mode,
                           runtime=runtime, mesh=mesh)
  steps = steps or policy.round_steps
  if real_slots > window:
    state = call(state=state, max_steps=np.int32(wide_steps), stop_on_finish=np.bool_(False),
                 real_slots=real_slots, window=wide_window or window)
    steps -= wide_steps
  if steps > 0:
    state = call(state=state, max_steps=np.int32(steps),
                 stop_on_finish=np.bool_(stop_on_finish), real_slots=window, window=window)
  return state, window


def run_round(config: Qwen2Config, params, state: DecodeState, policy: Policy, *,
              eos_ids: np.ndarray, mask_token_id: int, mode: Mode, measure: Measure | None,
              before: Progress | None = None, steps: int | None = None,
              scan: StopScan | None = None, runtime: Runtime = DEFAULT_RUNTIME,
              mesh: Mesh | None = None) -> tuple[DecodeState, int, Progress]:
  """One round (`dispatch`), the rows that were live cut at their stop strings (`scan`),
  and the acceptance seen (up to the cuts) reported to the policy.
  before: the state's `progress` when the caller has it; mesh: the one the params
  and the state are placed on (None: one device).
  -> (new state, W, its progress)."""
  before = before or progress(state)
  state, window = dispatch(config, params, state, policy, active=int(np.sum(~before.done)),
                           eos_ids=eos_ids, mask_token_id=mask_token_id, mode=mode,
                           measure=measure, steps=steps, runtime=runtime, mesh=mesh)
  found = scan.scan(state, ~before.done) if scan is not None else None
  if found is not None:
    state = loop.stop(state, *found, mesh=mesh)
  after = progress(state)
  policy.observe(window, int(np.sum(after.length - before.length)),
                 int(np.sum(after.forwards - before.forwards)))
  return state, window, after


def generate_with_policy(config: Qwen2Config, params, n: int, prompts: Bucket,
                         policy: Policy, *, mask_token_id: int, eos_token_ids, mode: Mode,
                         scan: StopScan | None = None, runtime: Runtime = DEFAULT_RUNTIME,
                         mesh: Mesh | None = None) -> GenerateResult:
  """`sampling.generate` of the first `n` rows of `prompts` with the window chosen by
  `policy` before every round, stop strings looked for after each (`scan`).

  The prefill runs first, at a window that does not depend on the policy's choice
  (so it compiles once per prompt bucket): the policy's only W, else the largest W
  in lossless mode (its drafts are cut to the W chosen next), 1 in gated mode
  (accepted tokens would otherwise exceed a smaller W's slots)."""
  eos_ids = batching.eos_array(eos_token_ids)
  prefill_window = (max(policy.windows) if mode == "lossless" or len(policy.windows) == 1
                    else 1)
  state = loop.prefill(config, params, prompts.prompt, prompts.prompt_len,
                       prompts.max_new_tokens, prompts.controls, eos_ids,
                       np.int32(mask_token_id), window=prefill_window, mode=mode,
                       cache_len=prompts.cache_len(max(policy.windows),
                                                   config.max_position_embeddings),
                       runtime=runtime, mesh=mesh)
  measure = timing.measure_fn(config, params, mode=mode, mask_token_id=mask_token_id,
                              runtime=runtime, mesh=mesh)
  used = {prefill_window: 1}
  if scan is not None:
    found = scan.scan(state, np.ones((len(prompts.prompt_len),), bool))
    state = state if found is None else loop.stop(state, *found, mesh=mesh)
  now = progress(state)
  steps, last = policy.round_steps, None
  while not np.all(now.done[:n]):
    steps0 = now.steps
    state, window, now = run_round(config, params, state, policy, eos_ids=eos_ids,
                                   mask_token_id=mask_token_id, mode=mode, measure=measure,
                                   before=now, steps=steps, scan=scan, runtime=runtime,
                                   mesh=mesh)
    used[window] = used.get(window, 0) + now.steps - steps0
    # While W stays what it was, each round runs twice as long as the one before (up to
    # MAX_ROUND_GROWTH x round_steps), so a steady choice pays fewer host round trips;
    # a round at a new W sets the next one back to round_steps.
    steps = (min(2 * steps, MAX_ROUND_GROWTH * policy.round_steps)
             if last in (None, window) else policy.round_steps)
    last = window
  return batching.results(state, n, used, eos_ids=eos_ids,
                          stopped=scan.stopped[:n] if scan is not None else ())
