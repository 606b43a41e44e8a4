"""The toy-scale study (`python -m mars_jax.study`, the CLI in mars_jax/study.py): its
variants, the train config of each, and training and evaluating them on the held-out
synthetic problems, once per seed. The report (intervals over seeds, the claim table,
the Pareto plot) is mars_jax/training/study_report.py.

Per seed of `study.seeds`, in WORKDIR/seed_<s>/: an AR-SFT parent is trained on the
synthetic task with that seed (init, masking and data order: `train.seed` and
`data.seed`; the task's split is `data.synthetic.seed`, the same for every seed, so
every seed is scored on the same held-out problems); from it, each variant trains the
same number of steps (`VARIANTS`, `LORA_VARIANTS`; docs/results_lora.md), or, named
"<variant>@<schedule>", the steps and learning rate of `study.schedules[schedule]` (the
stage 2 of configs/study_stage2.py as long as stage 1, the paper's proportions). With
`study.rounding_check`, the first seed's parent is also trained on the unrolled runtime
(`model.scan_layers=False`): the same seed and data, different float rounding.

Finished runs are reused, so an interrupted study resumes; processes that share a seed
(each with its own runs) record their results in its results.json under a lock. Each run is scored on the
synthetic test split drawn with its recorded data settings (its task.json; the study
config's data.synthetic for a run with no record); a reused parent whose record differs
from the study's is named.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from typing import NamedTuple

from mars_jax.evaluation import evaluate
from mars_jax.checkpoints import runs
from mars_jax.experiments import stages as experiment
from mars_jax.models import lora
from mars_jax.data import synthetic, task_settings
from mars_jax.decoding.loading import load_model

_LOG = logging.getLogger(__name__)

class Variant(NamedTuple):
  """A child's objective: `objective.kind`, `block_size`, `ar_weight`, `intra_block`, and
  `random_block_offset` (False: the paper's fixed partition, blocks from position 0)."""
  kind: str
  block: int
  ar_weight: float
  intra: str
  random_offset: bool = True


# name -> its objective; the parent is "parent".
VARIANTS = {
    "control": Variant("ar_sft", 4, 1.0, "causal"),
    "mars_b4": Variant("mars", 4, 1.0, "causal"),
    "mars_b8": Variant("mars", 8, 1.0, "causal"),
    "mars_b16": Variant("mars", 16, 1.0, "causal"),
    "mars_b4_fixed": Variant("mars", 4, 1.0, "causal", random_offset=False),
    "noar_b4": Variant("mars", 4, 0.0, "causal"),
    "noar_b8": Variant("mars", 8, 0.0, "causal"),
    "noar_b16": Variant("mars", 16, 0.0, "causal"),
    "bd_b4": Variant("mars", 4, 0.0, "bidirectional"),
}
# MARS at B = 4 (as mars_b4) through LoRA adapters over the frozen parent:
# name -> (lora.rank, lora.train_mask_row); alpha is twice the rank (the authors' 32 / 64).
LORA_VARIANTS = {
    "lora_r8": (8, True),
    "lora_r32": (32, True),
    "lora_r32_frozen_mask": (32, False),
}


# The first seed's parent again on the unrolled runtime (`study.rounding_check`).
UNROLLED_PARENT = "parent_unrolled"


def variant_config(cfg, name: str, parent_dir: str | None, seed: int = 0):
  """The train config of one run of the study, with `seed` as its train and data seed."""
  c = cfg.copy_and_resolve_references()
  c.unlock()
  c.stage1.enabled = False
  c.final_eval.num_problems = 0
  c.train.export_hf = False
  c.train.seed = seed
  c.data.seed = seed
  if name in ("parent", UNROLLED_PARENT):
    c.objective.kind = "ar_sft"
    c.train.steps = cfg.study.parent_steps
    c.optimizer.learning_rate = cfg.study.parent_learning_rate
    c.model.scan_layers = name == "parent" and cfg.model.scan_layers
  else:
    variant = objective_of(name)
    if base_name(name) in LORA_VARIANTS:
      rank, train_mask_row = LORA_VARIANTS[base_name(name)]
      c.lora.update(rank=rank, alpha=2.0 * rank, train_mask_row=train_mask_row)
    c.model.init = parent_dir
    c.objective.update(kind=variant.kind, block_size=variant.block,
                       ar_weight=variant.ar_weight, intra_block=variant.intra,
                       random_block_offset=variant.random_offset)
    c.train.steps, learning_rate = schedule_of(cfg, name)
    if learning_rate is not None:
      c.optimizer.learning_rate = learning_rate
  c.lock()
  return c


def base_name(name: str) -> str:
  """A run's variant without its schedule: "mars_b4@paper" -> "mars_b4"."""
  return name.split("@", 1)[0]


def schedule_of(cfg, name: str) -> tuple[int, float | None]:
  """(steps, learning rate) of a child: `study.child_steps` at the config's learning rate
  (None), or for "<variant>@<schedule>" that entry of `study.schedules`."""
  if "@" not in name:
    return cfg.study.child_steps, None
  schedule = name.split("@", 1)[1]
  schedules = cfg.study.get("schedules") or {}
  if schedule not in schedules:
    raise ValueError(f"study.variants: {name!r} names schedule {schedule!r}, which "
                     f"study.schedules does not define (it has {sorted(schedules)}); add "
                     f"study.schedules.{schedule} = dict(steps=..., learning_rate=...).")
  return int(schedules[schedule]["steps"]), float(schedules[schedule]["learning_rate"])


def objective_of(name: str) -> Variant:
  """The objective of a run ("<variant>" or "<variant>@<schedule>"); a LoRA variant trains
  mars_b4's."""
  name = base_name(name)
  if name in LORA_VARIANTS:
    return VARIANTS["mars_b4"]
  if name not in VARIANTS:
    raise ValueError(f"study.variants: unknown variant {name!r}; expected one of "
                     f"{[*VARIANTS, *LORA_VARIANTS]}, each optionally with "
                     "@<schedule> of study.schedules.")
  return VARIANTS[name]


def eval_settings(name: str, cfg) -> list[tuple[str, int, float]]:
  """(gate, window, tau) to evaluate: AR only for AR models; else window B (and B+1 at
  B=4) at every tau and gate, plus AR mode."""
  if name in ("parent", UNROLLED_PARENT) or base_name(name) == "control":
    return [("probability", 1, 1.0)]
  block = objective_of(name).block
  windows = [block, block + 1] if block == 4 else [block]
  out = [("probability", 1, 1.0)]
  for gate in cfg.study.gates:
    out += [(gate, w, tau) for w in windows for tau in cfg.study.taus]
  return out


def seeds_of(cfg) -> list[int]:
  """study.seeds as a list of distinct ints (a single int is one seed)."""
  seeds = cfg.study.seeds
  seeds = [seeds] if isinstance(seeds, int) else list(seeds)
  if not seeds or len(set(seeds)) != len(seeds) or not all(
      isinstance(s, int) and not isinstance(s, bool) for s in seeds):
    raise ValueError(f"study.seeds={cfg.study.seeds!r}: give distinct integer seeds, "
                     "e.g. --config.study.seeds=0,1,2.")
  return seeds


def parent_dirs(cfg, workdir: str) -> dict[int, str]:
  """seed -> the parent's run directory. study.parent_dir unset: WORKDIR/seed_<s>/parent,
  trained by the study. Set: a directory with `{seed}` in it (one per seed), or as many
  comma-separated directories as seeds; one directory serves one seed only."""
  seeds, given = seeds_of(cfg), cfg.study.parent_dir
  if not given:
    return {s: os.path.join(seed_dir(workdir, s), "parent") for s in seeds}
  if "{seed}" in given:
    return {s: given.replace("{seed}", str(s)) for s in seeds}
  dirs = [d.strip() for d in given.split(",")]
  if len(dirs) != len(seeds):
    raise ValueError(
        f"study.parent_dir={given!r} gives {len(dirs)} parent(s) for {len(seeds)} seeds "
        f"{seeds}: each seed needs its own parent, trained with that seed. Give one "
        "directory per seed, comma-separated in the order of study.seeds or as a path "
        "with {seed} in it (e.g. runs/parents/seed_{seed}), or leave study.parent_dir "
        "unset to train them.")
  return dict(zip(seeds, dirs))


def seed_dir(workdir: str, seed: int) -> str:
  return os.path.join(workdir, f"seed_{seed}")


def run_study(cfg, workdir: str) -> dict[int, dict]:
  """Trains and scores every run of every seed -> {seed: {run name: result}}."""
  parents = parent_dirs(cfg, workdir)
  names = ["parent", *cfg.study.variants]
  for name in names[1:]:
    objective_of(name)   # an unknown variant or schedule fails before any training
    schedule_of(cfg, name)
  out = {}
  for i, seed in enumerate(parents):
    extra = [UNROLLED_PARENT] if cfg.study.rounding_check and i == 0 else []
    out[seed] = run_seed(cfg, seed_dir(workdir, seed), seed, parents[seed], names + extra)
  return out


def run_seed(cfg, workdir: str, seed: int, parent_dir: str, names: list[str]) -> dict:
  """The runs `names` of one seed, in `workdir` (the parent in `parent_dir`) -> {name:
  result}; results.json there keeps the finished ones, so a rerun resumes."""
  os.makedirs(workdir, exist_ok=True)
  results_path = os.path.join(workdir, "results.json")
  study_split = split_settings(task_settings(cfg.data))
  problem_sets: dict[tuple, list[dict]] = {}
  for name in names:
    if name in _record(results_path):
      continue
    run_dir = parent_dir if name == "parent" else os.path.join(workdir, name)
    t0 = time.time()
    _LOG.info("[seed %d] %s -> %s", seed, name, run_dir)
    summary = experiment.run(variant_config(cfg, name, parent_dir, seed), run_dir)
    train_s = time.time() - t0
    final = summary["stages"]["main"]["final"] or {}
    model = load_model(run_dir)
    record = synthetic.load_task_settings(run_dir)
    split = split_settings(record) if record else study_split
    if split != study_split:
      _LOG.info("[%s] note: %s trained on synthetic %s, not the study's %s; evaluated on "
                "its own.", name, run_dir, split, study_split)
    key = tuple(sorted(split.items()))
    if key not in problem_sets:
      problem_sets[key] = evaluate.load_problems("synthetic", cfg.study.num_problems, **split)
    problems = problem_sets[key]
    rows = []
    t1 = time.time()
    for gate, w, tau in eval_settings(name, cfg):
      r = evaluate.score(model, problems, tau=tau, window=w, metric=gate,
                         batch_size=cfg.final_eval.batch_size,
                         max_new_tokens=cfg.final_eval.max_new_tokens)
      rows.append({"metric": gate, "window": w, "tau": tau,
                   **{k: v for k, v in r.items() if k != "outputs"}})
    trainable, total = _param_counts(run_dir)
    result = {"train_s": train_s, "eval_s": time.time() - t1, "rows": rows,
              "trainable_params": trainable, "params": total, "seed": seed,
              "final_loss": final.get("loss"), "final_eval_loss": final.get("eval_loss"),
              "run_dir": run_dir, "synthetic": split}
    print(f"\n[seed {seed}: {name}] train {train_s:.0f}s, eval {result['eval_s']:.0f}s\n"
          + evaluate.format_table(rows), flush=True)
    _record(results_path, name, result)
  results = _record(results_path)
  return {name: results[name] for name in names}


def _record(path: str, name: str | None = None, result: dict | None = None) -> dict:
  """The finished runs of a seed's results.json ({} before the first), with `name`'s
  `result` added and written back (atomically, under a lock on `path`.lock) when given."""
  with open(path + ".lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    results = {}
    if os.path.exists(path):
      with open(path) as f:
        results = json.load(f)
    if name is not None:
      results[name] = result
      with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
      os.replace(path + ".tmp", path)
    return results


def _param_counts(run_dir: str) -> tuple[int, int]:
  """(trained, total) parameters of a run: its adapters and mask row under LoRA, else all."""
  return lora.count(runs.load_params(run_dir, merge_adapters=False)[2])


def split_settings(record: dict) -> dict:
  """The generator settings of a task record that decide the test problems."""
  return {k: record["synthetic"][k] for k in synthetic.SPLIT_DEFAULTS}
