"""`python -m mars_jax.train --config configs/X.py [--config.a.b=value ...] --workdir DIR`.

Starts the distributed runtime (mars_jax.parallel.distributed), checks that every process
has the same config, and runs the experiment (mars_jax.experiments.stages: stage 1, main
stage, final evaluation, export). Fields: see mars_jax/training/config.py.

A config or data error (a bad value, a missing file, bad records under
data.on_bad="error", a refused export directory) prints one line, `error: ...`, and
exits with status 2; MARS_JAX_TRACEBACK=1 shows the traceback instead.

A SIGTERM makes every process save a checkpoint after the same step and exit with
status 143 (`trainer.PREEMPTED_EXIT`); rerunning the same command resumes from it
(docs/preemption.md).
"""

from __future__ import annotations

import logging
import os
import sys

from absl import flags
from absl import logging as absl_logging
import jax
from ml_collections import config_flags

from mars_jax.core import cli
from mars_jax.parallel import distributed
from mars_jax.training import loop as trainer
from mars_jax.experiments import stages as experiment

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, export)")
# Not __name__ ("__main__" under `python -m`): a child of the "mars_jax" logger set to INFO.
_LOG = logging.getLogger("mars_jax.train")


def main(_) -> None:
  cfg = _CONFIG.value
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
  logging.getLogger("mars_jax").setLevel(logging.INFO)  # progress, via absl's handler to stderr
  d = cfg.distributed
  plan = distributed.plan_from_env(os.environ, coordinator_address=d.coordinator_address,
                                   num_processes=d.num_processes, process_id=d.process_id,
                                   port=d.port)
  distributed.initialize(plan)
  distributed.assert_same_config(distributed.config_fingerprint(cfg))
  _LOG.info("%s", distributed.env_summary())
  try:
    with cli.one_line_errors():
      experiment.run(cfg, _WORKDIR.value)
  except trainer.Preempted as e:
    _LOG.warning("process %d: %s; exiting with status %d", jax.process_index(), e,
                 trainer.PREEMPTED_EXIT)
    sys.exit(trainer.PREEMPTED_EXIT)


if __name__ == "__main__":
  cli.run(main, required=("config", "workdir"))
