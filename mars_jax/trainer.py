"""The training loop of one stage: data -> sharded step -> metrics, eval, checkpoints.

  run_stage(cfg, run_dir, model_config, init_params, tokenizer, mask_id) -> StageResult

Resumes from the latest complete checkpoint in `run_dir` (params, optimizer state,
step, data-iterator state); a finished stage returns at once. Every process calls
it; process 0 alone prints, logs and writes files other than checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from mars_jax import checkpoint, objective as objective_lib, sharding, train_config
from mars_jax import train_step as ts
from mars_jax.data import load_data
from mars_jax.models.qwen2 import Qwen2Config
from mars_jax.optimizer import make_optimizer, make_schedule


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


def layout(cfg, model_config: Qwen2Config) -> dict:
  return {"model": checkpoint.model_layout(model_config),
          "objective": {k: cfg.objective[k] for k in
                        ("kind", "block_size", "ar_weight", "intra_block", "normalization")}}


def run_stage(cfg, run_dir: str, model_config: Qwen2Config, init_params: Any, tokenizer,
              mask_id: int) -> StageResult:
  """Trains one stage in `run_dir` as `cfg` says; returns its final params."""
  t0 = time.time()
  nproc, pid = jax.process_count(), jax.process_index()
  data = load_data(cfg.data, tokenizer)
  if pid == 0:
    print(f"[{os.path.basename(run_dir)}] data: {data.stats.summary()}", flush=True)
  batch_size = cfg.train.batch_size
  total = cfg.train.steps or data.num_steps(batch_size)
  if not total:
    raise ValueError("train.steps is not set and data.num_epochs is None: set one of them.")
  typed = train_config.typed(cfg, total_steps=total, mask_token_id=mask_id)
  mesh = sharding.make_mesh(typed.mesh)
  tx = make_optimizer(typed.optimizer)
  step_fn = ts.make_train_step(model_config, typed.objective, tx, mesh,
                               micro_batches=cfg.train.micro_batches,
                               learning_rate_fn=make_schedule(typed.optimizer))
  eval_step = ts.make_eval_step(model_config, typed.objective, mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  checkpoint.write_layout(run_dir, layout(cfg, model_config))
  multihost_utils.sync_global_devices("layout written")
  if pid == 0 and tokenizer is not None:
    tokenizer.save_pretrained(checkpoint.tokenizer_dir(run_dir))
  ckpt = checkpoint.RunCheckpointer(run_dir, max_to_keep=cfg.train.max_to_keep,
                                    save_every=cfg.train.checkpoint_every,
                                    async_save=cfg.train.async_checkpoint)
  it = data.train_iterator(batch_size=batch_size, shard_index=pid, shard_count=nproc)
  shardings = ts.train_state_shardings(model_config, tx, mesh)
  start = ckpt.latest_step()
  if start is not None:
    abstract = ts.abstract_train_state(model_config, tx)
    with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    params, opt, data_state = ckpt.restore(
        start, jax.tree.map(with_sharding, abstract.params, shardings.params),
        {"step": with_sharding(abstract.step, shardings.step),
         "opt_state": jax.tree.map(with_sharding, abstract.opt_state, shardings.opt_state)})
    state = ts.TrainState(step=opt["step"], params=params, opt_state=opt["opt_state"])
    it.set_state(data_state)
    if pid == 0:
      print(f"resumed {run_dir} from step {start}", flush=True)
  else:
    start = 0
    state = ts.init_train_state(model_config, tx, mesh, params=init_params,
                                rng=jax.random.key(cfg.train.seed))
  eval_batches = data.eval_batches(batch_size=batch_size, shard_index=pid,
                                   shard_count=nproc)[:cfg.train.eval_batches]
  writer = MetricsWriter(run_dir)
  history = []
  bar = tqdm(total=total, initial=start, desc=os.path.basename(run_dir), unit="step",
             disable=pid != 0, dynamic_ncols=True)
  tokens_per_step = batch_size * data.max_length
  last_t, last_step = time.time(), start
  end = min(total, cfg.train.stop_at_step or total)
  try:
    for step in range(start, end):
      state, metrics = step_fn(state, global_batch(next(it), batch_sharding))
      done = step + 1
      if done % cfg.train.log_every == 0 or done == total:
        m = _to_float(metrics)
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
      ckpt.save(done, state.params, {"step": state.step, "opt_state": state.opt_state},
                it.get_state(), force=done == end)
  finally:
    bar.close()
    writer.close()
    ckpt.close()
  return StageResult(config=model_config, params=state.params, history=history,
                     wall_s=time.time() - t0, finished=end == total)
