"""Stage 1 for Qwen3-8B on 8 GPUs (as the Qwen2.5-7B one), FSDP over all devices.

  python -m mars_jax.train --config configs/qwen3_8b_ar_sft.py --workdir runs/q3_8b_sft \
      --config.model.init=/models/Qwen3-8B --config.data.source=/data/sft/*.jsonl

Qwen3's own chat template writes an empty `<think></think>` block into the last
assistant turn, which the label masking (mars_jax/data/chat.py) rejects with a clear
error; pass a tokenizer with a ChatML template via --config.tokenizer.
"""

from mars_jax.train_config import paper_config


def get_config():
  c = paper_config(model_dir="models/Qwen3-8B", kind="ar_sft", fsdp=-1,
                   micro_batches=8, remat="full")
  c.mesh.data = 1
  return c
