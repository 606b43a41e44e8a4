"""AR and MARS decoding of a ragged batch of prompts: `generate`, the front door.

The decoding loop lives in `mars_jax.decoding`, one job per module:

  loop.py      the jitted kernels: one `lax.while_loop` over a fixed-shape KV cache
               (`advance`: one forward, its proposals and their acceptance), and the
               resumable pieces (`start`, `insert`, `regroup`, `run_steps`);
  batching.py  the host side: argument checks, the prompt `bucket` every caller
               shares, the `GenerateResult`;
  timing.py    measured seconds per step of a compiled variant;
  rounds.py    rounds of steps at the window a `WindowPolicy` chooses;
  mesh.py      decoding on a mesh: the shardings of the weights and the loop state.

`mars_jax.decoding.gates` holds the acceptance rules and `mars_jax.serve` continuous batching.
docs/design.md explains the slot layout and the invariants of the loop.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jax.sharding import Mesh

from mars_jax.choices import Metric, Mode
from mars_jax.decoding import batching, loop, rounds
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.decoding.batching import GenerateResult  # noqa: F401  (the result type)
from mars_jax.decoding.loop import DecodeState
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.decoding.window_policy import WindowPolicy


def decode_batch(config: Qwen2Config, params, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int], mask_token_id: int,
                 eos_token_ids: int | Sequence[int], tau: float | Sequence[float] = 1.0,
                 window: int = 1, metric: Metric | Sequence[Metric] = "probability",
                 mode: Mode = "gated", runtime: Runtime = DEFAULT_RUNTIME,
                 mesh: Mesh | None = None) -> DecodeState:
  """Buckets `prompts` and runs `loop.decode`; returns the final state (rows past
  len(prompts) are padding). Arguments as `generate`."""
  batching.check_prompts(config, prompts, max_new_tokens)
  batching.check_args(config, window=window, mode=mode, mask_token_id=mask_token_id)
  if mesh is not None:
    params = decode_mesh.place_params(config, params, mesh, runtime)
  b = batching.bucket(prompts, decode_mesh.batch_rows(len(prompts), mesh),
                      max_new_tokens=max_new_tokens, tau=tau, metric=metric)
  return loop.decode(config, params, b.prompt, b.prompt_len, b.max_new_tokens, b.tau,
                     b.metric, batching.eos_array(eos_token_ids), np.int32(mask_token_id),
                     window=window, mode=mode, cache_len=b.cache_len(window), runtime=runtime,
                     mesh=mesh)


def generate(config: Qwen2Config, params: Any, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], mask_token_id: int,
             eos_token_ids: int | Sequence[int], tau: float | Sequence[float] = 1.0,
             window: int | str = 1, metric: Metric | Sequence[Metric] = "probability",
             mode: Mode = "gated", policy: WindowPolicy | None = None,
             runtime: Runtime = DEFAULT_RUNTIME, mesh: Mesh | None = None) -> GenerateResult:
  """Greedy AR (window=1), MARS, or lossless MARS decoding of a ragged batch of prompts.

  prompts: token id lists (any lengths); max_new_tokens: per-sample budget (one,
  or one per prompt); mask_token_id: the `<|mask|>` id; eos_token_ids: one id or
  several (may be empty); window: W proposals per forward, 1 <= W <= block size
  + 1, or "auto": chosen before every round of steps by `policy` (a
  `WindowPolicy`; a fresh one, which measures its step costs first, by default);
  tau, metric: the gate (see `mars_jax.decoding.gates`), one, or one per prompt;
  mode: "gated" (MASK proposals committed while their gate holds) or "lossless"
  (drafts verified by the next forward; tau and metric unused).
  window=1, tau >= 1 with the probability or margin gate, or mode="lossless" is
  greedy AR token for token. runtime: how the params are computed (their layout
  and compute dtype; `LoadedModel.runtime` for a loaded model). mesh: a
  `sharding.make_mesh` mesh to decode on (weights split over tensor, rows over data;
  see `mars_jax.decoding.mesh`; the params are placed there unless they already are),
  or None: one device. The tokens are those of one device.
  """
  if window == "auto" or policy is not None:
    batching.check_prompts(config, prompts, max_new_tokens)
    policy = policy or WindowPolicy()
    batching.check_args(config, window=max(policy.windows), mode=mode,
                        mask_token_id=mask_token_id)
    if mesh is not None:
      params = decode_mesh.place_params(config, params, mesh, runtime)
    bucket = batching.bucket(prompts, decode_mesh.batch_rows(len(prompts), mesh),
                             max_new_tokens=max_new_tokens, tau=tau, metric=metric)
    return rounds.generate_with_policy(config, params, len(prompts), bucket, policy,
                                       mask_token_id=mask_token_id,
                                       eos_token_ids=eos_token_ids, mode=mode, runtime=runtime,
                                       mesh=mesh)
  if not isinstance(window, (int, np.integer)):
    raise ValueError(f"window={window!r}; expected an int >= 1 or 'auto'.")
  state = decode_batch(config, params, prompts, max_new_tokens=max_new_tokens,
                       mask_token_id=mask_token_id, eos_token_ids=eos_token_ids, tau=tau,
                       window=window, metric=metric, mode=mode, runtime=runtime, mesh=mesh)
  return batching.results(state, len(prompts), {window: int(state.steps)})
