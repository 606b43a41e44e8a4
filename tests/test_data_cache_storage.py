"""The tokenized cache where clusters keep it (mars_jax/data/cache.py, cache_files.py,
cache_admin.py): a copy of a file elsewhere finds its key, keys are listed and cleaned,
a read-only cache trains, a failing build cleans up and says what failed, descriptors
stay bounded, and the formats users have (JSON arrays, .jsonl.gz, .jsonl.zst, Parquet
by row group, named chat templates) give the in-memory pipeline's examples. The real
Qwen2.5 tokenizer throughout."""

import concurrent.futures
import errno
import gc
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from qwen_tokenizers import build_qwen_tokenizer
from test_data_cache import ROOT, _equal, write_chats

from mars_jax.data import cache, cache_admin, cache_files, load_data, pipeline


@pytest.fixture(scope="module")
def tok():
  return build_qwen_tokenizer("qwen2.5")


def _keys(cache_dir):
  return sorted(d for d in os.listdir(cache_dir) if not d.startswith("."))


def _same_examples(a, b):
  assert len(a.train) == len(b.train)
  for i in range(len(a.train)):
    _equal(a.train[i], b.train[i])


def test_a_copy_elsewhere_finds_the_key_and_old_keys_are_listed_and_cleaned(tok, tmp_path):
  src = write_chats(tmp_path / "a.jsonl", 60, bad=False)
  cdir = tmp_path / "c"
  cfg = {"source": src, "cache_dir": str(cdir), "cache_shard_records": 25}
  load_data(cfg, tok)
  (key,) = _keys(cdir)
  other = tmp_path / "mnt" / "renamed.jsonl"   # another mount, name and date
  other.parent.mkdir()
  shutil.copyfile(src, other)
  os.utime(other, (1e9, 1e9))
  report = cache.BuildReport()
  pipeline.prepare_cache({**cfg, "source": str(other)}, tok, report=report)
  assert (report.built, report.reused, _keys(cdir)) == (0, 3, [key])
  with open(other, "a") as f:   # new bytes: a new key
    f.write(json.dumps({"messages": [{"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "b"}]}) + "\n")
  assert len(load_data({**cfg, "source": str(other)}, tok).train) == 61
  assert len(_keys(cdir)) == 2
  (cdir / "notes").mkdir()                      # the user's, not ours
  (cdir / "notes" / "todo.txt").write_text("keep me")
  unfinished = cdir / "0123abcd"                # a build abandoned long ago
  unfinished.mkdir()
  (unfinished / cache.KEY_FILE).write_text("{}")
  os.utime(unfinished / cache.KEY_FILE, (1e9, 1e9))
  os.utime(unfinished, (1e9, 1e9))
  (new,) = set(_keys(cdir)) - {key, "0123abcd", "notes"}
  states = {k.name: k.state for k in cache_admin.keys(str(cdir))}
  assert states == {key: "complete", new: "complete", "0123abcd": "unfinished",
                    "notes": "not a cache key"}
  listing = subprocess.run(
      [sys.executable, "-m", "mars_jax.data.prepare", "--list", f"--cache_dir={cdir}"],
      cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
      capture_output=True, text=True, check=True).stdout
  assert f"{key}  complete" in listing and "60 records" in listing and src in listing
  assert listing.strip().endswith(f"4 key(s), {sum(k.bytes for k in cache_admin.keys(str(cdir))) / 2**20:.1f} MiB, in {cdir}")
  gone = cache_admin.clean(str(cdir))
  assert [k.name for k in gone] == ["0123abcd"] and (cdir / "notes" / "todo.txt").exists()
  os.utime(cdir / key / cache_files.LAST_USED, (1e9, 1e9))   # last read in 2001
  gone = cache_admin.clean(str(cdir), older_than=time.time() - 86400)
  assert [k.name for k in gone] == [key] and _keys(cdir) == sorted([new, "notes"])


def _read_only(source, where):
  """Bind-mounts `source` read-only at `where`; False where mounts are not allowed."""
  where.mkdir()
  ok = subprocess.run(["mount", "--bind", str(source), str(where)], capture_output=True)
  if ok.returncode:
    return False
  if subprocess.run(["mount", "-o", "remount,bind,ro", str(where)]).returncode:
    subprocess.run(["umount", str(where)])
    return False
  return True


def test_a_read_only_cache_trains(tok, tmp_path, monkeypatch):
  """A built cache mounted read-only: the data, the trainer's stream-length count (kept
  under MARS_JAX_DERIVED_CACHE instead) and batches; nothing written into it."""
  from mars_jax.training import loop as trainer  # pylint: disable=import-outside-toplevel
  src = write_chats(tmp_path / "a.jsonl", 80, bad=False)
  built = tmp_path / "built"
  load_data({"source": src, "cache_dir": str(built), "cache_shard_records": 30}, tok)
  ro = tmp_path / "ro"
  if not _read_only(built, ro):
    pytest.skip("bind mounts are not allowed here (needs root and CAP_SYS_ADMIN)")
  try:
    with pytest.raises(OSError, match="Read-only file system"):
      (ro / "x").write_text("")
    before = {p: p.stat().st_mtime_ns for p in ro.rglob("*")}
    monkeypatch.setenv("MARS_JAX_DERIVED_CACHE", str(tmp_path / "derived"))
    cfg = {"source": src, "cache_dir": str(ro), "cache_shard_records": 30, "max_length": 128,
           "num_eval": 8}
    data = its = None
    data = load_data(cfg, tok)
    ref = load_data({**cfg, "cache": False}, tok)
    want = trainer._longest_target_blocks(ref.train, 4, 128, range(4))
    assert trainer._longest_target_blocks(data.train, 4, 128, range(4)) == want > 0
    assert list((tmp_path / "derived").glob("*/target_blocks-B4-*.npy"))
    its = [d.train_iterator(batch_size=8, shard_index=0, shard_count=1) for d in (ref, data)]
    for _ in range(12):
      _equal(next(its[0]), next(its[1]))
    assert {p: p.stat().st_mtime_ns for p in ro.rglob("*")} == before
    (built / _keys(built)[0] / "manifest.json").write_text("{")   # damaged, read-only
    with pytest.raises(cache_files.CacheError, match="cannot be written here"):
      load_data(cfg, tok)
  finally:
    its = data = None
    gc.collect()   # the maps
    subprocess.run(["umount", "--lazy", str(ro)], check=True)


def test_a_failed_build_stops_the_workers_cleans_up_and_says_what_failed(tok, tmp_path,
                                                                         monkeypatch):
  """A full disk at shard 3 of 20 (two workers): the error names the shard, the shards
  not started are not tokenized, no temporary file is left and nothing is committed;
  the next build finishes. A rename that fails for another reason than "exists" is an
  error, not another builder's win."""
  src = write_chats(tmp_path / "a.jsonl", 400, bad=False)
  cfg = {"source": src, "cache_dir": str(tmp_path / "c"), "cache_shard_records": 20,
         "cache_workers": 2}
  save = np.save

  def full_disk(path, *a, **k):
    if ".tmp.shard-00003." in str(path):
      raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return save(path, *a, **k)

  monkeypatch.setattr(np, "save", full_disk)
  with pytest.raises(OSError, match="No space left on device") as e:
    load_data(cfg, tok)
  assert any("while tokenizing shard-00003" in n for n in getattr(e.value, "__notes__", []))
  (key,) = _keys(tmp_path / "c")
  left = os.listdir(tmp_path / "c" / key)
  assert not [n for n in left if n.startswith(".tmp.")], left
  assert "manifest.json" not in left and len([n for n in left if n.startswith("shard-")]) < 19
  monkeypatch.setattr(np, "save", save)
  rename = os.rename

  def denied(a, b):
    if "shard-" in str(b):
      raise PermissionError(errno.EACCES, "Permission denied", str(b))
    return rename(a, b)

  monkeypatch.setattr(os, "rename", denied)
  with pytest.raises(PermissionError):
    load_data({**cfg, "cache_workers": 1}, tok)
  monkeypatch.setattr(os, "rename", rename)
  assert not [n for n in os.listdir(tmp_path / "c" / key) if n.startswith(".tmp.")]
  _same_examples(load_data(cfg, tok), load_data({**cfg, "cache": False}, tok))


def test_shards_are_mapped_lazily_and_few_at_a_time(tok, tmp_path, monkeypatch):
  monkeypatch.setattr(cache_files, "MAX_OPEN_SHARDS", 3)
  src = write_chats(tmp_path / "a.jsonl", 120, bad=False)
  data = load_data({"source": src, "cache_dir": str(tmp_path / "c"),
                    "cache_shard_records": 5, "max_length": 4096}, tok)
  (file,) = data.train._files
  assert file.open_files() == 0   # opening maps nothing
  for i in range(len(data.train)):
    data.train[i]
    assert file.open_files() <= 3
  # eight threads reading at random share the LRU, and a pickled copy starts unmapped
  order = np.random.default_rng(0).permutation(np.repeat(np.arange(len(data.train)), 4))
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda i: data.train[int(i)]["tokens"], order))
  assert all(np.array_equal(g, data.train[int(i)]["tokens"]) for g, i in zip(got, order))
  assert file.open_files() <= 3 and pickle.loads(pickle.dumps(file)).open_files() == 0


@pytest.mark.e2e   # builds 10,000 shards (two minutes)
def test_ten_thousand_shards_under_a_descriptor_limit_of_64(tok, tmp_path):
  src = write_chats(tmp_path / "a.jsonl", 10_000, bad=False)
  script = f"""
import os, resource, sys
sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
from qwen_tokenizers import build_qwen_tokenizer
from mars_jax.data import load_data
cfg = {{"source": {src!r}, "cache_dir": {str(tmp_path / 'c')!r}, "cache_shard_records": 1,
       "max_length": 4096}}
tok = build_qwen_tokenizer("qwen2.5")
load_data(cfg, tok)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
data = load_data(cfg, tok)
most = 0
for i in range(len(data.train)):
  data.train[i]
  if i % 250 == 0:
    most = max(most, len(os.listdir("/proc/self/fd")))
print(len(data.train), most)
"""
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  examples, most = map(int, out.stdout.split())
  assert examples == 10_000 and most < 64


def _alpaca(tmp_path, n):
  rng = np.random.default_rng(1)
  return [{"instruction": f"Add {a} and {b}.", "input": "" if i % 2 else f"({i})",
           "output": f"{a + b}"} for i, (a, b) in enumerate(rng.integers(0, 99, (n, 2)))]


def test_the_formats_users_have_give_the_in_memory_examples(tok, tmp_path):
  """A JSON array (Alpaca as published), .jsonl.gz and .jsonl.zst of the same chats, and
  Parquet in one row group and in several: the cache's examples are the in-memory
  pipeline's, and the compressed files' are the plain file's."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  import zstandard  # pylint: disable=import-outside-toplevel
  records = _alpaca(tmp_path, 90)
  (tmp_path / "alpaca.json").write_text(json.dumps(records, indent=2))
  plain = write_chats(tmp_path / "chats.jsonl", 70)
  raw = open(plain, "rb").read()
  with gzip.open(tmp_path / "chats.jsonl.gz", "wb") as f:
    f.write(raw)
  (tmp_path / "chats.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
  table = pa.Table.from_pylist(records)
  pq.write_table(table, tmp_path / "one_group.parquet")
  pq.write_table(table, tmp_path / "groups.parquet", row_group_size=20)
  base = {"cache_dir": str(tmp_path / "c"), "cache_shard_records": 32, "max_length": 256}
  plain_data = load_data({**base, "source": plain}, tok)
  for name in ("alpaca.json", "chats.jsonl.gz", "chats.jsonl.zst", "one_group.parquet",
               "groups.parquet"):
    cfg = {**base, "source": str(tmp_path / name)}
    cached, memory = load_data(cfg, tok), load_data({**cfg, "cache": False}, tok)
    assert cached.stats.records == memory.stats.records == (70 + 2 if "chats" in name else 90)
    assert sorted(cached.stats.bad_records) == sorted(memory.stats.bad_records), name
    _same_examples(cached, memory)
    if "chats" in name:
      _same_examples(cached, plain_data)
      assert sorted(cached.stats.bad_records) == sorted(
          line.replace(plain, cfg["source"]) for line in plain_data.stats.bad_records)
  built_from = {json.loads((tmp_path / "c" / k / cache.KEY_FILE).read_text())["built_from"]: k
                for k in _keys(tmp_path / "c")}
  manifests = {n: json.loads((tmp_path / "c" / built_from[str(tmp_path / n)] /
                              "manifest.json").read_text())
               for n in ("one_group.parquet", "groups.parquet", "alpaca.json")}
  assert [s["examples"] for s in manifests["one_group.parquet"]["shards"]] == [90]
  assert [s["examples"] for s in manifests["groups.parquet"]["shards"]] == [40, 40, 10]
  assert manifests["alpaca.json"]["where"] == "row"
  assert not [n for d in _keys(tmp_path / "c") for n in os.listdir(tmp_path / "c" / d)
              if n.startswith(".tmp.")]   # the decompressed copies are gone


def test_a_named_chat_template_is_chosen_by_the_config(tok, tmp_path):
  named = build_qwen_tokenizer("qwen2.5", copy=True)
  named.chat_template = {"default": tok.chat_template,
                         "terse": tok.chat_template.replace("You are", "You were")}
  src = write_chats(tmp_path / "a.jsonl", 30, bad=False)
  cfg = {"source": src, "cache_dir": str(tmp_path / "c")}
  default, terse = (load_data({**cfg, "chat_template_name": n}, named) for n in (None, "terse"))
  memory = load_data({**cfg, "chat_template_name": "terse", "cache": False}, named)
  _same_examples(terse, memory)
  assert len(_keys(tmp_path / "c")) == 2
  assert any(not np.array_equal(default.train[i]["tokens"], terse.train[i]["tokens"])
             for i in range(len(default.train)))
  with pytest.raises(ValueError, match=r"chat_template_name='tools': the tokenizer has "
                                       r"\['default', 'terse'\]"):
    load_data({**cfg, "chat_template_name": "tools"}, named)


def test_workers_follow_the_cpu_affinity(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
  assert cache.default_workers() == 1
