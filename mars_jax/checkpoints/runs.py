"""Run directories: what a training run writes beside its orbax checkpoints, and reading a
run's params back for any user (training, decoding, export), below all of them.

  RUN_DIR/layout.json              model config, runtime (dtypes, scan) and objective of the run
  RUN_DIR/tokenizer/               tokenizer files (with `<|mask|>`), when known
  RUN_DIR/checkpoints/<step>/      orbax items: params, opt (optimizer state + step)
  RUN_DIR/data_state/<step>/process_<i>.json   each process's data-iterator state

A run in stages (`mars_jax.experiments.stages.run`) is WORKDIR/stage1, WORKDIR/stage2:
`last_stage` and `resolve_checkpoint` read its top directory as its last stage. Writing
checkpoints during training is `mars_jax.training.checkpoint.RunCheckpointer`'s.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from mars_jax.models import lora
from mars_jax.models.qwen2 import Qwen2Config, Runtime, abstract_params, relayout

LAYOUT_FILE = "layout.json"
_STAGE = re.compile(r"stage(\d+)")  # a stage's run directory under a run in stages
# Facts that change what a checkpoint means; a resumed run must agree on them.
_LAYOUT_KEYS = ("model", "objective")
# Runtime fields a resumed run must keep: the stored tree and the precision it trains at.
_RUNTIME_KEYS = ("param_dtype", "dtype", "scan_layers", "lora")


def model_layout(config: Qwen2Config, runtime: Runtime) -> dict[str, Any]:
  """The model and runtime parts of layout.json: the HF config, and how the run stores
  and computes it (param dtype, compute dtype, attention, remat, scan)."""
  return {"model": config.to_hf_dict(torch_dtype=runtime.param_dtype),
          "runtime": runtime.to_dict()}


def _layout_diffs(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
  diffs = [(k, old.get(k), new.get(k)) for k in _LAYOUT_KEYS
           if k in old and old.get(k) != new.get(k)]
  old_rt, new_rt = old.get("runtime", {}), new.get("runtime", {})
  return diffs + [(f"runtime.{k}", old_rt.get(k), new_rt.get(k)) for k in _RUNTIME_KEYS
                  if k in old_rt and old_rt.get(k) != new_rt.get(k)]


def write_layout(run_dir: str, layout: dict[str, Any]) -> None:
  """Writes layout.json, or checks an existing one agrees (a resumed or reused run dir)."""
  path = os.path.join(run_dir, LAYOUT_FILE)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    diffs = _layout_diffs(old, layout)
    if diffs:
      detail = "; ".join(f"{k}: checkpoint has {a!r}, config asks {b!r}" for k, a, b in diffs)
      raise ValueError(f"{path}: this run directory holds a different run ({detail}). Use a "
                       "fresh --workdir, or start a new stage from it with "
                       "model.init=<this run dir>.")
    return
  if jax.process_index() == 0:
    os.makedirs(run_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(layout, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def read_layout(run_dir: str) -> dict[str, Any]:
  path = os.path.join(run_dir, LAYOUT_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: not a mars_jax run directory (no {LAYOUT_FILE}).")
  with open(path) as f:
    return json.load(f)


def config_from_layout(layout: dict[str, Any]) -> tuple[Qwen2Config, Runtime]:
  """-> (model config, the runtime the run trained with)."""
  m = layout["model"]
  if "runtime" in layout:
    runtime = Runtime(**layout["runtime"])
  else:  # runs written before the runtime had its own record
    runtime = Runtime(param_dtype=m["param_dtype"], scan_layers=m["scan_layers"])
  return Qwen2Config.from_hf_dict(m, source=LAYOUT_FILE), runtime


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """A pytree of arrays or `jax.ShapeDtypeStruct`s -> `ShapeDtypeStruct`s of the same
  shapes and dtypes carrying `shardings` (a matching pytree of `jax.sharding.Sharding`):
  an orbax restore target that places each array as its sharding says."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def last_stage(path: str) -> str:
  """`path`, or for the top directory of a run in stages (`experiment.run` with stage 1:
  WORKDIR/stage1, WORKDIR/stage2) its last stage's run directory, the highest
  WORKDIR/stageN that holds a layout.json. FileNotFoundError when nothing is at `path`."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such directory.")
  if not os.path.isdir(path) or os.path.isfile(os.path.join(path, LAYOUT_FILE)):
    return path
  stages = [(int(m.group(1)), m.group(0)) for m in map(_STAGE.fullmatch, os.listdir(path))
            if m and os.path.isfile(os.path.join(path, m.group(0), LAYOUT_FILE))]
  return os.path.join(path, max(stages)[1]) if stages else path


def resolve_checkpoint(path: str) -> tuple[str, int]:
  """RUN_DIR, RUN_DIR/<step> (or RUN_DIR/checkpoints/<step>), or the top directory of a
  run in stages (its last stage, `last_stage`) -> (run_dir, step)."""
  given = path.rstrip("/") or "/"
  path = os.path.abspath(given)
  base = os.path.basename(path)
  if base.isdigit():
    parent = os.path.dirname(path)
    run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    step = int(base)
    if not os.path.isdir(os.path.join(run_dir, "checkpoints", base)):
      raise FileNotFoundError(f"{path}: no checkpoint step {step} in {run_dir}/checkpoints.")
    return run_dir, step
  path = os.path.abspath(last_stage(given))
  read_layout(path)
  steps = ocp.utils.checkpoint_steps(os.path.join(path, "checkpoints")) if os.path.isdir(
      os.path.join(path, "checkpoints")) else []
  if not steps:
    raise FileNotFoundError(f"{path}: run directory has no finished checkpoint.")
  return path, max(steps)


def load_params(path: str, *, runtime: Runtime | None = None, shardings: Any = None,
                merge_adapters: bool = True) -> tuple[Qwen2Config, Runtime, Any]:
  """Params of a training checkpoint (RUN_DIR = latest step, or RUN_DIR/<step>).

  -> (model config, runtime, params). `runtime`: how the caller will compute the
  params (default: the runtime the run trained with); the params come in its
  param dtype and layer layout. `shardings`: a pytree of `jax.sharding.Sharding`
  matching the stored params (default: all on the first local device). Works on
  checkpoints written by any number of processes. A LoRA run's adapters and mask row
  come merged into the weights (`lora.merge`, in float32), and the runtime returned
  has no `lora`: every reader of a run computes the adapted model as a plain one.
  `merge_adapters=False` keeps them apart (the runtime then keeps the run's `lora`).
  """
  run_dir, step = resolve_checkpoint(path)
  config, stored = config_from_layout(read_layout(run_dir))
  abstract = abstract_params(config, runtime=stored)
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  abstract = with_shardings(abstract, shardings)
  with ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"), item_names=("params",),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mgr:
    out = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  runtime = runtime or stored
  if not merge_adapters:
    return config, runtime.replace(lora=stored.lora), relayout(out.params, runtime)
  runtime = lora.without_lora(runtime)
  return config, runtime, relayout(lora.merge(out.params, stored.lora), runtime)


def tokenizer_dir(run_dir: str) -> str:
  return os.path.join(run_dir, "tokenizer")
