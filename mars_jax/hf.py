"""Hugging Face directories from outside code: the three names other programs import.

  from mars_jax import hf
  config, params = hf.load_pretrained("Qwen2.5-0.5B-Instruct", dtype=jnp.bfloat16)
  hf.save_pretrained(config, params, "out/", tokenizer=tokenizer)
  tokenizer, mask_id = hf.load_tokenizer("Qwen2.5-0.5B-Instruct", config.vocab_size)

The weight mapping, sharded safetensors, export markers and the `<|mask|>` token live in
`mars_jax.checkpoints.hf`, which the package itself imports.
"""

from mars_jax.checkpoints import hf as _hf

load_pretrained = _hf.load_pretrained
save_pretrained = _hf.save_pretrained
load_tokenizer = _hf.load_tokenizer

__all__ = ["load_pretrained", "load_tokenizer", "save_pretrained"]
