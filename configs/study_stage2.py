"""The study at the paper's proportions: stage 2 as long as stage 1 (docs/results.md).

  python -m mars_jax.study --config configs/study_stage2.py --workdir runs/study_stage2 \
      --config.study.report=docs/results.md

The authors train stage 2 as long as stage 1, at the same learning rate. Here, per seed of
`study.seeds` (five), one AR-SFT parent (configs/tiny.py's stage 1: 1200 steps at 2e-3)
and from it two arms:
- "@paper": the control and MARS (B = 4) trained 1200 steps at 2e-3, the parent's
  schedule; beside them MARS B = 4 with the paper's fixed block partition
  (mars_b4_fixed@paper, `objective.random_block_offset=False`), the one difference of
  our objective from the authors';
- no suffix: the control and MARS B = 4 trained 300 steps at configs/tiny.py's stage-2
  learning rate (1e-3), the arm of docs/results_300.md.
Both arms score MARS against the control and against the parent (the paper's AR-SFT
baseline is the stage-1 checkpoint itself), with the verdict margin `study.margin`
(1 point): "no worse" holds when the 95% interval lies above -1. The held-out
clean-stream loss is logged every 50 steps for the curves.

MARS B = 16 at the paper's schedule: add "mars_b16@paper" to `study.variants` (not in
docs/results.md: the session that ran it had no time left for it).
"""

import importlib.util
import os


def _study():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "study.py")
  spec = importlib.util.spec_from_file_location("study_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def get_config():
  c = _study()
  c.train.eval_every = 50
  c.study.seeds = (0, 1, 2, 3, 4)
  c.study.rounding_check = False
  c.study.schedules = dict(paper=dict(steps=c.stage1.steps, learning_rate=c.stage1.learning_rate))
  c.study.variants = ("control", "mars_b4", "control@paper", "mars_b4@paper",
                      "mars_b4_fixed@paper")
  return c
