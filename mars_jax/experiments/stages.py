"""One experiment end to end: the stages, the final evaluation and the HF export.

  run(cfg, workdir) -> summary

Runs the optional AR-SFT stage 1 (WORKDIR/stage1) and the main stage (WORKDIR, or
WORKDIR/stage2 after a stage 1), resuming each from its latest checkpoint (with
lora.rank > 0 each trains adapters over the weights it starts from, which are then
merged for the next stage, the evaluation and the export); then,
if asked, evaluates on the synthetic test split and exports the final weights to
WORKDIR/hf. Every process calls it. Fields: see mars_jax/training/config.py.

Progress and notices go to Python logging (INFO; `python -m mars_jax.train` shows
them on stderr); the final evaluation's accuracy tables, a result, are printed.
"""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental import multihost_utils

from mars_jax.checkpoints import hf, runs, vllm_recipe
from mars_jax.data import build_tokenizer, model_vocab_size, synthetic, task_settings
from mars_jax.data.run_tokenizer import config_ids
from mars_jax.data.tokenizer import BUILDERS
from mars_jax.decoding.loading import LoadedModel, eos_token_ids, load_model
from mars_jax.evaluation import evaluate
from mars_jax.models import lora
from mars_jax.training import config as train_config, loop as trainer

_LOG = logging.getLogger(__name__)


def _model_and_tokenizer(cfg, runtime):
  """-> (model config, params in `runtime`'s layout or None for random init, tokenizer,
  mask id). A tokenizer given with `tokenizer` for a model that has its own must have
  every added and special token of the model's own (hf.check_covers)."""
  init = cfg.model.init
  if init == "random":
    if cfg.tokenizer in (None, *BUILDERS):
      tok = build_tokenizer(cfg.tokenizer or "char")
      config = train_config.random_model_config(
          cfg, vocab_size=model_vocab_size(tok),
          bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
          eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
      return config, None, tok, tok.convert_tokens_to_ids(hf.MASK_TOKEN)
    config = train_config.random_model_config(cfg)
    tok, mask_id = hf.load_tokenizer(cfg.tokenizer, config.vocab_size,
                                     reserved_ids=config_ids(config))
    return config, None, tok, mask_id
  loaded = load_model(init, runtime=runtime)
  if cfg.tokenizer not in (None, *BUILDERS):  # an embedded name: the model's own tokenizer
    tok, mask_id = hf.load_tokenizer(
        cfg.tokenizer, loaded.config.vocab_size, reserved_ids=config_ids(loaded.config),
        model_tokenizer=loaded.tokenizer, model_where=f"model.init={init}")
    return loaded.config, loaded.params, tok, mask_id
  return loaded.config, loaded.params, loaded.tokenizer, loaded.mask_token_id


def source_generation_config(init: str) -> dict | None:
  """The generation_config.json of model.init: an HF directory's own, or the one a run
  saved with its tokenizer (None for random init, or when there is none)."""
  if init == "random":
    return None
  if os.path.isfile(os.path.join(init, "config.json")):
    return hf.read_generation_config(init)
  run_dir = runs.resolve_checkpoint(init)[0]
  return hf.read_generation_config(runs.tokenizer_dir(run_dir))


def stage1_config(cfg):
  """The AR-SFT stage-1 config derived from the main one."""
  s1 = cfg.copy_and_resolve_references()
  s1.unlock()
  s1.objective.kind = "ar_sft"
  if cfg.stage1.steps is not None:
    s1.train.steps = cfg.stage1.steps
  if cfg.stage1.learning_rate is not None:
    s1.optimizer.learning_rate = cfg.stage1.learning_rate
  s1.lock()
  return s1


def run(cfg, workdir: str) -> dict:
  """Every stage, the final evaluation and the export. Returns a summary dict."""
  train_config.validate(cfg)
  if cfg.stage1.enabled:
    train_config.validate(stage1_config(cfg))
  if cfg.train.export_hf:  # refuse a WORKDIR/hf we did not write now, not after training
    hf.check_export_target(os.path.join(workdir, "hf"), overwrite=True)
  runtime = train_config.runtime(cfg)
  config, params, tok, mask_id = _model_and_tokenizer(cfg, runtime)
  generation_config = source_generation_config(cfg.model.init)
  summary: dict = {"stages": {}}
  stages = [("stage1", stage1_config(cfg)), ("stage2", cfg)] if cfg.stage1.enabled else [
      ("main", cfg)]
  models = {}
  for name, stage_cfg in stages:
    run_dir = workdir if name == "main" else os.path.join(workdir, name)
    stage_runtime = train_config.stage_runtime(stage_cfg, runtime, mask_id)
    res = trainer.run_stage(stage_cfg, run_dir, config, stage_runtime, params, tok, mask_id,
                            generation_config=generation_config)
    # what the next stage, the evaluation and the export start from: adapters merged
    params = lora.merge(res.params, stage_runtime.lora)
    models[name] = params
    summary["stages"][name] = {"run_dir": run_dir, "wall_s": res.wall_s,
                               "final": res.history[-1] if res.history else None}
    if jax.process_index() == 0 and res.history:
      last = res.history[-1]
      _LOG.info("[%s] %s: step %d loss %.4f%s (%.0fs)", name, stage_cfg.objective.kind,
                last["step"], last["loss"],
                f" eval_loss {last['eval_loss']:.4f}" if "eval_loss" in last else "",
                res.wall_s)
    if not res.finished:
      _LOG.info("[%s] stopped at train.stop_at_step=%s; rerun without it (or with a later "
                "step) to resume.", name, cfg.train.stop_at_step)
      summary["stopped"] = True
      return summary
  if cfg.final_eval.num_problems > 0:
    gathered = {k: _host_params(v) for k, v in models.items()}
    summary["final_eval"] = _final_eval(cfg, config, runtime, gathered, tok, mask_id,
                                        {k: summary["stages"][k]["run_dir"] for k in models})
  if cfg.train.export_hf:
    final = _host_params(params)  # every process joins the gather; process 0 writes
    out = os.path.join(workdir, "hf")
    objective = {k: cfg.objective[k] for k in ("kind", "block_size")}
    pard = hf.pard_token_of(objective, tok)
    if jax.process_index() == 0:
      # overwrite: WORKDIR/hf is this run's own export (a rerun re-exports there); a
      # directory there without the export marker is still refused, untouched.
      hf.save_pretrained(config, final, out, tokenizer=tok, dtype=cfg.train.export_dtype,
                         overwrite=True, generation_config=generation_config,
                         source={"run_dir": workdir, "objective": objective},
                         pard_token=pard)
      # after the weights (save_pretrained replaces `out`): the data it trained on, which
      # `python -m mars_jax.evaluate --model WORKDIR/hf` draws its problems with
      synthetic.save_task_settings(out, _task_record(cfg, summary["stages"][stages[-1][0]][
          "run_dir"]))
      _LOG.info("exported the final weights to %s; %s", out, vllm_recipe.note(
          out, pard, objective["block_size"]))
    summary["export"] = out
  return summary


def _host_params(params):
  """Fully replicated host copy of (possibly multi-process sharded) params."""
  if jax.process_count() > 1:
    return multihost_utils.process_allgather(params, tiled=True)
  return jax.device_get(params)


def _task_record(cfg, run_dir: str) -> dict:
  """The task record of a stage's run dir (written by the trainer before training; a
  resumed run keeps the one it started with), else the config's data settings."""
  return synthetic.load_task_settings(run_dir) or task_settings(cfg.data)


def _final_eval(cfg, config, runtime, models, tok, mask_id, run_dirs) -> dict:
  """Accuracy and tokens per forward of each stage's final params (AR, then MARS taus),
  on the synthetic test split drawn with the settings its run dir's task.json records
  (the run's data.synthetic): held-out problems of the distribution it trained on."""
  fe = cfg.final_eval
  window = fe.window or cfg.objective.block_size
  problem_sets: dict[tuple, list[dict]] = {}
  out = {}
  for name, params in models.items():
    task = _task_record(cfg, run_dirs[name])["synthetic"]
    split = {k: task[k] for k in synthetic.SPLIT_DEFAULTS}
    key = tuple(split.items())
    if key not in problem_sets:
      problem_sets[key] = evaluate.load_problems("synthetic", fe.num_problems, **split)
    problems = problem_sets[key]
    model = LoadedModel(config, runtime, params, tok, mask_id, eos_token_ids(tok, config))
    is_mars = name != "stage1"
    settings = [(1, 1.0)] + ([(window, t) for t in fe.taus] if is_mars else [])
    rows = []
    for w, tau in settings:
      r = evaluate.score(model, problems, tau=tau, window=w, metric=fe.metric,
                         batch_size=fe.batch_size, max_new_tokens=fe.max_new_tokens)
      rows.append({"model": name, "metric": fe.metric, "window": w, "tau": tau,
                   **{k: v for k, v in r.items() if k != "outputs"}})
    out[name] = rows
    if jax.process_index() == 0:
      print(f"\n[{name}] held-out accuracy on {len(problems)} synthetic problems ("
            + ", ".join(f"{k} {v}" for k, v in split.items()) + "):")
      print(evaluate.format_table(rows), flush=True)
  return out
