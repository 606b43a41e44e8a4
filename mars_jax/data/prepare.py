"""`python -m mars_jax.data.prepare --config configs/X.py [--config.data.source=...]
[--workers N] [--verify]`: tokenizes a config's data files into the tokenized cache
(mars_jax/data/cache.py, docs/data.md), or finds it built, and prints one line:

  prepared: 100000 records read, 99950 kept, 50 bad, 34012345 tokens in 61.2 s; cache
  /root/.cache/mars_jax/data (12 shards built, 0 found)

"kept" counts the examples cached; the row length, truncation, held-out split and
packing are applied when training reads them. Training builds the cache itself when it
is missing: this command does it ahead, e.g. once on a login node, or on every host of
a slice at once (`jax.distributed` is started as `python -m mars_jax.train` starts it,
each process builds its share of the shards; the cache directory, data.cache_dir or
$MARS_JAX_DATA_CACHE, must then be shared storage). --workers: processes per host
(default data.cache_workers; 0: the CPUs this process may run on). --verify reads
every byte of a cache found built and checks its crc32 (opening checks sizes only; a
fresh build is always checked whole).

  python -m mars_jax.data.prepare --list [--cache_dir DIR]
  python -m mars_jax.data.prepare --clean [--older_than 2026-11-01|30d] [--dry_run]

--list prints one line per key of the cache directory (--cache_dir, else the config's
data.cache_dir, else $MARS_JAX_DATA_CACHE or ~/.cache/mars_jax/data): its state, size,
records and tokens, last use and the file it was built from. --clean removes the keys
no run will read (damaged, of an old format, unfinished for a day) and, with
--older_than, those last used before that date (or that many days ago); only
directories this project wrote are removed (mars_jax/data/cache_admin.py).

A config or data error prints one line, `error: ...`, and exits with status 2
(MARS_JAX_TRACEBACK=1 shows the traceback).
"""

from __future__ import annotations

import datetime
import logging
import os
import time

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mars_jax.core import cli
from mars_jax.data import cache, cache_admin, pipeline
from mars_jax.data.run_tokenizer import data_tokenizer
from mars_jax.parallel import distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                          lock_config=True)
_WORKERS = flags.DEFINE_integer("workers", None, "tokenizing processes per host (default: "
                                "data.cache_workers; 0: the CPUs this process may run on)",
                                lower_bound=0)
_VERIFY = flags.DEFINE_bool("verify", False, "check every byte (crc32) of a cache found built")
_LIST = flags.DEFINE_bool("list", False, "list the cache directory's keys and exit")
_CLEAN = flags.DEFINE_bool("clean", False, "remove the keys no run will read and exit")
_OLDER = flags.DEFINE_string("older_than", None, "with --clean: also the keys last used "
                             "before this date (YYYY-MM-DD) or this many days ago (30d)")
_DRY = flags.DEFINE_bool("dry_run", False, "with --clean: say what would be removed")
_DIR = flags.DEFINE_string("cache_dir", None, "with --list/--clean: the cache directory")
_LOG = logging.getLogger("mars_jax.data.prepare")


def prepare(cfg, workers: int | None = None, verify: bool = False) -> str:
  """Builds or finds the cache of `cfg.data` (with `verify`, every byte of what was
  found checked); returns the one-line summary."""
  begin = time.perf_counter()
  tokenizer = data_tokenizer(cfg)
  report = cache.BuildReport()
  files = pipeline.prepare_cache(cfg.data, tokenizer, workers=workers, report=report,
                                 verify=verify)
  bad = sum(len(f.bad) + f.empty for f in files)
  for f in files:
    for kind, where, reason in f.bad[:5]:
      _LOG.warning("bad record: %s: %s: %s", where, kind, reason)
  return (f"prepared: {sum(f.records for f in files)} records read, "
          f"{sum(len(f) for f in files)} kept, {bad} bad, "
          f"{sum(int(f.lengths.sum()) for f in files)} tokens in "
          f"{time.perf_counter() - begin:.1f} s; cache {pipeline.cache_dir(cfg.data)} "
          f"({report.built} shards built, {report.reused} found"
          + (f", {report.repaired} damaged key(s) rebuilt" if report.repaired else "")
          + (", every byte checked" if verify else "") + ")")


def older_than(text: str | None, now: float | None = None) -> float | None:
  """--older_than as a time: "YYYY-MM-DD" (local midnight) or "<N>d" (N days ago)."""
  if text is None:
    return None
  now = time.time() if now is None else now
  if text.endswith("d") and text[:-1].isdigit():
    return now - int(text[:-1]) * 86400
  try:
    return datetime.datetime.strptime(text, "%Y-%m-%d").timestamp()
  except ValueError as e:
    raise ValueError(f"--older_than={text!r}; expected a date (2026-11-01) or a number "
                     "of days (30d).") from e


def admin(cache_dir: str, do_list: bool, do_clean: bool, since: float | None,
          dry_run: bool) -> str:
  """--list and --clean: their lines."""
  lines = []
  if do_clean:
    gone = cache_admin.clean(cache_dir, since, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    lines += [f"{verb}: {cache_admin.describe(k)}" for k in gone]
    lines.append(f"{verb} {len(gone)} key(s), {sum(k.bytes for k in gone) / 2**20:.1f} MiB, "
                 f"from {cache_dir}")
  if do_list:
    found = cache_admin.keys(cache_dir)
    lines += [cache_admin.describe(k) for k in found]
    lines.append(f"{len(found)} key(s), {sum(k.bytes for k in found) / 2**20:.1f} MiB, "
                 f"in {cache_dir}")
  return "\n".join(lines)


def main(_) -> None:
  cfg = _CONFIG.value
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("mars_jax").setLevel(logging.INFO)
  with cli.one_line_errors():
    if _LIST.value or _CLEAN.value:
      directory = _DIR.value or (pipeline.cache_dir(cfg.data) if cfg
                                 else cache.default_dir())
      print(admin(directory, _LIST.value, _CLEAN.value, older_than(_OLDER.value),
                  _DRY.value), flush=True)
      return
    if cfg is None:
      raise ValueError("--config is required to prepare a cache (or give --list/--clean).")
    d = cfg.distributed
    distributed.initialize(distributed.plan_from_env(
        os.environ, coordinator_address=d.coordinator_address,
        num_processes=d.num_processes, process_id=d.process_id, port=d.port))
    print(prepare(cfg, _WORKERS.value, _VERIFY.value), flush=True)


if __name__ == "__main__":
  cli.run(main, required=())
