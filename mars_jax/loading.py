"""Load a model for inference from an HF directory or a training run (checkpoint).

  load_model(path) -> LoadedModel(config, params, tokenizer, mask_token_id, eos_token_ids)

`path` is an HF directory (config.json + safetensors + tokenizer files), a run
directory (its latest checkpoint), or RUN_DIR/<step>.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mars_jax import checkpoint, hf
from mars_jax.models.qwen2 import Qwen2Config


@dataclasses.dataclass
class LoadedModel:
  config: Qwen2Config
  params: Any
  tokenizer: Any
  mask_token_id: int
  eos_token_ids: tuple[int, ...]


def eos_token_ids(tokenizer, config: Qwen2Config, model_dir: str | None = None
                  ) -> tuple[int, ...]:
  """EOS ids of the config, `generation_config.json` (when in `model_dir`), the chat turn
  end (`<|im_end|>`) and the tokenizer's EOS, deduplicated, within the vocabulary."""
  ids = list(config.eos_token_ids)
  gen = os.path.join(model_dir or "", "generation_config.json")
  if model_dir and os.path.isfile(gen):
    with open(gen) as f:
      eos = json.load(f).get("eos_token_id")
    ids += [eos] if isinstance(eos, int) else list(eos or [])
  for tok in ("<|im_end|>", tokenizer.eos_token):
    if tok is not None and tok in tokenizer.get_vocab():
      ids.append(tokenizer.convert_tokens_to_ids(tok))
  return tuple(dict.fromkeys(i for i in ids if i is not None and i < config.vocab_size))


def load_model(path: str, *, dtype: str = "float32", **runtime) -> LoadedModel:
  """Config, params and tokenizer (with `<|mask|>`) from an HF dir or a training run.

  `dtype` is the parameter dtype of an HF directory (a run loads in its own)."""
  if os.path.isfile(os.path.join(path, "config.json")):
    config, params = hf.load_pretrained(path, dtype=dtype, **runtime)
    tok_dir = path
  else:
    config, params = checkpoint.load_params(path, **runtime)
    tok_dir = checkpoint.tokenizer_dir(checkpoint.resolve_checkpoint(path)[0])
    if not os.path.isdir(tok_dir):
      raise FileNotFoundError(f"{tok_dir}: the run saved no tokenizer; export it with a "
                              "tokenizer or pass an HF directory.")
  tokenizer, mask_id = hf.load_tokenizer(tok_dir, config.vocab_size)
  return LoadedModel(config, params, tokenizer, mask_id,
                     eos_token_ids(tokenizer, config, tok_dir))


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
  """A chat (role/content turns) in the tokenizer's template plus the assistant header."""
  return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
