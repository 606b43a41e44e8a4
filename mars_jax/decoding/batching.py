"""The decoding loop's host side: checks, prompt buckets, results.

Every caller of the loop (`sampling.generate`, the window-policy rounds and
`serve.Server`) lays its prompts out with `bucket`: rows padded to a power of two
(padding rows have max_new_tokens 0, so they start done), prompts right-padded to
a power-of-two width (>= MIN_PROMPT_BUCKET), one budget and one set of controls
(`loop.Controls`: gate, sampling, seed, stop ids) per row. Powers of two bound the
compiled variants of the loop (see `mars_jax.decoding.loop`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from mars_jax.core import choices
from mars_jax.decoding import gates
from mars_jax.core.choices import Metric, Mode
from mars_jax.decoding.loop import STOP_BUCKET, Controls, DecodeState
from mars_jax.models.qwen2 import Qwen2Config

MIN_PROMPT_BUCKET = 8
EOS_BUCKET = 8
FINISH_REASONS = ("eos", "stop", "length")


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """What `generate` returns.

  tokens: one continuation per prompt, up to and including its EOS or stop id, or
    the token that completed a stop string; nothing decoded after it.
  num_forwards: per prompt, the forwards it took part in (prefill included) up to the
    one that committed its last token.
  forwards: forwards run for the whole batch (the longest sample's count).
  windows: forwards run for the batch at each window W.
  finish_reasons: per prompt, "eos" (an EOS id ended it), "stop" (a stop id or stop
    string), or "length" (max_new_tokens reached).
  texts: per prompt, when a tokenizer was given: the decoded continuation (special
    tokens skipped) without its final EOS or stop id, cut before the first stop string.
  drafter_forwards: with a drafter (`mars_jax.decoding.speculative`), per prompt, the
    drafter forwards it drafted in; drafter_steps: drafter forwards run for the batch.
    `forwards` and `num_forwards` then count the target's.
  """
  tokens: list[list[int]]
  num_forwards: list[int]
  forwards: int
  windows: dict[int, int] = dataclasses.field(default_factory=dict)
  finish_reasons: list[str] = dataclasses.field(default_factory=list)
  texts: list[str] | None = None
  drafter_forwards: list[int] = dataclasses.field(default_factory=list)
  drafter_steps: int = 0

  @property
  def num_tokens(self) -> list[int]:
    return [len(t) for t in self.tokens]

  @property
  def tokens_per_forward(self) -> float:
    """Generated tokens per forward of a sample (1.0 for AR), over the batch."""
    return sum(self.num_tokens) / max(sum(self.num_forwards), 1)

  @property
  def drafter_forwards_per_token(self) -> float:
    """Drafter forwards per generated token, over the batch (0.0 without a drafter)."""
    return sum(self.drafter_forwards) / max(sum(self.num_tokens), 1)


def pow2(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def eos_array(eos_token_ids: int | Sequence[int]) -> np.ndarray:
  """EOS ids -> int32[e] padded with -1 to a power of two (>= EOS_BUCKET)."""
  ids = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else list(eos_token_ids)
  out = np.full((pow2(len(ids), EOS_BUCKET),), -1, np.int32)
  out[:len(ids)] = ids
  return out


def ids_per_prompt(ids, n: int, name: str) -> list[list[int]]:
  """One id list for every prompt (ints), or one list per prompt -> n int lists."""
  ids = list(ids or ())
  if not ids or all(isinstance(i, (int, np.integer)) for i in ids):
    return [[int(i) for i in ids]] * n
  if len(ids) != n:
    raise ValueError(f"{name}: {len(ids)} lists for {n} prompts; pass one list of ids, or "
                     "one list per prompt.")
  return [[int(i) for i in row] for row in ids]


def per_prompt(value, n: int, name: str, dtype) -> np.ndarray:
  """A scalar, or one value per prompt -> dtype[n]."""
  out = np.broadcast_to(np.asarray(value, dtype), (n,)) if np.ndim(value) == 0 else (
      np.asarray(value, dtype))
  if out.shape != (n,):
    raise ValueError(f"{name}: {len(out)} values for {n} prompts; pass one, or one per "
                     "prompt.")
  return out


def check_args(config: Qwen2Config, *, window: int, mode: Mode, mask_token_id: int) -> None:
  """Raises ValueError on a window, mode or mask id the sampler rejects."""
  if window < 1:
    raise ValueError(f"window={window}; it must be >= 1 (1 is plain AR decoding).")
  choices.check(Mode, mode, "mode")
  if not 0 <= mask_token_id < config.vocab_size:
    raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary "
                     f"(vocab_size {config.vocab_size}); use hf.load_tokenizer's id.")


def check_prompt_ids(config: Qwen2Config, prompts: Sequence[Sequence[int]]) -> None:
  """Raises ValueError when a prompt holds a token id outside [0, vocab_size)."""
  for i, p in enumerate(prompts):
    ids = np.asarray(p)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt {i}: token ids must be integers, got {ids.dtype}.")
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
      raise ValueError(
          f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, "
          f"{config.vocab_size}); encode prompts with the model's own tokenizer.")


def check_prompts(config: Qwen2Config, prompts: Sequence[Sequence[int]], max_new_tokens
                   ) -> np.ndarray:
  """-> the per-prompt budgets int32[len(prompts)]; raises on empty prompts or budgets,
  token ids outside the vocabulary, and sequences longer than the model's positions."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts must be a non-empty list of non-empty token lists.")
  budget = per_prompt(max_new_tokens, len(prompts), "max_new_tokens", np.int32)
  if np.any(budget < 1):
    raise ValueError(f"max_new_tokens={budget.tolist()}; it must be >= 1.")
  check_prompt_ids(config, prompts)
  total = np.asarray([len(p) for p in prompts]) + budget
  i = int(np.argmax(total))
  if total[i] > config.max_position_embeddings:
    raise ValueError(
        f"prompt {i}: {len(prompts[i])} prompt tokens + max_new_tokens {int(budget[i])} = "
        f"{int(total[i])} exceeds the model's max_position_embeddings "
        f"({config.max_position_embeddings}); lower max_new_tokens or shorten the prompt.")
  return budget


def check_sampling(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                   seed: np.ndarray) -> None:
  """Raises ValueError on sampling controls outside their ranges."""
  if not np.all(np.isfinite(temperature) & (temperature >= 0)):
    raise ValueError(f"temperature={temperature.tolist()}; it must be >= 0 (0: greedy).")
  if np.any(top_k < 0):
    raise ValueError(f"top_k={top_k.tolist()}; it must be >= 0 (0: off).")
  if not np.all((top_p > 0) & (top_p <= 1)):
    raise ValueError(f"top_p={top_p.tolist()}; it must be in (0, 1] (1.0: off).")
  if np.any((seed < 0) | (seed >= 1 << 32)):
    raise ValueError(f"seed={seed.tolist()}; it must be in [0, 2**32).")


def controls(n: int, rows: int, *, tau=1.0, metric: Metric | Sequence[Metric] = "probability",
             temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_token_ids=(),
             window=0, lossless=False, min_p=0.0, ignore_eos=False,
             stop_width: int | None = None) -> Controls:
  """The `loop.Controls` of n prompts in the first n of `rows` rows (the rest padding);
  each argument one value, or one per prompt (stop_token_ids: one id list, or one per
  prompt). window: tokens per forward at most (0: the step's W); lossless: verified,
  not gated (under the lossless kernel); min_p: the min-p cut (0: off); ignore_eos: EOS
  does not end the sample. stop_width: stop ids per row (default: a
  power of two >= STOP_BUCKET that holds them; a state's width when inserting into
  it)."""
  def pad(values, fill=0):
    return np.pad(values, (0, rows - n), constant_values=fill)
  sample = [per_prompt(temperature, n, "temperature", np.float64),
            per_prompt(top_k, n, "top_k", np.int64), per_prompt(top_p, n, "top_p", np.float64),
            per_prompt(seed, n, "seed", np.int64)]
  check_sampling(*sample)
  min_ps = per_prompt(min_p, n, "min_p", np.float64)
  if np.any(~((min_ps >= 0) & (min_ps <= 1))):
    raise ValueError(f"min_p={min_ps.tolist()}; expected values in [0, 1] (0: off).")
  caps = per_prompt(window, n, "window", np.int32)
  if np.any(caps < 0):
    raise ValueError(f"window={caps.tolist()}; a sample's window must be >= 1 (0: the "
                     "step's W).")
  stops = ids_per_prompt(stop_token_ids, n, "stop_token_ids")
  width = stop_width or pow2(max(map(len, stops)), STOP_BUCKET)
  if max(map(len, stops)) > width:
    raise ValueError(f"{max(map(len, stops))} stop token ids; at most {width} per request.")
  stop_ids = np.full((rows, width), -1, np.int32)
  for i, row in enumerate(stops):
    stop_ids[i, :len(row)] = row
  return Controls(tau=pad(per_prompt(tau, n, "tau", np.float32), 1.0),
                  metric=pad(gates.metric_ids(metric, n)),
                  temperature=pad(sample[0].astype(np.float32)),
                  top_k=pad(sample[1].astype(np.int32)),
                  top_p=pad(sample[2].astype(np.float32), 1.0),
                  seed=pad(sample[3].astype(np.uint32)), stop_ids=stop_ids,
                  window=pad(caps),
                  lossless=pad(per_prompt(lossless, n, "lossless", bool)),
                  min_p=pad(min_ps.astype(np.float32)),
                  ignore_eos=pad(per_prompt(ignore_eos, n, "ignore_eos", bool)))


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Prompts laid out for the loop, b rows (a power of two) of width P.

  prompt: int32[b, P] right-padded; prompt_len: int32[b] (1 on padding rows);
  max_new_tokens: int32[b] (0 on padding rows: they start done);
  controls: `loop.Controls` of b rows (padding rows: greedy, exact AR).
  """
  prompt: np.ndarray
  prompt_len: np.ndarray
  max_new_tokens: np.ndarray
  controls: Controls

  def cache_len(self, window: int, max_positions: int | None = None) -> int:
    """Cache slots for every row's prompt + budget + W - 1: a power of two >= P, capped
    at max_positions + W - 1 (a budget that fills the model's context, max_positions,
    would otherwise double the cache)."""
    need = int(np.max(self.prompt_len + self.max_new_tokens)) + window - 1
    slots = pow2(need, self.prompt.shape[1])
    if max_positions is None:
      return slots
    return max(self.prompt.shape[1], min(slots, max_positions + window - 1))


def bucket(prompts: Sequence[Sequence[int]], rows: int, *, max_new_tokens,
           width: int | None = None, **controls_kw) -> Bucket:
  """n prompts in the first n of `rows` rows (rows >= n), `width` slots wide (default:
  the longest prompt's power of two, at least MIN_PROMPT_BUCKET); max_new_tokens and
  the controls (tau, metric, temperature, top_k, top_p, seed, stop_token_ids; see
  `controls`): one value, or one per prompt (as `sampling.generate`)."""
  n = len(prompts)
  longest = max(map(len, prompts))
  if width is not None and width < longest:
    raise ValueError(f"width={width} is below the longest prompt ({longest}).")
  prompt = np.zeros((rows, width or pow2(longest, MIN_PROMPT_BUCKET)), np.int32)
  lens = np.ones((rows,), np.int32)
  for i, p in enumerate(prompts):
    prompt[i, :len(p)] = p
    lens[i] = len(p)

  def pad(values, fill=0):
    return np.pad(values, (0, rows - n), constant_values=fill)
  return Bucket(prompt, lens, pad(per_prompt(max_new_tokens, n, "max_new_tokens", np.int32)),
                controls(n, rows, **controls_kw))


def finish_reason(tokens: Sequence[int], eos_ids, stop_ids, *, stopped: bool) -> str:
  """"eos", "stop" or "length" for a finished continuation; stopped: a stop string
  ended it. eos_ids, stop_ids: int arrays (entries < 0 are padding)."""
  last = tokens[-1] if tokens else -1
  if stopped:
    return "stop"
  if last >= 0 and last in set(np.asarray(eos_ids).tolist()):
    return "eos"
  return "stop" if last >= 0 and last in set(np.asarray(stop_ids).tolist()) else "length"


def results(state: DecodeState, n: int, windows: dict[int, int] | None = None, *,
            eos_ids=(), stopped: Sequence[bool] = ()) -> GenerateResult:
  """The `GenerateResult` of the first `n` rows of a final `DecodeState` (texts unset).
  eos_ids: the EOS ids decoded with; stopped: per row, whether a stop string ended it."""
  seq, start, end, fwd, steps, stop_ids = jax.device_get(
      (state.seq, state.prompt_len, state.length, state.forwards, state.steps,
       state.controls.stop_ids))
  tokens = [seq[i, start[i]:end[i]].tolist() for i in range(n)]
  stopped = list(stopped) or [False] * n
  return GenerateResult(
      tokens=tokens, num_forwards=fwd[:n].tolist(), forwards=int(steps),
      windows=dict(windows or {}),
      finish_reasons=[finish_reason(t, eos_ids, stop_ids[i], stopped=stopped[i])
                      for i, t in enumerate(tokens)])
