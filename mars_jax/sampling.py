"""Decoding from outside code: `generate`, AR or MARS over a ragged batch of prompts.

  from mars_jax import sampling
  result = sampling.generate(config, params, prompts, max_new_tokens=64,
                             mask_token_id=mask_id, eos_token_ids=(eos,), tau=0.95, window=4)
  result.tokens, result.forwards, result.tokens_per_forward

The loop and its parts live in `mars_jax.decoding` (`mars_jax.decoding.sampler` is this
function's home, which the package itself imports).
"""

from mars_jax.decoding import sampler as _sampler
from mars_jax.decoding.batching import GenerateResult

generate = _sampler.generate

__all__ = ["GenerateResult", "generate"]
