"""Chat data on the real Qwen vocabulary: the targets of Qwen2.5's and Qwen3's templates,
every record shape users have, and bad records counted with their file and line.

Tokenizers: tests/qwen_tokenizers.py (the real BPE ranks and special ids, templates that
behave like the published ones).
"""

import json
from pathlib import Path

import numpy as np
import pytest

import qwen_tokenizers as qt
from mars_jax.data import formats
from mars_jax.data.chat import TemplateError, format_chats, target_spans
from mars_jax.data.pipeline import load_data
from mars_jax.data.validation import BadInputError


@pytest.fixture(scope="module")
def qwen25():
  return qt.build_qwen_tokenizer("qwen2.5")


@pytest.fixture(scope="module")
def qwen3():
  return qt.build_qwen_tokenizer("qwen3")


def _chat(*turns):
  return [{"role": role, "content": content} for role, content in turns]


def targets(tok, ex) -> list[str]:
  """The target tokens' text, consecutive targets joined, one string per run."""
  runs, cur = [], []
  for t, m in zip(ex["tokens"], ex["loss_mask"]):
    if m:
      cur.append(int(t))
    elif cur:
      runs.append(tok.decode(cur))
      cur = []
  return runs + ([tok.decode(cur)] if cur else [])


def _write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


MULTI = _chat(("user", "What is 2+3?"), ("assistant", "2+3 = 5."), ("user", "And 4+4?"),
              ("assistant", "4+4 = 8, twice four."))


# ---- the targets of the published templates -----------------------------------------


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_qwen25_targets_are_each_reply_and_its_im_end(qwen25, system):
  chat = ([{"role": "system", "content": system}] if system else []) + MULTI
  ex = format_chats(qwen25, [chat])[0]
  assert targets(qwen25, ex) == ["2+3 = 5.<|im_end|>", "4+4 = 8, twice four.<|im_end|>"]
  ids = qwen25.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
  assert ex["tokens"].tolist() == list(ids)                  # the tokens inference sees
  text = qwen25.decode(ex["tokens"])
  assert (qt.DEFAULT_SYSTEM in text) == (system is None)     # the default prompt, no target


THINKING = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3."},
            {"role": "user", "content": "And 4+4?"},
            {"role": "assistant", "content": "8", "reasoning_content": "Four twice."}]


def test_qwen3_targets_a_thinking_turn_whole_and_skip_the_empty_think_block(qwen3):
  """A thinking turn's targets are everything the model writes after
  `<|im_start|>assistant\n`: `<think>`, the reasoning, `</think>`, their newlines, the
  reply and <|im_end|>. The empty think block of a non-thinking turn and the reasoning
  the template strips from earlier turns are not targets."""
  ex = format_chats(qwen3, [THINKING])[0]
  text = qwen3.decode(ex["tokens"])
  assert "2 plus 3." not in text                              # stripped by the template
  assert "<think>\nFour twice.\n</think>\n\n8<|im_end|>" in text
  assert targets(qwen3, ex) == ["5<|im_end|>", "<think>\nFour twice.\n</think>\n\n8<|im_end|>"]
  plain = format_chats(qwen3, [MULTI])[0]
  assert "<think>\n\n</think>\n\n4+4 = 8" in qwen3.decode(plain["tokens"])
  assert targets(qwen3, plain) == ["2+3 = 5.<|im_end|>", "4+4 = 8, twice four.<|im_end|>"]
  ids = qwen3.apply_chat_template(THINKING, tokenize=True, return_dict=True)["input_ids"]
  assert ex["tokens"].tolist() == list(ids)
  think = [qwen3.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
  assert ex["loss_mask"][np.isin(ex["tokens"], think)].all()
  assert not plain["loss_mask"][np.isin(plain["tokens"], think)].any()


def test_qwen3_thinking_turn_every_token_from_think_to_im_end_is_a_target(qwen3):
  im_start, im_end, think = (qwen3.convert_tokens_to_ids(t)
                             for t in ("<|im_start|>", "<|im_end|>", "<think>"))
  # (a) thinking mode: one run of targets, from <think> through <|im_end|>
  chat = _chat(("user", "4+4?"))
  chat.append({"role": "assistant", "content": "It is 8.",
               "reasoning_content": "Four and four\nmake eight."})
  for kwargs in ({}, {"enable_thinking": True}):
    ex = format_chats(qwen3, [chat], template_kwargs=kwargs)[0]
    tokens, mask = ex["tokens"].tolist(), ex["loss_mask"]
    first = tokens.index(think)
    last = len(tokens) - 1 - tokens[::-1].index(im_end)
    assert tokens[first - 3:first] == [im_start, *qwen3.encode("assistant\n")]
    assert np.flatnonzero(mask).tolist() == list(range(first, last + 1))
    assert qwen3.decode(ex["tokens"][mask]) == (
        "<think>\nFour and four\nmake eight.\n</think>\n\nIt is 8.<|im_end|>")
  # (b) the empty block of a turn without reasoning, whatever enable_thinking says
  for kwargs in ({}, {"enable_thinking": False}):
    ex = format_chats(qwen3, [_chat(("user", "4+4?"), ("assistant", "8"))],
                      template_kwargs=kwargs)[0]
    assert qwen3.decode(ex["tokens"]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n8<|im_end|>\n")
    assert targets(qwen3, ex) == ["8<|im_end|>"]
  # (c) reasoning the template drops (an earlier turn) gives no target; the reply does
  ex = format_chats(qwen3, [THINKING])[0]
  assert "2 plus 3." not in qwen3.decode(ex["tokens"])
  assert targets(qwen3, ex)[0] == "5<|im_end|>"
  assert qwen3.decode(ex["tokens"]).count("<think>") == 1


def mask_dump(tok, ex) -> str:
  """The chat's tokens, each target as `[tok]`, a newline character shown as `\\n`,
  one line per assistant turn (the form of docs/data.md)."""
  out = "".join(f"[{s}]" if m else s for s, m in (
      (tok.decode([int(t)]).replace("\n", "\\n"), m)
      for t, m in zip(ex["tokens"], ex["loss_mask"])))
  return out.replace("<|im_start|>assistant", "\n<|im_start|>assistant")


def test_the_qwen3_mask_dump_of_docs_data_md(qwen3):
  doc = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
  block = doc.split("One Qwen3 chat on the real vocabulary", 1)[1]
  block = block.split("```\n", 1)[1].split("```", 1)[0]
  chat = [{"role": "system", "content": "Be brief."}] + THINKING
  assert block == mask_dump(qwen3, format_chats(qwen3, [chat])[0]) + "\n"


def test_inline_think_is_one_target_span_in_qwen3_and_chatml(qwen3, qwen25):
  """Qwen3 moves `<think>...</think>` leading the content into its think block, which is
  one target with the reply; ChatML renders the content verbatim, tags and all."""
  chat = _chat(("user", "4+4?"), ("assistant", "<think>\nfour and four\n</think>\n\n8"))
  assert targets(qwen3, format_chats(qwen3, [chat])[0]) == [
      "<think>\nfour and four\n</think>\n\n8<|im_end|>"]
  assert targets(qwen25, format_chats(qwen25, [chat])[0]) == [
      "<think>\nfour and four\n</think>\n\n8<|im_end|>"]


def test_train_on_last_keeps_only_the_last_reply(qwen3):
  ex = format_chats(qwen3, [MULTI], train_on="last")[0]
  assert targets(qwen3, ex) == ["4+4 = 8, twice four.<|im_end|>"]
  with pytest.raises(ValueError, match="train_on"):
    format_chats(qwen3, [MULTI], train_on="first")


def test_template_kwargs_reach_the_template(qwen3):
  chat = _chat(("user", "Hi"), ("assistant", "Hello"))
  a = format_chats(qwen3, [chat])[0]
  b = format_chats(qwen3, [chat], template_kwargs={"enable_thinking": False})[0]
  # Qwen3's enable_thinking changes only the generation prompt: the same training tokens
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  tok = qt.build_qwen_tokenizer("qwen2.5", copy=True)
  tok.chat_template = ("{%- if persona is defined %}<|im_start|>system\n{{ persona }}"
                       "<|im_end|>\n{%- endif %}" + qt.QWEN25_TEMPLATE)
  ex = format_chats(tok, [chat], template_kwargs={"persona": "A pirate."})[0]
  assert "A pirate." in tok.decode(ex["tokens"]) and targets(tok, ex) == ["Hello<|im_end|>"]


def test_a_reply_that_starts_with_a_newline(qwen25, qwen3):
  """The stated rule: a token any of whose characters is the reply's is a target. ChatML
  keeps the newline, merged with the header's into one token that is a target; Qwen3's
  template strips it, so the reply starts at its first character."""
  chat = _chat(("user", "Hi"), ("assistant", "\nok"))
  ex = format_chats(qwen25, [chat])[0]
  assert targets(qwen25, ex) == ["\n\nok<|im_end|>"]
  assert qwen25.decode(ex["tokens"]).endswith("assistant\n\nok<|im_end|>\n")
  assert targets(qwen3, format_chats(qwen3, [chat])[0]) == ["ok<|im_end|>"]


def test_spans_are_character_offsets_of_the_rendered_text(qwen3):
  text, spans = target_spans(qwen3, MULTI)
  assert [text[a:b] for a, b, _ in spans] == ["2+3 = 5.", "4+4 = 8, twice four."]


def test_a_template_that_rewrites_replies_is_a_template_error(qwen25):
  tok = qt.build_qwen_tokenizer("qwen2.5", copy=True)
  tok.chat_template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|upper }}"
                       "<|im_end|>\n{%- endfor %}")
  with pytest.raises(TemplateError, match=r"messages\[1\]"):
    format_chats(tok, [_chat(("user", "hi"), ("assistant", "yo"))])


# ---- record shapes, files ------------------------------------------------------------

QA = [("What is 1+1?", "2"), ("Name a colour.", "Blue."), ("Capital of France?", "Paris.")]
SHAPED = {
    "messages": [{"messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": q},
                               {"role": "assistant", "content": a}]} for q, a in QA],
    "sharegpt": [{"conversations": [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": q},
                                    {"from": "gpt", "value": a}]} for q, a in QA],
    "alpaca": [{"instruction": q, "input": "", "output": a, "system": "Be brief."}
               for q, a in QA],
    "prompt_completion": [{"prompt": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": q}],
                           "completion": [{"role": "assistant", "content": a}]}
                          for q, a in QA],
}


def _tokens(data):
  return [data.train[i]["tokens"].tolist() for i in range(len(data.train))]


@pytest.mark.parametrize("shape", sorted(SHAPED))
def test_every_shape_gives_the_chat_of_the_messages_form(qwen25, tmp_path, shape):
  cfg = {"max_length": 128, "seed": 0}
  ref = load_data({**cfg, "source": _write_jsonl(tmp_path / "ref.jsonl",
                                                 SHAPED["messages"])}, qwen25)
  path = _write_jsonl(tmp_path / f"{shape}.jsonl", SHAPED[shape])
  auto = load_data({**cfg, "source": path}, qwen25)
  named = load_data({**cfg, "source": path, "format": shape}, qwen25)
  assert _tokens(auto) == _tokens(named) == _tokens(ref) and auto.stats.bad == 0
  assert formats.detect_format(SHAPED[shape], "x") == shape


def test_alpaca_input_and_string_prompt_completion():
  assert formats.to_messages({"instruction": "Sum", "input": "1 2", "output": "3"},
                             "alpaca") == _chat(("user", "Sum\n\n1 2"), ("assistant", "3"))
  assert formats.to_messages({"prompt": "Q", "completion": "A"}, "prompt_completion") == \
      _chat(("user", "Q"), ("assistant", "A"))


def test_parquet_and_save_to_disk_equal_jsonl(qwen25, tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  datasets = pytest.importorskip("datasets")
  cfg = {"max_length": 128}
  records = SHAPED["sharegpt"] + [{"conversations": [{"from": "gpt", "value": "first"}]}]
  jsonl = load_data({**cfg, "source": _write_jsonl(tmp_path / "d.jsonl", records)}, qwen25)
  pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
  parquet = load_data({**cfg, "source": str(tmp_path / "d.parquet")}, qwen25)
  datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "arrow"))
  arrow = load_data({**cfg, "source": str(tmp_path / "arrow")}, qwen25)
  assert _tokens(jsonl) == _tokens(parquet) == _tokens(arrow) and len(jsonl.train) == 3
  for data, where in ((parquet, "d.parquet:row 3"), (arrow, "arrow:row 3")):
    assert data.stats.counts["assistant_first"] == 1
    assert data.stats.examples[0].startswith(str(tmp_path / where) + ": assistant_first")
  datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(
      str(tmp_path / "dd"))
  with pytest.raises(ValueError, match=r"a DatasetDict with splits \['train'\]; name the split"):
    load_data({**cfg, "source": str(tmp_path / "dd")}, qwen25)
  assert len(load_data({**cfg, "source": str(tmp_path / "dd" / "train")}, qwen25).train) == 3


def test_a_file_of_no_known_shape_is_refused_with_its_keys(qwen25, tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}] * 3)
  with pytest.raises(formats.UnknownFormatError,
                     match=r"keys found: \['answer', 'question'\] in 3 records.*data.format"):
    load_data({"source": path}, qwen25)
  with pytest.raises(ValueError, match="data.format='csv'"):
    load_data({"source": path, "format": "csv"}, qwen25)


def test_sharegpt_with_num_eval_names_the_real_cause(qwen25, tmp_path):
  """A ShareGPT file read as messages used to report only `leaves no training records of
  0`; now its shape is detected, and a file of bad records says why they are bad."""
  path = _write_jsonl(tmp_path / "d.jsonl", SHAPED["sharegpt"] * 8)
  assert len(load_data({"source": path, "num_eval": 16}, qwen25).train) == 8
  with pytest.raises(ValueError, match=r"(?s)usable ones.*malformed=24.*a record with keys "
                                       r"\['conversations'\] in a messages-shaped file"):
    load_data({"source": path, "num_eval": 16, "format": "messages"}, qwen25)


def test_tool_turns_are_context_and_tool_calls_are_skipped(qwen25, tmp_path):
  call = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {
                            "name": "weather", "arguments": {"city": "Paris"}}}]},
                       {"role": "tool", "content": "18C, sunny"},
                       {"role": "assistant", "content": "It is 18C and sunny."}]}
  observed = {"messages": [{"role": "user", "content": "Weather?"},
                           {"role": "tool", "content": "18C"},
                           {"role": "assistant", "content": "18C."}]}
  data = load_data({"source": _write_jsonl(tmp_path / "d.jsonl", [call, observed]),
                    "max_length": 256}, qwen25)
  assert data.stats.counts["tool_calls"] == 1 and len(data.train) == 1
  ex = data.train[0]
  assert "<tool_response>\n18C\n</tool_response>" in qwen25.decode(ex["tokens"])
  assert targets(qwen25, ex) == ["18C.<|im_end|>"]


# ---- bad records ---------------------------------------------------------------------

GOOD = {"messages": _chat(("user", "2+2?"), ("assistant", "4"))}
BAD = {
    "assistant_first": {"messages": _chat(("assistant", "Hello!"), ("user", "hi"),
                                          ("assistant", "ok"))},
    "empty_content": {"messages": _chat(("user", " "), ("assistant", "ok"))},
    "empty_assistant": {"messages": _chat(("user", "hi"), ("assistant", ""))},
    "unknown_role": {"messages": _chat(("robot", "beep"), ("assistant", "ok"))},
    "no_assistant": {"messages": _chat(("user", "hi"))},
    "malformed": {"messages": [{"role": "user"}]},
    "too_long": {"messages": _chat(("user", "word " * 300), ("assistant", "ok"))},
    "template_error": {"messages": _chat(("user", "hi"), ("assistant", "ok"),
                                         ("assistant", "again"))},
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_record_is_counted_with_its_line_or_raises(qwen25, tmp_path, kind):
  tok = qwen25
  if kind == "template_error":   # a template that, like many, refuses two replies in a row
    tok = qt.build_qwen_tokenizer("qwen2.5", copy=True)
    tok.chat_template = (
        "{%- for m in messages %}{%- if loop.index0 > 0 and m.role == messages[loop.index0 - 1]"
        ".role %}{{ raise_exception('roles must alternate') }}{%- endif %}{%- endfor %}"
        + qt.QWEN25_TEMPLATE)
  path = _write_jsonl(tmp_path / "d.jsonl", [GOOD, BAD[kind], GOOD])
  cfg = {"source": path, "max_length": 64, "truncate": False}
  data = load_data(cfg, tok)
  assert data.stats.counts[kind] == 1 and data.stats.bad == 1 and len(data.train) == 2
  assert data.stats.examples[0].startswith(f"{path}:2: {kind}: ")
  with pytest.raises(BadInputError, match=f"{path}:2: {kind}"):
    load_data({**cfg, "on_bad": "error"}, tok)


def test_many_bad_records_of_many_kinds_never_stop_a_run(qwen3, tmp_path):
  lines = [GOOD, *BAD.values(), "{not json", GOOD] * 5
  data = load_data({"source": _write_jsonl(tmp_path / "d.jsonl", lines), "max_length": 64,
                    "truncate": False}, qwen3)
  # Qwen3's template renders two replies in a row, so that record is kept here
  assert len(data.train) == 15 and data.stats.records == len(lines)
  assert data.stats.bad == len(lines) - 15
  assert "assistant_first=5" in data.stats.summary()


def test_one_probe_for_all_turns_equals_probing_each_piece(qwen25, qwen3, monkeypatch):
  """The fast path (one rendering with sentinels at every piece) gives the spans of the
  piece-by-piece probes, or declines; checked on chats that take either path."""
  from mars_jax.data import chat as chat_lib
  chats = [
      MULTI,
      _chat(("system", "S."), ("user", "Hi"), ("assistant", "\nok"), ("user", "More"),
            ("assistant", "ok\n")),
      _chat(("user", "4+4?"), ("assistant", "<think>\nfour and four\n</think>\n\n8")),
      [{"role": "user", "content": "a"},
       {"role": "assistant", "content": "b", "reasoning_content": "\nr\n"},
       {"role": "user", "content": "c"},
       {"role": "assistant", "content": "d", "reasoning_content": "why"}],
      [{"role": "user", "content": "q"}, {"role": "tool", "content": "t"},
       {"role": "assistant", "content": " spaced "}],
      [{"role": "user", "content": "q"},
       {"role": "assistant", "content": "a", "reasoning_content": "r1"},
       {"role": "assistant", "content": "<think> r2 </think> b"}],
  ]
  fast = {(f, i): target_spans(tok, c) for f, tok in (("2.5", qwen25), ("3", qwen3))
          for i, c in enumerate(chats)}
  declined = sum(chat_lib._spans_in_one_probe(
      tok, c, [k for k, m in enumerate(c) if m["role"] == "assistant"], {},
      target_spans(tok, c)[0]) is None
      for tok in (qwen25, qwen3) for c in chats)
  assert 0 < declined < 2 * len(chats)                     # both paths are exercised
  monkeypatch.setattr(chat_lib, "_spans_in_one_probe", lambda *a: None)
  for (f, i), got in fast.items():
    tok = qwen25 if f == "2.5" else qwen3
    assert got == target_spans(tok, chats[i]), (f, i)


def test_labels_from_the_encoding_equal_labels_from_every_offset(qwen25, qwen3, monkeypatch):
  """The mask found from each span's first and last token (`_label_by_tokens`, the fast
  path) equals the one from every token's character offsets (`_label`), on replies that
  split characters into several byte tokens (emoji, CJK, combining accents), straddle
  their header's newline, or hold only whitespace; and the fallback gives it too."""
  from mars_jax.data import chat as chat_lib
  replies = ["\U0001F600\U0001F680 ok", "数学很难。答案是 5！", "e\u0301te\u0301 \u00e9t\u00e9",
             "\nstarts on a newline", "  \t ", "ends on a newline\n", "<|im_end|>literal",
             "\u200b\u200dzero width", "a" * 300]
  chats = [_chat(("system", "S\u00e9."), ("user", r), ("assistant", r), ("user", "x"),
                 ("assistant", r[::-1] or "y")) for r in replies]
  for tok in (qwen25, qwen3):
    rendered = [target_spans(tok, c) for c in chats]
    fast = chat_lib.tokenize_rendered(tok, rendered)
    special = frozenset(tok.all_special_ids)
    for (text, spans), ex in zip(rendered, fast):
      enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
      offsets = np.asarray(enc["offset_mapping"]).reshape(-1, 2)
      ids = np.asarray(enc["input_ids"])
      assert np.array_equal(ex["tokens"], ids)
      assert np.array_equal(ex["loss_mask"], chat_lib._label(offsets, ids, spans, special))
    monkeypatch.setattr(chat_lib, "_label_by_tokens", lambda *a: None)
    slow = chat_lib.tokenize_rendered(tok, rendered)
    monkeypatch.undo()
    assert all(np.array_equal(a["loss_mask"], b["loss_mask"]) for a, b in zip(fast, slow))


def test_chat_template_kwargs_from_the_config_as_json(tmp_path):
  """`--config.data.chat_template_kwargs='{...}'` reaches the template; bad JSON names
  the field and the fix."""
  tok = qt.build_qwen_tokenizer("qwen2.5", copy=True)
  tok.chat_template = ("{%- if persona is defined %}<|im_start|>system\n{{ persona }}"
                       "<|im_end|>\n{%- endif %}" + qt.QWEN25_TEMPLATE)
  path = _write_jsonl(tmp_path / "d.jsonl", [{"messages": _chat(("user", "Hi"),
                                                                ("assistant", "Yo"))}])
  data = load_data({"source": path, "chat_template_kwargs": '{"persona": "A pirate."}'}, tok)
  assert "A pirate." in tok.decode(data.train[0]["tokens"])
  with pytest.raises(ValueError, match=r"data.chat_template_kwargs=.*is not JSON.*enable_thinking"):
    load_data({"source": path, "chat_template_kwargs": "{enable_thinking: false}"}, tok)
