"""RoPE scaling as the published Qwen2.5 and Qwen3 `config.json` files write it
(`rope_scaling`, or transformers 5's `rope_parameters`): the frequencies each rotary
pair turns at, and the factor cos and sin are multiplied by.

  default   inv_freq_i = theta ** (-2i / d)
  linear    inv_freq_i / factor                         (positions interpolated)
  yarn      per pair, between interpolated (inv_freq / factor) and extrapolated
            (inv_freq) by a linear ramp over the pairs that turn between beta_fast
            and beta_slow times within original_max_position_embeddings; cos and sin
            scaled by 0.1 ln(factor) + 1 (or `attention_factor`)

The same formulas as transformers' `modeling_rope_utils` (YaRN, arXiv 2309.00071), so
logits past the original window equal transformers'. "dynamic" NTK is not one of them:
its frequencies follow the length of each forward, which a KV cache that keeps earlier
keys cannot.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

TYPES = ("linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A checkpoint's RoPE scaling (None on the config: the default RoPE)."""
  rope_type: str
  factor: float
  original_max_position_embeddings: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  @classmethod
  def from_hf(cls, d: dict[str, Any], source: str) -> "RopeScaling | None":
    """config.json's rope dict -> RopeScaling, or None for the default RoPE; ValueError
    naming the key for a type or a field this does not implement."""
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in ("default", None):
      return None
    if kind not in TYPES:
      raise ValueError(f"{source}: rope_type={kind!r} is not supported; implemented: "
                       f"'default', {', '.join(map(repr, TYPES))}.")
    if d.get("factor") is None or float(d["factor"]) < 1.0:
      raise ValueError(f"{source}: rope_scaling needs a 'factor' >= 1 (got "
                       f"{d.get('factor')!r}).")
    if kind == "yarn" and not d.get("original_max_position_embeddings"):
      raise ValueError(f"{source}: YaRN rope_scaling needs 'original_max_position_embeddings'.")
    fields = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
    kw = {k: d[k] for k in fields if d.get(k) is not None}
    return cls(rope_type=kind, **{**kw, "factor": float(d["factor"])})

  def to_hf(self) -> dict[str, Any]:
    """The rope dict of an exported config.json: the type's own fields, None left out."""
    if self.rope_type == "linear":
      return {"rope_type": "linear", "factor": self.factor}
    return {"rope_type": self.rope_type, **{k: v for k, v in dataclasses.asdict(self).items()
                                            if v is not None and k != "rope_type"}}


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None
                ) -> tuple[np.ndarray, float]:
  """-> (inv_freq float32[head_dim / 2], the factor on cos and sin)."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
  inv_freq = (1.0 / theta ** exponents).astype(np.float32)
  if scaling is None:
    return inv_freq, 1.0
  if scaling.rope_type == "linear":
    return inv_freq / np.float32(scaling.factor), 1.0
  return _yarn(head_dim, theta, scaling, exponents)


def _yarn(dim: int, theta: float, s: RopeScaling, exponents: np.ndarray
          ) -> tuple[np.ndarray, float]:
  def mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if s.attention_factor is not None:
    attention = s.attention_factor
  elif s.mscale and s.mscale_all_dim:
    attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
  else:
    attention = mscale(s.factor)

  def correction_dim(rotations: float) -> float:
    return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))
  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = (1 - ramp).astype(np.float32)
  pos_freqs = (theta ** exponents).astype(np.float32)
  inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  return inv_freq.astype(np.float32), float(attention)
