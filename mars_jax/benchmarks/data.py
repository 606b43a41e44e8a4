"""`python -m mars_jax.bench data`: building and reading the training data, ours against
what users run today for the same work (`datasets` .map, as TRL's SFTTrainer does it), in
one run.

  python -m mars_jax.bench data [--chats 100000[,1000000]] [--workers-list 1,2]
      [--work-dir runs/bench_data] [--seed 0] [--model HF_DIR] [--skip-peer]
      [--peer-batched] [--drop-page-cache] [--out bench_data.json]
  python -m mars_jax.bench data --stages 5000 [--chats 100000] [--out stages.json]

`--drop-page-cache` empties the kernel's page cache (root, Linux) before each warm
start, so that it reads the cache from the disk as a start on another host would.
`--stages K` times each step of a build on one core over the first K chats instead
(see `child_stages`), the peer's per-chat work beside it.

Needs the test requirements (requirements-test.txt: dashscope ships the Qwen BPE ranks,
torch writes the checkpoint): the model is tests/qwen_tokenizers.py's
`make_qwen_checkpoint(DIR, "qwen2.5")`, a tiny random Qwen2 with the real Qwen2.5
tokenizer and chat template, written once to WORK/qwen2.5-tiny (or --model DIR).

Chats (mars_jax/benchmarks/chat_corpus.py): WORK/chats-N-seedS.jsonl, N OpenAI records
{"messages": [...]}, deterministic from the seed (numpy, one pass: 49 s and 1.4 GB a
million here): a
third with a system prompt, 1-3 user/assistant turns, English-like text from a word
list (Zipf frequencies, capitals, commas, numbers, questions, paragraphs in replies),
turn lengths varied per chat; ~340 tokens a chat with the Qwen2.5 template (median
~300; the longest of 12,288 sampled, 864; a chat has at most 1,122 words, so none is
cut at max_length 2048). A sidecar WORK/chats-N-seedS.json records N, the seed, the
generator's version and the file's size; a file that matches it is reused.

Per N and per W in --workers-list, each build into a fresh empty cache directory, and
a warm start of a new process from that cache, then the directory is removed:

  ours   cold: python -m mars_jax.data.prepare --config configs/tiny.py
             --config.model.init=MODEL --config.data.source=CHATS
             --config.data.max_length=2048 --config.data.cache_dir=CACHE --workers W
         (its one summary line gives the records kept and the tokens)
         warm: what training does at start: configs/tiny.py's config with those
             overrides, `run_tokenizer.data_tokenizer(cfg)`, `load_data(cfg.data, tok)`
             (which reads the cache), `next(data.train_iterator(batch_size=32, ...))`;
             a hit when no file in the cache changed but the key's `last_used` stamp
             and its `derived/` counts (what every reader may write)
  peer   cold: `Dataset.from_json(CHATS, cache_dir=CACHE)` (HF_DATASETS_CACHE=CACHE
             too), then `.map(fn, num_proc=W)`, fn = `tokenizer.apply_chat_template(
             messages, tokenize=False)` then `tokenizer(text, add_special_tokens=False)`
             -> input_ids (as TRL's SFTTrainer prepares conversational data: a .map,
             one record per call; --peer-batched: batched=True); tokenizer =
             AutoTokenizer.from_pretrained(MODEL); first batch `ds[:32]`
         warm: the same in a new process on the same cache: datasets finds the Arrow
             file and the map's cache files by fingerprint; the run checks that every
             cache file of the mapped dataset existed before (`cache_hit`). To find
             the fingerprint, datasets hashes the map function, the tokenizer it holds
             included, cold or warm: ~5 s for Qwen2.5's on one CPU core, whatever N
             (the JSON's map_s holds it).

Not the same work: ours also finds each chat's assistant spans and stores the loss
masks (the targets) with each record's offsets, line and first target, and checks
every record (bad ones are counted and reported); the peer's plain
tokenize has no targets (TRL computes an assistant mask only with
`assistant_only_loss`, through `return_assistant_tokens_mask`, which needs a template
with {% generation %} tags: Qwen2.5's has none). Both tokenize the same rendered text,
so their token counts are equal.

Figures (each cold build and warm start is a subprocess whose process tree, workers
included, is polled every 0.2 s with psutil): cold wall s (process start to exit,
imports included), chats/s and tokens/s, tokens/s per process (/ W), CPU s (user + sys
of the tree), the peak of the tree's summed RSS (and summed PSS, which counts pages
shared between forked workers once), the cache's size on disk; warm: import s and s to
the first batch, both from process start, the tree's peak RSS, and the RSS growth
attributable to the data (RSS after the first batch minus RSS before loading it, the
tokenizer already loaded). Import s counts transformers' tokenizer modules for both
systems (transformers imports them at first use, inside the tokenizer's loading); the
JSON also has tokenizer_s (start to a loaded tokenizer). After the table: the cold
speedup of each W over W=1 (ours cuts each file into shards of data.cache_shard_records,
5,000 records by default, one process a shard: below 10,000 chats W=2 has nothing to
share), and the peer's cold and warm seconds over ours.

Hidden child modes (run by the bench itself): --child ours-warm | peer-cold | peer-warm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

from mars_jax.benchmarks.chat_corpus import chats_file
from mars_jax.benchmarks.data_report import (MORE_BATCHES, SYSTEMS, comparisons, fmt,
                                             print_stages, print_table, row_of)
from mars_jax.benchmarks.measured import (DROP_CACHES, RESULT, ROOT, check_can_drop_page_cache,
                                          check_exit, child_env, child_result,
                                          drop_page_cache, handles, max_rss_mb, rss_bytes,
                                          run_measured, started_at, tree_bytes)

BATCH = 32            # the first batch's rows

# ---- model ---------------------------------------------------------------------------


def default_model(work_dir: str) -> str:
  """WORK/qwen2.5-tiny: tests/qwen_tokenizers.py's tiny random Qwen2 with the real
  Qwen2.5 tokenizer, written once (needs the test requirements: dashscope, torch)."""
  out = os.path.abspath(os.path.join(work_dir, "qwen2.5-tiny"))
  if os.path.isfile(os.path.join(out, "config.json")):
    return out
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from qwen_tokenizers import make_qwen_checkpoint  # pylint: disable=import-outside-toplevel
  os.makedirs(work_dir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".qwen2.5-tiny.tmp-", dir=work_dir)  # ours alone to remove
  try:
    make_qwen_checkpoint(tmp, "qwen2.5")
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out


def _count(text: str, word: str) -> int | None:
  """The last "<number> word" in text (commas allowed in the number), else None."""
  found = re.findall(rf"(\d[\d,]*)\s+{word}\b", text)
  return int(found[-1].replace(",", "")) if found else None


def tree_state(path: str, ignore: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
  """{file: (size, mtime_ns)} of every file under path, but files and directories named
  in `ignore` (and what those directories hold)."""
  out = {}
  for root, dirs, files in os.walk(path):
    dirs[:] = [d for d in dirs if d not in ignore]
    for name in files:
      if name in ignore:
        continue
      full = os.path.join(root, name)
      try:
        st = os.stat(full)
      except OSError:
        continue
      out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns)
  return out


def _reader_bookkeeping() -> frozenset[str]:
  """What every reader of our cache may write into a key (its `last_used` stamp and
  its `derived/` counts): a warm start that writes only these built nothing. (Imported
  here, in the bench's own process, not in the peer's children: it brings JAX.)"""
  from mars_jax.data import cache_files  # pylint: disable=import-outside-toplevel
  return frozenset({cache_files.DERIVED, cache_files.LAST_USED})


# ---- ours ----------------------------------------------------------------------------

TINY = os.path.join(ROOT, "configs", "tiny.py")
MAX_LENGTH = 2048


def prepare_command(model: str, chats: str, cache: str, workers: int) -> list[str]:
  return [sys.executable, "-m", "mars_jax.data.prepare", "--config", TINY,
          f"--config.model.init={model}", f"--config.data.source={chats}",
          f"--config.data.max_length={MAX_LENGTH}", f"--config.data.cache_dir={cache}",
          "--workers", str(workers)]


def _child_command(mode: str, model: str, chats: str, cache: str, workers: int,
                   batched: bool = False) -> list[str]:
  return [sys.executable, "-m", "mars_jax.benchmarks.data", "--child", mode, "--model", model,
          "--chats-file", chats, "--cache", cache, "--workers", str(workers),
          *(["--peer-batched"] if batched else [])]


def ours(model: str, chats: str, cache: str, workers: int, log: str, drop: bool) -> dict:
  """Our cold build (the prepare CLI) into `cache`, then a warm start from it (after
  dropping the page cache when `drop`)."""
  cold = run_measured(prepare_command(model, chats, cache, workers), child_env(), f"{log}-cold")
  check_exit(cold, "mars_jax.data.prepare")
  text = cold["stdout"] + "\n" + cold["stderr"]
  lines = [ln for ln in text.splitlines() if re.search(r"\d\s+tokens\b", ln)]
  cold.update(summary=lines[-1] if lines else None, tokens=_count(text, "tokens"),
              kept=_count(text, "kept"), bad=_count(text, "bad"),
              shards_built=_count(text, "shards built"), cache_bytes=tree_bytes(cache))
  bookkeeping = _reader_bookkeeping()
  state = tree_state(cache, bookkeeping)
  if drop:
    drop_page_cache()
  warm = run_measured(_child_command("ours-warm", model, chats, cache, workers), child_env(),
                      f"{log}-warm")
  check_exit(warm, "our warm start")
  warm.update(child_result(warm), cache_unchanged=tree_state(cache, bookkeeping) == state)
  return {"cold": cold, "warm": warm}


def _tiny_config(model: str, chats: str, cache: str):
  """configs/tiny.py's config with the prepare command's overrides."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("tiny_config", TINY)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  cfg.model.init, cfg.data.source = model, chats
  cfg.data.max_length, cfg.data.cache_dir = MAX_LENGTH, cache
  return cfg


def child_ours_warm(a) -> dict:
  """What training does at start, up to its first batch (see the module doc)."""
  start = started_at()
  # pylint: disable=import-outside-toplevel,unused-import
  from transformers import AutoTokenizer  # noqa: F401  (as the peer's: transformers imports
  from mars_jax.experiments import stages  # noqa: F401  its tokenizer modules lazily, at
  from mars_jax.data import load_data       # first use; training imports `stages`)
  from mars_jax.data.run_tokenizer import data_tokenizer
  import_s = time.time() - start
  cfg = _tiny_config(a.model, a.chats_file, a.cache)
  tok = data_tokenizer(cfg)
  tokenizer_s = time.time() - start
  rss0 = rss_bytes()
  data = load_data(cfg.data, tok)
  it = data.train_iterator(batch_size=BATCH, shard_index=0, shard_count=1)
  batch = next(it)
  first_s = time.time() - start
  rss1 = rss_bytes()
  first = handles(a.cache)
  for _ in range(MORE_BATCHES):   # spread over the shards: the maps stay bounded
    next(it)
  more = handles(a.cache)
  return {"fds_first_batch": first["fds"], "cache_maps_first_batch": first["cache_maps"],
          "fds_more_batches": more["fds"], "cache_maps_more_batches": more["cache_maps"],
          "import_s": import_s, "tokenizer_s": tokenizer_s, "first_batch_s": first_s,
          "data_rss_mb": (rss1 - rss0) / 2**20, "rss_mb": rss1 / 2**20,
          "max_rss_mb": max_rss_mb(), "examples": len(data.train),
          "batch_shape": list(batch["tokens"].shape),
          "batch_targets": int(np.asarray(batch["loss_mask"]).sum())}


def _best(fn, before=lambda: None, repeats: int = 3):
  """(fn's result, the least of `repeats` timings, `before` run untimed before each)."""
  best = float("inf")
  for _ in range(repeats):
    before()
    begin = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - begin)
  return out, best


def child_stages(a) -> dict:
  """Where a build's time goes, on one core as in a build worker: the fixed costs of a
  `prepare` process; a whole shard of the first a.stages chats of the file built as a
  build worker builds it; then each step of that work on the same chats, and the peer's
  work per chat (one render, one tokenize) beside it. Each step is the best of three;
  the BPE's word cache is emptied before each step that tokenizes, so none gains from
  an earlier one."""
  start = started_at()
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  # pylint: disable=import-outside-toplevel
  from mars_jax.data import cache, cache_units, chat, formats, prepare  # noqa: F401
  from mars_jax.data.run_tokenizer import data_tokenizer
  from mars_jax.data.validation import check_messages
  fixed = {"imports_s": time.time() - start}
  cfg = _tiny_config(a.model, a.chats_file, a.cache)
  tok, fixed["tokenizer_s"] = _best(lambda: data_tokenizer(cfg), repeats=1)
  fixed["fingerprint_s"] = _best(lambda: cache.tokenizer_fingerprint(tok), repeats=1)[1]
  fixed["content_hash_s"] = _best(lambda: cache.file_identity(a.chats_file, True),
                                  repeats=1)[1]
  fixed["file_mb"] = os.path.getsize(a.chats_file) / 2**20
  cold = getattr(tok.backend_tokenizer.model, "_clear_cache", lambda: None)  # tokenizers 0.21+
  settings = cache.Settings(fmt="messages", shard_records=a.stages)

  def shard():
    with tempfile.TemporaryDirectory(dir=a.cache) as tmp:
      cache.build_unit(cache_units.plan(a.chats_file, tmp, a.stages, "messages")[0][0], tok,
                       settings)

  steps = {"one shard, whole (ours: read, check, render, tokenize, label, write)":
           _best(shard, cold)[1]}
  with open(a.chats_file, "rb") as f:
    lines = [line for line, _ in zip(f, range(a.stages))]

  def parse():
    out = []
    for line in lines:
      messages = formats.to_messages(json.loads(line), "messages")
      assert check_messages(messages) is None
      out.append(messages)
    return out

  chats, steps["parse and check"] = _best(parse)
  steps["render (one)"] = _best(lambda: [chat.render(tok, m, {}) for m in chats])[1]
  rendered, steps["render and find spans (ours: two renders)"] = _best(
      lambda: [chat.target_spans(tok, m) for m in chats])
  texts = [text for text, _ in rendered]
  steps["BPE alone (the backend's encode_batch)"] = _best(
      lambda: tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False), cold)[1]
  steps["tokenize (the tokenizer call ours makes)"] = _best(
      lambda: tok(texts, add_special_tokens=False, return_attention_mask=False), cold)[1]
  examples, steps["tokenize and label (ours)"] = _best(
      lambda: chat.tokenize_rendered(tok, rendered), cold)
  steps["peer: render and tokenize each"] = _best(lambda: [
      tok(tok.apply_chat_template(m, tokenize=False), add_special_tokens=False)
      for m in chats], cold)[1]
  return {"fixed": fixed, "chats": len(chats), "steps_s": steps,
          "tokens": int(sum(len(e["tokens"]) for e in examples))}


# ---- the peer: datasets .map ---------------------------------------------------------


def peer(model: str, chats: str, cache: str, workers: int, batched: bool, log: str,
         drop: bool) -> dict:
  """The peer's cold build into `cache`, then its warm start in a new process (after
  dropping the page cache when `drop`)."""
  env = child_env(HF_DATASETS_CACHE=cache)
  out = {}
  for phase in ("cold", "warm"):
    state = tree_state(cache)
    if drop and phase == "warm":
      drop_page_cache()
    run = run_measured(_child_command(f"peer-{phase}", model, chats, cache, workers, batched),
                       env, f"{log}-{phase}")
    check_exit(run, f"the peer's {phase} run")
    run.update(child_result(run))
    if phase == "cold":
      run["cache_bytes"] = tree_bytes(cache)
    else:
      run["cache_unchanged"] = tree_state(cache) == state
    out[phase] = run
  return out


def child_peer(a, phase: str) -> dict:
  """Dataset.from_json, then .map(render and tokenize, num_proc=W), then ds[:32]."""
  start = started_at()
  # pylint: disable=import-outside-toplevel
  import datasets
  import pyarrow.compute as pc
  from transformers import AutoTokenizer
  import_s = time.time() - start
  datasets.disable_progress_bars()
  tok = AutoTokenizer.from_pretrained(a.model)
  tokenizer_s = time.time() - start
  rss0 = rss_bytes()
  existing = {os.path.join(a.cache, f) for f in tree_state(a.cache)}

  if a.peer_batched:
    def fn(batch):
      texts = [tok.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
      return {"input_ids": tok(texts, add_special_tokens=False)["input_ids"]}
  else:
    def fn(example):
      text = tok.apply_chat_template(example["messages"], tokenize=False)
      return {"input_ids": tok(text, add_special_tokens=False)["input_ids"]}

  ds = datasets.Dataset.from_json(a.chats_file, cache_dir=a.cache)
  json_s = time.time() - start
  mapped = ds.map(fn, batched=a.peer_batched, num_proc=a.workers if a.workers > 1 else None)
  map_s = time.time() - start
  batch = mapped[:BATCH]
  first_s = time.time() - start
  rss1 = rss_bytes()
  first = handles(a.cache)
  files = [os.path.abspath(f["filename"]) for f in mapped.cache_files]
  lengths = pc.list_value_length(mapped.data.column("input_ids"))
  return {"import_s": import_s, "tokenizer_s": tokenizer_s, "from_json_s": json_s - tokenizer_s,
          "map_s": map_s - json_s, "first_batch_s": first_s,
          "data_rss_mb": (rss1 - rss0) / 2**20, "rss_mb": rss1 / 2**20,
          "max_rss_mb": max_rss_mb(), "kept": len(mapped), "bad": 0,
          "tokens": int(pc.sum(lengths).as_py() or 0),
          "json_cache_hit": bool(ds.cache_files) and all(
              os.path.abspath(f["filename"]) in existing for f in ds.cache_files),
          "cache_hit": bool(files) and all(f in existing for f in files),
          "map_cache_files": len(files), "batch_rows": len(batch["input_ids"]),
          "fds_first_batch": first["fds"], "cache_maps_first_batch": first["cache_maps"]}


# ---- the run -------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
  return [int(x) for x in str(text).split(",") if x.strip()]


def _versions() -> dict:
  out = {"python": sys.version.split()[0]}
  for name in ("datasets", "transformers", "tokenizers", "pyarrow", "jax", "grain", "numpy",
               "psutil", "trl"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def _slim(run: dict) -> dict:
  """A measured run for the JSON: the output's tail instead of all of it."""
  out = {k: v for k, v in run.items() if k not in ("stdout", "stderr")}
  out["output_tail"] = (run.get("stdout", "") + run.get("stderr", ""))[-2000:]
  return out


def run(args) -> dict:
  if args.drop_page_cache:
    check_can_drop_page_cache()
  work = os.path.abspath(args.work_dir)
  os.makedirs(work, exist_ok=True)
  model = os.path.abspath(args.model) if args.model else default_model(work)
  result = {"model_dir": model, "work_dir": work, "seed": args.seed,
            "workers_list": _ints(args.workers_list), "peer_batched": args.peer_batched,
            "skip_peer": args.skip_peer, "max_length": MAX_LENGTH,
            "drop_page_cache": args.drop_page_cache,
            "versions": _versions(), "cpu_count": os.cpu_count(),
            "load_average_start": os.getloadavg(),
            "env": {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM",
                                                   "OMP_NUM_THREADS")},
            "chats": {}, "runs": [], "rows": []}
  for n in _ints(args.chats):
    path, write_s = chats_file(work, n, args.seed)
    result["chats"][n] = {"path": path, "bytes": os.path.getsize(path), "write_s": write_s}
    print(f"chats N={n}: {path} " + ("(reused)" if write_s is None else
                                     f"(written in {write_s:.1f} s)"), flush=True)
    for w in result["workers_list"]:
      systems = ["ours"] + ([] if args.skip_peer else ["peer"])
      for system in systems:
        cache = tempfile.mkdtemp(prefix=f"cache-{system}-{n}-w{w}.", dir=work)  # ours alone
        log = os.path.join(work, f"{system}-{n}-w{w}")
        try:
          if system == "ours":
            measured = ours(model, path, cache, w, log, args.drop_page_cache)
          else:
            measured = peer(model, path, cache, w, args.peer_batched, log,
                            args.drop_page_cache)
        finally:
          shutil.rmtree(cache, ignore_errors=True)
        row = row_of(n, SYSTEMS[system], w, measured)
        result["rows"].append(row)
        result["runs"].append({"chats": n, "system": SYSTEMS[system], "workers": w,
                               **{k: _slim(v) for k, v in measured.items()}})
        print(f"{SYSTEMS[system]} N={n} W={w}: cold {row['cold_s']:.1f} s "
              f"({fmt(row['tokens'])} tokens, peak RSS {row['cold_peak_rss_mb']:.0f} MB), "
              f"warm first batch {row['warm_first_batch_s']:.1f} s", flush=True)
  result["comparisons"] = comparisons(result["rows"])
  result["load_average_end"] = os.getloadavg()
  return result


def stages(args) -> dict:
  """`child_stages` in a new process on the first --chats file (written if missing)."""
  work = os.path.abspath(args.work_dir)
  os.makedirs(work, exist_ok=True)
  model = os.path.abspath(args.model) if args.model else default_model(work)
  path, _ = chats_file(work, _ints(args.chats)[0], args.seed)
  command = _child_command("stages", model, path, work, 1) + ["--stages", str(args.stages)]
  run_ = run_measured(command, child_env(), os.path.join(work, "stages"))
  check_exit(run_, "the stages child")
  return {"model_dir": model, "chats_file": path, "versions": _versions(),
          **child_result(run_)}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench data", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--chats", default="100000", help="comma list of chat counts N")
  p.add_argument("--workers-list", default="1,2", help="comma list of build processes W")
  p.add_argument("--work-dir", default=os.path.join("runs", "bench_data"),
                 help="the chats files, the model, logs and (while measured) the caches")
  p.add_argument("--seed", type=int, default=0, help="the chats' seed")
  p.add_argument("--model", default=None,
                 help="an HF directory (default: WORK/qwen2.5-tiny, written once)")
  p.add_argument("--skip-peer", action="store_true", help="ours only")
  p.add_argument("--peer-batched", action="store_true",
                 help="the peer's .map with batched=True (TRL's is one record per call)")
  p.add_argument("--out", default="bench_data.json", help="JSON of everything")
  p.add_argument("--stages", type=int, default=0,
                 help="instead of the runs: where a build's time goes, step by step on "
                      "one core, over the first STAGES chats of the first --chats file")
  p.add_argument("--drop-page-cache", action="store_true",
                 help=f"drop the kernel's page cache before each warm start (writes "
                      f"{DROP_CACHES}: root on Linux)")
  # the bench's own child processes
  p.add_argument("--child", choices=["ours-warm", "peer-cold", "peer-warm", "stages"],
                 help=argparse.SUPPRESS)
  p.add_argument("--chats-file", help=argparse.SUPPRESS)
  p.add_argument("--cache", help=argparse.SUPPRESS)
  p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
  return p


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  if args.child:
    children = {"ours-warm": child_ours_warm, "stages": child_stages,
                "peer-cold": lambda a: child_peer(a, "cold"),
                "peer-warm": lambda a: child_peer(a, "warm")}
    print(RESULT + json.dumps(children[args.child](args)), flush=True)
    return
  if args.stages:
    result = stages(args)
    print_stages(result)
  else:
    result = run(args)
    print_table(result)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
