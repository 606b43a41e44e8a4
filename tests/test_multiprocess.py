"""Real processes on localhost (CPU, gloo): 2 processes x 2 devices vs 1 process,
resume of a 2-process run, and export of its checkpoint to transformers."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from test_train import ROOT, SMALL, assert_bitwise, losses, params_of, train


# Random block offsets on (the trainer's default): each row's is drawn from its own tokens,
# so 2 processes, which place the examples otherwise than 1 does, draw the same ones.
STEPS = ["--config.train.steps=4", "--config.train.checkpoint_every=2"]


def free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def train_2proc(workdir, *extra, devices=2):
  """launch/local.sh: 2 processes x `devices` CPU devices -> the log directory."""
  logdir = os.path.join(workdir + "_logs")
  r = subprocess.run(
      ["bash", os.path.join(ROOT, "launch/local.sh"), "--num-processes", "2",
       "--devices-per-process", str(devices), "--port", str(free_port()), "--logdir", logdir, "--",
       *SMALL, f"--workdir={workdir}", *extra],
      env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ROOT}, cwd=ROOT,
      capture_output=True, text=True)
  if r.returncode != 0:
    logs = "\n".join(open(os.path.join(logdir, f)).read()[-3000:] for f in os.listdir(logdir))
    raise AssertionError(f"2-process run failed:\n{r.stderr}\n{logs}")
  return logdir


@pytest.fixture(scope="module")
def two_proc(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("mp") / "run")
  train_2proc(d, *STEPS)
  return d


@pytest.mark.e2e  # several training processes on localhost
def test_two_processes_equal_one(two_proc, tmp_path):
  one = str(tmp_path / "one")
  train(one, *STEPS)
  a, b = losses(two_proc), losses(one)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], atol=1e-5, rtol=0)
  import jax
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0),
               params_of(two_proc), params_of(one))


@pytest.mark.slow  # ~50 s; single-process resume and kill -9 run with -m e2e
def test_two_process_resume_is_exact(two_proc, tmp_path):
  d = str(tmp_path / "resumed")
  train_2proc(d, *STEPS, "--config.train.stop_at_step=2")
  assert sorted(losses(d)) == [1, 2]
  assert sorted(os.listdir(os.path.join(d, "data_state", "2"))) == [
      "process_0.json", "process_1.json"]
  train_2proc(d, *STEPS)
  ref, got = losses(two_proc), losses(d)
  assert [got[s] for s in range(1, 5)] == [ref[s] for s in range(1, 5)]
  assert_bitwise(params_of(d), params_of(two_proc))


@pytest.mark.e2e  # several training processes on localhost
def test_export_of_two_process_checkpoint(two_proc, tmp_path):
  import torch
  import transformers
  out = str(tmp_path / "hf")
  subprocess.run([sys.executable, "-m", "mars_jax.export", "--checkpoint", two_proc,
                  "--out", out], check=True, cwd=ROOT, capture_output=True,
                 env={**os.environ, "PYTHONPATH": ROOT})
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok.convert_tokens_to_ids("<|mask|>") == 3
  assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [
      "Qwen2ForCausalLM"]
  ids = tok("Ann has 3 apples. #### 7", return_tensors="pt").input_ids
  from mars_jax.models import qwen2
  from mars_jax.checkpoints import runs
  config, runtime, params = runs.load_params(two_proc)   # in the run's layer layout
  t = ids.shape[1]
  ours = qwen2.forward(config, params, ids.numpy().astype(np.int32),
                       np.arange(t, dtype=np.int32)[None], np.tril(np.ones((1, t, t), bool)),
                       runtime=runtime)
  with torch.no_grad():
    ref = model(ids).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


@pytest.mark.e2e  # several training processes on localhost
def test_processes_with_different_configs_fail_clearly(tmp_path):
  port = free_port()
  procs = []
  for pid, lr in ((0, "1e-3"), (1, "2e-3")):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "MARS_COORDINATOR_ADDRESS": f"localhost:{port}", "MARS_NUM_PROCESSES": "2",
           "MARS_PROCESS_ID": str(pid)}
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "mars_jax.train", *SMALL, f"--workdir={tmp_path}/w",
         "--config.train.steps=2", f"--config.optimizer.learning_rate={lr}"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert all(p.returncode != 0 for p in procs)
  assert all("processes disagree on the config" in o for o in outs)
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


@pytest.mark.e2e  # several training processes on localhost
def test_resume_with_another_process_count_is_refused(two_proc, tmp_path):
  import shutil
  d = str(tmp_path / "copy")
  shutil.copytree(two_proc, d)
  r = train(d, "--config.train.steps=6", "--config.train.checkpoint_every=2", check=False)
  assert r.returncode != 0
  assert "holds the data-iterator state of 2 process(es), this run has 1" in r.stdout + r.stderr
