"""`python -m mars_jax.study --config configs/study.py --workdir runs/study`: the toy-scale
reproduction of the paper's claims, once per seed of `study.seeds` (default 0, 1, 2).

Per seed, an AR-SFT parent is trained on the synthetic task (init, masking and data order
from the seed; the held-out problems are the same for every seed); from it, each variant
trains the same number of steps: the AR-SFT control (the parent trained on), MARS with the AR
loss at B = 4, 8, 16, MARS without it (ar_weight 0), the Block Diffusion
baseline (bidirectional intra-block attention, no AR loss, B = 4), and MARS at B = 4
through LoRA adapters (`LORA_VARIANTS`: ranks 8 and 32, and 32 with the mask row
frozen; docs/results_lora.md). Each is then
evaluated on held-out problems at every tau, window and gate of the study config. The
report (mars_jax/training/study_report.py: means with 95% intervals over seeds, the
paper's claims as paired differences with a verdict, a Pareto plot with error bars, the
wall-clock of every run) goes to `study.report` (default WORKDIR/results.md;
`--config.study.report=docs/results.md` for the tracked one, with
configs/study_stage2.py; docs/results_300.md is configs/study.py's). Finished runs are reused,
so an interrupted study resumes. `study.parent_dir` reuses trained parents: one per
seed (a path with `{seed}` in it, or comma-separated directories).

The held-out problems are the synthetic test split drawn with each run's recorded data
settings (its task.json: difficulty, split seed, test fraction; the study config's
data.synthetic for a run with no record), so every model is scored on the distribution
it trained on; a reused parent whose record differs from the study's is named.

Progress goes to Python logging (INFO, on stderr under this CLI); each run's results
table is printed.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mars_jax.core import cli
from mars_jax.experiments.study import run_study
from mars_jax.experiments.study_report import write_report

_CONFIG = config_flags.DEFINE_config_file("config", None, "study config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "study directory")


def main(_) -> None:
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
  logging.getLogger("mars_jax").setLevel(logging.INFO)  # progress, via absl's handler to stderr
  cfg = _CONFIG.value
  with cli.one_line_errors():   # a bad seed list, parent_dir or variant: one line
    results = run_study(cfg, _WORKDIR.value)
  report = cfg.study.report or os.path.join(_WORKDIR.value, "results.md")
  write_report(cfg, results, report, "python -m mars_jax.study " + " ".join(sys.argv[1:]))
  print(f"wrote {report}")


if __name__ == "__main__":
  cli.run(main, required=("config", "workdir"))
