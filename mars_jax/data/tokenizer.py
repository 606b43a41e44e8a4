"""The embedded task's ChatML tokenizers, built offline: "char" and "words".

"char" (`build_char_tokenizer`): one token per byte: every ASCII character is one token, any other character is
its UTF-8 bytes (so no text is ever lost). Four special tokens come first, so
their ids never depend on the rest:

  id  0  <|endoftext|>   pad
  id  1  <|im_start|>
  id  2  <|im_end|>      eos (ends every chat turn)
  id  3  <|mask|>        the MARS mask token (mars_jax.checkpoints.hf.MASK_TOKEN)
  ids 4..259             bytes 0..255, in GPT-2's byte-to-unicode spelling ("Ġ" = space)

It is a byte-level BPE without merges, with exactly the normalizer, pre-tokenizer
and decoder that transformers' `Qwen2Tokenizer` builds. That matters: an HF
directory with a qwen2 config.json is loaded by `AutoTokenizer` as a
`Qwen2Tokenizer` rebuilt from our vocab, and it must give the same ids.

The chat template is Qwen2.5's ChatML without the default system prompt:

  <|im_start|>user\\nWhat is 2+3?<|im_end|>\\n<|im_start|>assistant\\n2+3=5<|im_end|>\\n

and `add_generation_prompt=True` appends `<|im_start|>assistant\\n`.

"words" (`build_word_tokenizer`): the same specials, bytes, pre-tokenizer, decoder and
template, plus BPE merges learned (with `tokenizers`' trainer, deterministically) on
the synthetic task's own text until every word of it is one token. Qwen2's
pre-tokenizer splits numbers into single digits, so digits stay one token each
(arithmetic is learned digit by digit) while words are whole: an example is about
55 tokens instead of 109, and any other text still falls back to bytes.

`build_tokenizer(name)` builds either by name (the `tokenizer` config field).
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

from mars_jax.checkpoints.hf import MASK_TOKEN

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, MASK_TOKEN)
# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
QWEN2_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _byte_symbols() -> list[str]:
  """GPT-2's byte -> printable unicode table (what `pre_tokenizers.ByteLevel` emits)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  extra = iter(range(256, 512))
  return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _byte_level(model) -> Tokenizer:
  """A tokenizer around `model` with Qwen2's normalizer, pre-tokenizer and decoder."""
  core = Tokenizer(model)
  core.normalizer = normalizers.NFC()
  core.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  core.decoder = decoders.ByteLevel()
  return core


def build_char_tokenizer():
  """Returns the "char" `PreTrainedTokenizerFast` described above (260 tokens)."""
  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(_byte_symbols()))}
  return _wrap(_byte_level(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="",
                                      end_of_word_suffix="", fuse_unk=False,
                                      byte_fallback=False)))


def _task_text() -> list[str]:
  """The text the "words" merges are learned on: the role names and 2000 problems of
  each difficulty (every template, name and item appears)."""
  from mars_jax.data import synthetic  # pylint: disable=import-outside-toplevel
  text = ["system", "user", "assistant"]
  for difficulty in synthetic.DIFFICULTIES:
    text += [f"{r['question']}\n{r['answer']}"
             for r in synthetic.generate(2000, seed=0, difficulty=difficulty)]
  return text


def build_word_tokenizer():
  """Returns the "words" `PreTrainedTokenizerFast` described above (~430 tokens)."""
  core = _byte_level(models.BPE())
  # the specials keep ids 0..3; every byte is in the alphabet (no text is lost); the
  # vocabulary is large enough that every pair in the task's text gets merged
  trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1,
                                special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=_byte_symbols(), show_progress=False)
  core.train_from_iterator(_task_text(), trainer)
  return _wrap(core)


BUILDERS = {"char": build_char_tokenizer, "words": build_word_tokenizer}


def build_tokenizer(name: str):
  """The embedded tokenizer called `name` ("char" or "words")."""
  if name not in BUILDERS:
    raise ValueError(f"tokenizer={name!r} is not an embedded tokenizer; expected one of "
                     f"{sorted(BUILDERS)} (or an HF directory in the `tokenizer` field).")
  return BUILDERS[name]()


def _wrap(core: Tokenizer):
  """`core` with the special tokens added, as a ChatML `PreTrainedTokenizerFast`."""
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  return PreTrainedTokenizerFast(
      tokenizer_object=core,
      pad_token=PAD_TOKEN,
      eos_token=IM_END,
      extra_special_tokens=[IM_START, MASK_TOKEN],
      chat_template=CHAT_TEMPLATE,
      clean_up_tokenization_spaces=False,
      model_max_length=4096,
  )


def model_vocab_size(tokenizer, multiple: int = 64) -> int:
  """Embedding rows for a model using `tokenizer`: len(tokenizer) rounded up to `multiple`.

  Leaves spare rows (Qwen2.5 does the same), at least one: 260 tokens -> 320.
  """
  return (len(tokenizer) // multiple + 1) * multiple
