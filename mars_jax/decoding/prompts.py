"""Per-prompt settings of a decoding run, shared by every caller that takes prompts from a
user (generate, evaluate, lm_eval): sampling seeds and token budgets, checked before a
model loads."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mars_jax.decoding import batching

SEED_RANGE = 1 << 32  # seeds are uint32


def check_seed(seed: int) -> int:
  """`seed` when it is a sampling seed, an int in [0, 2**32); raises ValueError else."""
  if not 0 <= seed < SEED_RANGE:
    raise ValueError(f"seed={seed}; it must be in [0, 2**32).")
  return seed


def prompt_seeds(seed: int, n: int) -> list[int]:
  """The sampling seeds of n prompts (or requests): seed + i mod 2**32 for the i-th, so
  repeated prompts sample differently and a run is reproducible from `seed` alone."""
  check_seed(seed)
  return [(seed + i) % SEED_RANGE for i in range(n)]


def check_sampling_flags(temperature: float, top_k: int, top_p: float, seed: int) -> None:
  """Raises ValueError on sampling flags outside their ranges (before a model loads)."""
  batching.check_sampling(*(np.asarray([v]) for v in (temperature, top_k, top_p, seed)))


def budgets(max_positions: int, prompts: Sequence[Sequence[int]],
            max_new_tokens: int | None) -> list[int]:
  """Per prompt, its max_new_tokens: the flag's value, or (None) as many as fit the
  context, max_positions - len(prompt)."""
  if max_new_tokens is not None:
    return [max_new_tokens] * len(prompts)
  for i, p in enumerate(prompts):
    if len(p) >= max_positions:
      raise ValueError(f"prompt {i}: {len(p)} tokens leave no room to generate in the "
                       f"model's max_position_embeddings ({max_positions}); shorten it.")
  return [max_positions - len(p) for p in prompts]
