"""The tokenized cache (mars_jax/data/cache.py) on the real Qwen2.5 tokenizer and
realistic chats: the batches it gives equal the in-memory pipeline's (packing off and
on, 1 and 2 processes, a resume mid-epoch), its key follows what changes the tokens and
nothing else, a damaged cache is refused, `python -m mars_jax.data.prepare` finishes a
build killed with -9, and two processes under jax.distributed build it together."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from qwen_tokenizers import build_qwen_tokenizer, make_qwen_checkpoint

from mars_jax.data import cache, cache_files, load_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is was for on that with as it by at from this be are an or "
         "model data train token answer number sum list code file value step").split()


def write_chats(path, n, seed=0, bad=True):
  """n chat records as users have them (a third with a system prompt, 1-3 turns, some
  long), plus, with `bad`, an invalid line, a blank line and a reply with no prompt."""
  rng = np.random.default_rng(seed)
  text = lambda k: " ".join(rng.choice(WORDS, k)) + f" {rng.integers(1000)}."  # noqa: E731
  with open(path, "w") as f:
    for i in range(n):
      msgs = [{"role": "system", "content": "You are helpful."}] if i % 3 == 0 else []
      for _ in range(1 + i % 3):
        msgs += [{"role": "user", "content": text(int(rng.integers(3, 30)))},
                 {"role": "assistant", "content": text(int(rng.integers(2, 120)))}]
      f.write(json.dumps({"messages": msgs}) + "\n")
      if bad and i == 7:
        f.write("{not json\n\n")
      if bad and i == 11:
        f.write(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("data_cache")
  return {"tok": build_qwen_tokenizer("qwen2.5"), "tmp": tmp,
          "chats": write_chats(tmp / "chats.jsonl", 300)}


def _cfg(setup, **kw):
  return {"source": setup["chats"], "max_length": 192, "num_eval": 16,
          "cache_dir": str(setup["tmp"] / "cache"), "cache_shard_records": 64, **kw}


def _equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("packing", [False, True])
def test_batches_equal_the_in_memory_pipeline(setup, packing):
  cfg = _cfg(setup, packing=packing)
  ref = load_data({**cfg, "cache": False}, setup["tok"])
  cold = load_data(cfg, setup["tok"])
  warm = load_data(cfg, setup["tok"])
  for data in (cold, warm):
    s, r = data.stats, ref.stats
    assert (s.records, s.kept, s.truncated, s.counts) == (r.records, r.kept, r.truncated,
                                                          r.counts)
    assert sorted(s.bad_records) == sorted(r.bad_records)
  assert ref.stats.truncated and ref.stats.counts["malformed"] == 1
  assert ref.stats.counts["assistant_first"] == 1
  for count in (1, 2):
    for index in range(count):
      its = [d.train_iterator(batch_size=8, shard_index=index, shard_count=count)
             for d in (ref, warm)]
      for _ in range(45):   # past the first epoch's end (268 examples / 8 per batch)
        _equal(next(its[0]), next(its[1]))
  for x, y in zip(ref.eval_batches(batch_size=8, shard_index=0, shard_count=1),
                  warm.eval_batches(batch_size=8, shard_index=0, shard_count=1)):
    _equal(x, y)


def test_the_two_process_batches_make_the_one_process_batch(setup):
  data = load_data(_cfg(setup), setup["tok"])
  one = data.train_iterator(batch_size=8, shard_index=0, shard_count=1)
  two = [data.train_iterator(batch_size=8, shard_index=i, shard_count=2) for i in (0, 1)]
  for _ in range(5):
    whole, halves = next(one), [next(it) for it in two]
    for k in whole:   # process p holds rows p, p+2, ... of the global batch
      np.testing.assert_array_equal(whole[k][0::2], halves[0][k])
      np.testing.assert_array_equal(whole[k][1::2], halves[1][k])


def test_a_resume_mid_epoch_gives_the_uninterrupted_batches(setup):
  data = load_data(_cfg(setup, packing=True), setup["tok"])
  it = data.train_iterator(batch_size=8, shard_index=0, shard_count=1)
  straight = [next(it) for _ in range(12)]
  it = data.train_iterator(batch_size=8, shard_index=0, shard_count=1)
  for _ in range(5):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  again = load_data(_cfg(setup, packing=True), setup["tok"])   # a new process reads it
  resumed = again.train_iterator(batch_size=8, shard_index=0, shard_count=1)
  resumed.set_state(state)
  for want in straight[5:]:
    _equal(want, next(resumed))


def _keys(setup):
  return sorted(d for d in os.listdir(setup["tmp"] / "cache") if not d.startswith("."))


def test_the_key_follows_what_changes_the_tokens(setup, tmp_path):
  tok = setup["tok"]
  src = write_chats(tmp_path / "a.jsonl", 40, bad=False)
  cfg = {"source": src, "cache_dir": str(tmp_path / "c"), "max_length": 128}
  dirs = lambda: sorted(d for d in os.listdir(tmp_path / "c") if d[0] != ".")  # noqa: E731
  load_data(cfg, tok)
  assert len(dirs()) == 1
  report = cache.BuildReport()
  # the seed, row length, truncation and packing are applied when reading: same key
  from mars_jax.data import pipeline
  pipeline.prepare_cache({**cfg, "seed": 3, "max_length": 64, "packing": True}, tok,
                         report=report)
  assert (report.built, report.reused, len(dirs())) == (0, 1, 1)
  load_data({**cfg, "train_on": "last"}, tok)                      # targets change
  load_data({**cfg, "chat_template_kwargs": '{"x": 1}'}, tok)      # the template's input
  assert len(dirs()) == 3
  other = build_qwen_tokenizer("qwen2.5", copy=True)
  other.chat_template = other.chat_template.replace("You are", "You were")
  load_data(cfg, other)                                            # another template
  assert len(dirs()) == 4
  with open(src, "a") as f:                                        # the file changed
    f.write(json.dumps({"messages": [{"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "b"}]}) + "\n")
  data = load_data(cfg, tok)
  assert len(dirs()) == 5 and data.stats.records == 41


def test_a_damaged_key_is_rebuilt_and_a_flipped_byte_found_by_verify(setup, tmp_path):
  """Opening checks sizes, not bytes: a truncated file or manifest is found at once and
  the key rebuilt; a flipped byte only under verify (prepare --verify), which rebuilds
  it too; both give the batches of the whole cache."""
  from mars_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  src = write_chats(tmp_path / "a.jsonl", 20, bad=False)
  cfg = {"source": src, "cache_dir": str(tmp_path / "c")}
  want = load_data(cfg, setup["tok"]).train[3]
  (key,) = [d for d in os.listdir(tmp_path / "c") if d[0] != "."]
  tokens = tmp_path / "c" / key / "shard-00000" / "tokens.npy"
  for damage in ("truncate", "manifest", "flip"):
    if damage == "truncate":
      tokens.write_bytes(tokens.read_bytes()[:-4])
    elif damage == "manifest":
      manifest = tmp_path / "c" / key / "manifest.json"
      manifest.write_text(manifest.read_text()[:40])
    else:
      raw = bytearray(tokens.read_bytes())
      raw[-1] ^= 1
      tokens.write_bytes(bytes(raw))
      report = cache.BuildReport()
      pipeline.prepare_cache(cfg, setup["tok"], report=report)
      assert report.repaired == 0   # a size check cannot see it
    report = cache.BuildReport()
    files = pipeline.prepare_cache(cfg, setup["tok"], report=report, verify=damage == "flip")
    assert (report.repaired, report.built) == (1, 1), damage
    _equal(load_data(cfg, setup["tok"]).train[3], want)
    assert len(files[0]) == 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen_hf") / "hf", "qwen2.5")


def _prepare_cmd(model_dir, source, cache_dir, *extra):
  return [sys.executable, "-m", "mars_jax.data.prepare", "--config",
          os.path.join(ROOT, "configs", "tiny.py"), f"--config.model.init={model_dir}",
          f"--config.data.source={source}", f"--config.data.cache_dir={cache_dir}", *extra]


_ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}


@pytest.mark.e2e  # data.prepare in subprocesses, killed or side by side
def test_prepare_finishes_a_build_killed_with_minus_9(setup, model_dir, tmp_path):
  src = write_chats(tmp_path / "big.jsonl", 3000, bad=False)
  cdir = tmp_path / "c"
  cmd = _prepare_cmd(model_dir, src, cdir, "--config.data.cache_shard_records=100",
                     "--workers=1")
  proc = subprocess.Popen(cmd, env=_ENV, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)
  shards = lambda: [p for p in cdir.glob("*/shard-*")]  # noqa: E731
  deadline = time.time() + 300
  while len(shards()) < 3:
    assert proc.poll() is None, proc.stdout.read().decode()
    assert time.time() < deadline
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  done = len(shards())
  assert 3 <= done < 30 and not list(cdir.glob("*/manifest.json"))
  assert all((p / "meta.json").is_file() for p in shards())   # whole shards only
  out = subprocess.run(cmd, env=_ENV, cwd=ROOT, capture_output=True, text=True, check=True)
  line = out.stdout.strip().splitlines()[-1]
  assert line.startswith("prepared: 3000 records read, 3000 kept, 0 bad, ")
  built, found = map(int, re.search(r"\((\d+) shards built, (\d+) found\)", line).groups())
  assert built + found == 30 and found >= done - 1
  resumed = load_data({"source": src, "cache_dir": str(cdir), "cache_shard_records": 100},
                      setup["tok"])
  clean = load_data({"source": src, "cache": False}, setup["tok"])
  assert len(resumed.train) == len(clean.train) == 3000
  for i in range(0, 3000, 97):
    _equal(resumed.train[i], clean.train[i])


@pytest.mark.e2e  # data.prepare in subprocesses, killed or side by side
def test_two_processes_build_their_shares_and_read_the_union(model_dir, tmp_path):
  src = write_chats(tmp_path / "a.jsonl", 600, bad=False)
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  cmd = _prepare_cmd(model_dir, src, tmp_path / "c", "--config.data.cache_shard_records=100")
  procs = [subprocess.Popen(cmd, env={**_ENV, "MARS_COORDINATOR_ADDRESS": f"localhost:{port}",
                                      "MARS_NUM_PROCESSES": "2", "MARS_PROCESS_ID": str(i)},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in (0, 1)]
  lines = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    lines.append(out.strip().splitlines()[-1])
  assert all(line.startswith("prepared: 600 records read, 600 kept, 0 bad") for line in lines)
  assert sorted(line.rsplit("(", 1)[1] for line in lines) == [
      "3 shards built, 3 found)", "3 shards built, 3 found)"]


def test_the_stream_length_count_is_kept_with_the_cache(setup):
  """The trainer's count of target-block positions (what sizes the MARS stream) is the
  in-memory pipeline's, and a cached file keeps it for the next start."""
  from mars_jax.training import loop as trainer  # pylint: disable=import-outside-toplevel
  ref = load_data({**_cfg(setup), "cache": False}, setup["tok"])
  data = load_data(_cfg(setup), setup["tok"])
  for source, other in ((ref.train, data.train), (ref.eval, data.eval)):
    assert (trainer._longest_target_blocks(source, 4, 192, range(4)) ==
            trainer._longest_target_blocks(other, 4, 192, range(4)) > 0)
  assert list((setup["tmp"] / "cache").glob("*/derived/target_blocks-B4-L192-offsets0-1-2-3.npy"))
