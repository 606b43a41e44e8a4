"""A user's starting point, built offline: a tiny Qwen2 checkpoint written by transformers
with a real byte-level BPE tokenizer, and chat / GSM8K-format data files of a small task.

  hf_dir = make_qwen2_checkpoint(tmp / "hf", texts=task_texts(records))
  write_chat_jsonl(tmp / "chat.jsonl", records)
  write_gsm8k_jsonl(tmp / "test.jsonl", problems)

The tokenizer is what `tokenizers` trains (Qwen2's split regex then the ByteLevel
pre-tokenizer, the ByteLevel decoder, a BpeTrainer over the task's text), wrapped in
`transformers.PreTrainedTokenizerFast` with Qwen2.5's ChatML template (no default
system prompt), eos `<|im_end|>` and pad `<|endoftext|>`. The model has a few spare
embedding rows past the tokenizer, so `<|mask|>` (added by mars_jax.checkpoints.hf.load_tokenizer)
fits, and its eos_token_id is `<|im_end|>`'s.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Qwen2.5's ChatML template without the default system prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int = 400):
  """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts` (specials first)."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
  from tokenizers import trainers
  from transformers import PreTrainedTokenizerFast
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

  core = Tokenizer(models.BPE())
  # Qwen2's own normalizer and pre-tokenizer (digits split one by one, then bytes):
  # transformers' AutoTokenizer loads a qwen2 checkpoint's tokenizer.json as a
  # Qwen2Tokenizer, which rebuilds exactly these, so the ids agree with training.
  core.normalizer = normalizers.NFC()
  core.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  core.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  core.train_from_iterator(list(texts), trainer=trainer)
  return PreTrainedTokenizerFast(
      tokenizer_object=core, eos_token=IM_END, pad_token=PAD_TOKEN,
      extra_special_tokens=[IM_START], chat_template=CHATML_TEMPLATE,
      clean_up_tokenization_spaces=False, model_max_length=4096)


def make_qwen2_checkpoint(path, *, texts: Iterable[str], hidden: int = 32, layers: int = 2,
                          heads: int = 4, kv_heads: int = 2, intermediate: int = 64,
                          tie: bool = True, spare_rows: int = 4, bpe_vocab: int = 400,
                          max_positions: int = 512, seed: int = 0) -> str:
  """Saves a random `Qwen2ForCausalLM` and its BPE tokenizer to `path`; returns the path.

  vocab_size = len(tokenizer) + spare_rows; eos_token_id = the `<|im_end|>` id.
  """
  import torch
  import transformers

  path = str(path)
  tok = train_bpe_tokenizer(texts, vocab_size=bpe_vocab)
  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(
      vocab_size=len(tok) + spare_rows, hidden_size=hidden, intermediate_size=intermediate,
      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
      max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=tie,
      bos_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
      eos_token_id=tok.convert_tokens_to_ids(IM_END),
      pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN))
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
  tok.save_pretrained(path)
  return path


def task_records(num: int, *, seed: int = 0, split: str = "train") -> list[dict]:
  """Easy synthetic arithmetic problems: {"question", "answer"} ("... #### N")."""
  from mars_jax.data import synthetic
  return synthetic.generate(num, seed=seed, split=split, difficulty="easy")


def task_texts(problems: Sequence[dict]) -> list[str]:
  """The text a tokenizer is trained on: the chat roles, every question and answer."""
  return ["system", "user", "assistant"] + [t for p in problems
                                           for t in (p["question"], p["answer"])]


def write_chat_jsonl(path, problems: Sequence[dict]) -> str:
  """One {"messages": [user question, assistant answer]} per line."""
  with open(path, "w") as f:
    for p in problems:
      f.write(json.dumps({"messages": [{"role": "user", "content": p["question"]},
                                       {"role": "assistant", "content": p["answer"]}]}) + "\n")
  return os.fspath(path)


def write_gsm8k_jsonl(path, problems: Sequence[dict]) -> str:
  """One {"question", "answer"} per line, the answer ending in "#### N"."""
  with open(path, "w") as f:
    for p in problems:
      f.write(json.dumps({"question": p["question"], "answer": p["answer"]}) + "\n")
  return os.fspath(path)
