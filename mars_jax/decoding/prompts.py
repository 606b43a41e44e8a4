"""Prompts from a user and their per-prompt settings, shared by the CLIs that decode
(generate, evaluate, lm_eval): prompt files read and encoded, sampling seeds and token
budgets checked before a model loads, and the sampling flags."""

from __future__ import annotations

import argparse
import json
from typing import Sequence

import numpy as np

from mars_jax.decoding import batching
from mars_jax.decoding.loading import chat_prompt_ids

SEED_RANGE = 1 << 32  # seeds are uint32


def read_prompts(path: str) -> list[list[dict]]:
  """JSONL of {"prompt"} or {"messages"} -> chats (trailing assistant turn dropped)."""
  chats = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      record = json.loads(line)
      if "messages" in record:
        messages = list(record["messages"])
        if messages and messages[-1]["role"] == "assistant":
          messages.pop()
      elif "prompt" in record:
        messages = [{"role": "user", "content": record["prompt"]}]
      else:
        raise ValueError(f"{path}:{n}: expected a 'prompt' or 'messages' key.")
      chats.append(messages)
  return chats


def encode(tokenizer, chats: Sequence[list[dict]], *, raw: bool) -> list[list[int]]:
  if raw:
    return [tokenizer.encode("".join(m["content"] for m in c), add_special_tokens=False)
            for c in chats]
  return [chat_prompt_ids(tokenizer, c) for c in chats]


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


def add_sampling_flags(p: argparse.ArgumentParser, seed_flag: str, seed_help: str) -> None:
  """--temperature, --top-k, --top-p and the sampling seed flag (named `seed_flag`)."""
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled")
  p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="sample within the top-p probability mass (1.0: off)")
  p.add_argument(seed_flag, type=int, default=0, help=seed_help)
