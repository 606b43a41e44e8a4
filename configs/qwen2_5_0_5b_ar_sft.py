"""Stage 1 for Qwen2.5-0.5B-Instruct: plain AR SFT with the paper's recipe.

  python -m mars_jax.train --config configs/qwen2_5_0_5b_ar_sft.py --workdir runs/0.5b_sft \
      --config.model.init=/models/Qwen2.5-0.5B-Instruct --config.data.source=/data/sft/*.jsonl

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen2_5_0_5b_ar_sft.py
--topology v5p-8` (TPU) and `--topology h200-8` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  return paper_config(model_dir="models/Qwen2.5-0.5B-Instruct", preset="qwen2.5-0.5b",
                      kind="ar_sft", fsdp=1, micro_batches=4, remat="none")
