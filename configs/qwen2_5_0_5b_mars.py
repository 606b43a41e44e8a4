"""Stage 2 for Qwen2.5-0.5B: MARS (B=4, ar_weight 1) from the stage-1 run, paper recipe.

  python -m mars_jax.train --config configs/qwen2_5_0_5b_mars.py --workdir runs/0.5b_mars \
      --config.model.init=runs/0.5b_sft --config.data.source=/data/sft/*.jsonl
"""

from mars_jax.train_config import paper_config


def get_config():
  return paper_config(model_dir="runs/0.5b_sft", kind="mars", fsdp=1, micro_batches=8,
                      remat="none")
