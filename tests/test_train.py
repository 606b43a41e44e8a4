"""The train CLI: resume exactness, SIGKILL recovery, config errors, the two-stage run."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A very small model and run, so each subprocess takes seconds.
SMALL = [
    "--config", os.path.join(ROOT, "configs/tiny.py"),
    "--config.model.overrides.hidden_size=32", "--config.model.overrides.intermediate_size=64",
    "--config.model.overrides.num_hidden_layers=2", "--config.model.overrides.num_attention_heads=2",
    "--config.model.overrides.num_key_value_heads=1", "--config.data.synthetic.num_train=400",
    "--config.data.synthetic.num_test=16", "--config.train.batch_size=8",
    "--config.train.log_every=1", "--config.train.eval_every=1000",
    "--config.train.eval_batches=1", "--config.final_eval.num_problems=0",
    "--config.train.export_hf=False", "--config.stage1.enabled=False",
]


def train(workdir, *extra, check=True, **kw):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  cmd = [sys.executable, "-m", "mars_jax.train", *SMALL, f"--workdir={workdir}", *extra]
  if kw.pop("background", False):
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, **kw)
  if check and r.returncode != 0:
    raise AssertionError(f"train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
  return r


def losses(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f]
  return {r["step"]: r["loss"] for r in rows}


def params_of(run_dir):
  from mars_jax.checkpoints import runs
  import jax
  _, _, params = runs.load_params(run_dir)
  return jax.tree.map(np.asarray, params)


def assert_bitwise(a, b):
  import jax
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """6 uninterrupted MARS steps (the reference for resume tests)."""
  d = str(tmp_path_factory.mktemp("straight"))
  train(d, "--config.train.steps=6", "--config.train.checkpoint_every=3")
  return d


@pytest.mark.e2e  # the train CLI in a subprocess
def test_resume_is_exact(straight, tmp_path):
  d = str(tmp_path / "resumed")
  r = train(d, "--config.train.steps=6", "--config.train.checkpoint_every=3",
            "--config.train.stop_at_step=3")
  # progress goes to the "mars_jax" loggers at INFO, which the CLI shows on stderr
  for line in ("process 0/1, ", "[resumed] data: ", "[resumed] target stream: ",
               "[main] mars: step 3 loss ", "[main] stopped at train.stop_at_step=3"):
    assert line in r.stderr, line
  assert sorted(losses(d)) == [1, 2, 3]
  r = train(d, "--config.train.steps=6", "--config.train.checkpoint_every=3")
  assert f"resumed {d} from step 3" in r.stderr
  ref, got = losses(straight), losses(d)
  assert sorted(got) == list(range(1, 7))
  assert [got[s] for s in range(1, 7)] == [ref[s] for s in range(1, 7)]
  assert_bitwise(params_of(d), params_of(straight))


@pytest.mark.e2e  # the train CLI in a subprocess
def test_resume_keeps_the_recorded_precision(straight):
  """layout.json records the runtime; continuing the run at another compute dtype is
  refused (it would silently change what the run trains at)."""
  with open(os.path.join(straight, "layout.json")) as f:
    runtime = json.load(f)["runtime"]
  assert runtime["dtype"] == "float32"
  assert runtime["scan_layers"] is True           # configs/tiny.py scans its layers,
  assert runtime["remat"] == "dots_with_no_batch_dims"  # keeping the projections' outputs
  r = train(straight, "--config.train.steps=7", "--config.model.dtype=bfloat16", check=False)
  assert r.returncode != 0
  assert "runtime.dtype: checkpoint has 'float32', config asks 'bfloat16'" in r.stderr


def kill_after_a_checkpoint(run_dir, *extra, steps=6, at_least=2) -> int:
  """Starts a `steps`-step run that checkpoints every step, sends it SIGKILL once step
  `at_least` is saved, and returns the step of its last complete checkpoint."""
  proc = train(run_dir, f"--config.train.steps={steps}", "--config.train.checkpoint_every=1",
               "--config.train.async_checkpoint=False", *extra, background=True)
  ckpts = os.path.join(run_dir, "checkpoints")
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    done = [s for s in os.listdir(ckpts) if s.isdigit()] if os.path.isdir(ckpts) else []
    if any(int(s) >= at_least for s in done):
      break
    time.sleep(0.2)
  assert proc.poll() is None, "the run finished before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  from mars_jax.checkpoints import runs
  _, killed_at = runs.resolve_checkpoint(run_dir)
  assert at_least <= killed_at < steps
  return killed_at


@pytest.mark.e2e  # the train CLI in a subprocess
def test_sigkill_leaves_a_restorable_checkpoint(straight, tmp_path):
  d = str(tmp_path / "killed")
  killed_at = kill_after_a_checkpoint(d)
  r = train(d, "--config.train.steps=6", "--config.train.checkpoint_every=1")
  got, ref = losses(d), losses(straight)
  assert all(got[s] == ref[s] for s in range(killed_at + 1, 7))
  assert_bitwise(params_of(d), params_of(straight))
  assert r.returncode == 0


@pytest.mark.parametrize("override,message", [
    ("--config.objective.block_size=0", "objective.block_size=0"),
    ("--config.optimizer.learning_rate=-1.0", "optimizer.learning_rate=-1.0"),
    ("--config.objective.kind=diffusion", "objective.kind='diffusion'"),
    ("--config.mesh.data=3", "needs 3 devices"),
    ("--config.objective.no_such_field=1", "no_such_field"),
])
def test_bad_config_is_a_clear_error(tmp_path, override, message):
  t0 = time.time()
  r = train(str(tmp_path / "bad"), override, "--config.train.steps=2", check=False)
  assert r.returncode != 0
  assert message in r.stdout + r.stderr
  assert not os.path.exists(tmp_path / "bad" / "checkpoints")


def _chat_file(path, n=48):
  from mars_jax.data import synthetic
  with open(path, "w") as f:
    for record in synthetic.chat_records(n, seed=5, difficulty="easy"):
      f.write(json.dumps(record) + "\n")
  return str(path)


@pytest.mark.parametrize("num_eval", [pytest.param(0, marks=pytest.mark.e2e),
                                      pytest.param(8, marks=pytest.mark.slow)])
def test_file_source_trains_with_or_without_held_out_slice(tmp_path, num_eval):
  """A JSONL source without eval_source: num_eval=0 trains without eval loss (one-line
  notice); num_eval=8 holds 8 records out and reports eval loss."""
  d = str(tmp_path / "run")
  r = train(d, f"--config.data.source={_chat_file(tmp_path / 'chat.jsonl')}",
            f"--config.data.num_eval={num_eval}", "--config.train.steps=3",
            "--config.train.eval_every=1", "--config.train.checkpoint_every=3")
  rows = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
  assert [row["step"] for row in rows] == [1, 2, 3]
  assert all(np.isfinite(row["loss"]) for row in rows)
  notice = "no eval set: training without eval loss" in r.stderr
  if num_eval:
    assert not notice and all(np.isfinite(row["eval_loss"]) for row in rows)
  else:
    assert notice and not any("eval_loss" in row for row in rows)
  from mars_jax.checkpoints import runs
  assert runs.resolve_checkpoint(d)[1] == 3


@pytest.mark.e2e  # the train CLI in a subprocess
def test_eval_batches_zero_means_no_eval_loss(tmp_path):
  """train.eval_batches=0 never fails, even with no eval set or one smaller than a
  batch; a held-out slice smaller than one batch is a clear error at set-up otherwise."""
  import ml_collections
  from mars_jax.training import loop as trainer
  from mars_jax.data import build_char_tokenizer, load_data
  tok = build_char_tokenizer()
  path = _chat_file(tmp_path / "chat.jsonl", n=20)

  def batches(num_eval, eval_batches):
    data = load_data({"source": path, "num_eval": num_eval, "max_length": 128}, tok)
    cfg = ml_collections.ConfigDict({"train": {"batch_size": 8, "eval_batches": eval_batches}})
    return trainer.held_out_batches(cfg, data, "run", shard_index=0, shard_count=1)

  assert batches(0, 0) == [] and batches(3, 0) == [] and batches(0, 4) == []
  assert len(batches(16, 4)) == 2 and len(batches(16, 1)) == 1
  with pytest.raises(ValueError, match="train.eval_batches=0"):
    batches(3, 4)
  train(str(tmp_path / "run"), f"--config.data.source={path}", "--config.data.num_eval=3",
        "--config.train.eval_batches=0", "--config.train.eval_every=1",
        "--config.train.steps=2")
  rows = [json.loads(l) for l in open(os.path.join(tmp_path, "run", "metrics.jsonl"))]
  assert len(rows) == 2 and not any("eval_loss" in row for row in rows)


@pytest.mark.slow
def test_tiny_two_stage_end_to_end(tmp_path):
  """configs/tiny.py shortened: both losses fall, checkpoints, metrics and a loadable export."""
  import torch
  import transformers
  d = str(tmp_path / "tiny")
  r = train(d, "--config.stage1.enabled=True", "--config.stage1.steps=40",
            "--config.train.steps=20", "--config.train.log_every=5",
            "--config.train.export_hf=True", "--config.final_eval.num_problems=8",
            "--config.model.overrides.hidden_size=64",
            "--config.model.overrides.intermediate_size=128")
  for stage, kind_loss in (("stage1", "ce_ar"), ("stage2", "ce_mask")):
    rows = [json.loads(l) for l in open(os.path.join(d, stage, "metrics.jsonl"))]
    assert rows[-1][kind_loss] < rows[0][kind_loss], (stage, rows[0], rows[-1])
    assert os.path.isdir(os.path.join(d, stage, "checkpoints"))
    assert os.listdir(os.path.join(d, stage, "tensorboard"))
  assert "held-out accuracy" in r.stdout
  model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf"))
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(d, "hf"))
  assert tok.convert_tokens_to_ids("<|mask|>") == 3
  ids = tok("1+2=3", return_tensors="pt").input_ids
  from mars_jax.checkpoints import hf
  from mars_jax.checkpoints import runs
  config, _, params = runs.load_params(os.path.join(d, "stage2"))
  import jax.numpy as jnp
  from mars_jax.models import qwen2
  t = ids.shape[1]
  ours = qwen2.forward(config, params, jnp.asarray(ids.numpy(), jnp.int32),
                       jnp.arange(t, dtype=jnp.int32)[None], jnp.tril(jnp.ones((1, t, t), bool)))
  with torch.no_grad():
    ref = model(ids).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)
