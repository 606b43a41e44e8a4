"""Offline copies of the real Qwen2.5 and Qwen3 tokenizers, for tests on the real vocabulary.

  tok = build_qwen_tokenizer("qwen2.5")        # or "qwen3"
  tok("Hello world").input_ids                 # [9707, 1879]
  hf_dir = make_qwen_checkpoint(tmp / "hf", "qwen3")

The BPE ranks come from `dashscope` (a test requirement): its wheel ships Qwen's
`qwen.tiktoken`, one `base64(token bytes) rank` line per token, ranks 0..151642. Those are
the ranks of the published Qwen2 / Qwen2.5 / Qwen3 tokenizers (they share one vocabulary).
From them this module builds, with `tokenizers`, the byte-level BPE that transformers'
`Qwen2Tokenizer` is:

  vocab       each token's bytes in GPT-2's byte-to-unicode spelling ("Ġ" = space) -> rank
  merges      for every token of two or more bytes, each split of it into two pieces that
              are both tokens, ordered by the merged token's rank, then by the pieces'
              ranks (what tiktoken does: it merges the adjacent pair whose join ranks lowest)
  normalizer  NFC
  pre-tok.    Qwen2's split regex (digits one by one), then ByteLevel without its own regex
  decoder     ByteLevel

then adds the special and added tokens at their published ids (151643.. below, 22 for
Qwen2.5, 26 for Qwen3) and sets eos `<|im_end|>`, pad `<|endoftext|>`, no bos, and a chat
template written here that renders like the published one (QWEN25_TEMPLATE, QWEN3_TEMPLATE).
Its tokenizer_config.json names `Qwen2Tokenizer`, as the published ones do, so AutoTokenizer
loads a saved copy the way it loads a real checkpoint's.

Building takes about 5 s, so a built tokenizer is kept per process (functools.cache) and on
disk (`cached_tokenizer_dir`: under $MARS_JAX_TEST_CACHE, default ~/.cache/mars_jax_tests,
keyed by the family and a hash of the ranks file, this module's templates and token tables,
BUILD_VERSION and the tokenizers / transformers versions), written once by whichever process
gets there first.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

from mars_jax.data.tokenizer import QWEN2_PRETOKENIZE_REGEX


def _ranks_path() -> str:
  spec = importlib.util.find_spec("dashscope")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("dashscope is not installed: it ships the Qwen BPE ranks "
                      "(pip install -r requirements-test.txt)")
  return os.path.join(list(spec.submodule_search_locations)[0], "resources", "qwen.tiktoken")


QWEN_RANKS = _ranks_path()
NUM_RANKS = 151643  # ids 0..151642 are BPE tokens; the specials start at 151643

FAMILIES = ("qwen2.5", "qwen3")
BUILD_VERSION = "2"  # part of the cache key: bump it when `_build` changes what it makes

# (id, content, special) as in the published tokenizer.json's added_tokens
_QWEN25_ADDED = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
)
_QWEN3_ADDED = _QWEN25_ADDED + (
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
ADDED_TOKENS = {"qwen2.5": _QWEN25_ADDED, "qwen3": _QWEN3_ADDED}

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
MODEL_MAX_LENGTH = 131072
VOCAB_SIZE = 151936  # the published models' embedding rows (len(tokenizer) plus spares)
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# ---------------------------------------------------------------------------------------
# Chat templates. Jinja with "{%-" / "{{-" on every tag, so the layout whitespace between
# tags never reaches the output; string literals use Jinja's "\n" escapes.

# The system section listing `tools` (JSON schemas), after the system text (shared by both).
_TOOLS_SECTION = r"""
{%- macro tools_section(tools) -%}
  {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" -}}
  {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
  {%- for schema in tools -%}
    {{- "\n" + (schema | tojson) -}}
  {%- endfor -%}
  {{- "\n</tools>\n\nFor each function call, return a json object with function name and " -}}
  {{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endmacro -%}
"""

# One `<tool_call>` block; `raw_strings`: a string `arguments` is taken as JSON already
# (Qwen3) rather than JSON-quoted again (Qwen2.5).
_TOOL_CALL = r"""
{%- macro tool_call_block(call, raw_strings) -%}
  {%- set fn = call.function if call.function is defined else call -%}
  {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
  {%- if raw_strings and fn.arguments is string -%}
    {{- fn.arguments -}}
  {%- else -%}
    {{- fn.arguments | tojson -}}
  {%- endif -%}
  {{- '}\n</tool_call>' -}}
{%- endmacro -%}
"""

# Tool results: consecutive `tool` messages share one user turn.
_TOOL_RESPONSE = r"""
{%- macro tool_response(messages, i, text) -%}
  {%- if i == 0 or messages[i - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
  {{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
  {%- if i + 1 == messages | length or messages[i + 1].role != 'tool' -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endmacro -%}
"""

QWEN25_TEMPLATE = _TOOLS_SECTION + _TOOL_CALL + _TOOL_RESPONSE + r"""
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- set system_text = messages[0].content if has_system else '""" + DEFAULT_SYSTEM + r"""' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' + system_text + '\n\n' + tools_section(tools) + '<|im_end|>\n' -}}
{%- else -%}
  {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and has_system -%}
  {%- elif message.role == 'tool' -%}
    {{- tool_response(messages, loop.index0, message.content) -}}
  {%- elif message.role == 'assistant' and message.tool_calls -%}
    {{- '<|im_start|>assistant' -}}
    {%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}
    {%- for call in message.tool_calls -%}
      {{- '\n' + tool_call_block(call, false) -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

QWEN3_TEMPLATE = _TOOLS_SECTION + _TOOL_CALL + _TOOL_RESPONSE + r"""
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- tools_section(tools) + '<|im_end|>\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{#- the last real user query: a user message that is not a wrapped tool response -#}
{%- set q = namespace(last=messages | length - 1, found=false) -%}
{%- for message in messages -%}
  {%- if message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>')
                 and message.content.endswith('</tool_response>')) -%}
    {%- set q.last = loop.index0 -%}
    {%- set q.found = true -%}
  {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- set text = message.content if message.content is string else '' -%}
  {%- if loop.first and has_system -%}
  {%- elif message.role == 'tool' -%}
    {{- tool_response(messages, loop.index0, text) -}}
  {%- elif message.role == 'assistant' -%}
    {%- set think = namespace(reasoning='', answer=text) -%}
    {%- if message.reasoning_content is string -%}
      {%- set think.reasoning = message.reasoning_content -%}
    {%- elif '</think>' in text -%}
      {%- set head = text.split('</think>')[0] -%}
      {%- set think.reasoning = head.rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- set think.answer = text.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > q.last and (loop.last or think.reasoning) -%}
      {{- '<|im_start|>assistant\n<think>\n' + think.reasoning.strip('\n') + '\n</think>\n\n'
          + think.answer.lstrip('\n') -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + think.answer -}}
    {%- endif -%}
    {%- for call in message.tool_calls or [] -%}
      {%- if not loop.first or think.answer -%}{{- '\n' -}}{%- endif -%}
      {{- tool_call_block(call, true) -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
"""

TEMPLATES = {"qwen2.5": QWEN25_TEMPLATE, "qwen3": QWEN3_TEMPLATE}

# ---------------------------------------------------------------------------------------
# The BPE.


def byte_to_unicode() -> dict[int, str]:
  """GPT-2's table: each byte -> one printable character (what ByteLevel spells bytes as).

  Bytes that print as themselves (except space) keep their own character; the other 68,
  in order, take the characters from U+0100 up.
  """
  keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
  table, spare = {}, 0x100
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(spare)
      spare += 1
  return table


def load_ranks(path: str = QWEN_RANKS) -> dict[bytes, int]:
  """token bytes -> rank, from a tiktoken ranks file."""
  ranks = {}
  with open(path, "rb") as f:
    for line in f:
      if line.strip():
        b64, rank = line.split()
        ranks[base64.b64decode(b64)] = int(rank)
  return ranks


def bpe_vocab_and_merges(ranks: dict[bytes, int]):
  """(vocab, merges) of the byte-level BPE equivalent to the tiktoken `ranks`."""
  spell = byte_to_unicode()
  text = {tok: "".join(spell[b] for b in tok) for tok in ranks}
  vocab = {text[tok]: rank for tok, rank in ranks.items()}
  keyed = []
  for tok, rank in ranks.items():
    for cut in range(1, len(tok)):
      left, right = tok[:cut], tok[cut:]
      left_rank, right_rank = ranks.get(left), ranks.get(right)
      if left_rank is not None and right_rank is not None:
        keyed.append((rank, left_rank, right_rank, text[left], text[right]))
  keyed.sort()
  return vocab, [(a, b) for _, _, _, a, b in keyed]


def _check_family(family: str) -> None:
  if family not in FAMILIES:
    raise ValueError(f"family={family!r}; expected one of {FAMILIES}")


def _build(family: str):
  """Builds the `PreTrainedTokenizerFast` of `family` from the ranks (about 5 s)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
  from tokenizers import pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  _check_family(family)
  ranks = load_ranks()
  if sorted(ranks.values()) != list(range(NUM_RANKS)):
    raise ValueError(f"{QWEN_RANKS}: expected ranks 0..{NUM_RANKS - 1}")
  vocab, merges = bpe_vocab_and_merges(ranks)
  core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, dropout=None,
                              continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
  core.normalizer = normalizers.NFC()
  core.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  core.decoder = decoders.ByteLevel()
  # ids follow in order after the ranks, so each lands on its published id (checked below)
  core.add_tokens([AddedToken(content, special=special, normalized=False, lstrip=False,
                              rstrip=False, single_word=False)
                   for _, content, special in ADDED_TOKENS[family]])
  specials = [content for _, content, special in ADDED_TOKENS[family]
              if special and content != PAD_TOKEN]
  tok = PreTrainedTokenizerFast(
      tokenizer_object=core,
      bos_token=None,
      eos_token=EOS_TOKEN,
      pad_token=PAD_TOKEN,
      unk_token=None,
      extra_special_tokens=specials,
      chat_template=TEMPLATES[family],
      clean_up_tokenization_spaces=False,
      split_special_tokens=False,
      model_max_length=MODEL_MAX_LENGTH,
  )
  check_added_tokens(tok, family)
  return tok


def check_added_tokens(tok, family: str) -> None:
  """Raises unless every special / added token of `family` has its published id, the
  tokenizer has exactly the published length and eos / pad / bos are as published."""
  for token_id, content, special in ADDED_TOKENS[family]:
    got = tok.convert_tokens_to_ids(content)
    if got != token_id:
      raise AssertionError(f"{family}: {content!r} has id {got}, expected {token_id}")
    added = tok.added_tokens_decoder.get(token_id)
    if added is None or added.content != content or added.special != special:
      raise AssertionError(f"{family}: added token {token_id} is {added!r}, expected "
                           f"{content!r} special={special}")
  expected_len = ADDED_TOKENS[family][-1][0] + 1
  if len(tok) != expected_len:
    raise AssertionError(f"{family}: len(tokenizer) = {len(tok)}, expected {expected_len}")
  if (tok.eos_token, tok.pad_token, tok.bos_token) != (EOS_TOKEN, PAD_TOKEN, None):
    raise AssertionError(f"{family}: eos/pad/bos = {tok.eos_token!r}/{tok.pad_token!r}/"
                         f"{tok.bos_token!r}")


# ---------------------------------------------------------------------------------------
# Caching.


def cache_root() -> str:
  return os.environ.get("MARS_JAX_TEST_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "mars_jax_tests"))


@functools.cache
def _ranks_digest() -> str:
  with open(QWEN_RANKS, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def cache_key(family: str) -> str:
  """A hash of what the built tokenizer depends on: the ranks file, the template and token
  table of `family`, the split regex, BUILD_VERSION, and the tokenizers / transformers
  versions (their save format)."""
  import tokenizers
  import transformers

  _check_family(family)
  h = hashlib.sha256()
  for part in (_ranks_digest(), BUILD_VERSION, family, TEMPLATES[family],
               repr(ADDED_TOKENS[family]),
               QWEN2_PRETOKENIZE_REGEX, EOS_TOKEN, PAD_TOKEN, str(MODEL_MAX_LENGTH),
               tokenizers.__version__, transformers.__version__):
    h.update(part.encode("utf-8"))
    h.update(b"\0")
  return h.hexdigest()[:16]


def cached_tokenizer_dir(family: str) -> str:
  """A directory holding `family`'s tokenizer (`save_pretrained` output), built on first use.

  The build is written to a temporary sibling and renamed into place, so a reader never
  sees half a directory; when two processes (pytest-xdist workers) race, the loser's
  rename fails on the winner's complete directory and its copy is dropped.
  """
  final = os.path.join(cache_root(), f"{family}-{cache_key(family)}")
  if os.path.isfile(os.path.join(final, "tokenizer.json")):
    return final
  os.makedirs(cache_root(), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{family}-", dir=cache_root())
  try:
    save_tokenizer(_build(family), tmp)
    os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the cache from other users
    try:
      os.rename(tmp, final)
    except OSError:
      if not os.path.isfile(os.path.join(final, "tokenizer.json")):
        raise
  finally:
    if os.path.isdir(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
  return final


def save_tokenizer(tok, directory: str) -> None:
  """`tok.save_pretrained(directory)`, with the published tokenizer_config.json class."""
  tok.save_pretrained(directory)
  _as_published_config(directory)


def _as_published_config(directory: str) -> None:
  """Names the tokenizer class in `directory`'s tokenizer_config.json as the published
  Qwen2.5 / Qwen3 ones do, so AutoTokenizer loads it as a `Qwen2Tokenizer` (a
  `PreTrainedTokenizerFast` that rebuilds this same BPE, normalizer, pre-tokenizer and
  decoder) and code under test sees the class it sees with a real checkpoint."""
  config_path = os.path.join(directory, "tokenizer_config.json")
  with open(config_path, encoding="utf-8") as f:
    config = json.load(f)
  config.update(tokenizer_class="Qwen2Tokenizer", add_prefix_space=False, errors="replace")
  # the published files list them as additional_special_tokens (transformers 5 writes a
  # list under extra_special_tokens, which 4.x cannot read) and have no 5.x-only keys
  extra = config.pop("extra_special_tokens", None)
  if extra:
    config["additional_special_tokens"] = extra
  for key in ("backend", "is_local", "local_files_only"):
    config.pop(key, None)
  with open(config_path, "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
    f.write("\n")


@functools.cache
def _load(family: str):
  from transformers import PreTrainedTokenizerFast

  # as the base class: a second faster than as Qwen2Tokenizer, whose own rebuild of the
  # same BPE from the vocab and merges is then thrown away
  tok = PreTrainedTokenizerFast.from_pretrained(cached_tokenizer_dir(family))
  check_added_tokens(tok, family)
  if tok.chat_template != TEMPLATES[family]:
    raise AssertionError(f"{family}: the cached chat template differs from this module's")
  return tok


def build_qwen_tokenizer(family: str, *, copy: bool = False):
  """The `transformers.PreTrainedTokenizerFast` of `family` ("qwen2.5" or "qwen3"), as
  published. (AutoTokenizer loads a saved copy as a `Qwen2Tokenizer`, its subclass, with
  the same backend; save it with `save_tokenizer` to keep that class name.)

  Built once per cache directory (see `cached_tokenizer_dir`) and loaded once per process:
  every call returns the same object, so don't change it (add tokens, set attributes);
  `copy=True` gives a private deep copy instead (about 1 s).
  """
  import copy as copy_module

  _check_family(family)
  return copy_module.deepcopy(_load(family)) if copy else _load(family)


# ---------------------------------------------------------------------------------------
# Checkpoints.

GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}


def make_qwen_checkpoint(path, family: str, *, hidden: int = 16, layers: int = 2,
                         heads: int = 2, kv_heads: int = 1, intermediate: int = 32,
                         tie: bool = True, seed: int = 0) -> str:
  """Saves a tiny random Qwen2 ("qwen2.5") or Qwen3 ("qwen3", head_dim 8) model with the
  real vocabulary size (151936 rows), the real tokenizer (`save_tokenizer`) and a
  generation_config.json like the published Instruct ones to `path`; returns the path.
  About 0.5 s once torch and transformers' model code are imported."""
  import torch
  import transformers

  _check_family(family)
  path = str(path)
  config_cls, model_cls, extra = {
      "qwen2.5": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
  }[family]
  torch.manual_seed(seed)
  cfg = config_cls(
      vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
      max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=151643,
      eos_token_id=151645, pad_token_id=151643, **extra)
  model = model_cls(cfg).eval()
  model.save_pretrained(path)
  save_tokenizer(build_qwen_tokenizer(family), path)
  # after the model's save: replaces the generation_config.json it derived from cfg
  with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump(GENERATION_CONFIG, f, indent=2)
    f.write("\n")
  return path
