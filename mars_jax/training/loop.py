"""The training loop of one stage: data -> sharded step -> metrics, eval, checkpoints.

  run_stage(cfg, run_dir, model_config, runtime, init_params, tokenizer, mask_id)
      -> StageResult

Resumes from the latest complete checkpoint in `run_dir` (params, optimizer state,
step, data-iterator state); a finished stage returns at once. Every process calls
it; process 0 alone logs (to the `mars_jax.training.loop` logger: INFO progress, WARNING
problems) and writes files other than checkpoints.

Eval loss: every `train.eval_every` steps (on a log step) over the first
`train.eval_batches` global batches of the data's eval set. It is off, with a
one-line notice, when the data has no eval set (a file source without
`data.num_eval` or `data.eval_source`), and off when `train.eval_batches` is 0.

SIGTERM (a spot VM's or a scheduler's notice, docs/preemption.md): the step in
progress finishes, every process stops after the same step, saves a checkpoint of
it (data-iterator state included), waits for the save, and `run_stage` raises
`Preempted`; the train CLI exits with `PREEMPTED_EXIT`. A second SIGTERM while
saving is ignored. One process: a Python handler that only sets a flag, installed
for the loop and restored after it. Several: JAX's preemption service (its handler
from `jax.distributed.initialize`, on by default), whose sync point is the first
step boundary every process reaches after a notice on any of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from mars_jax.checkpoints import hf
from mars_jax.parallel import sharding
from mars_jax.training import checkpoint, config as train_config, objective as objective_lib
from mars_jax.checkpoints import runs
from mars_jax.models import lora
from mars_jax.training import step as ts
from mars_jax.data import load_data, synthetic, task_settings
from mars_jax.models.qwen2 import Qwen2Config, Runtime
from mars_jax.training.optimizer import make_optimizer, make_schedule

_LOG = logging.getLogger(__name__)
BAD_RECORDS = "bad_records.txt"   # in the run dir: "file:line: kind: reason" of each
# The train CLI's exit status after a SIGTERM stopped it with its checkpoint saved:
# 128 + SIGTERM, what shells, srun and container runtimes report for a process that
# SIGTERM ended, so wrappers that requeue such jobs requeue this one too.
PREEMPTED_EXIT = 128 + signal.SIGTERM


class Preempted(Exception):
  """A SIGTERM stopped the stage after `step`, whose checkpoint is complete."""

  def __init__(self, run_dir: str, step: int):
    super().__init__(f"{run_dir}: stopped by SIGTERM after step {step}, checkpoint saved; "
                     "rerun the same command to resume")
    self.run_dir, self.step = run_dir, step


@dataclasses.dataclass
class StageResult:
  config: Qwen2Config
  params: Any                 # sharded over the stage's mesh
  history: list[dict]         # one dict of logged metrics per log step
  wall_s: float
  finished: bool              # False when train.stop_at_step ended it early


class MetricsWriter:
  """metrics.jsonl and TensorBoard scalars in the run dir (process 0 only)."""

  def __init__(self, run_dir: str):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
      self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
    self.jsonl.flush()
    for k, v in metrics.items():
      self.tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tb.close()


def global_batch(local: dict[str, np.ndarray], batch_sharding) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over (data, fsdp)."""
  return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
          for k, v in local.items()}


def _to_float(metrics) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def evaluate_loss(eval_step, params, batches, batch_sharding) -> dict[str, float]:
  """Objective metrics over the held-out batches (sums added, normalised once)."""
  total = None
  for b in batches:
    sums = eval_step(params, global_batch(b, batch_sharding))
    total = sums if total is None else jax.tree.map(lambda a, x: a + x, total, sums)
  _, metrics = objective_lib.finalize(total)
  return {f"eval_{k}": v for k, v in _to_float(metrics).items()}


def held_out_batches(cfg, data, name: str, *, shard_index: int,
                     shard_count: int) -> list[dict[str, np.ndarray]]:
  """This process's eval-loss batches: the first `train.eval_batches` of the eval set.

  Empty (no eval loss, a one-line notice) when train.eval_batches is 0 or the data
  has no eval set (a file source without data.eval_source and with data.num_eval 0).
  An eval set smaller than one global batch is an error here, before anything is
  compiled or written.
  """
  if not cfg.train.eval_batches:
    return []
  if data.eval is None or not len(data.eval):
    if shard_index == 0:
      how = ("data.synthetic.num_test" if data.config["source"] == "synthetic" else
             "data.num_eval=N to hold out N records of data.source, or data.eval_source")
      _LOG.info("[%s] no eval set: training without eval loss (set %s).", name, how)
    return []
  try:
    batches = data.eval_batches(batch_size=cfg.train.batch_size, shard_index=shard_index,
                                shard_count=shard_count)
  except ValueError as e:
    raise ValueError(f"{e} Hold out at least train.batch_size={cfg.train.batch_size} "
                     "records (data.num_eval, data.eval_source), or set "
                     "train.eval_batches=0 for no eval loss.") from e
  return batches[:cfg.train.eval_batches]


def stream_length(cfg, data, name: str, *, verbose: bool) -> int:
  """The objective's target-stream length n (see `objective.target_stream`).

  objective.stream_length when set; else derived from the data: without packing,
  the most positions any train or eval example has in blocks that hold a target
  (so no row is ever cut), rounded up to a multiple of 8 and of B; with packing,
  the row length.
  """
  length = data.max_length
  if cfg.objective.stream_length is not None:
    n, why = cfg.objective.stream_length, "objective.stream_length"
  elif data.config["packing"]:
    n, why = length, "packed rows"
  else:
    block = 1 if cfg.objective.kind == "ar_sft" else cfg.objective.block_size
    offsets = range(block) if block > 1 and cfg.objective.random_block_offset else (0,)
    longest = max(_longest_target_blocks(source, block, length, offsets)
                  for source in (data.train, data.eval) if source is not None)
    n = objective_lib.fitting_stream_length(longest, block, length)
    why = (f"the longest example's target blocks: {longest}"
           + (", any block offset" if len(offsets) > 1 else ""))
  if verbose:
    _LOG.info("[%s] target stream: %s of %s positions per row (%s)", name, n, length, why)
  return int(n)


def _longest_target_blocks(source, block_size: int, length: int, offsets=(0,)) -> int:
  """Max over the examples of `source` and the block `offsets` (see
  `objective.prepare`) of an example's positions in target blocks (a cached source
  keeps the per-example counts, so a later start reads them)."""
  counts = source.per_example(
      functools.partial(objective_lib.example_target_block_lengths, block_size=block_size,
                        row_length=length, block_offsets=tuple(offsets)),
      f"target_blocks-B{block_size}-L{length}-offsets{'-'.join(map(str, offsets))}")
  return int(counts.max()) if len(counts) else 0


def layout(cfg, model_config: Qwen2Config, runtime: Runtime) -> dict:
  init = cfg.model.init
  return {**runs.model_layout(model_config, runtime),
          "init": init if init == "random" else os.path.abspath(init),
          "objective": {k: cfg.objective[k] for k in
                        ("kind", "block_size", "ar_weight", "intra_block", "normalization")}}


@contextlib.contextmanager
def sigterm_notice(reached_sync_point):
  """-> `stop(step) -> bool`: True at the first step boundary after a SIGTERM, at the
  same step on every process; call it at every step, with the same steps everywhere.

  Several processes: `reached_sync_point` (orbax's `CheckpointManager.reached_preemption`,
  JAX's preemption service; False when that service is off). One process: a SIGTERM
  handler that only sets a flag, the previous handler restored on exit.
  """
  if jax.process_count() > 1:
    yield reached_sync_point
    return
  signalled = []
  previous = signal.signal(signal.SIGTERM, lambda *_: signalled.append(True))
  try:
    yield lambda step: bool(signalled)
  finally:   # None: the previous handler was not set from Python
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def _closing(bar, writer, ckpt):
  """Closes the progress bar, the metrics and the checkpointer (waiting for its saves)."""
  try:
    yield
  finally:
    bar.close()
    writer.close()
    ckpt.close()


def run_stage(cfg, run_dir: str, model_config: Qwen2Config, runtime: Runtime,
              init_params: Any, tokenizer, mask_id: int, *,
              generation_config: dict | None = None) -> StageResult:
  """Trains one stage in `run_dir` as `cfg` says; returns its final params.

  `init_params` (None: random init) must be in `runtime`'s layout. The tokenizer is
  saved in the run with `generation_config` (the source checkpoint's), which the
  export carries over."""
  t0 = time.time()
  nproc, pid = jax.process_count(), jax.process_index()
  data = load_data(cfg.data, tokenizer)
  if pid == 0:
    log = _LOG.warning if data.stats.bad else _LOG.info
    log("[%s] %s", os.path.basename(run_dir), data.stats.summary())  # starts "data:"
    listing = os.path.join(run_dir, BAD_RECORDS)
    if data.stats.bad:
      os.makedirs(run_dir, exist_ok=True)
      with open(listing, "w") as f:
        f.write("".join(line + "\n" for line in data.stats.bad_records))
      log("[%s] all %d bad records, by file:line: %s", os.path.basename(run_dir),
          data.stats.bad, listing)
    elif os.path.isfile(listing):   # an earlier invocation's list: this data has none
      os.remove(listing)
  batch_size = cfg.train.batch_size
  eval_batches = held_out_batches(cfg, data, os.path.basename(run_dir), shard_index=pid,
                                  shard_count=nproc)
  total = cfg.train.steps or data.num_steps(batch_size)
  if not total:
    raise ValueError("train.steps is not set and data.num_epochs is None: set one of them.")
  stream = stream_length(cfg, data, os.path.basename(run_dir), verbose=pid == 0)
  typed = train_config.typed(cfg, total_steps=total, mask_token_id=mask_id,
                             stream_length=stream)
  mesh = sharding.make_mesh(typed.mesh)
  tx = make_optimizer(typed.optimizer)
  step_fn = ts.make_train_step(model_config, typed.objective, tx, mesh,
                               micro_batches=cfg.train.micro_batches,
                               learning_rate_fn=make_schedule(typed.optimizer),
                               runtime=runtime, seed=cfg.train.seed)
  eval_step = ts.make_eval_step(model_config, typed.objective, mesh, runtime=runtime)
  batch_sharding = sharding.batch_sharding(mesh)
  runs.write_layout(run_dir, layout(cfg, model_config, runtime))
  if pid == 0:   # the data the run trains on, for evaluation (see synthetic.TASK_FILE)
    synthetic.record_task_settings(run_dir, task_settings(cfg.data))
  multihost_utils.sync_global_devices("layout written")
  if pid == 0 and tokenizer is not None:
    hf.save_tokenizer(tokenizer, runs.tokenizer_dir(run_dir),
                      generation_config=generation_config)
  ckpt = checkpoint.RunCheckpointer(run_dir, max_to_keep=cfg.train.max_to_keep,
                                    save_every=cfg.train.checkpoint_every,
                                    async_save=cfg.train.async_checkpoint)
  it = data.train_iterator(batch_size=batch_size, shard_index=pid, shard_count=nproc)
  state, data_state, start = ckpt.restore_or_init(
      ts.abstract_train_state(model_config, tx, runtime=runtime),
      ts.train_state_shardings(model_config, tx, mesh, runtime=runtime),
      lambda: ts.init_train_state(model_config, tx, mesh, params=init_params,
                                  rng=jax.random.key(cfg.train.seed), runtime=runtime))
  if pid == 0 and runtime.lora is not None:
    trained, total_params = lora.count(state.params)
    _LOG.info("[%s] LoRA rank %d over %s%s: training %s of %s params (%.2f%%)",
              os.path.basename(run_dir), runtime.lora.rank, runtime.lora.targets,
              " and the mask row" if runtime.lora.mask_token_id is not None else "",
              f"{trained:,}", f"{total_params:,}", 100 * trained / total_params)
  if data_state is not None:
    it.set_state(data_state)
    if pid == 0:
      _LOG.info("resumed %s from step %d", run_dir, start)
  writer = MetricsWriter(run_dir)
  history = []
  bar = tqdm(total=total, initial=start, desc=os.path.basename(run_dir), unit="step",
             disable=pid != 0, dynamic_ncols=True)
  tokens_per_step = batch_size * data.max_length
  last_t, last_step = time.time(), start
  end = min(total, cfg.train.stop_at_step or total)
  rows_cut = 0.0   # rows whose target blocks did not fit the stream (summed on device)
  preempted = False
  with sigterm_notice(ckpt.manager.reached_preemption) as stop, _closing(bar, writer, ckpt):
    for step in range(start, end):
      state, metrics = step_fn(state, global_batch(next(it), batch_sharding))
      rows_cut = rows_cut + metrics["rows_cut"]
      done = step + 1
      if done % cfg.train.log_every == 0 or done == total:
        m = _to_float(metrics)
        m["rows_cut"] = float(rows_cut)
        now = time.time()
        m["tokens_per_s"] = tokens_per_step * (done - last_step) / max(now - last_t, 1e-9)
        last_t, last_step = now, done
        if eval_batches and (done % cfg.train.eval_every == 0 or done == total):
          m.update(evaluate_loss(eval_step, state.params, eval_batches, batch_sharding))
          last_t = time.time()
        history.append({"step": done, **m})
        writer.write(done, m)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}", refresh=False)
      bar.update(1)
      preempted = stop(done)
      ckpt.save(done, state.params, {"step": state.step, "opt_state": state.opt_state},
                it.get_state(), force=done == end or preempted)
      if preempted:
        if pid == 0:
          _LOG.warning("[%s] SIGTERM: saving step %d, then stopping", os.path.basename(run_dir),
                       done)
        break
  if preempted:   # after `_closing` waited for the save to finish
    raise Preempted(run_dir, done)
  if pid == 0 and history and history[-1]["rows_cut"]:
    _LOG.warning("[%s] warning: %.0f rows in this invocation had more target-block positions "
                 "than the target stream's %s; their targets past it were not trained on "
                 "(raise objective.stream_length, or leave it unset to fit the data).",
                 os.path.basename(run_dir), history[-1]["rows_cut"], stream)
  return StageResult(config=model_config, params=state.params, history=history,
                     wall_s=time.time() - t0, finished=end == total)
