"""The tokenizer a run of a config tokenizes its data with, found without loading any
weights: an embedded tokenizer (random init), the tokenizer of model.init (an HF
directory or a run), or the `tokenizer` field's, checked to cover the model's own.
`python -m mars_jax.data.prepare` tokenizes with it; training loads the same one."""

from __future__ import annotations

import os

from mars_jax.checkpoints import hf, runs
from mars_jax.data.tokenizer import BUILDERS, build_tokenizer
from mars_jax.models import qwen2


def config_ids(config: qwen2.Qwen2Config) -> set[int]:
  """The token ids the model config names (BOS, EOS): `<|mask|>` must not take one."""
  return {i for i in (config.bos_token_id, *config.eos_token_ids) if i is not None}


def data_tokenizer(cfg):
  """The tokenizer a run of `cfg` tokenizes its data with (what `run` trains with,
  `<|mask|>` added), without loading weights: `python -m mars_jax.data.prepare`."""
  init = cfg.model.init
  if init == "random":
    if cfg.tokenizer in (None, *BUILDERS):
      return build_tokenizer(cfg.tokenizer or "char")
    config = qwen2.preset(cfg.model.preset, **cfg.model.overrides.to_dict())
    return hf.load_tokenizer(cfg.tokenizer, config.vocab_size,
                             reserved_ids=config_ids(config))[0]
  if os.path.isfile(os.path.join(init, "config.json")):
    config, tok_dir = hf.Qwen2Config.from_json_file(os.path.join(init, "config.json")), init
  else:
    run_dir = runs.resolve_checkpoint(init)[0]
    config = runs.config_from_layout(runs.read_layout(run_dir))[0]
    tok_dir = runs.tokenizer_dir(run_dir)
  own = hf.load_tokenizer(tok_dir, config.vocab_size)[0]
  if cfg.tokenizer in (None, *BUILDERS):
    return own
  return hf.load_tokenizer(cfg.tokenizer, config.vocab_size, reserved_ids=config_ids(config),
                           model_tokenizer=own, model_where=f"model.init={init}")[0]
