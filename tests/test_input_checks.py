"""Bad input at the edges a user touches fails early with a message that names the fix."""

import json
import logging
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from mars_jax import evaluate, serve
from mars_jax.decoding import loading, sampler as sampling
from mars_jax.training import masks, objective
from mars_jax.checkpoints import runs
from mars_jax.decoding import batching, gates
from mars_jax.models.qwen2 import Qwen2Config, Runtime, init_params

CONFIG = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                     eos_token_id=2, tie_word_embeddings=True, max_position_embeddings=32)
MASK = 63


@pytest.mark.parametrize("bad", [-1, 64, 1000])
@pytest.mark.parametrize("window", [1, 3, "auto"])
def test_generate_rejects_token_ids_outside_the_vocabulary(bad, window):
  # params=None: the check runs on the host before anything touches the model
  with pytest.raises(ValueError, match=rf"prompt 1: token id {bad} is outside the "
                     r"vocabulary \[0, 64\); encode prompts with the model's own tokenizer"):
    sampling.generate(CONFIG, None, [[1, 2], [3, bad, 4]], max_new_tokens=4,
                      mask_token_id=MASK, eos_token_ids=2, window=window)


def test_generate_rejects_sequences_past_max_position_embeddings():
  with pytest.raises(ValueError, match=r"prompt 1: 10 prompt tokens \+ max_new_tokens 23 = 33 "
                     r"exceeds the model's max_position_embeddings \(32\); lower "
                     r"max_new_tokens or shorten the prompt"):
    sampling.generate(CONFIG, None, [[1], [5] * 10], max_new_tokens=23, mask_token_id=MASK,
                      eos_token_ids=2, window=2)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    sampling.generate(CONFIG, None, [[1] * 3], max_new_tokens=30, mask_token_id=MASK,
                      eos_token_ids=2, window="auto")
  budget = batching.check_prompts(CONFIG, [[1] * 10, [1]], [22, 31])  # exactly 32: fine
  assert budget.tolist() == [22, 31]


def test_server_rejects_token_ids_outside_the_vocabulary():
  params = init_params(CONFIG, jax.random.PRNGKey(0))
  server = serve.Server(CONFIG, params, mask_token_id=MASK, eos_token_ids=(2,), max_len=32)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    server.submit([1, 64], max_new_tokens=4)
  assert server.idle


@pytest.mark.parametrize("mask_id", [64, 100, -1, np.int32(64)])
def test_objective_rejects_a_mask_id_outside_the_vocabulary(mask_id):
  # params, batch unused: the check is on static values before the forward
  with pytest.raises(ValueError, match=r"mask_token_id=-?\d+ is outside the model's vocabulary "
                     r"\[0, 64\); use the id hf.load_tokenizer returns"):
    objective.mars_loss(CONFIG, None, None, block_size=4, mask_token_id=mask_id)
  objective.check_mask_token_id(CONFIG, 63)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_evaluate_num_problems_must_be_positive(value, capsys):
  with pytest.raises(SystemExit) as e:
    evaluate.main(["--model", "/nonexistent", "--num-problems", value])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--num-problems" in err and ("must be >= 1" in err or "not an integer" in err)


def _run_dir(root, kind, block):
  d = root / f"run_{kind}"
  (d / "checkpoints" / "7").mkdir(parents=True)
  (d / "layout.json").write_text(json.dumps({"objective": {"kind": kind, "block_size": block}}))
  return str(d)


def test_window_above_block_plus_one_warns(tmp_path, caplog):
  run = _run_dir(tmp_path, "mars", 4)
  assert loading.trained_block_size(run) == 4
  assert loading.trained_block_size(run + "/checkpoints/7") == 4
  with caplog.at_level(logging.WARNING, logger="mars_jax.decoding.loading"):
    loading.warn_untrained_windows(run, [1, 4, 5])
    assert not caplog.records
    loading.warn_untrained_windows(run, [1, 6, 8])
  [record] = caplog.records
  assert record.levelno == logging.WARNING
  msg = record.getMessage()
  assert "window 6,8 > block size + 1 = 5" in msg and "B=4" in msg and "<= 5" in msg


def test_window_check_skips_models_without_a_record(tmp_path, caplog):
  ar = _run_dir(tmp_path, "ar_sft", 4)
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text("{}")  # an HF directory without a mars_jax marker
  with caplog.at_level(logging.WARNING, logger="mars_jax.decoding.loading"):
    for path in (ar, str(hf_dir), str(tmp_path / "missing")):
      assert loading.trained_block_size(path) is None
      loading.warn_untrained_windows(path, [16])
  assert not caplog.records


@pytest.mark.parametrize("call,field,allowed", [
    (lambda: sampling.generate(CONFIG, None, [[1]], max_new_tokens=2, mask_token_id=MASK,
                               eos_token_ids=2, window=2, mode="greedy"),
     "mode", ["gated", "lossless"]),
    (lambda: sampling.generate(CONFIG, None, [[1]], max_new_tokens=2, mask_token_id=MASK,
                               eos_token_ids=2, window=2, metric="top1"),
     "metric", ["probability", "margin", "entropy"]),
    (lambda: objective.ObjectiveConfig(kind="dpo", mask_token_id=MASK),
     "objective.kind", ["mars", "ar_sft"]),
    (lambda: objective.ObjectiveConfig(mask_token_id=MASK, intra_block="full"),
     "objective.intra_block", ["causal", "bidirectional"]),
    (lambda: objective.ObjectiveConfig(mask_token_id=MASK, normalization="batch"),
     "objective.normalization", ["sequence", "token"]),
    (lambda: masks.two_stream_mask(8, 4, intra_block="full"),
     "intra_block", ["causal", "bidirectional"]),
    (lambda: Runtime(remat="some"), "remat",
     ["none", "full", "dots", "dots_with_no_batch_dims", "names"]),
    (lambda: Runtime(attention_impl="flashy"), "attention_impl",
     ["xla", "dot_product_attention", "cudnn", "splash", "flash", "auto"]),
])
def test_choices_are_checked_with_one_message(call, field, allowed):
  """Every named choice fails the same way: the field, the value, the allowed values."""
  with pytest.raises(ValueError, match=re.escape(f"; expected one of {allowed}.")) as e:
    call()
  assert str(e.value).startswith(f"{field}=")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The C++ logging some jaxlib builds print at import (e.g. the CUDA plugin's "Could not
# find cuda drivers" on a host without a GPU): not the CLI's output.
_CPP_LOG = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before "
                      r"absl::InitializeLog\(\))")


def cli(module, *args, cwd=ROOT):
  """`python -m module args` -> (exit status, stdout, the stderr lines the CLI wrote)."""
  r = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True,
                     text=True, env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
                     timeout=120)
  return r.returncode, r.stdout, [l for l in r.stderr.splitlines() if not _CPP_LOG.match(l)]


def assert_one_line_error(module, *args, says=""):
  status, _, err = cli(module, *args)
  assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (status, err)
  assert says in err[0], err[0]


CONFIG_CLIS = {"mars_jax.train": ["--workdir", "unused"], "mars_jax.plan": ["--topology", "v5p-8"],
               "mars_jax.study": ["--workdir", "unused"], "mars_jax.data.prepare": []}
FLAG_MISTAKES = {
    "misspelled key": (["--config", "configs/tiny.py", "--config.train.stepz=3"],
                       "error: --config.train.stepz: no such key in the config (did you mean "
                       "train.steps?)"),
    "missing file": (["--config", "configs/nope.py"], "error: configs/nope.py: no such config "
                     "file"),
    "bad value": (["--config", "configs/tiny.py", "--config.train.steps=abc"],
                  "--config.train.steps=abc: invalid literal for int()"),
    "no config": ([], "error: --config is required"),
}


@pytest.mark.parametrize("module", CONFIG_CLIS)
def test_config_clis_help_exits_0(module):
  status, out, _ = cli(module, "--help")
  assert status == 0 and "--config" in out


@pytest.mark.parametrize("module,mistake", [
    *(("mars_jax.train", m) for m in FLAG_MISTAKES),
    ("mars_jax.plan", "misspelled key"), ("mars_jax.study", "missing file"),
    ("mars_jax.data.prepare", "bad value")])
def test_config_cli_flag_mistakes_are_one_line(module, mistake):
  """Each config CLI parses its flags through cli.run: train meets every mistake, the
  others one each."""
  args, says = FLAG_MISTAKES[mistake]
  assert_one_line_error(module, *args, *CONFIG_CLIS[module], says=says)


def test_config_cli_misplaced_and_required_flags():
  assert_one_line_error("mars_jax.train", "--config", "configs/tiny.py", says="error: "
                        "--workdir is required")
  assert_one_line_error("mars_jax.train", "--config", "configs/tiny.py", "--workdir", "w", "x",
                        says="error: unexpected arguments ['x']")


def test_a_run_in_stages_reads_its_last_stage(tmp_path, capsys):
  top = tmp_path / "run"
  for stage in ("stage1", "stage2"):   # as experiment.run lays them out, each a run
    (top / stage / "checkpoints" / "3").mkdir(parents=True)
    (top / stage / "checkpoints" / "3" / "keep.txt").write_text("step 3")
    (top / stage / "layout.json").write_text("{}")
  assert runs.resolve_checkpoint(str(top)) == (str(top / "stage2"), 3)
  assert loading.model_path(str(top)) == str(top / "stage2")
  assert capsys.readouterr().err == (f"{top}: a run in stages; reading its last stage, "
                                     f"{top}/stage2\n")
  assert loading.model_path(str(top / "stage1")) == str(top / "stage1")
  assert not capsys.readouterr().err
  with pytest.raises(FileNotFoundError, match=r"^runs/tiny/hff: no such directory\.$"):
    runs.resolve_checkpoint("runs/tiny/hff")


@pytest.mark.parametrize("module,args,says", [
    ("mars_jax.generate", ["--model", "runs/tiny/hff", "--prompt", "x"],
     "error: runs/tiny/hff: no such directory."),
    ("mars_jax.export", ["--checkpoint", "runs/tiny/hff", "--out", "unused"],
     "error: runs/tiny/hff: no such directory."),
    ("mars_jax.generate", ["--model", "runs/tiny/hff", "--prompt", "x", "--tau", "1.5"],
     "error: --tau 1.5: the probability gate's threshold must be in [0, 1]"),
    ("mars_jax.serve", ["--model", "runs/tiny/hff", "--tau", "1.5"],
     "error: --tau 1.5: the probability gate's threshold must be in [0, 1]"),
    ("mars_jax.evaluate", ["--model", "runs/tiny/hff"],
     "error: runs/tiny/hff: no such directory."),
    ("mars_jax.evaluate", ["--model", "runs/tiny/hff", "--taus", "1.0,1.5"],
     "error: --taus 1.5: the probability gate's threshold must be in [0, 1]"),
])
def test_model_cli_mistakes_are_one_line(module, args, says):
  assert_one_line_error(module, *args, says=says)


def test_tau_is_checked_against_its_gate():
  gates.check_tau([0.0, 0.9, 1.0], "margin")
  gates.check_tau(1.6, "entropy")   # nats
  with pytest.raises(ValueError, match=r"^--taus 1.5: the margin gate's threshold"):
    gates.check_tau([0.9, 1.5], "margin", "--taus")
  with pytest.raises(ValueError, match="entropy gate's threshold must be >= 0"):
    gates.check_tau(-0.1, "entropy")
