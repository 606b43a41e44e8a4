"""The toy-scale study on the embedded task.

  python -m mars_jax.study --config configs/study.py --workdir runs/study

The model, tokenizer and data are configs/tiny.py's, and so is the parent's run length;
each child runs 300 steps (the run docs/results_300.md reports; the study at the paper's
proportions is configs/study_stage2.py, docs/results.md). `study` sets the seeds, the
run lengths, the variants and the evaluation grid (see mars_jax/experiments/study.py). Every
seed of `study.seeds` trains its own parent and variants (`--config.study.seeds=0,1,2,3,4`
for five). With the defaults a parent is configs/tiny.py's stage 1 with the seed as
train.seed and data.seed, so a study of seed 0 alone can reuse the default run's
parent:

  python -m mars_jax.study --config configs/study.py --workdir runs/study0 \
      --config.study.seeds=0 --config.study.parent_dir=runs/tiny/stage1

Several seeds need one parent each (`{seed}` in the path, or comma-separated). The
MARS variants run the paper's objective (ar_weight 1, or 0 without the AR loss) at
configs/tiny.py's stage-2 learning rate. `rounding_check` trains the first seed's parent once more on the unrolled
runtime, for the spread float rounding alone gives. The report goes to
WORKDIR/results.md; `--config.study.report=docs/results_300.md` replaces the tracked one.
"""

import importlib.util
import os

import ml_collections


def _tiny():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")
  spec = importlib.util.spec_from_file_location("tiny_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def get_config():
  c = _tiny()
  c.train.eval_every = 100
  c.train.checkpoint_every = 100
  c.study = ml_collections.ConfigDict(dict(
      seeds=(0, 1, 2), rounding_check=True,
      parent_dir=ml_collections.config_dict.placeholder(str),
      parent_steps=c.stage1.steps, parent_learning_rate=c.stage1.learning_rate,
      child_steps=300,  # docs/results_300.md's run (configs/tiny.py's stage 2 now runs 450)
      # "<variant>@<name>" trains that variant with these steps and learning rate
      # (configs/study_stage2.py: "paper", stage 2 as long as stage 1).
      schedules=ml_collections.ConfigDict(),
      # Verdicts: "no worse" holds when the 95% interval of the difference lies above
      # -margin points, does not hold when it lies below, and cannot be told otherwise.
      margin=1.0,
      variants=("control", "mars_b4", "mars_b8", "mars_b16", "noar_b4", "noar_b8",
                "noar_b16", "bd_b4", "lora_r32"),
      # The margin gate too: gates=('probability','margin') (twice the evaluation time).
      taus=(1.0, 0.95, 0.9, 0.8, 0.7), gates=("probability",), num_problems=500,
      # None: WORKDIR/results.md; the tracked report is written with
      # --config.study.report=docs/results_300.md
      report=ml_collections.config_dict.placeholder(str)))
  return c
