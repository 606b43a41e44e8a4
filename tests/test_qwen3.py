"""Qwen3 end to end with the code Qwen2 uses: the sampler against transformers' greedy
`generate`, and the train CLI (MARS steps) from a tiny Qwen3 HF directory to an export
that transformers reloads with the logits mars_jax computes.

Parity of the forward itself (masks, positions, padding, GQA, the cache) is in
test_qwen2_parity.py, parametrized over both families.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

from mars_jax.checkpoints import hf
from mars_jax.decoding import sampler as sampling
from mars_jax.checkpoints import runs
from mars_jax.data import build_char_tokenizer, model_vocab_size
from mars_jax.models import qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = {"family": "qwen3", "head_dim": 24}   # head_dim != hidden / heads (16)
MASK_ID = 127
PROMPTS = [[11, 52, 3], [7, 90, 33, 64, 25, 18, 41, 9, 100], [60, 61]]


def causal_logits(config, params, tokens):
  """tokens: int32[b, t] -> float32[b, t, vocab] of a plain causal forward."""
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
  return np.asarray(qwen2.forward(config, params, tokens, positions, mask))


@pytest.mark.parametrize("tie,kv", [(False, 2), (True, 1)])
def test_greedy_ar_and_lossless_equal_transformers_generate(hf_tiny, tie, kv):
  path, model = hf_tiny(tie=tie, num_kv_heads=kv, seed=2, **QWEN3)
  config, params = hf.load_pretrained(path)
  assert config.model_type == "qwen3"
  eos = config.eos_token_ids
  ref = []
  for prompt in PROMPTS:
    with torch.no_grad():
      out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           eos_token_id=list(eos), pad_token_id=0)
    ref.append(out[0, len(prompt):].tolist())
  kw = dict(max_new_tokens=12, mask_token_id=MASK_ID, eos_token_ids=eos)
  ar = sampling.generate(config, params, PROMPTS, window=1, tau=1.0, **kw)
  assert ar.tokens == ref
  lossless = sampling.generate(config, params, PROMPTS, window=4, mode="lossless", **kw)
  assert lossless.tokens == ref


@pytest.mark.slow  # end to end: the train CLI, export, transformers reload
def test_train_cli_export_reloads_in_transformers(hf_tiny, tmp_path):
  """Two MARS steps of the train CLI from a tiny Qwen3 HF directory (the embedded
  task's character tokenizer saved next to it), the run's HF export, and transformers'
  `AutoModelForCausalLM` on that export."""
  tok = build_char_tokenizer()
  src, _ = hf_tiny(tie=False, vocab=model_vocab_size(tok), **QWEN3)
  init = str(tmp_path / "Qwen3-tiny")
  shutil.copytree(src, init)
  tok.save_pretrained(init)
  work = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "mars_jax.train", "--config", "configs/tiny.py",
         f"--workdir={work}", f"--config.model.init={init}", "--config.stage1.enabled=False",
         "--config.train.steps=2", "--config.train.batch_size=4", "--config.train.log_every=1",
         "--config.train.eval_every=1000", "--config.train.eval_batches=1",
         "--config.data.synthetic.num_train=32", "--config.data.synthetic.num_test=4",
         "--config.final_eval.num_problems=0", "--config.data.max_length=128"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                     env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  rows = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
  assert [row["step"] for row in rows] == [1, 2]
  assert all(np.isfinite(row["ce_mask"]) and np.isfinite(row["ce_ar"]) for row in rows)

  config, _, params = runs.load_params(work)
  _, start = hf.load_pretrained(init)
  assert config.model_type == "qwen3" and config.head_dim == 24
  assert not np.allclose(np.asarray(params["layers"]["attn"]["q_norm"]["scale"]),
                         np.asarray(start["layers"]["attn"]["q_norm"]["scale"]))
  out = os.path.join(work, "hf")
  assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [
      "Qwen3ForCausalLM"]
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16)).astype(np.int32)
  with torch.no_grad():
    ref = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
  ours = causal_logits(config, jax.device_get(params), tokens)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
