"""The data pipeline the trainer calls: config -> validated examples -> batches.

  data = load_data(data_cfg, tokenizer)   # reads and checks everything now (tokenized
                                          # once into the cache, read lazily after)
  print(data.stats.summary())
  it = data.train_iterator(batch_size=32)  # grain DatasetIterator, endless or num_epochs
  batch = next(it)                         # see "Batches" below
  state = it.get_state()                   # JSON-able dict: save it with the checkpoint
  it.set_state(state)                      # a fresh iterator resumes with the same batches
  for batch in data.eval_batches(batch_size=32): ...

Config fields (a dict or ml_collections ConfigDict; `default_config()` has them all,
an unknown key is an error):
  source        "synthetic", or data files: a path, glob, directory or comma-separated
                list of them (.jsonl/.json lines or a .json array, either maybe .gz or
                .zst; .parquet; or a directory written by `datasets`' save_to_disk) of
                chat records, e.g. {"messages": [{"role":
                "system"|"user"|"assistant"|"tool", "content": str}]}.
  format        the records' shape: "auto" (detected per file), "messages" (OpenAI),
                "sharegpt", "alpaca" or "prompt_completion" (mars_jax.data.formats).
  train_on      "all": every assistant turn is a target (the default); "last": only
                the last one (the authors' setting).
  chat_template_kwargs
                keyword arguments of the tokenizer's chat template, a dict or its JSON
                text, e.g. '{"enable_thinking": false}' for Qwen3.
  chat_template_name
                for a tokenizer with several named chat templates, the one to render
                chats with (e.g. "tool_use"); None: the tokenizer's default.
  eval_source   held-out chat files (same forms); None: for "synthetic" the test split,
                for files the `num_eval` records held out of `source` (none if 0).
  num_eval      records of a file `source` held out for eval when `eval_source` is
                None: a fixed random subset drawn by `seed` over all the files' records
                (the same whatever the process count); they never appear in training.
                0 (the default): no held-out slice, so a file source without
                `eval_source` has no eval set and the trainer trains without eval loss
                (it says so in one line). The eval set is read in whole global batches
                (`eval_batches`), so hold out at least one batch of records.
  max_length    row length L in tokens (512); longer records are cut (see `truncate`).
  truncate      True: cut records longer than L and count them; False: such records
                are bad input ("too_long"), handled by `on_bad`.
  packing       False: one example per row, right-padded. True: several examples per
                row (first-fit), with "segment_ids" and per-segment "positions".
  seed          shuffling seed; every epoch has its own order drawn from it.
  num_epochs    passes over the training set; None: repeat forever (use a step count).
  on_bad        "skip": skip bad records and report them in `stats`; "error": raise
                BadInputError at load time naming the file and line of the first.
  cache         True (the default): data files are tokenized once into the tokenized
                cache (mars_jax/data/cache.py; `python -m mars_jax.data.prepare` builds
                it ahead) and read from it lazily; False: tokenized in memory at every
                load. The embedded task ("synthetic") is always generated in memory.
  cache_dir     where the cache lives (None: $MARS_JAX_DATA_CACHE, else
                ~/.cache/mars_jax/data); shared storage for several hosts.
  cache_hash    how the cache's key hashes a file's content: "full" (the default)
                every byte, once per file version (path, size, mtime, inode; kept in
                the cache's .stat/); "sample" its size and first and last MiB (an edit
                elsewhere that keeps the size is not seen). Never its path or dates: a
                copy of the file elsewhere finds the same key.
  cache_workers processes that tokenize on each host (0: the CPUs this process may
                run on).
  cache_shard_records
                records per shard of the cache: the unit of parallel work and of what
                a killed build loses.
  synthetic     the embedded task, for source="synthetic": num_train and num_test
                problems, the split `seed`, `test_fraction` of problem identities
                reserved for test, and `difficulty` ("standard" or "easy": smaller
                numbers, learnable by a tiny model in minutes; see
                mars_jax.data.synthetic).

Batches: {"tokens": int32[b, L], "loss_mask": bool[b, L]}, loss_mask True exactly on
assistant targets; with packing also "segment_ids": int32[b, L] (1, 2, ... per example
in the row, 0 on padding) and "positions": int32[b, L] (0.. restarting per segment).
b is the per-process batch: `batch_size // shard_count` for a global batch size.

Sharding: process p of k takes elements p, p+k, p+2k, ... of the one shuffled stream,
so (without packing) the k per-process batches of step t together are exactly the
single-process global batch t, whatever k. A finite stream is cut to whole global
batches so every process yields the same number of batches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any, Mapping

import grain
import grain.experimental as grain_exp
import ml_collections
import numpy as np

from mars_jax.data import cache, formats, synthetic
from mars_jax.data.chat import TRAIN_ON, pad_example, pad_id_of
from mars_jax.data.examples import CachedSource, TokenizedSource
from mars_jax.data.sources import RecordsSource, expand_paths, open_file
from mars_jax.data.validation import POLICIES, DataStats

_LOG = logging.getLogger(__name__)
_READ = grain.ReadOptions(num_threads=1, prefetch_buffer_size=256)


def default_config() -> ml_collections.ConfigDict:
  """The data config with every field at its default (see the module docstring)."""
  placeholder = ml_collections.config_dict.placeholder
  return ml_collections.ConfigDict({
      "source": "synthetic",
      "format": "auto",
      "train_on": "all",
      "chat_template_kwargs": "{}",
      "chat_template_name": placeholder(str),
      "eval_source": placeholder(str),
      "num_eval": 0,
      "max_length": 512,
      "truncate": True,
      "packing": False,
      "seed": 0,
      "num_epochs": placeholder(int),
      "on_bad": "skip",
      "cache": True,
      "cache_dir": placeholder(str),
      "cache_hash": "full",
      "cache_workers": 0,
      "cache_shard_records": cache.SHARD_RECORDS,
      "synthetic": {"num_train": 20000, "num_test": 500, "seed": 0, "test_fraction": 0.1,
                    "difficulty": "standard"},
  })


def _resolve(cfg: Mapping[str, Any]) -> dict[str, Any]:
  """Defaults filled in and every value checked; unknown keys are an error."""
  out = default_config().to_dict()
  given = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else dict(cfg)
  unknown = sorted(set(given) - set(out)) + sorted(
      f"synthetic.{k}" for k in set(given.get("synthetic") or {}) - set(out["synthetic"]))
  if unknown:
    raise ValueError(f"unknown data config keys {unknown}; known: {sorted(out)} and "
                     f"synthetic.{sorted(out['synthetic'])}.")
  out.update({k: v for k, v in given.items() if k != "synthetic"})
  out["synthetic"].update(given.get("synthetic") or {})
  syn = out["synthetic"]
  is_int = lambda v, low: isinstance(v, int) and not isinstance(v, bool) and v >= low  # noqa: E731
  checks = [
      ("max_length", out["max_length"], is_int(out["max_length"], 2), "an int >= 2"),
      ("on_bad", out["on_bad"], out["on_bad"] in POLICIES, f"one of {POLICIES}"),
      ("num_epochs", out["num_epochs"],
       out["num_epochs"] is None or is_int(out["num_epochs"], 1), "None or an int >= 1"),
      ("num_eval", out["num_eval"], is_int(out["num_eval"], 0), "an int >= 0"),
      ("cache", out["cache"], isinstance(out["cache"], bool), "True or False"),
      ("cache_hash", out["cache_hash"], out["cache_hash"] in ("sample", "full"),
       '"full" (every byte of each file) or "sample" (its first and last MiB)'),
      ("cache_workers", out["cache_workers"], is_int(out["cache_workers"], 0),
       "an int >= 0 (0: the CPUs this process may run on)"),
      ("cache_shard_records", out["cache_shard_records"],
       is_int(out["cache_shard_records"], 1), "an int >= 1"),
      ("source", out["source"], bool(out["source"]), '"synthetic" or data files'),
      ("synthetic.num_train", syn["num_train"], is_int(syn["num_train"], 1), "an int >= 1"),
      ("synthetic.num_test", syn["num_test"], is_int(syn["num_test"], 0), "an int >= 0"),
  ]
  for name, value, ok, expected in checks:
    if not ok:
      raise ValueError(f"data.{name}={value!r}; expected {expected}.")
  formats.check_format(out["format"])
  if out["train_on"] not in TRAIN_ON:
    raise ValueError(f"data.train_on={out['train_on']!r}; expected one of {TRAIN_ON}.")
  out["chat_template_kwargs"] = template_kwargs(out["chat_template_kwargs"])
  if out["chat_template_name"] is not None:   # the named template, as transformers takes it
    out["chat_template_kwargs"] = {**out["chat_template_kwargs"],
                                   "chat_template": out["chat_template_name"]}
  return out


def check_template_name(cfg: Mapping[str, Any], tokenizer) -> None:
  """data.chat_template_name names one of the tokenizer's chat templates."""
  name = cfg["chat_template_name"]
  templates = getattr(tokenizer, "chat_template", None)
  if name is None:
    if isinstance(templates, dict) and "default" not in templates:
      raise ValueError(f"the tokenizer has chat templates {sorted(templates)} and none "
                       "named 'default'; choose one with data.chat_template_name.")
    return
  if not isinstance(templates, dict) or name not in templates:
    have = sorted(templates) if isinstance(templates, dict) else (
        "one unnamed template" if templates else "no chat template")
    raise ValueError(f"data.chat_template_name={name!r}: the tokenizer has {have}; name "
                     "one of its templates, or leave data.chat_template_name unset.")


def template_kwargs(value: Any) -> dict[str, Any]:
  """`data.chat_template_kwargs` as a dict: a mapping, or JSON text of an object."""
  if isinstance(value, str):
    try:
      value = json.loads(value or "{}")
    except ValueError as e:
      raise ValueError(f"data.chat_template_kwargs={value!r} is not JSON ({e}); pass an "
                       """object, e.g. '{"enable_thinking": false}'.""") from e
  if not isinstance(value, Mapping):
    raise ValueError(f"data.chat_template_kwargs={value!r}; expected a JSON object of "
                     "chat template keyword arguments.")
  return dict(value)


def task_settings(data_cfg: Mapping[str, Any]) -> dict[str, Any]:
  """The task record of a data config (see `synthetic.save_task_settings`):
  {"source", "synthetic": {seed, test_fraction, difficulty, num_train, num_test}},
  defaults filled in. The final evaluation and the run's task.json both come from it."""
  cfg = _resolve(data_cfg)
  syn = cfg["synthetic"]
  synthetic.check_split_settings(syn, "data.synthetic")
  return {"source": cfg["source"],
          "synthetic": {k: syn[k] for k in ("seed", "test_fraction", "difficulty",
                                             "num_train", "num_test")}}


class _Subset:
  """Items `indices` of a source, keeping `where` for reports."""

  def __init__(self, source, indices: np.ndarray):
    self._source, self._indices = source, indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, i: int):
    return self._source[int(self._indices[i])]

  def where(self, i: int) -> str:
    return self._source.where(int(self._indices[i]))


def _file_sources(spec, stats: DataStats, fmt: str) -> list:
  return [open_file(path, stats, fmt) for path in expand_paths(spec)]


def _held_out_flags(sizes: list[int], num_eval: int, seed: int,
                    stats: DataStats) -> list[np.ndarray]:
  """Per file of `sizes` usable records, bool[size]: True on the `num_eval` records of
  all the files that are held out for eval (a permutation drawn by `seed`)."""
  total = sum(sizes)
  if num_eval >= total:
    raise ValueError(f"data.num_eval={num_eval} leaves no training records of the {total} "
                     f"usable ones.\n{stats.summary()}")
  is_eval = np.zeros(total, bool)
  is_eval[np.random.default_rng(seed).permutation(total)[:num_eval]] = True
  return np.split(is_eval, np.cumsum(sizes)[:-1])


def _held_out(sources: list, num_eval: int, seed: int,
              stats: DataStats) -> tuple[list, list]:
  """Splits file sources into (train, eval) subsets, `num_eval` records to eval."""
  flags = _held_out_flags([len(s) for s in sources], num_eval, seed, stats)
  return ([_Subset(s, np.flatnonzero(~f)) for s, f in zip(sources, flags)],
          [_Subset(s, np.flatnonzero(f)) for s, f in zip(sources, flags)])


@dataclasses.dataclass
class ChatData:
  """Validated, tokenized train (and eval) examples of one data config.

  `train`/`eval` items are {"tokens": int32[n], "loss_mask": bool[n]}, n <= L.
  """
  config: dict[str, Any]
  train: TokenizedSource | CachedSource
  eval: TokenizedSource | CachedSource | None
  stats: DataStats
  pad_id: int

  @property
  def max_length(self) -> int:
    return self.config["max_length"]

  def num_steps(self, batch_size: int) -> int | None:
    """Global batches of `batch_size` rows in the whole run (None: endless).

    Exact without packing: floor(num_epochs * examples / batch_size), batches may
    straddle epochs. With packing, rows hold several examples, so this is an upper
    bound.
    """
    epochs = self.config["num_epochs"]
    return None if epochs is None else epochs * len(self.train) // batch_size

  def train_iterator(self, *, batch_size: int, shard_index: int | None = None,
                     shard_count: int | None = None,
                     global_batch: bool = True) -> grain.DatasetIterator:
    """The training batches of process `shard_index` of `shard_count`.

    `batch_size` is global (split evenly over processes) unless `global_batch` is
    False, then per process. Shards default to jax's process index and count.
    Returns a grain iterator with `get_state()`/`set_state()` (JSON-able state).
    """
    index, count = _shard(shard_index, shard_count)
    rows = _per_process(batch_size, count, global_batch)
    cfg = self.config
    ds = grain.MapDataset.source(self.train).shuffle(seed=cfg["seed"])
    ds = ds.repeat(cfg["num_epochs"])
    if cfg["num_epochs"] is not None:
      usable = len(ds) // (rows * count) * (rows * count)
      _LOG.info("data: %d epochs of %d examples; the last %d are cut to whole global "
                "batches of %d.", cfg["num_epochs"], len(self.train), len(ds) - usable,
                rows * count)
      ds = ds[:usable]
    ds = ds[index::count].to_iter_dataset(_READ)
    return iter(self._rows(ds, packing=cfg["packing"], bins=rows)
                .batch(rows, drop_remainder=True))

  def eval_batches(self, *, batch_size: int, shard_index: int | None = None,
                   shard_count: int | None = None,
                   global_batch: bool = True) -> list[dict[str, np.ndarray]]:
    """The held-out batches of this process, in order, one example per padded row.

    Never packed, so every process gets the same number of batches: the eval set
    is cut to whole global batches (the cut is `len(eval) % batch_size` examples).
    Raises ValueError if there is no eval set or it is smaller than one global batch.
    """
    if self.eval is None or not len(self.eval):
      raise ValueError("no eval set: set data.eval_source, data.num_eval (file "
                       "sources) or data.synthetic.num_test (source='synthetic').")
    index, count = _shard(shard_index, shard_count)
    rows = _per_process(batch_size, count, global_batch)
    usable = len(self.eval) // (rows * count) * (rows * count)
    if not usable:
      raise ValueError(f"the eval set has {len(self.eval)} examples, fewer than one "
                       f"global batch of {rows * count}.")
    ds = grain.MapDataset.source(self.eval)[:usable][index::count].to_iter_dataset(_READ)
    return list(self._rows(ds, packing=False, bins=rows).batch(rows))

  def _rows(self, ds: grain.IterDataset, *, packing: bool, bins: int) -> grain.IterDataset:
    """Examples -> rows of length L: padded, or first-fit packed into `bins` at a time."""
    length = self.max_length
    if not packing:
      return ds.map(functools.partial(pad_example, length=length, pad_id=self.pad_id))
    packed = grain_exp.FirstFitPackIterDataset(
        ds, length_struct={"tokens": length, "loss_mask": length}, num_packing_bins=bins,
        seed=self.config["seed"], shuffle_bins=True,
        padding_struct={"tokens": self.pad_id, "loss_mask": False})
    return packed.map(_packed_row)


def _packed_row(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """grain's packed features -> tokens, loss_mask, segment_ids, positions (all [L])."""
  return {"tokens": row["tokens"].astype(np.int32),
          "loss_mask": row["loss_mask"].astype(bool),
          "segment_ids": row["tokens_segment_ids"].astype(np.int32),
          "positions": row["tokens_positions"].astype(np.int32)}


def _shard(index: int | None, count: int | None) -> tuple[int, int]:
  if index is None or count is None:
    import jax  # pylint: disable=import-outside-toplevel
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
  if not 0 <= index < count:
    raise ValueError(f"shard_index={index} is outside 0..shard_count-1={count - 1}.")
  return index, count


def _per_process(batch_size: int, count: int, global_batch: bool) -> int:
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}; expected >= 1.")
  if not global_batch:
    return batch_size
  if batch_size % count:
    raise ValueError(f"global batch_size={batch_size} is not divisible by the "
                     f"{count} processes.")
  return batch_size // count


def cache_settings(cfg: Mapping[str, Any]) -> cache.Settings:
  """What of a resolved data config goes into the tokenized cache's key."""
  return cache.Settings(fmt=cfg["format"], train_on=cfg["train_on"],
                        template_kwargs=json.dumps(cfg["chat_template_kwargs"],
                                                   sort_keys=True),
                        full_hash=cfg["cache_hash"] == "full",
                        shard_records=cfg["cache_shard_records"])


def cache_dir(cfg: Mapping[str, Any]) -> str:
  """data.cache_dir, else $MARS_JAX_DATA_CACHE, else ~/.cache/mars_jax/data."""
  return cfg["cache_dir"] or cache.default_dir()


def prepare_cache(data_cfg: Mapping[str, Any], tokenizer, *, workers: int | None = None,
                  report: cache.BuildReport | None = None,
                  verify: bool = False) -> list[cache.FileCache]:
  """Builds (or finds) the tokenized cache of every file of `data.source` and
  `data.eval_source`; returns them opened and checked (every byte with `verify`), the
  train files first.
  With several JAX processes each builds its share and all wait for the rest."""
  cfg = _resolve(data_cfg)
  if cfg["source"] == "synthetic":
    raise ValueError('data.source="synthetic" is generated in memory; the tokenized '
                     "cache is for data files.")
  check_template_name(cfg, tokenizer)
  paths = expand_paths(cfg["source"]) + (
      expand_paths(cfg["eval_source"]) if cfg["eval_source"] is not None else [])
  index, count = _shard(None, None)
  return cache.ensure(paths, tokenizer, cache_settings(cfg), cache_dir=cache_dir(cfg),
                      workers=cfg["cache_workers"] if workers is None else workers,
                      process_index=index, process_count=count, barrier=_barrier,
                      report=report, verify=verify)


def _barrier() -> None:
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  multihost_utils.sync_global_devices("mars_jax data cache built")


def _load_cached(cfg: dict[str, Any], tokenizer, stats: DataStats) -> ChatData:
  """load_data over the tokenized cache: what it stores is read back as the in-memory
  path would have found it (counts, bad records, the held-out split), then the row
  length is applied; examples stay on disk until a batch reads them."""
  n_train = len(expand_paths(cfg["source"]))
  files = prepare_cache(cfg, tokenizer)
  for file in files:
    stats.records += file.records
    for kind, where, reason in file.bad:
      stats.report_bad(kind, where, reason)
    if file.empty:
      stats.report_bad("empty_file", file.path, "no records")
  train_files, eval_files = files[:n_train], files[n_train:]
  train_picks = [np.arange(len(f)) for f in train_files]
  eval_picks = [np.arange(len(f)) for f in eval_files]
  if cfg["num_eval"] and cfg["eval_source"] is None:
    flags = _held_out_flags([f.num_valid for f in train_files], cfg["num_eval"],
                            cfg["seed"], stats)
    held = [flag[f.valid] for f, flag in zip(train_files, flags)]
    train_picks = [np.flatnonzero(~h) for h in held]
    eval_files, eval_picks = train_files, [np.flatnonzero(h) for h in held]
  fit = functools.partial(CachedSource, stats=stats, max_length=cfg["max_length"],
                          truncate=cfg["truncate"])
  train = fit(train_files, train_picks)
  held_out = fit(eval_files, eval_picks) if eval_files else None
  data = ChatData(config=cfg, train=train, eval=held_out, stats=stats,
                  pad_id=pad_id_of(tokenizer))
  if not len(data.train):
    raise ValueError(f"no training examples left in {cfg['source']!r}.\n{stats.summary()}")
  return data


def load_data(data_cfg: Mapping[str, Any], tokenizer) -> ChatData:
  """Reads, checks and tokenizes the train and eval examples of `data_cfg`.

  All bad input is found here: under on_bad="error" this raises BadInputError with
  the file and line; under "skip" the counts are in `.stats` (also logged). Raises
  ValueError if no training example is left.
  """
  cfg = _resolve(data_cfg)
  stats = DataStats(on_bad=cfg["on_bad"])
  if cfg["source"] != "synthetic" and cfg["cache"]:
    return _load_cached(cfg, tokenizer, stats)   # prepare_cache checks the template name
  check_template_name(cfg, tokenizer)
  if cfg["source"] == "synthetic":
    syn = cfg["synthetic"]
    kw = {"seed": syn["seed"], "test_fraction": syn["test_fraction"],
          "difficulty": syn["difficulty"]}
    train = [RecordsSource(synthetic.chat_records(syn["num_train"], split="train", **kw),
                           stats, name="synthetic-train")]
    held = ([RecordsSource(synthetic.chat_records(syn["num_test"], split="test", **kw),
                           stats, name="synthetic-test")] if syn["num_test"] else [])
  else:
    train = _file_sources(cfg["source"], stats, cfg["format"])
    held = []
    if cfg["num_eval"] and cfg["eval_source"] is None:
      train, held = _held_out(train, cfg["num_eval"], cfg["seed"], stats)
  if cfg["eval_source"] is not None:
    held = _file_sources(cfg["eval_source"], stats, cfg["format"])
  tok = functools.partial(TokenizedSource, tokenizer=tokenizer, stats=stats,
                          max_length=cfg["max_length"], truncate=cfg["truncate"],
                          train_on=cfg["train_on"],
                          template_kwargs=cfg["chat_template_kwargs"])
  data = ChatData(config=cfg, train=tok(train), eval=tok(held) if held else None,
                  stats=stats, pad_id=pad_id_of(tokenizer))
  if not len(data.train):
    raise ValueError(f"no training examples left in {cfg['source']!r}.\n{stats.summary()}")
  return data
