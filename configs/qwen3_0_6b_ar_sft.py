"""Stage 1 for Qwen3-0.6B: plain AR SFT with the paper's recipe (as the Qwen2.5-0.5B one).

  python -m mars_jax.train --config configs/qwen3_0_6b_ar_sft.py --workdir runs/q3_0.6b_sft \
      --config.model.init=/models/Qwen3-0.6B --config.data.source=/data/sft/*.jsonl

Qwen3's own chat template writes an empty `<think></think>` block into the last
assistant turn, which the label masking (mars_jax/data/chat.py) rejects with a clear
error; pass a tokenizer with a ChatML template via --config.tokenizer.
"""

from mars_jax.train_config import paper_config


def get_config():
  return paper_config(model_dir="models/Qwen3-0.6B", kind="ar_sft", fsdp=1,
                      micro_batches=4, remat="none")
