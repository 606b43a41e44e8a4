"""Orbax checkpoints of a training run as it trains: params, optimizer state, data-iterator
state, saved and restored. The run directory's layout and reading it back are
`mars_jax.checkpoints.runs`'s:

  RUN_DIR/layout.json              model config, runtime (dtypes, scan) and objective of the run
  RUN_DIR/tokenizer/               tokenizer files (with `<|mask|>`), when known
  RUN_DIR/checkpoints/<step>/      orbax items: params, opt (optimizer state + step)
  RUN_DIR/data_state/<step>/process_<i>.json   each process's data-iterator state

Orbax writes each step to a temporary directory and renames it when complete, so a
crash mid-save never leaves a step that `restore` would pick. The data state of a
step is written (synchronously, by every process) before that step's orbax save
starts, so a finalised step always has its data state.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from mars_jax.checkpoints.runs import with_shardings
from mars_jax.training.step import TrainState


class RunCheckpointer:
  """Saves and restores (params, opt, data state) under RUN_DIR, async by default.

    ckpt = RunCheckpointer(run_dir, save_every=100)
    state, data_state, start = ckpt.restore_or_init(abstract, shardings, init)
    ckpt.save(step, state.params, {"step": state.step, "opt_state": state.opt_state},
              iterator.get_state())
  """

  def __init__(self, run_dir: str, *, max_to_keep: int = 3, save_every: int = 1000,
               async_save: bool = True):
    self.run_dir = os.path.abspath(run_dir)
    self.save_every = save_every
    self.manager = ocp.CheckpointManager(
        os.path.join(self.run_dir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True),
        item_names=("params", "opt"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _data_path(self, step: int, process: int | None = None) -> str:
    process = jax.process_index() if process is None else process
    return os.path.join(self.run_dir, "data_state", str(step), f"process_{process}.json")

  def save(self, step: int, params: Any, opt: Any, data_state: Any, *,
           force: bool = False) -> bool:
    """Saves when `step` is due (or `force`); returns whether a save started."""
    if not (force or step % self.save_every == 0):
      return False
    path = self._data_path(step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(data_state, f)
    os.replace(path + ".tmp", path)
    return self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt)), force=True)

  def restore(self, step: int, abstract: TrainState, shardings: TrainState
              ) -> tuple[TrainState, Any]:
    """Restores `step` -> (TrainState placed in `shardings`, this process's data state).

    `abstract`: the run's `TrainState` of `jax.ShapeDtypeStruct`s (see
    `train_step.abstract_train_state`); `shardings`: a matching `TrainState` of
    `jax.sharding.Sharding`s (see `train_step.train_state_shardings`).
    """
    target = with_shardings(abstract, shardings)
    out = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target.params),
        opt=ocp.args.StandardRestore({"step": target.step, "opt_state": target.opt_state})))
    path = self._data_path(step)
    written = len(os.listdir(os.path.dirname(path))) if os.path.isdir(
        os.path.dirname(path)) else 0
    if written != jax.process_count():
      raise ValueError(
          f"{os.path.dirname(path)}: checkpoint step {step} holds the data-iterator state of "
          f"{written} process(es), this run has {jax.process_count()}; resume with the same "
          "number of processes (the data order depends on it), or start a new stage from "
          "this run with model.init=<run dir>.")
    with open(path) as f:
      data_state = json.load(f)
    state = TrainState(step=out.opt["step"], params=out.params,
                       opt_state=out.opt["opt_state"])
    return state, data_state

  def restore_or_init(self, abstract: TrainState, shardings: TrainState,
                      init: Callable[[], TrainState]) -> tuple[TrainState, Any, int]:
    """The run's state: its latest step restored, else `init()` (a step-0 state in
    `shardings`, e.g. from `train_step.init_train_state`).

    -> (TrainState placed in `shardings`, this process's data-iterator state or None
    when initialised, the step it is at). `abstract`, `shardings`: see `restore`.
    """
    step = self.latest_step()
    if step is None:
      return init(), None, 0
    state, data_state = self.restore(step, abstract, shardings)
    return state, data_state, step

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
