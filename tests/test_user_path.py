"""The user's path end to end, each CLI run in a subprocess as a user types it.

From a tiny Qwen2 checkpoint that transformers wrote with the real Qwen2.5 tokenizer
(the real vocabulary and special ids, a template like the published one with its
default system prompt: tests/qwen_tokenizers.py) and a chat JSONL:
stage 1 with the shipped 0.5B AR-SFT config, stage 2 with the shipped MARS config
from it (only size overrides: bfloat16 compute as shipped), the export, and the
generate and evaluate CLIs on the export. The exported weights must give
transformers the logits mars_jax computes.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import qwen_tokenizers as qt
import user_path_fixtures as fx

# A user's whole path through the CLIs (train, export, generate, evaluate): `-m e2e`.
pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Size and length only: every other field (bfloat16 compute over float32 weights, B=4,
# micro-batches, the held-out eval slice, lr schedule, HF export) is the shipped config's.
SIZE = ["--config.train.batch_size=8", "--config.train.steps=3",
        "--config.data.max_length=96", "--config.data.num_eval=8"]
TIMINGS: dict = {}


def cli(module, *args, timeout=300):
  """`python -m module args...` in the repository root, as a user runs it."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  t0 = time.time()
  r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=timeout)
  TIMINGS.setdefault(module, []).append(round(time.time() - t0, 1))
  if r.returncode != 0:
    raise AssertionError(f"python -m {module} {' '.join(args)} exited {r.returncode}:\n"
                         f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
  return r


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  """Files of the whole path: the HF checkpoint, data, both runs and the export."""
  tmp = tmp_path_factory.mktemp("user")
  train = fx.task_records(240, seed=0)
  test = fx.task_records(8, seed=0, split="test")
  paths = {
      "hf": qt.make_qwen_checkpoint(tmp / "Qwen2.5-tiny", "qwen2.5"),
      "chat": fx.write_chat_jsonl(tmp / "chat.jsonl", train),
      "gsm8k": fx.write_gsm8k_jsonl(tmp / "test.jsonl", test),
      "sft": str(tmp / "runs" / "sft"), "mars": str(tmp / "runs" / "mars"),
      "out": str(tmp / "export"), "eval": str(tmp / "eval"),
      "question": test[0]["question"],
  }
  paths["stage1"] = cli("mars_jax.train", "--config", "configs/qwen2_5_0_5b_ar_sft.py",
                        "--workdir", paths["sft"], f"--config.model.init={paths['hf']}",
                        f"--config.data.source={paths['chat']}", *SIZE).stdout
  paths["stage2"] = cli("mars_jax.train", "--config", "configs/qwen2_5_0_5b_mars.py",
                        "--workdir", paths["mars"], f"--config.model.init={paths['sft']}",
                        f"--config.data.source={paths['chat']}", *SIZE).stdout
  paths["export_log"] = cli("mars_jax.export", "--checkpoint", paths["mars"],
                            "--out", paths["out"]).stdout
  yield paths
  print(f"\nuser path CLI wall seconds: {TIMINGS}")


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_fixture_tokenizer_is_what_transformers_loads(user):
  """The checkpoint's tokenizer, reloaded by AutoTokenizer, is Qwen2.5's: the real
  vocabulary and ids, its default system prompt, and spare rows past it for <|mask|>."""
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(user["hf"])
  cfg = transformers.AutoConfig.from_pretrained(user["hf"])
  assert tok.eos_token == fx.IM_END and tok.pad_token == fx.PAD_TOKEN
  assert cfg.eos_token_id == tok.convert_tokens_to_ids(fx.IM_END) == 151645
  assert tok("Hello world").input_ids == [9707, 1879]
  assert len(tok) == 151665 < cfg.vocab_size == 151936
  chat = [{"role": "user", "content": "2+3?"}]
  assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
      f"<|im_start|>system\n{qt.DEFAULT_SYSTEM}<|im_end|>\n"
      "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_both_stages_train_and_record_their_layout(user):
  for stage, kind in (("sft", "ar_sft"), ("mars", "mars")):
    rows = _metrics(user[stage])
    assert rows and rows[-1]["step"] == 3
    assert np.isfinite(rows[-1]["loss"]) and np.isfinite(rows[-1]["eval_loss"])
    with open(os.path.join(user[stage], "layout.json")) as f:
      layout = json.load(f)
    assert layout["objective"]["kind"] == kind
    assert layout["runtime"]["dtype"] == "bfloat16"         # the shipped compute dtype
    assert layout["runtime"]["param_dtype"] == "float32"
    assert layout["model"]["vocab_size"] == json.load(
        open(os.path.join(user["hf"], "config.json")))["vocab_size"]
    assert layout["init"] == os.path.abspath(user["hf"] if stage == "sft" else user["sft"])
  assert "ce_mask" in _metrics(user["mars"])[-1]
  assert f"{user['mars']} -> {user['out']}" in user["export_log"]


def test_export_matches_transformers_and_knows_the_mask_token(user):
  import jax
  import jax.numpy as jnp
  import torch
  import transformers
  from mars_jax.checkpoints import hf
  from mars_jax.checkpoints import runs
  from mars_jax.models import qwen2

  tok = transformers.AutoTokenizer.from_pretrained(user["out"])
  base = transformers.AutoTokenizer.from_pretrained(user["hf"])
  assert hf.MASK_TOKEN in tok.get_vocab()
  mask_id = tok.convert_tokens_to_ids(hf.MASK_TOKEN)
  model = transformers.AutoModelForCausalLM.from_pretrained(user["out"],
                                                            dtype=torch.float32).eval()
  assert mask_id == len(base) == 151665 < model.config.vocab_size
  # vLLM's parallel drafting reads the mask id there; transformers keeps the key
  assert model.config.pard_token == mask_id
  assert f'vllm serve {user["out"]} --speculative-config' in user["export_log"]
  config, params = hf.load_pretrained(user["out"])
  *_, trained = runs.load_params(user["mars"])     # the run's last step, float32
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(trained), jax.device_get(params))
  rng = np.random.default_rng(0)
  prompt = tok.apply_chat_template([{"role": "user", "content": user["question"]}],
                                   tokenize=False, add_generation_prompt=True)
  ids = np.stack([tok(prompt, add_special_tokens=False).input_ids[:16],
                  rng.integers(0, model.config.vocab_size, 16)]).astype(np.int32)
  ids[1, 5] = mask_id
  t = ids.shape[1]
  ours = qwen2.forward(config, params, jnp.asarray(ids),
                       jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), ids.shape),
                       jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (2, t, t)))
  with torch.no_grad():
    ref = model(torch.from_numpy(ids).long()).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


def test_generate_cli_on_the_export(user):
  r = cli("mars_jax.generate", "--model", user["out"], "--prompt", user["question"],
          "--window", "4", "--tau", "0.9", "--max-new-tokens", "12")
  assert "=== [0]" in r.stdout and "tokens/forward" in r.stdout, r.stdout


def test_generate_cli_names_the_fix_for_a_budget_past_the_context(user):
  """Bad input at the CLI: a one-line error naming the fix, exit 2, no traceback."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  r = subprocess.run([sys.executable, "-m", "mars_jax.generate", "--model", user["out"],
                      "--prompt", user["question"], "--max-new-tokens", "100000"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "max_position_embeddings" in r.stderr and "lower max_new_tokens" in r.stderr
  assert "Traceback" not in r.stderr


def test_evaluate_cli_on_the_export(user):
  r = cli("mars_jax.evaluate", "--model", user["out"], "--task", user["gsm8k"],
          "--num-problems", "8", "--taus", "0.9", "--windows", "1,4",
          "--metrics", "probability", "--batch-size", "8", "--max-new-tokens", "12",
          "--out", user["eval"])
  lines = r.stdout.splitlines()
  assert any("tok/fwd" in line for line in lines), r.stdout
  rows = [line.split() for line in lines if line.startswith("probability")]
  assert [(row[1], row[2]) for row in rows] == [("1", "1.00"), ("4", "0.90")], r.stdout
  assert float(rows[0][4]) == 1.0 and rows[0][5] == "8"      # AR: one token per forward
  assert 1.0 <= float(rows[1][4]) <= 4.0
  with open(os.path.join(user["eval"], "results.json")) as f:
    assert len(json.load(f)["rows"]) == 2


def test_export_is_readable_by_others_and_keeps_the_generation_config(user):
  from mars_jax.checkpoints import hf
  assert os.stat(user["out"]).st_mode & 0o777 == 0o777 & ~_umask()
  for name in os.listdir(user["out"]):
    assert os.stat(os.path.join(user["out"], name)).st_mode & 0o777 == 0o666 & ~_umask()
  assert hf.read_generation_config(user["out"]) == hf.read_generation_config(user["hf"])
  assert hf.read_generation_config(user["out"])["eos_token_id"] == [151645, 151643]
  assert hf.read_export_marker(user["out"])["mask_token_id"] == 151665


def _umask():
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def test_export_tokenizer_loads_in_transformers_4(user):
  """The exported tokenizer gives transformers 4.57 (installed beside, in a subprocess)
  the ids and chat template transformers 5 gives, as the input checkpoint's does."""
  import transformers
  import transformers4
  texts = ["Hello world", "<|im_start|>user\nHi<|mask|><|im_end|>", "数学 3+4=7 🙂"]
  chat = [{"role": "user", "content": user["question"]}]
  code = """
import json, sys, transformers

tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
texts, chat = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"version": transformers.__version__,
                  "ids": [tok(t, add_special_tokens=False).input_ids for t in texts],
                  "prompt": tok.apply_chat_template(chat, tokenize=False,
                                                    add_generation_prompt=True),
                  "eos": tok.eos_token, "pad": tok.pad_token}))
"""
  for directory in (user["hf"], user["out"]):
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    r = transformers4.run_transformers4(code, directory, json.dumps(texts), json.dumps(chat))
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("4.57")
    assert got["ids"] == [tok(t, add_special_tokens=False).input_ids for t in texts]
    assert got["prompt"] == tok.apply_chat_template(chat, tokenize=False,
                                                    add_generation_prompt=True)
    assert (got["eos"], got["pad"]) == (fx.IM_END, fx.PAD_TOKEN)
  assert got["ids"][1][-2] == 151665        # the export's <|mask|>, one token in 4.x too


def test_train_cli_prints_a_bad_record_as_one_line(user, tmp_path):
  """on_bad='error' and a record whose first turn is the assistant's: one line naming
  the file and line, exit 2, no traceback; with skipping on (the shipped default) the
  same file trains."""
  path = tmp_path / "bad.jsonl"
  lines = open(user["chat"]).read().splitlines()
  lines.insert(2, json.dumps({"messages": [{"role": "assistant", "content": "Hi!"},
                                           {"role": "user", "content": "2+2?"},
                                           {"role": "assistant", "content": "4"}]}))
  path.write_text("\n".join(lines) + "\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  r = subprocess.run([sys.executable, "-m", "mars_jax.train", "--config",
                      "configs/qwen2_5_0_5b_ar_sft.py", "--workdir", str(tmp_path / "run"),
                      f"--config.model.init={user['hf']}", f"--config.data.source={path}",
                      "--config.data.on_bad=error", *SIZE], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-3000:]
  assert "Traceback" not in r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and errors[0].startswith(f"error: {path}:3: assistant_first: ")
