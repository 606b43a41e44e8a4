"""Stage 2 for Qwen2.5-72B: MARS (B=4, ar_weight 1) from the stage-1 run, FSDP over every chip.

  python -m mars_jax.train --config configs/qwen2_5_72b_mars.py --workdir runs/72b_mars \
      --config.model.init=runs/72b_sft --config.data.source=/data/sft/*.jsonl

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen2_5_72b_mars.py
--topology v5p-64` (TPU) and `--topology h200-16` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  c = paper_config(model_dir="runs/72b_sft", preset="qwen2.5-72b", kind="mars", fsdp=-1,
                   micro_batches=12, remat="full")
  c.mesh.data = 1
  return c
