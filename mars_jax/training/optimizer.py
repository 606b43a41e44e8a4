"""AdamW with linear warmup then cosine/linear decay, global-norm clipping, weight decay.

The paper's recipe: lr 5e-6, warmup ratio 0.03, then decay to 0 over the run.
Weight decay follows the Hugging Face Trainer: every weight except biases and
norm scales. Gradient accumulation lives in the train step (exact for both loss
normalisations), not here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

DECAYS = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Schedule and AdamW settings.

  total_steps: optimizer steps of the whole run (after accumulation).
  warmup_ratio: fraction of total_steps with linear warmup from 0 (rounded up);
  warmup_steps, when set, overrides it. decay: "cosine", "linear" or "constant"
  after warmup, down to learning_rate * final_lr_ratio. max_grad_norm: global-norm
  clip threshold (None or 0: no clipping).
  """

  learning_rate: float = 5e-6
  total_steps: int = 1000
  warmup_ratio: float = 0.03
  warmup_steps: int | None = None
  decay: str = "cosine"
  final_lr_ratio: float = 0.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float | None = 1.0

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"optimizer.learning_rate={self.learning_rate}; must be > 0.")
    if self.total_steps < 1:
      raise ValueError(f"optimizer.total_steps={self.total_steps}; must be >= 1.")
    if not 0 <= self.warmup_ratio <= 1:
      raise ValueError(f"optimizer.warmup_ratio={self.warmup_ratio}; must be in [0, 1].")
    if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.total_steps:
      raise ValueError(f"optimizer.warmup_steps={self.warmup_steps}; must be in "
                       f"[0, total_steps={self.total_steps}].")
    if self.decay not in DECAYS:
      raise ValueError(f"optimizer.decay={self.decay!r}; expected one of {list(DECAYS)}.")
    if self.weight_decay < 0:
      raise ValueError(f"optimizer.weight_decay={self.weight_decay}; must be >= 0.")
    if self.max_grad_norm is not None and self.max_grad_norm < 0:
      raise ValueError(f"optimizer.max_grad_norm={self.max_grad_norm}; must be >= 0.")

  @property
  def num_warmup_steps(self) -> int:
    if self.warmup_steps is not None:
      return self.warmup_steps
    return math.ceil(self.warmup_ratio * self.total_steps)


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
  """Learning rate as a function of the optimizer step (0-based)."""
  peak = config.learning_rate
  end = peak * config.final_lr_ratio
  warmup = config.num_warmup_steps
  rest = max(config.total_steps - warmup, 1)
  if config.decay == "cosine":
    after = optax.cosine_decay_schedule(peak, rest, alpha=config.final_lr_ratio)
  elif config.decay == "linear":
    after = optax.linear_schedule(peak, end, rest)
  else:
    after = optax.constant_schedule(peak)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(params: Any) -> Any:
  """True for the weights that get weight decay: all but biases and norm scales."""
  def decays(path, _):
    name = getattr(path[-1], "key", str(path[-1]))
    return not (name.endswith("bias") or name == "scale")
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  """clip_by_global_norm (if set) -> AdamW(schedule, decoupled weight decay)."""
  adamw = optax.adamw(make_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  if not config.max_grad_norm:
    return adamw
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
