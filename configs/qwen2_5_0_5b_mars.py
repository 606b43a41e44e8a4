"""Stage 2 for Qwen2.5-0.5B: MARS (B=4, ar_weight 1) from the stage-1 run, paper recipe.

  python -m mars_jax.train --config configs/qwen2_5_0_5b_mars.py --workdir runs/0.5b_mars \
      --config.model.init=runs/0.5b_sft --config.data.source=/data/sft/*.jsonl

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen2_5_0_5b_mars.py
--topology v5p-8` (TPU) and `--topology h200-8` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  return paper_config(model_dir="runs/0.5b_sft", preset="qwen2.5-0.5b", kind="mars",
                      fsdp=1, micro_batches=8, remat="none")
