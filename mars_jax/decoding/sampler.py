"""AR and MARS decoding of a ragged batch of prompts: `generate` (outside code imports it as
`mars_jax.sampling.generate`).

The decoding loop lives in `mars_jax.decoding`, one job per module:

  loop.py      the jitted kernels: one `lax.while_loop` over a fixed-shape KV cache
               (`advance`: one forward, its proposals and their acceptance), and the
               resumable pieces (`start`, `insert`, `regroup`, `run_steps`);
  batching.py  the host side: argument checks, the prompt `bucket` every caller
               shares, the `GenerateResult`;
  gates.py     the confidence gates and the left-to-right acceptance rules;
  draws.py     greedy or sampled tokens (temperature, top-k, top-p, position-keyed noise);
  stops.py     stop strings, found on the decoded text between rounds;
  timing.py    measured seconds per step of a compiled variant;
  window_policy.py, rounds.py   the load-aware window, and rounds of steps at the W it
               chooses;
  speculative.py  two-model decoding: a drafter (AR or MARS) drafts, the target verifies;
  mesh.py      decoding on a mesh: the shardings of the weights and the loop state.

`mars_jax.serve` holds continuous batching. docs/design.md explains the slot layout,
the invariants of the loop and how sampling keeps the AR distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from jax.sharding import Mesh

from mars_jax.core.choices import Metric, Mode
from mars_jax.decoding import batching, loop, rounds, speculative, stops, timing
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.decoding.batching import GenerateResult
from mars_jax.decoding.loop import DecodeState
from mars_jax.decoding.window_policy import FixedWindow, WindowPolicy
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime


def decode_batch(config: Qwen2Config, params, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int], mask_token_id: int,
                 eos_token_ids: int | Sequence[int], window: int = 1, mode: Mode = "gated",
                 runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None,
                 **controls) -> DecodeState:
  """Buckets `prompts` and runs `loop.decode`; returns the final state (rows past
  len(prompts) are padding). Arguments as `generate`; controls: tau, metric,
  temperature, top_k, top_p, seed, stop_token_ids (lossless: every row, in lossless
  mode)."""
  controls.setdefault("lossless", mode == "lossless")
  batching.check_prompts(config, prompts, max_new_tokens)
  batching.check_args(config, window=window, mode=mode, mask_token_id=mask_token_id)
  if mesh is not None:
    params = decode_mesh.place_params(config, params, mesh, runtime)
  b = batching.bucket(prompts, decode_mesh.batch_rows(len(prompts), mesh),
                      max_new_tokens=max_new_tokens, **controls)
  return loop.decode(config, params, b.prompt, b.prompt_len, b.max_new_tokens, b.controls,
                     batching.eos_array(eos_token_ids), np.int32(mask_token_id),
                     window=window, mode=mode,
                     cache_len=b.cache_len(window, config.max_position_embeddings),
                     runtime=runtime, mesh=mesh)


def generate(config: Qwen2Config, params: Any, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], mask_token_id: int,
             eos_token_ids: int | Sequence[int], tau: float | Sequence[float] = 1.0,
             window: int | str = 1, metric: Metric | Sequence[Metric] = "probability",
             mode: Mode = "gated", temperature: float | Sequence[float] = 0.0,
             top_k: int | Sequence[int] = 0, top_p: float | Sequence[float] = 1.0,
             seed: int | Sequence[int] = 0, stop: str | Sequence | None = None,
             stop_token_ids: Sequence = (), tokenizer=None,
             policy: WindowPolicy | None = None, runtime: Runtime = DEFAULT_RUNTIME,
             mesh: Mesh | None = None, drafter: speculative.Drafter | None = None,
             draft_window: int = 4) -> GenerateResult:
  """AR (window=1), MARS, or lossless MARS decoding of a ragged batch of prompts,
  greedy or sampled.

  prompts: token id lists (any lengths); max_new_tokens: per-sample budget (one,
  or one per prompt); mask_token_id: the `<|mask|>` id; eos_token_ids: one id or
  several (may be empty); window: W proposals per forward, 1 <= W <= block size
  + 1, or "auto": chosen before every round of steps by `policy` (a
  `WindowPolicy`; by default a fresh one over the process's cost table for this model
  shape (`timing.shared_costs`: each compiled variant's step cost is measured once per
  process, on its first need));
  tau, metric: the gate (see `mars_jax.decoding.gates`), one, or one per prompt;
  mode: "gated" (MASK proposals committed while their gate holds) or "lossless"
  (drafts verified by the next forward; tau and metric unused).

  temperature (0: greedy), top_k (0: off), top_p (1.0: off), seed: sampling, one
  value or one per prompt (`mars_jax.decoding.draws`); a prompt's tokens depend on
  its seed, not on its batch or row. Greedy: window=1, tau >= 1 with the probability
  or margin gate, or mode="lossless" is greedy AR token for token. Sampling: window=1
  or tau >= 1 is AR sampling with the same seed, token for token, and so is
  mode="lossless" at every W (the drafts share the verifying draws' noise).

  stop: stop strings (one list, or one per prompt), found on the decoded text after
  every round of steps (needs `tokenizer`); stop_token_ids: ids that end a sample as
  EOS does (one list, or one per prompt). A sample ends at the token that completes a
  stop string, and what it decoded past that is neither returned nor counted.
  tokenizer: also fills `GenerateResult.texts`.
  runtime: how the params are computed (their layout and compute dtype;
  `LoadedModel.runtime` for a loaded model). mesh: a `sharding.make_mesh` mesh to
  decode on (weights split over tensor, rows over data; see
  `mars_jax.decoding.mesh`; the params are placed there unless they already are), or
  None: one device. The tokens are those of one device.

  drafter: a `speculative.Drafter` (another model over the same tokenizer, AR or MARS):
  each round it drafts up to `draft_window` (K) tokens and this model verifies them in
  one forward, with `window` - 1 MASK slots after them whose gated proposals (tau,
  metric) start the next round's drafts (window 1: an AR target). The output is this
  model's AR output, greedy or sampled with the same seed, token for token (`mode` is
  not read); `forwards` count this model's, `drafter_forwards` the drafter's. One
  device, a fixed window.
  """
  controls = dict(tau=tau, metric=metric, temperature=temperature, top_k=top_k,
                  top_p=top_p, seed=seed, stop_token_ids=stop_token_ids,
                  lossless=mode == "lossless")
  if not (window == "auto" or isinstance(window, (int, np.integer))):
    raise ValueError(f"window={window!r}; expected an int >= 1 or 'auto'.")
  stop_rows = stops.check_stops(stop, len(prompts))
  stopped = [False] * len(prompts)
  if drafter is not None:
    if policy is not None or mesh is not None:
      raise ValueError("decoding with a drafter runs on one device at a fixed window: "
                       "pass neither policy= nor mesh=.")
    speculative.check_args(config, drafter, prompts, max_new_tokens,
                           draft_window=draft_window, window=window,
                           mask_token_id=mask_token_id)
    bucket = batching.bucket(prompts, batching.pow2(len(prompts)),
                             max_new_tokens=max_new_tokens, **controls)
    scan = stops.StopScan(tokenizer, stop_rows + [()] * (len(bucket.prompt_len) - len(prompts)))
    out = speculative.generate(config, params, len(prompts), bucket, drafter,
                               draft_window=draft_window, window=window,
                               mask_token_id=mask_token_id, eos_token_ids=eos_token_ids,
                               scan=scan, runtime=runtime)
    stopped = scan.stopped[:len(prompts)]
  elif window == "auto" or policy is not None or any(stop_rows):
    batching.check_prompts(config, prompts, max_new_tokens)
    policy = policy or (WindowPolicy(costs=timing.shared_costs(config, mode=mode,
                                                               runtime=runtime, mesh=mesh))
                        if window == "auto" else FixedWindow(int(window)))
    batching.check_args(config, window=max(policy.windows), mode=mode,
                        mask_token_id=mask_token_id)
    if mesh is not None:
      params = decode_mesh.place_params(config, params, mesh, runtime)
    bucket = batching.bucket(prompts, decode_mesh.batch_rows(len(prompts), mesh),
                             max_new_tokens=max_new_tokens, **controls)
    scan = stops.StopScan(tokenizer, stop_rows + [()] * (len(bucket.prompt_len) - len(prompts)))
    out = rounds.generate_with_policy(config, params, len(prompts), bucket, policy,
                                      mask_token_id=mask_token_id,
                                      eos_token_ids=eos_token_ids, mode=mode, scan=scan,
                                      runtime=runtime, mesh=mesh)
    stopped = scan.stopped[:len(prompts)]
  else:
    state = decode_batch(config, params, prompts, max_new_tokens=max_new_tokens,
                         mask_token_id=mask_token_id, eos_token_ids=eos_token_ids,
                         window=window, mode=mode, runtime=runtime, mesh=mesh, **controls)
    out = batching.results(state, len(prompts), {window: int(state.steps)},
                           eos_ids=batching.eos_array(eos_token_ids))
  if tokenizer is None:
    return out
  return dataclasses.replace(out, texts=[
      stops.text(tokenizer, t, stop_rows[i], reason=r, stopped=stopped[i])
      for i, (t, r) in enumerate(zip(out.tokens, out.finish_reasons))])
