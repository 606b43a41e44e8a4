"""The package's named choices: one `Literal` type each, checked by one function.

  Mode           sampler: "gated" (MASK proposals committed while their gate holds)
                 or "lossless" (drafts verified by the next forward)
  Metric         gate statistic: "probability", "margin", "entropy" (`mars_jax.decoding.gates`)
  Kind           objective: "mars" (two streams) or "ar_sft" (plain causal)
  IntraBlock     noisy-stream attention inside a block: "causal" (MARS) or
                 "bidirectional" (Block Diffusion)
  Normalization  loss weights: "sequence" or "token" (`mars_jax.training.objective`)
  Remat          decoder-layer rematerialisation policy (`mars_jax.models.qwen2`)
  AttentionImpl  "xla" (einsum), "dot_product_attention" (`jax.nn.dot_product_attention`),
                 "cudnn" (the same, forced to cuDNN), "splash" (JAX's Pallas TPU
                 splash kernel, `mars_jax.models.splash`), "flash" (blockwise, the
                 mask from per-token vectors, `mars_jax.models.flash`), "auto" ("flash"
                 from 4096 positions a pass on; below them splash where the step is
                 compiled for TPU, "xla" elsewhere)

Signatures annotate with these types; the entry points that take a choice from a
user (configs, CLIs, `sampling.generate`) call `check`, whose error names the
field and the allowed values.
"""

from __future__ import annotations

import typing
from typing import Literal

Mode = Literal["gated", "lossless"]
Metric = Literal["probability", "margin", "entropy"]
Kind = Literal["mars", "ar_sft"]
IntraBlock = Literal["causal", "bidirectional"]
Normalization = Literal["sequence", "token"]
Remat = Literal["none", "full", "dots", "dots_with_no_batch_dims", "names"]
AttentionImpl = Literal["xla", "dot_product_attention", "cudnn", "splash", "flash", "auto"]


def values(choice: typing.Any) -> tuple[str, ...]:
  """The allowed values of a choice type, in their documented order."""
  return typing.get_args(choice)


def check(choice: typing.Any, value: typing.Any, name: str) -> str:
  """-> value when it is one of the choice's values; else ValueError
  "{name}={value!r}; expected one of [...]"."""
  allowed = values(choice)
  if value not in allowed:
    raise ValueError(f"{name}={value!r}; expected one of {list(allowed)}.")
  return value
