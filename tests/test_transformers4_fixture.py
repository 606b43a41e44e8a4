"""Sanity test of tests/transformers4.py: its subprocess gets transformers 4.57 with
nothing from the venv, and that transformers saves and reloads a tokenizer."""

import json
import os

import transformers4

_VERSIONS = """
import json, sys
import huggingface_hub, safetensors, tokenizers, transformers
mods = {m.__name__: m for m in (transformers, huggingface_hub, tokenizers, safetensors)}
print(json.dumps({
    "versions": {n: m.__version__ for n, m in mods.items()},
    "files": {n: m.__file__ for n, m in mods.items()},
    "site_packages_on_path": [p for p in sys.path if "site-packages" in p],
    "torch": "torch" in sys.modules,
}))
"""

_ROUND_TRIP = """
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

out = sys.argv[1]
vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3, "mask": 4}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
fast.save_pretrained(out)
back = AutoTokenizer.from_pretrained(out)
print(json.dumps({
    "class": type(back).__name__,
    "ids": back("hello world mask nope")["input_ids"],
    "eos": back.eos_token_id,
    "decoded": back.decode([2, 3]),
}))
"""


def _last_json(proc):
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fixture_gives_transformers_457_alone(tmp_path):
  got = _last_json(transformers4.run_transformers4(_VERSIONS, cwd=tmp_path))
  assert got["versions"]["transformers"].startswith("4.57"), got
  assert got["versions"]["huggingface_hub"].split(".")[0] == "0", got
  path = os.path.realpath(transformers4.transformers4_path()) + os.sep
  for name, file in got["files"].items():
    assert os.path.realpath(file).startswith(path), (name, file)
  assert got["site_packages_on_path"] == [], got
  assert not got["torch"]


def test_fixture_round_trips_a_tokenizer_saved_by_457(tmp_path):
  out = tmp_path / "tok"
  got = _last_json(transformers4.run_transformers4(_ROUND_TRIP, out, cwd=tmp_path))
  assert got["class"] == "PreTrainedTokenizerFast", got
  assert got["ids"] == [2, 3, 4, 0], got
  assert got["eos"] == 1
  assert got["decoded"] == "hello world"
  assert (out / "tokenizer.json").is_file()
  assert (out / "tokenizer_config.json").is_file()
