"""The README's real-checkpoint commands on a Qwen3 checkpoint with Qwen3's own tokenizer
and template (thinking and non-thinking chats, ShareGPT and OpenAI records, a few bad
records among them), each CLI run in a subprocess as a user types it: MARS with the
shipped Qwen3 config straight from the HF directory (size overrides only; the two-stage
path is test_user_path.py's), the export, generate, and evaluate.

The checkpoint is a tiny Qwen3 that transformers wrote with the real vocabulary size and
the real Qwen3 tokenizer (tests/qwen_tokenizers.py): `<|mask|>` must land above
`</think>` (151668), and the export must keep Qwen3's own template.
"""

import json
import os

import pytest

import qwen_tokenizers as qt
import user_path_fixtures as fx
from test_user_path import SIZE, cli

# A user's whole path through the CLIs on Qwen3: `-m e2e`.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def qwen3_user(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("qwen3_user")
  train = fx.task_records(240, seed=0)
  test = fx.task_records(8, seed=0, split="test")
  chats = tmp / "chat.jsonl"
  with open(chats, "w") as f:
    for record in BAD.values():
      f.write(json.dumps(record) + "\n")
    for i, p in enumerate(train):
      if i % 2:   # ShareGPT needs its own file: one shape per file
        continue
      reply = {"role": "assistant", "content": p["answer"]}
      if i % 4 == 0:
        reply["reasoning_content"] = "Add the two numbers."
      f.write(json.dumps({"messages": [{"role": "user", "content": p["question"]},
                                       reply]}) + "\n")
  sharegpt = tmp / "sharegpt.jsonl"
  with open(sharegpt, "w") as f:
    for p in train[1::2]:
      f.write(json.dumps({"conversations": [{"from": "human", "value": p["question"]},
                                            {"from": "gpt", "value": p["answer"]}]}) + "\n")
  paths = {"hf": qt.make_qwen_checkpoint(tmp / "Qwen3-tiny", "qwen3"),
           "data": f"{chats},{sharegpt}", "mars": str(tmp / "mars"), "chats": str(chats),
           "out": str(tmp / "export"), "gsm8k": fx.write_gsm8k_jsonl(tmp / "test.jsonl", test),
           "question": test[0]["question"], "tmp": tmp}
  paths["train"] = cli("mars_jax.train", "--config", "configs/qwen3_0_6b_mars.py",
                       "--workdir", paths["mars"], f"--config.model.init={paths['hf']}",
                       f"--config.data.source={paths['data']}", *SIZE)
  cli("mars_jax.export", "--checkpoint", paths["mars"], "--out", paths["out"])
  return paths


BAD = {   # line 1.. of chat.jsonl: each kind once, skipped and counted, never fatal
    "assistant_first": {"messages": [{"role": "assistant", "content": "Hello!"},
                                     {"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "content": "4"}]},
    "empty_content": {"messages": [{"role": "user", "content": ""},
                                   {"role": "assistant", "content": "4"}]},
    "unknown_role": {"messages": [{"role": "robot", "content": "beep"},
                                  {"role": "assistant", "content": "4"}]},
    "tool_calls": {"messages": [{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": "", "tool_calls": [
                                    {"type": "function", "function": {"name": "weather",
                                                                      "arguments": {}}}]}]},
    "too_long": {"messages": [{"role": "user", "content": "word " * 200},
                              {"role": "assistant", "content": "4"}]},
}


def test_training_skips_and_lists_each_bad_record(qwen3_user):
  log = qwen3_user["train"].stderr
  assert "245 records read, 240 kept, 0 truncated, 5 bad (" in log
  for kind in BAD:
    assert f"{kind}=1" in log
  with open(os.path.join(qwen3_user["mars"], "bad_records.txt")) as f:
    listed = f.read().splitlines()
  assert [line.split(": ")[:2] for line in listed] == [
      [f"{qwen3_user['chats']}:{n}", kind] for n, kind in enumerate(BAD, start=1)]
  rows = [json.loads(line) for line in open(os.path.join(qwen3_user["mars"], "metrics.jsonl"))]
  assert rows[-1]["step"] == 3 and "ce_mask" in rows[-1]


def test_export_keeps_qwen3s_template_and_puts_the_mask_above_its_tokens(qwen3_user):
  import transformers
  from mars_jax.checkpoints import hf
  tok = transformers.AutoTokenizer.from_pretrained(qwen3_user["out"])
  base = transformers.AutoTokenizer.from_pretrained(qwen3_user["hf"])
  assert tok.chat_template == base.chat_template == qt.QWEN3_TEMPLATE
  assert tok.convert_tokens_to_ids(hf.MASK_TOKEN) == 151669 == len(base)
  assert hf.read_export_marker(qwen3_user["out"])["mask_token_id"] == 151669
  for t, i in (("<tool_response>", 151665), ("<think>", 151667), ("</think>", 151668)):
    assert tok.convert_tokens_to_ids(t) == i
  assert hf.read_generation_config(qwen3_user["out"]) == qt.GENERATION_CONFIG


def test_generate_on_the_export(qwen3_user):
  r = cli("mars_jax.generate", "--model", qwen3_user["out"], "--prompt",
          qwen3_user["question"], "--window", "4", "--mode", "lossless",
          "--max-new-tokens", "8")
  assert "=== [0]" in r.stdout and "tokens/forward" in r.stdout, r.stdout


def test_evaluate_on_the_export(qwen3_user):
  r = cli("mars_jax.evaluate", "--model", qwen3_user["out"], "--task", qwen3_user["gsm8k"],
          "--num-problems", "8", "--taus", "0.9", "--windows", "1,4", "--metrics",
          "probability", "--batch-size", "8", "--max-new-tokens", "8")
  rows = [line.split() for line in r.stdout.splitlines() if line.startswith("probability")]
  assert [(row[1], row[2]) for row in rows] == [("1", "1.00"), ("4", "0.90")], r.stdout


def test_a_qwen25_tokenizer_for_a_qwen3_model_is_refused_by_name(qwen3_user):
  """The Qwen2.5 tokenizer lacks Qwen3's <tool_response> .. </think>: with it, <|mask|>
  would take row 151665, Qwen3's trained <tool_response>. Refused in one line, naming them."""
  import subprocess
  import sys
  from test_user_path import ROOT
  tok_dir = str(qwen3_user["tmp"] / "qwen2.5-tokenizer")
  qt.save_tokenizer(qt.build_qwen_tokenizer("qwen2.5"), tok_dir)
  r = subprocess.run(
      [sys.executable, "-m", "mars_jax.train", "--config", "configs/qwen3_0_6b_mars.py",
       "--workdir", str(qwen3_user["tmp"] / "refused"),
       f"--config.model.init={qwen3_user['hf']}", f"--config.tokenizer={tok_dir}",
       f"--config.data.source={qwen3_user['data']}", *SIZE],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
      capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  error = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
  assert len(error) == 1 and "lacks special tokens of the model's own" in error[0]
  for name in ("<tool_response> (151665)", "</tool_response> (151666)", "<think> (151667)",
               "</think> (151668)"):
    assert name in error[0]
  assert not os.path.exists(qwen3_user["tmp"] / "refused")     # refused before any write
