"""Measured seconds per decoding step of a compiled loop variant: the step costs the
load-aware window (`mars_jax.decoding.window_policy`) weighs, and what `bench decode` reports."""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import Mesh

from mars_jax.core.choices import Mode
from mars_jax.decoding import batching, loop, programs
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.decoding.window_policy import CostTable, Measure

_COSTS: dict[tuple, CostTable] = {}
MEASURE_STEPS = 8  # steps a policy's timing runs: a server times 5 buckets x 4 windows x 5


def step_seconds(config: Qwen2Config, params, *, batch: int, cache_len: int, window: int,
                 mode: Mode, mask_token_id: int, steps: int = 32, repeats: int = 5,
                 runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None,
                 sample: dict | None = None, call=programs.direct) -> float:
  """Measured seconds per decoding step of the `run_steps` variant (batch, cache_len,
  window, mode), best of `repeats` runs of `steps` steps after one that compiles.

  A step reads the cache up to its live length (`attention.cached_attention`), so the
  steps run around the middle of the bucket, as a decode that fills it does on
  average: `batch` rows whose `live` prompt tokens count as prefilled (cursor at the
  last one; their K/V are left as zeros, which costs the same), tau 1. mesh: the one
  the params are placed on (None: one device). sample: every row's temperature, top_k
  and top_p (`loop.Controls`; None: greedy). call: how the kernels are called
  (`programs.direct`, or a server's `Programs`)."""
  live = max(1, (cache_len - window - steps) // 2)
  prompt = np.ones((batch, max(1, cache_len // 2)), np.int32)  # one width for every W
  rows = np.ones((batch,), np.int32)
  controls = loop.new_controls(batch).replace(lossless=np.full((batch,), mode == "lossless"))
  controls = controls.replace(**{name: np.full((batch,), value, getattr(controls, name).dtype)
                                 for name, value in (sample or {}).items()})
  best = float("inf")
  for _ in range(repeats + 1):
    state = call(loop.start, config, prompt, live * rows, (cache_len - window - live + 1) * rows,
                       controls, cache_len=cache_len, runtime=runtime, mesh=mesh)
    state = state.replace(cursor=state.length - 1)
    jax.block_until_ready(state)
    begin = time.perf_counter()
    # called as `rounds.dispatch` calls it, so a server's warmup compiles it once
    state = call(loop.run_steps, config, params, eos_ids=batching.eos_array(()),
                           mask_token_id=np.int32(mask_token_id), mode=mode, runtime=runtime,
                           mesh=mesh, state=state, max_steps=np.int32(steps),
                           stop_on_finish=np.bool_(False), real_slots=window, window=window)
    ran = int(state.steps)
    best = min(best, (time.perf_counter() - begin) / max(ran, 1))
  return best


def measure_fn(config: Qwen2Config, params, *, mode: Mode, mask_token_id: int,
               runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None,
               call=programs.direct) -> Measure:
  """(batch, cache_len, window) -> seconds per step (one timed run of MEASURE_STEPS
  steps: the policy repeats it round-robin over the windows), for
  `WindowPolicy.choose`; call: as `step_seconds`'s."""
  def measure(batch: int, cache_len: int, window: int) -> float:
    return step_seconds(config, params, batch=batch, cache_len=cache_len, window=window,
                        mode=mode, mask_token_id=mask_token_id, steps=MEASURE_STEPS, repeats=1,
                        runtime=runtime, mesh=mesh, call=call)
  return measure


def shared_costs(config: Qwen2Config, *, mode: Mode, runtime: Runtime = DEFAULT_RUNTIME,
                 mesh: Mesh | None = None) -> CostTable:
  """The process's cost table for a model shape, mode, runtime and mesh: a step's cost
  depends on the shapes, not on the weights' values, so every `WindowPolicy` made for
  the same model (one per `sampling.generate(window="auto")` call) reads and fills one
  table, and each compiled variant is measured once per process."""
  meta = {"mode": mode, "backend": jax.default_backend()}
  return _COSTS.setdefault((config, mode, runtime, mesh), CostTable(meta=meta))
