"""Load a model for inference from an HF directory or a training run (checkpoint).

  load_model(path, runtime=None, mesh=None) -> LoadedModel(config, runtime, params,
                                      tokenizer, mask_token_id, eos_token_ids, mesh)

`path` is an HF directory (config.json + safetensors + tokenizer files), a run
directory (its latest checkpoint), RUN_DIR/<step>, or the top directory of a run in
stages (its last stage's run). The params come in the
layout of `runtime` (default: float32 for an HF directory, the run's own runtime
for a run), which the model is then computed with. With a `mesh` they are placed
with the decode shardings (`mars_jax.decoding.mesh`): a checkpoint is restored
straight into them, an HF directory is staged on the host (CPU) device first, so no
accelerator holds the whole model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from mars_jax.checkpoints import hf
from mars_jax.checkpoints import runs
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.decoding import speculative
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime


@dataclasses.dataclass
class LoadedModel:
  config: Qwen2Config
  runtime: Runtime
  params: Any
  tokenizer: Any
  mask_token_id: int
  eos_token_ids: tuple[int, ...]
  mesh: Mesh | None = None  # where the params are placed (None: one device)


def eos_token_ids(tokenizer, config: Qwen2Config, model_dir: str | None = None
                  ) -> tuple[int, ...]:
  """EOS ids of the config, `generation_config.json` (when in `model_dir`), the chat turn
  end (`<|im_end|>`) and the tokenizer's EOS, deduplicated, within the vocabulary."""
  ids = list(config.eos_token_ids)
  eos = (hf.read_generation_config(model_dir) or {}).get("eos_token_id") if model_dir else None
  ids += [eos] if isinstance(eos, int) else list(eos or [])
  for tok in ("<|im_end|>", tokenizer.eos_token):
    if tok is not None and tok in tokenizer.get_vocab():
      ids.append(tokenizer.convert_tokens_to_ids(tok))
  return tuple(dict.fromkeys(i for i in ids if i is not None and i < config.vocab_size))


def _host_device():
  """The CPU device (None where the CPU platform is off): where an HF directory's
  weights are staged before they are split over a mesh."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


def load_model(path: str, *, runtime: Runtime | None = None,
               mesh: Mesh | None = None) -> LoadedModel:
  """Config, runtime, params and tokenizer (with `<|mask|>`) from an HF dir or a run;
  mesh: place the params for decoding on it (None: the first device)."""
  if os.path.isfile(os.path.join(path, "config.json")):
    runtime = runtime or DEFAULT_RUNTIME
    with jax.default_device(_host_device() if mesh is not None else None):
      config, params = hf.load_pretrained(path, dtype=runtime.param_dtype,
                                          scan_layers=runtime.scan_layers)
    tok_dir = path
  else:
    shardings = None
    if mesh is not None:
      stored_config, stored = runs.config_from_layout(
          runs.read_layout(runs.resolve_checkpoint(path)[0]))
      shardings = decode_mesh.param_shardings(stored_config, mesh, stored)
    config, runtime, params = runs.load_params(path, runtime=runtime,
                                                     shardings=shardings)
    tok_dir = runs.tokenizer_dir(runs.resolve_checkpoint(path)[0])
    if not os.path.isdir(tok_dir):
      raise FileNotFoundError(f"{tok_dir}: the run saved no tokenizer; export it with a "
                              "tokenizer or pass an HF directory.")
  if mesh is not None:
    params = decode_mesh.place_params(config, params, mesh, runtime)
  tokenizer, mask_id = hf.load_tokenizer(tok_dir, config.vocab_size)
  return LoadedModel(config, runtime, params, tokenizer, mask_id,
                     eos_token_ids(tokenizer, config, tok_dir), mesh)


def model_path(path: str) -> str:
  """A CLI's --model or --checkpoint -> the path to read: `path`, or the last stage of a
  run in stages (`runs.last_stage`), which it names on stderr. FileNotFoundError
  when nothing is at `path`."""
  stage = runs.last_stage(path)
  if stage != path:
    print(f"{path}: a run in stages; reading its last stage, {stage}", file=sys.stderr)
  return stage


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
  """A chat (role/content turns) in the tokenizer's template plus the assistant header
  (unless add_generation_prompt is false); template_kwargs: the template's extra
  variables (Qwen3's enable_thinking)."""
  return list(tokenizer.apply_chat_template(
      list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
      return_dict=True, **template_kwargs)["input_ids"])


def trained_block_size(path: str) -> int | None:
  """The MARS block size B the model at `path` was trained with: the objective in a
  run's layout.json, or in the marker of an HF directory mars_jax exported. None when
  there is no record, or the model is not a MARS run."""
  try:
    if os.path.isfile(os.path.join(path, "config.json")):
      objective = (hf.read_export_marker(path) or {}).get("source", {}).get("objective")
    else:
      objective = runs.read_layout(runs.resolve_checkpoint(path)[0]).get(
          "objective")
  except (OSError, ValueError, AttributeError):
    return None
  if not isinstance(objective, dict) or objective.get("kind") != "mars":
    return None
  block = objective.get("block_size")
  return block if isinstance(block, int) else None


def warn_untrained_windows(path: str, windows: Sequence[int]) -> None:
  """Logs a warning when a window exceeds B + 1 of the MARS run at `path` (B known)."""
  block = trained_block_size(path)
  over = sorted({w for w in windows if block is not None and w > block + 1})
  if over:
    logging.getLogger(__name__).warning(
        "window %s > block size + 1 = %d: %s was trained with MARS block size B=%d, so "
        "proposals past the first B+1 were never trained (expect fewer accepted tokens "
        "per forward); use a window <= %d.", ",".join(map(str, over)), block + 1, path,
        block, block + 1)


def trained_window(path: str, cap: int) -> int:
  """The window the model at `path` drafts or verifies with by default: a MARS run's
  B + 1, at most `cap`; 1 for a model not trained with MARS."""
  block = trained_block_size(path)
  return 1 if block is None else min(block + 1, cap)


def check_same_tokenizer(target, drafter, target_where: str, drafter_where: str) -> None:
  """Raises ValueError when the drafter's tokenizer is not the target's: a token of
  either vocabulary (special and added tokens included) missing from the other or at
  another id, `<|mask|>` aside (an AR model has none; a MARS run added its own). The
  embedding row counts may differ."""
  def vocab(tok):
    return {t: i for t, i in tok.get_vocab().items() if t != hf.MASK_TOKEN}
  want, have = vocab(target), vocab(drafter)
  if want == have:
    return
  differ = sorted((i, t) for t, i in want.items() if have.get(t) != i)
  extra = sorted((i, t) for t, i in have.items() if t not in want)
  shown = [f"{t!r} ({i})" for i, t in (differ + extra)[:5]]
  raise ValueError(
      f"{drafter_where}: the drafter's tokenizer is not the target's ({target_where}): "
      f"{len(differ)} of the target's tokens are missing or at other ids and {len(extra)} "
      f"are extra, e.g. {', '.join(shown)}. A drafter must share the target's tokenizer "
      "(vocabulary and special tokens).")


def load_drafter(path: str, target: LoadedModel, target_path: str, *, draft_window: int,
                 window: int | None = None, runtime: Runtime | None = None
                 ) -> speculative.Drafter:
  """The drafter at `path` for `target` (loaded from `target_path`), its tokenizer checked
  against the target's. window: its drafting window (None: a MARS run's trained B + 1, at
  most draft_window; 1, AR drafting, for a model that was not trained with MARS)."""
  if target.mesh is not None:
    raise ValueError("decoding with a drafter runs on one device; drop --mesh.")
  model = load_model(path, runtime=runtime)
  check_same_tokenizer(target.tokenizer, model.tokenizer, target_path, path)
  if window is None:
    window = trained_window(path, draft_window)
  else:
    warn_untrained_windows(path, [window])
  return speculative.Drafter(model.config, model.params, model.mask_token_id, model.runtime,
                             window)
