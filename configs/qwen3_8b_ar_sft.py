"""Stage 1 for Qwen3-8B on 8 GPUs (as the Qwen2.5-7B one), FSDP over all devices.

  python -m mars_jax.train --config configs/qwen3_8b_ar_sft.py --workdir runs/q3_8b_sft \
      --config.model.init=/models/Qwen3-8B --config.data.source=/data/sft/*.jsonl

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen3_8b_ar_sft.py
--topology v5p-16` (TPU) and `--topology h200-8` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  c = paper_config(model_dir="models/Qwen3-8B", preset="qwen3-8b", kind="ar_sft", fsdp=-1,
                   micro_batches=8, remat="full")
  c.mesh.data = 1
  return c
