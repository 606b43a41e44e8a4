"""Data: local chat files (JSONL or JSON arrays, maybe .gz or .zst; Parquet; `datasets`
directories) to training rows:
sources, chat formatting, label masking, bad records, the tokenized cache, packing,
grain pipelines, and the synthetic task. Not a downloader or a data-mixing tool:
`data.source` names local files (docs/data.md).

Entry points (see pipeline.py for the config fields and batch layout):
  load_data(data_cfg, tokenizer) -> ChatData
  ChatData.train_iterator(batch_size=..., shard_index=..., shard_count=...)
  ChatData.eval_batches(batch_size=..., shard_index=..., shard_count=...)
  build_tokenizer("char" | "words"), model_vocab_size(tokenizer)
                                                          the embedded task's tokenizers
  synthetic.generate / chat_records / extract_answer      the embedded task
  task_settings(data_cfg), synthetic.save_task_settings / load_task_settings
                                                          a run's task record (task.json)
"""

from mars_jax.data import synthetic
from mars_jax.data.chat import format_chats, pad_example
from mars_jax.data.pipeline import ChatData, default_config, load_data, task_settings
from mars_jax.data.tokenizer import (build_char_tokenizer, build_tokenizer,
                                     build_word_tokenizer, model_vocab_size)
from mars_jax.data.validation import BAD_KINDS, BadInputError, DataStats

__all__ = [
    "BAD_KINDS", "BadInputError", "ChatData", "DataStats", "build_char_tokenizer",
    "build_tokenizer", "build_word_tokenizer", "default_config", "format_chats", "load_data", "model_vocab_size", "pad_example",
    "synthetic", "task_settings",
]
