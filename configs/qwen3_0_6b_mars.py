"""Stage 2 for Qwen3-0.6B: MARS (B=4, ar_weight 1) from the stage-1 run, paper recipe.

  python -m mars_jax.train --config configs/qwen3_0_6b_mars.py --workdir runs/q3_0.6b_mars \
      --config.model.init=runs/q3_0.6b_sft --config.data.source=/data/sft/*.jsonl

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen3_0_6b_mars.py
--topology v5p-8` (TPU) and `--topology h200-8` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  return paper_config(model_dir="runs/q3_0.6b_sft", preset="qwen3-0.6b", kind="mars",
                      fsdp=1, micro_batches=8, remat="none")
