"""A MARS export served by vLLM as its own parallel drafter: the config key vLLM reads the
mask id from, the speculative config, and the `vllm serve` command.

vLLM's draft-model speculation with `"parallel_drafting": true` (PARD) feeds the drafter
`[last token | mask x (K - 1)]` under causal attention and takes its K outputs as the
proposals, then verifies them with the target model: MARS's own decoding layout, so a
MARS model drafts for itself. vLLM finds the mask id in the drafter's config.json under
`pard_token`, which every MARS export writes (`python -m mars_jax.export`).

K (`num_speculative_tokens`) is the trained window, B + 1 for MARS block size B: the
first proposal is the model's own next token (the target's own, when greedy), the B
masks after it are the ones MARS trained (docs/serving.md, "MARS checkpoints in
vLLM", has the measured acceptance by K).
"""

from __future__ import annotations

import json
import os
import shlex

PARD_TOKEN = "pard_token"   # the config.json key of vLLM's parallel drafting
DEFAULT_BLOCK_SIZE = 4      # configs/tiny.py's and the paper's B, when a model has no record


def draft_tokens(block_size: int | None) -> int:
  """K for a model trained with MARS block size B (None: no record, the default B)."""
  return (block_size or DEFAULT_BLOCK_SIZE) + 1


def read_pard_token(model_dir: str) -> int | None:
  """DIR/config.json's `pard_token` (None when it has none)."""
  with open(os.path.join(model_dir, "config.json")) as f:
    return json.load(f).get(PARD_TOKEN)


def speculative_config(model_dir: str, k: int) -> dict:
  """vLLM's --speculative-config: the model at `model_dir` drafts K tokens in parallel."""
  return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": k,
          "parallel_drafting": True}


def serve_args(model_dir: str, k: int) -> list[str]:
  """`vllm serve DIR --speculative-config JSON` as argv (add host, port, dtype, ...)."""
  return ["vllm", "serve", model_dir, "--speculative-config",
          json.dumps(speculative_config(model_dir, k))]


def serve_command(model_dir: str, k: int) -> str:
  """`serve_args` as one shell line, quoted."""
  return shlex.join(serve_args(model_dir, k))


def note(model_dir: str, pard_token: int | None, block_size: int | None) -> str:
  """What an export's log says of serving `model_dir` with vLLM: the command (with the
  directory's absolute path, to run from anywhere), or why it runs there as a plain
  model (no `pard_token`: not a MARS model)."""
  if pard_token is None:
    return (f"{model_dir} has no {PARD_TOKEN} (not a MARS model): vLLM serves it as a "
            "plain model, without parallel drafting.")
  k = draft_tokens(block_size)
  return (f"serve it with vLLM, the model as its own parallel drafter ({k} tokens a "
          f"step, {PARD_TOKEN} {pard_token}; docs/serving.md):\n  "
          + serve_command(os.path.abspath(model_dir), k))
