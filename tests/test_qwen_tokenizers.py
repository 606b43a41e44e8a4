"""The offline Qwen2.5 / Qwen3 tokenizers (tests/qwen_tokenizers.py): the real ids, the
chat templates, and a checkpoint directory transformers loads."""

import json
import os
import time
import unicodedata

import pytest

import qwen_tokenizers as qt

FAMILIES = qt.FAMILIES

MIXED_TEXT = [
    "Hello world",
    "你好，世界！今天天气很好。",
    "Emoji: 🙂👍🏽🚀 and a flag 🇫🇷",
    "def square(x):\n    return x ** 2  # 平方\n\n\tprint(square(12345))\n",
    "Numbers 3.14159, -42, 1e-9, 2025-01-31 and 1,000,000",
    "  leading spaces, trailing spaces   \n\n\nnew lines\r\nCRLF",
    "Ünïcödé ça va? Привет, мир! مرحبا こんにちは 한국어",
    "I'm sure it's what they'd've said, WE'LL see",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>x</tool_call>",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
                "\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22C"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is 22C and sunny."},
]


def render(family, messages, **kwargs):
  return qt.build_qwen_tokenizer(family).apply_chat_template(messages, tokenize=False,
                                                             **kwargs)


# --- the vocabulary ------------------------------------------------------------------


def test_ranks_file():
  assert os.path.isfile(qt.QWEN_RANKS)
  assert len(qt.load_ranks()) == 151643


@pytest.mark.parametrize("family", FAMILIES)
def test_hello_world(family):
  tok = qt.build_qwen_tokenizer(family)
  assert tok("Hello world").input_ids == [9707, 1879]
  assert tok.decode([9707, 1879]) == "Hello world"


@pytest.mark.parametrize("family", FAMILIES)
def test_special_and_added_ids(family):
  tok = qt.build_qwen_tokenizer(family)
  assert len(tok) == {"qwen2.5": 151665, "qwen3": 151669}[family]
  assert len(qt.ADDED_TOKENS[family]) == {"qwen2.5": 22, "qwen3": 26}[family]
  for token_id, content, special in qt.ADDED_TOKENS[family]:
    assert tok.convert_tokens_to_ids(content) == token_id, content
    assert tok.convert_ids_to_tokens(token_id) == content
    assert tok.added_tokens_decoder[token_id].special is special, content
    # an added token in text is one token, never split into BPE pieces
    assert tok(f"a{content}b").input_ids == [64, token_id, 65]
  assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
  assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
  assert tok.bos_token is None and tok.unk_token is None
  assert tok.model_max_length == 131072
  assert tok.clean_up_tokenization_spaces is False
  special = {content for _, content, s in qt.ADDED_TOKENS[family] if s}
  assert set(tok.all_special_tokens) == special
  assert "<think>" not in tok.all_special_tokens and "<tool_call>" not in tok.all_special_tokens


def test_qwen3_extends_qwen25():
  t25, t3 = qt.build_qwen_tokenizer("qwen2.5"), qt.build_qwen_tokenizer("qwen3")
  for text in MIXED_TEXT:
    assert t25(text).input_ids == t3(text).input_ids
  assert t3("<think>\nx\n</think>").input_ids[0] == 151667
  assert "<think>" not in t25.get_vocab()


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(family):
  tok = qt.build_qwen_tokenizer(family)
  for text in MIXED_TEXT:
    ids = tok(text).input_ids
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)
  # Qwen2's pre-tokenizer: one token per digit
  ids = tok("1234567890").input_ids
  assert len(ids) == 10 and tok.convert_ids_to_tokens(ids) == list("1234567890")
  assert tok(" 2025").input_ids == [220, 17, 15, 17, 20]
  # the byte-level spelling: a space is "Ġ", a newline "Ċ"
  assert tok.convert_ids_to_tokens(tok(" world\n").input_ids) == ["Ġworld", "Ċ"]


def test_matches_tiktoken():
  """The BPE gives tiktoken's ids (dashscope's own encoder) on text without specials."""
  tiktoken = pytest.importorskip("tiktoken")
  enc = tiktoken.Encoding("qwen", pat_str=qt.QWEN2_PRETOKENIZE_REGEX,
                          mergeable_ranks=qt.load_ranks(), special_tokens={})
  tok = qt.build_qwen_tokenizer("qwen3")
  with open(qt.__file__, encoding="utf-8") as f:
    source = f.read()  # code and prose, without the added tokens it names
  for _, content, _ in qt.ADDED_TOKENS["qwen3"]:
    source = source.replace(content, "")
  for text in [*MIXED_TEXT[:-1], source, "".join(MIXED_TEXT[:-1]) * 3]:
    text = unicodedata.normalize("NFC", text)
    assert tok(text).input_ids == enc.encode_ordinary(text), text[:40]


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_tokenizer_loads_saved_dir(family):
  from transformers import AutoTokenizer, PreTrainedTokenizerFast

  tok = qt.build_qwen_tokenizer(family)
  directory = qt.cached_tokenizer_dir(family)
  with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
    assert json.load(f)["tokenizer_class"] == "Qwen2Tokenizer"
  loaded = AutoTokenizer.from_pretrained(directory)
  assert type(loaded).__name__ == "Qwen2Tokenizer"
  assert isinstance(loaded, PreTrainedTokenizerFast)
  assert len(loaded) == len(tok)
  assert loaded.chat_template == tok.chat_template == qt.TEMPLATES[family]
  for text in MIXED_TEXT:
    assert loaded(text).input_ids == tok(text).input_ids
  assert ({i: (t.content, t.special) for i, t in loaded.added_tokens_decoder.items()}
          == {i: (t.content, t.special) for i, t in tok.added_tokens_decoder.items()})
  assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == ("<|im_end|>",
                                                                    "<|endoftext|>", None)


def test_cache_dir_is_keyed_and_reused():
  a, b = qt.cached_tokenizer_dir("qwen2.5"), qt.cached_tokenizer_dir("qwen3")
  assert a != b and os.path.dirname(a) == os.path.dirname(b) == qt.cache_root()
  t0 = time.perf_counter()
  assert qt.cached_tokenizer_dir("qwen3") == b
  assert time.perf_counter() - t0 < 2  # hashes the ranks file, builds nothing
  assert qt.build_qwen_tokenizer("qwen3") is qt.build_qwen_tokenizer("qwen3")
  assert qt.build_qwen_tokenizer("qwen3", copy=True) is not qt.build_qwen_tokenizer("qwen3")
  with pytest.raises(ValueError):
    qt.build_qwen_tokenizer("qwen2")


def test_cache_write_tolerates_a_race(tmp_path, monkeypatch):
  """Another process renames its complete build into place while this one saves: this one
  drops its copy and returns the other's; no temporary directory is left behind."""
  monkeypatch.setenv("MARS_JAX_TEST_CACHE", str(tmp_path))
  final = os.path.join(str(tmp_path), f"qwen3-{qt.cache_key('qwen3')}")

  class Saved:
    def save_pretrained(self, directory):
      with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write("mine")
      with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        f.write("{}")
      os.makedirs(final)  # the other process wins the rename meanwhile
      with open(os.path.join(final, "tokenizer.json"), "w") as f:
        f.write("theirs")

  monkeypatch.setattr(qt, "_build", lambda family: Saved())
  assert qt.cached_tokenizer_dir("qwen3") == final
  with open(os.path.join(final, "tokenizer.json")) as f:
    assert f.read() == "theirs"
  assert os.listdir(str(tmp_path)) == [os.path.basename(final)]


# --- the chat templates -----------------------------------------------------------------


def test_qwen25_default_system_prompt():
  chat = [{"role": "user", "content": "Hi"}]
  assert render("qwen2.5", chat, add_generation_prompt=True) == (
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
      "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
  chat = [{"role": "system", "content": "Be brief."}, *chat,
          {"role": "assistant", "content": "Hello."}]
  assert render("qwen2.5", chat) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\nHello.<|im_end|>\n")
  assert qt.DEFAULT_SYSTEM not in render("qwen3", chat[1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_tools(family):
  text = render(family, TOOL_CHAT, tools=TOOLS)
  system = {"qwen2.5": qt.DEFAULT_SYSTEM + "\n\n", "qwen3": ""}[family]
  schema = json.dumps(TOOLS[0], ensure_ascii=False)
  final = {"qwen2.5": "", "qwen3": "<think>\n\n</think>\n\n"}[family]
  assert text == (
      f"<|im_start|>system\n{system}{TOOLS_HEADER}{schema}{TOOLS_FOOTER}<|im_end|>\n"
      "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n"
      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
      "<|im_start|>user\n<tool_response>\n22C\n</tool_response>\n"
      "<tool_response>\nsunny\n</tool_response><|im_end|>\n"
      f"<|im_start|>assistant\n{final}It is 22C and sunny.<|im_end|>\n")
  # a system message goes before the tools section; content before the tool call
  chat = [{"role": "system", "content": "Be brief."}, TOOL_CHAT[0],
          {**TOOL_CHAT[1], "content": "Let me check."}]
  text = render(family, chat, tools=TOOLS)
  assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{TOOLS_HEADER}")
  assert "<|im_start|>assistant\n" in text and "Let me check.\n<tool_call>\n" in text
  # the tool turns tokenize to the real added ids (two each in the tools section)
  ids = qt.build_qwen_tokenizer(family)(render(family, TOOL_CHAT, tools=TOOLS)).input_ids
  assert ids.count(151657) == 3 and ids.count(151658) == 3  # <tool_call> </tool_call>
  if family == "qwen3":
    assert ids.count(151665) == 2 and ids.count(151666) == 2  # <tool_response> x2
  else:  # not added tokens in Qwen2.5: BPE pieces
    assert "<tool_response>" not in qt.build_qwen_tokenizer(family).get_vocab()


def test_qwen3_thinking():
  chat = [{"role": "user", "content": "1+1?"},
          {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2"},
          {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}]
  # the final turn gets an empty think block; the earlier one loses its reasoning
  assert render("qwen3", chat) == (
      "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
      "<|im_start|>user\n2+2?<|im_end|>\n"
      "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
  # reasoning_content renders in the last turn
  last = {"role": "assistant", "content": "4", "reasoning_content": "\nadd again\n"}
  assert render("qwen3", chat[:3] + [last]).endswith(
      "<|im_start|>user\n2+2?<|im_end|>\n"
      "<|im_start|>assistant\n<think>\nadd again\n</think>\n\n4<|im_end|>\n")
  # an inline think block is split out of the content
  last = {"role": "assistant", "content": "<think>add again</think>\n\n4"}
  assert render("qwen3", chat[:3] + [last]).endswith(
      "<|im_start|>assistant\n<think>\nadd again\n</think>\n\n4<|im_end|>\n")
  # after the last query (tool responses are not queries): reasoning kept in every turn
  # that has some, and turns without any render just their content
  tools = [TOOL_CHAT[0],
           {**TOOL_CHAT[1], "reasoning_content": "need the weather"},
           TOOL_CHAT[2],
           {"role": "assistant", "content": "Checking again.",
            "tool_calls": TOOL_CHAT[1]["tool_calls"]},
           TOOL_CHAT[3], TOOL_CHAT[4]]
  text = render("qwen3", tools)
  assert "<|im_start|>assistant\n<think>\nneed the weather\n</think>\n\n<tool_call>" in text
  assert "<|im_start|>assistant\nChecking again.\n<tool_call>" in text
  assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 22C and sunny."
                       "<|im_end|>\n")


def test_qwen3_enable_thinking_changes_only_the_generation_prompt():
  chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "<think>r</think>Hello"},
          {"role": "user", "content": "Again"}]
  base = render("qwen3", chat, add_generation_prompt=True)
  assert base.startswith("<|im_start|>system\nS<|im_end|>\n")
  assert base.endswith("<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
  assert render("qwen3", chat, add_generation_prompt=True, enable_thinking=True) == base
  assert (render("qwen3", chat, add_generation_prompt=True, enable_thinking=False)
          == base + "<think>\n\n</think>\n\n")
  assert render("qwen3", chat, enable_thinking=False) == render("qwen3", chat)
  assert render("qwen3", chat) + "<|im_start|>assistant\n" == base


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_ids(family):
  tok = qt.build_qwen_tokenizer(family)
  ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True,
                                add_generation_prompt=True, return_dict=False)
  if family == "qwen3":
    assert ids == [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
  else:
    assert ids[:3] == [151644, 8948, 198] and ids[-9:] == [
        151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]


# --- the checkpoint ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads(tmp_path, family):
  import torch
  import transformers

  t0 = time.perf_counter()
  path = qt.make_qwen_checkpoint(tmp_path / "hf", family)
  assert time.perf_counter() - t0 < 20  # ~0.5 s, plus ~3 s of imports the first time
  model = transformers.AutoModelForCausalLM.from_pretrained(path)
  assert type(model).__name__ == {"qwen2.5": "Qwen2ForCausalLM",
                                  "qwen3": "Qwen3ForCausalLM"}[family]
  cfg = model.config
  assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id,
          cfg.max_position_embeddings) == (151936, 151643, 151645, 151643, 512)
  if family == "qwen3":
    assert cfg.head_dim == 8
  tok = transformers.AutoTokenizer.from_pretrained(path)
  assert type(tok).__name__ == "Qwen2Tokenizer" and len(tok) == len(
      qt.build_qwen_tokenizer(family))
  assert tok("Hello world").input_ids == [9707, 1879]
  assert tok.chat_template == qt.TEMPLATES[family]
  gen = transformers.GenerationConfig.from_pretrained(path)
  assert gen.eos_token_id == [151645, 151643]
  assert (gen.bos_token_id, gen.pad_token_id, gen.do_sample, gen.top_k) == (151643, 151643,
                                                                             True, 20)
  assert (gen.temperature, gen.top_p, gen.repetition_penalty) == (0.7, 0.8, 1.05)
  with torch.no_grad():
    logits = model(torch.tensor([tok("Hello world").input_ids])).logits
  assert logits.shape == (1, 2, 151936)
