"""`python -m mars_jax.data.prepare --config configs/X.py [--config.data.source=...]
[--workers N]`: tokenizes a config's data files into the tokenized cache
(mars_jax/data/cache.py, docs/data.md), or finds it built, and prints one line:

  prepared: 100000 records read, 99950 kept, 50 bad, 34012345 tokens in 61.2 s; cache
  /root/.cache/mars_jax/data (12 shards built, 0 found)

"kept" counts the examples cached; the row length, truncation, held-out split and
packing are applied when training reads them. Training builds the cache itself when it
is missing: this command does it ahead, e.g. once on a login node, or on every host of
a slice at once (`jax.distributed` is started as `python -m mars_jax.train` starts it,
each process builds its share of the shards; the cache directory, data.cache_dir or
$MARS_JAX_DATA_CACHE, must then be shared storage). --workers: processes per host
(default data.cache_workers; 0: every core).

A config or data error prints one line, `error: ...`, and exits with status 2
(MARS_JAX_TRACEBACK=1 shows the traceback).
"""

from __future__ import annotations

import logging
import os
import time

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mars_jax.core import cli
from mars_jax.data import cache, pipeline
from mars_jax.data.run_tokenizer import data_tokenizer
from mars_jax.parallel import distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                          lock_config=True)
_WORKERS = flags.DEFINE_integer("workers", None, "tokenizing processes per host (default: "
                                "data.cache_workers; 0: every core)", lower_bound=0)
_LOG = logging.getLogger("mars_jax.data.prepare")


def prepare(cfg, workers: int | None = None) -> str:
  """Builds or finds the cache of `cfg.data`; returns the one-line summary."""
  begin = time.perf_counter()
  tokenizer = data_tokenizer(cfg)
  report = cache.BuildReport()
  files = pipeline.prepare_cache(cfg.data, tokenizer, workers=workers, report=report)
  bad = sum(len(f.bad) + f.empty for f in files)
  for f in files:
    for kind, where, reason in f.bad[:5]:
      _LOG.warning("bad record: %s: %s: %s", where, kind, reason)
  return (f"prepared: {sum(f.records for f in files)} records read, "
          f"{sum(len(f) for f in files)} kept, {bad} bad, "
          f"{sum(int(f.lengths.sum()) for f in files)} tokens in "
          f"{time.perf_counter() - begin:.1f} s; cache {pipeline.cache_dir(cfg.data)} "
          f"({report.built} shards built, {report.reused} found)")


def main(_) -> None:
  cfg = _CONFIG.value
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("mars_jax").setLevel(logging.INFO)
  with cli.one_line_errors():
    d = cfg.distributed
    distributed.initialize(distributed.plan_from_env(
        os.environ, coordinator_address=d.coordinator_address,
        num_processes=d.num_processes, process_id=d.process_id, port=d.port))
    print(prepare(cfg, _WORKERS.value), flush=True)


if __name__ == "__main__":
  cli.run(main)
