"""Data pipeline: label masking, truncation, padding/packing, shuffling, sharding,
resumable iterator state, bad input, the synthetic task and its tokenizer."""

import json
import os
import re

import numpy as np
import pytest

from mars_jax.checkpoints import hf
from mars_jax.data import synthetic
from mars_jax.data.chat import format_chats, pad_example
from mars_jax.data.pipeline import default_config, load_data
from mars_jax.data.tokenizer import (CHAT_TEMPLATE, IM_END, build_char_tokenizer,
                                     build_tokenizer, build_word_tokenizer, model_vocab_size)
from mars_jax.data.validation import BadInputError


@pytest.fixture(scope="module")
def tok():
  return build_char_tokenizer()


def _chat(*turns):
  return [{"role": role, "content": content} for role, content in turns]


def _cfg(**kw):
  syn = kw.pop("synthetic", {})
  cfg = {"max_length": 128, "synthetic": {"num_train": 64, "num_test": 16, **syn}}
  cfg.update(kw)
  return cfg


def _write_jsonl(path, lines):
  with open(path, "w") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  return str(path)


def _targets(tok, ex):
  return tok.decode(ex["tokens"][ex["loss_mask"]])


# ---- label masking -------------------------------------------------------------------


def test_single_turn_mask_positions(tok):
  q, a = "What is 2+3?", "2+3=5\n#### 5"
  ex = format_chats(tok, [_chat(("user", q), ("assistant", a))])[0]
  # <|im_start|> user \n q <|im_end|> \n <|im_start|> assistant \n : len(q) + 19 tokens
  start = len(q) + 19
  assert np.flatnonzero(ex["loss_mask"]).tolist() == list(range(start, start + len(a) + 1))
  assert ex["tokens"][start + len(a)] == tok.convert_tokens_to_ids(IM_END)
  assert len(ex["tokens"]) == start + len(a) + 2       # the final "\n" is no target
  assert ex["tokens"].dtype == np.int32 and ex["loss_mask"].dtype == bool


def test_multi_turn_mask_positions(tok):
  chat = _chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Yo"),
               ("user", "Ok?"), ("assistant", "No"))
  ex = format_chats(tok, [chat])[0]
  # Hand-counted: "S system . Be brief. E ." is 19 tokens, then (as in chat.py's
  # docstring) "Yo E" at 21..23 and "No E" at 47..49 shift by 19.
  assert np.flatnonzero(ex["loss_mask"]).tolist() == [40, 41, 42, 66, 67, 68]
  assert _targets(tok, ex) == f"Yo{IM_END}No{IM_END}"


def test_mask_with_multi_char_tokens_and_default_system_prompt():
  """A byte-level BPE tokenizer and a Qwen2.5-style template that injects a system prompt."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  core = Tokenizer(models.BPE())
  core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  core.decoder = decoders.ByteLevel()
  corpus = ["The answer is 42 because six times seven.", "hello world, assistant user",
            "You are a helpful assistant.", "system prompt with many words"] * 20
  core.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=400, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  template = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a "
              "helpful assistant.<|im_end|>\\n' }}{%- endif %}" + CHAT_TEMPLATE)
  bpe = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                pad_token="<|endoftext|>", chat_template=template,
                                extra_special_tokens=["<|im_start|>"])
  chat = _chat(("user", "hello world"), ("assistant", "The answer is 42."),
               ("user", "why?"), ("assistant", " because six times seven"))
  ex = format_chats(bpe, [chat])[0]
  assert len(ex["tokens"]) < len(bpe.apply_chat_template(chat, tokenize=False))
  assert _targets(bpe, ex) == "The answer is 42.<|im_end|> because six times seven<|im_end|>"
  ids = bpe.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
  assert ex["tokens"].tolist() == list(ids)


# ---- truncation, padding, packing ----------------------------------------------------


def test_truncation_keeps_start_and_counts(tok, tmp_path):
  long = _chat(("user", "q" * 30), ("assistant", "a" * 60))        # 112 tokens
  short = _chat(("user", "q"), ("assistant", "a"))
  path = _write_jsonl(tmp_path / "d.jsonl", [{"messages": long}, {"messages": short}])
  data = load_data({"source": path, "max_length": 64}, tok)
  assert data.stats.truncated == 1 and data.stats.bad == 0 and len(data.train) == 2
  full = format_chats(tok, [long])[0]
  cut = data.train[0] if len(data.train[0]["tokens"]) == 64 else data.train[1]
  np.testing.assert_array_equal(cut["tokens"], full["tokens"][:64])
  np.testing.assert_array_equal(cut["loss_mask"], full["loss_mask"][:64])


def test_pad_example(tok):
  ex = format_chats(tok, [_chat(("user", "Hi"), ("assistant", "Yo"))])[0]
  n = len(ex["tokens"])
  row = pad_example(ex, 40, pad_id=0)
  assert row["tokens"].shape == (40,) and row["tokens"].dtype == np.int32
  assert row["loss_mask"].shape == (40,) and row["loss_mask"].dtype == bool
  np.testing.assert_array_equal(row["tokens"][:n], ex["tokens"])
  assert (row["tokens"][n:] == 0).all() and not row["loss_mask"][n:].any()


def test_padded_batches(tok):
  data = load_data(_cfg(), tok)
  batch = next(data.train_iterator(batch_size=8, shard_index=0, shard_count=1))
  assert set(batch) == {"tokens", "loss_mask"}
  assert batch["tokens"].shape == (8, 128) and batch["tokens"].dtype == np.int32
  assert batch["loss_mask"].shape == (8, 128) and batch["loss_mask"].dtype == bool
  for row in range(8):
    text = tok.decode(batch["tokens"][row][batch["loss_mask"][row]])
    assert text.endswith(IM_END) and synthetic.extract_answer(text) is not None


def _segments(batch):
  """Yields (row, segment id, tokens, loss_mask, positions) of every packed segment."""
  for r, seg in enumerate(batch["segment_ids"]):
    for s in np.unique(seg[seg > 0]):
      sel = seg == s
      yield r, s, batch["tokens"][r][sel], batch["loss_mask"][r][sel], batch["positions"][r][sel]


def test_packing_segments_and_positions(tok):
  data = load_data(_cfg(max_length=256, num_epochs=1, packing=True), tok)
  examples = {tuple(data.train[i]["tokens"]): data.train[i]["loss_mask"]
              for i in range(len(data.train))}
  seen = []
  for batch in data.train_iterator(batch_size=4, shard_index=0, shard_count=1):
    assert set(batch) == {"tokens", "loss_mask", "segment_ids", "positions"}
    assert all(v.shape == (4, 256) for v in batch.values())
    for seg in batch["segment_ids"]:
      used = seg[seg > 0]
      # ids 1, 2, ... in contiguous runs, padding (0) only at the end
      assert used.tolist() == sorted(used.tolist()) and used[0] == 1
      assert set(np.unique(used)) == set(range(1, used.max() + 1))
      assert (seg[len(used):] == 0).all()
    assert not batch["loss_mask"][batch["segment_ids"] == 0].any()
    for _, _, tokens, mask, positions in _segments(batch):
      assert positions.tolist() == list(range(len(tokens)))
      np.testing.assert_array_equal(mask, examples[tuple(tokens)])
      seen.append(tuple(tokens))
  assert len(seen) == len(set(seen)) and len(seen) >= len(examples) - 8
  assert np.mean([len(s) for s in seen]) > 100


# ---- shuffling, sharding, state ------------------------------------------------------


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_shuffle_is_deterministic_by_seed(tok):
  a = _take(load_data(_cfg(), tok).train_iterator(batch_size=8, shard_index=0, shard_count=1), 3)
  b = _take(load_data(_cfg(), tok).train_iterator(batch_size=8, shard_index=0, shard_count=1), 3)
  c = _take(load_data(_cfg(seed=1), tok).train_iterator(batch_size=8, shard_index=0,
                                                         shard_count=1), 3)
  _assert_same(a, b)
  assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])


def test_epochs_reshuffle_and_cover(tok):
  data = load_data(_cfg(num_epochs=2), tok)
  batches = list(data.train_iterator(batch_size=8, shard_index=0, shard_count=1))
  assert len(batches) == data.num_steps(8) == 2 * 64 // 8
  rows = [tuple(r) for b in batches for r in b["tokens"]]
  first, second = rows[:64], rows[64:]
  assert len(set(first)) == 64 and set(first) == set(second) and first != second


def test_process_shards_are_disjoint_and_form_the_global_batch(tok):
  data = load_data(_cfg(num_epochs=1), tok)
  whole = list(data.train_iterator(batch_size=8, shard_index=0, shard_count=1))
  shards = [list(data.train_iterator(batch_size=8, shard_index=i, shard_count=2))
            for i in range(2)]
  assert len(shards[0]) == len(shards[1]) == len(whole) == 8
  for step, batch in enumerate(whole):
    parts = [tuple(r) for s in shards for r in s[step]["tokens"]]
    assert all(s[step]["tokens"].shape == (4, 128) for s in shards)
    assert sorted(parts) == sorted(tuple(r) for r in batch["tokens"])
  rows = [[tuple(r) for b in s for r in b["tokens"]] for s in shards]
  assert not set(rows[0]) & set(rows[1]) and len(set(rows[0]) | set(rows[1])) == 64
  per_process = list(data.train_iterator(batch_size=4, shard_index=1, shard_count=2,
                                         global_batch=False))
  _assert_same(per_process, shards[1])
  with pytest.raises(ValueError, match="divisible"):
    data.train_iterator(batch_size=7, shard_index=0, shard_count=2)


@pytest.mark.parametrize("packing", [False, True])
def test_iterator_state_restores_the_same_batches(tok, tmp_path, packing):
  from etils import epath
  from grain.checkpoint import CheckpointHandler   # what orbax saves grain iterators with
  cfg = _cfg(packing=packing, max_length=256 if packing else 128)
  it = load_data(cfg, tok).train_iterator(batch_size=4, shard_index=1, shard_count=2)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))
  CheckpointHandler().save(epath.Path(tmp_path), it)
  expected = _take(it, 12)                       # crosses the 32-example epoch boundary
  resumed = load_data(cfg, tok).train_iterator(batch_size=4, shard_index=1, shard_count=2)
  resumed.set_state(state)
  _assert_same(_take(resumed, 12), expected)
  restored = load_data(cfg, tok).train_iterator(batch_size=4, shard_index=1, shard_count=2)
  CheckpointHandler().restore(epath.Path(tmp_path), restored)
  _assert_same(_take(restored, 12), expected)


def test_eval_batches_are_held_out_and_even_across_processes(tok):
  data = load_data(_cfg(synthetic={"num_test": 20}), tok)
  shards = [data.eval_batches(batch_size=8, shard_index=i, shard_count=2) for i in range(2)]
  assert len(shards[0]) == len(shards[1]) == 2          # 20 -> 16 = 2 global batches
  rows = {tuple(r) for s in shards for b in s for r in b["tokens"]}
  assert len(rows) == 16
  train = {tuple(pad_example(data.train[i], 128, data.pad_id)["tokens"])
           for i in range(len(data.train))}
  assert len(train) == 64 and not rows & train
  with pytest.raises(ValueError, match="fewer than one global batch"):
    data.eval_batches(batch_size=32, shard_index=0, shard_count=1)


def test_num_eval_holds_out_file_records(tok, tmp_path):
  records = synthetic.chat_records(40, seed=3)
  path = _write_jsonl(tmp_path / "d.jsonl", records)
  data = load_data({"source": path, "num_eval": 10, "max_length": 128}, tok)
  assert len(data.train) == 30 and len(data.eval) == 10
  train = {tuple(data.train[i]["tokens"]) for i in range(30)}
  held = {tuple(data.eval[i]["tokens"]) for i in range(10)}
  assert not train & held and len(train | held) == 40


# ---- sources and bad input -----------------------------------------------------------

GOOD = {"messages": _chat(("user", "2+2?"), ("assistant", "4\n#### 4"))}
BAD_LINES = {
    "malformed": '{"messages": [',
    "unknown_role": {"messages": _chat(("robot", "beep"), ("assistant", "ok"))},
    "empty_assistant": {"messages": _chat(("user", "hi"), ("assistant", "  "))},
    "no_assistant": {"messages": _chat(("user", "hi"))},
    "too_long": {"messages": _chat(("user", "x" * 200), ("assistant", "y"))},
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_record_is_counted_or_raises(tok, tmp_path, kind):
  path = _write_jsonl(tmp_path / "d.jsonl", [GOOD, "", BAD_LINES[kind], GOOD])
  cfg = {"source": path, "max_length": 64, "truncate": False}
  data = load_data(cfg, tok)
  assert data.stats.counts[kind] == 1 and data.stats.bad == 1
  assert data.stats.records == 3 and data.stats.kept == 2 and len(data.train) == 2
  assert data.stats.examples[0].startswith(f"{path}:3: {kind}: ")
  assert f"{kind}=1" in data.stats.summary() and f"{path}:3" in data.stats.summary()
  with pytest.raises(BadInputError, match=f"{path}:3: {kind}"):
    load_data({**cfg, "on_bad": "error"}, tok)


def test_too_long_without_target_after_truncation(tok, tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [GOOD, BAD_LINES["too_long"]])
  data = load_data({"source": path, "max_length": 64}, tok)
  assert data.stats.counts["too_long"] == 1 and data.stats.truncated == 0
  assert "no assistant token within max_length 64" in data.stats.examples[0]


def test_empty_file_is_counted_or_raises(tok, tmp_path):
  good = _write_jsonl(tmp_path / "a.jsonl", [GOOD])
  empty = str(tmp_path / "b.jsonl")
  open(empty, "w").close()
  data = load_data({"source": f"{good},{empty}", "max_length": 64}, tok)
  assert data.stats.counts["empty_file"] == 1 and len(data.train) == 1
  assert data.stats.examples == [f"{empty}: empty_file: no records"]
  with pytest.raises(BadInputError, match=f"{empty}: empty_file"):
    load_data({"source": str(tmp_path), "max_length": 64, "on_bad": "error"}, tok)
  with pytest.raises(ValueError, match="no training examples"):
    load_data({"source": empty, "max_length": 64}, tok)


def test_parquet_source_matches_jsonl(tok, tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  records = synthetic.chat_records(12, seed=5) + [BAD_LINES["empty_assistant"]]
  pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
  _write_jsonl(tmp_path / "d.jsonl", records)
  from_parquet = load_data({"source": str(tmp_path / "d.parquet"), "max_length": 128}, tok)
  from_jsonl = load_data({"source": str(tmp_path / "d.jsonl"), "max_length": 128}, tok)
  assert from_parquet.stats.counts["empty_assistant"] == 1
  assert from_parquet.stats.examples[0].startswith(f"{tmp_path / 'd.parquet'}:row 12: ")
  assert len(from_parquet.train) == len(from_jsonl.train) == 12
  for i in range(12):
    np.testing.assert_array_equal(from_parquet.train[i]["tokens"], from_jsonl.train[i]["tokens"])
  pq.write_table(pa.table({"text": ["hi"]}), tmp_path / "x.parquet")
  with pytest.raises(ValueError, match=r"match no known chat shape \(keys found: \['text'\]"):
    load_data({"source": str(tmp_path / "x.parquet")}, tok)


def test_config_errors(tok):
  with pytest.raises(ValueError, match="unknown data config keys"):
    load_data({"max_lenght": 64}, tok)
  with pytest.raises(ValueError, match="synthetic.num_tran"):
    load_data({"synthetic": {"num_tran": 5}}, tok)
  with pytest.raises(ValueError, match="data.on_bad='ignore'"):
    load_data({"on_bad": "ignore"}, tok)
  with pytest.raises(ValueError, match="data.max_length=0"):
    load_data({"max_length": 0}, tok)
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    load_data({"source": "/nonexistent/missing.jsonl"}, tok)
  cfg = default_config()
  cfg.max_length = 96
  cfg.synthetic.num_train = 8
  assert load_data(cfg, tok).max_length == 96


# ---- synthetic task and tokenizer ----------------------------------------------------


def test_synthetic_is_deterministic_and_splits_are_disjoint():
  train = synthetic.generate(3000, seed=7)
  assert train == synthetic.generate(3000, seed=7)
  assert synthetic.generate(100, seed=7) == train[:100]
  assert synthetic.generate(100, seed=8) != train[:100]
  test = synthetic.generate(500, seed=7, split="test")
  # identity = template (the answer's first word) and numbers, whatever the names
  identity = lambda r: (r["answer"].split(":")[0], re.findall(r"\d+", r["question"]))  # noqa: E731
  train_ids = {repr(identity(r)) for r in train}
  test_ids = {repr(identity(r)) for r in test}
  assert len(train_ids) == 3000 and len(test_ids) == 500 and not train_ids & test_ids
  assert len({r["answer"].split(":")[0] for r in test}) == len(synthetic.TEMPLATES)
  with pytest.raises(ValueError, match="split"):
    synthetic.generate(1, split="valid")


def test_synthetic_answers_are_correct():
  for r in synthetic.generate(300, seed=0):
    steps = r["answer"].split("\n")
    assert len(steps) == 3
    for step in steps[:2]:
      lhs, rhs = step.split(": ")[1].split("=")
      assert eval(lhs) == int(rhs)                 # noqa: S307 (digits and one operator)
    assert steps[1].endswith("=" + synthetic.extract_answer(r["answer"]))


def test_extract_answer():
  assert synthetic.extract_answer("5+2=7\n#### 7") == "7"
  assert synthetic.extract_answer("#### 1,000") == "1000"
  assert synthetic.extract_answer("#### 3 then #### -4.50") == "-4.5"
  assert synthetic.extract_answer("#### 7.0") == "7"
  assert synthetic.extract_answer("the answer is 7") is None
  assert synthetic.is_correct("x\n#### 12<|im_end|>", "y\n#### 12")
  assert not synthetic.is_correct("no answer", "#### 12")
  assert not synthetic.is_correct("#### 13", "#### 12")


def test_tokenizer_ids_and_roundtrip(tok, tmp_path):
  from transformers import AutoTokenizer
  assert len(tok) == 260 and model_vocab_size(tok) == 320
  assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
  assert tok.convert_tokens_to_ids(hf.MASK_TOKEN) == 3
  chat = _chat(("user", "Ann has 3 pens.\nHow many?"), ("assistant", "3+0=3\n#### 3"))
  text = tok.apply_chat_template(chat, tokenize=False)
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert len(ids) == len("Ann has 3 pens.\nHow many?") + len("3+0=3\n#### 3") + 21
  assert tok.decode(ids) == text
  utf8 = tok("né ü", add_special_tokens=False)["input_ids"]
  assert len(utf8) == 6 and tok.decode(utf8) == "né ü"     # non-ASCII: one token per byte
  tok.save_pretrained(tmp_path / "tok")
  again = AutoTokenizer.from_pretrained(tmp_path / "tok")
  assert again(text, add_special_tokens=False)["input_ids"] == ids
  assert again.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) == \
      text[:text.index("assistant\n") + len("assistant\n")]
  assert again.eos_token == IM_END and again.pad_token_id == 0


@pytest.fixture(scope="module")
def words():
  return build_word_tokenizer()


def test_word_tokenizer_keeps_words_whole_and_digits_single(words, tok):
  chat = synthetic.chat_records(64, split="test")
  text = words.apply_chat_template(chat[0]["messages"], tokenize=False)
  ids = words(text, add_special_tokens=False)["input_ids"]
  pieces = words.convert_ids_to_tokens(ids)
  assert words.decode(ids) == text
  for word in re.findall(r"[A-Za-z]+", chat[0]["messages"][0]["content"]):
    assert word in pieces or "Ġ" + word in pieces, (word, pieces)
  assert all(len(p) == 1 for p in pieces if any(ch.isdigit() for ch in p))
  assert [words.convert_tokens_to_ids(t) for t in (
      "<|endoftext|>", "<|im_start|>", "<|im_end|>", hf.MASK_TOKEN)] == [0, 1, 2, 3]
  ours = [len(e["tokens"]) for e in format_chats(words, [c["messages"] for c in chat])]
  chars = [len(e["tokens"]) for e in format_chats(tok, [c["messages"] for c in chat])]
  assert max(ours) <= 64 and np.mean(ours) < 0.6 * np.mean(chars)
  other = "Zoë pays 1,234.5 € — ok?\n\tdone"                # not task text: bytes, no loss
  assert words.decode(words(other, add_special_tokens=False)["input_ids"]) == other
  with pytest.raises(ValueError, match="'bytes'.*'char', 'words'"):
    build_tokenizer("bytes")


def test_word_tokenizer_is_the_same_in_every_process(words):
  import subprocess
  import sys
  code = ("from mars_jax.data.tokenizer import build_word_tokenizer as b; "
          "print(b().backend_tokenizer.to_str())")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                       check=True, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
  assert json.loads(out) == json.loads(words.backend_tokenizer.to_str())


@pytest.mark.parametrize("name", ["char", "words"])
def test_tokenizer_through_hf_save_and_load(name, tmp_path):
  import jax
  tok = build_tokenizer(name)
  from mars_jax.models.qwen2 import Qwen2Config, init_params
  config = Qwen2Config(vocab_size=model_vocab_size(tok), hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       bos_token_id=None, eos_token_id=tok.eos_token_id,
                       tie_word_embeddings=True)
  path = str(tmp_path / "model")
  hf.save_pretrained(config, init_params(config, jax.random.PRNGKey(0)), path, tokenizer=tok)
  assert os.path.isfile(os.path.join(path, "tokenizer.json"))
  loaded, mask_id = hf.load_tokenizer(path)
  # config.json says qwen2, so transformers rebuilds a Qwen2Tokenizer from our vocab
  assert type(loaded).__name__ == "Qwen2Tokenizer"
  assert mask_id == 3 and len(loaded) == len(tok) and loaded.eos_token_id == 2
  cfg = _cfg(synthetic={"num_train": 64})
  ours, theirs = load_data(cfg, tok).train, load_data(cfg, loaded).train
  for i in range(64):
    np.testing.assert_array_equal(ours[i]["tokens"], theirs[i]["tokens"])
    np.testing.assert_array_equal(ours[i]["loss_mask"], theirs[i]["loss_mask"])


def test_easy_difficulty_small_numbers_disjoint_splits():
  train = synthetic.generate(2000, split="train", difficulty="easy")
  test = synthetic.generate(300, split="test", difficulty="easy")
  assert not {r["question"] for r in train} & {r["question"] for r in test}
  answers = [int(synthetic.extract_answer(r["answer"])) for r in train + test]
  assert max(answers) <= 60 and min(answers) >= 0
  with pytest.raises(ValueError, match="difficulty='hard'"):
    synthetic.generate(1, difficulty="hard")
