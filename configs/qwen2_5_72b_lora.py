"""MARS (B=4, ar_weight 1) for Qwen2.5-72B through LoRA: rank 32, alpha 64 on every
projection, the `<|mask|>` row trained; the base weights frozen (no gradient, no
optimizer state), FSDP over every chip.

  python -m mars_jax.train --config configs/qwen2_5_72b_lora.py --workdir runs/72b_lora \
      --config.model.init=runs/72b_sft --config.data.source=/data/sft/*.jsonl

model.init may be the Instruct checkpoint itself (an HF directory) as well as a stage-1
run. Learning rate 1e-4 (the usual LoRA starting point, not tuned at this scale).
Compiled and fitted by `python -m mars_jax.plan --config configs/qwen2_5_72b_lora.py
--topology h200-8` (one 8-GPU node, where full MARS needs two) and `--topology h200-16`;
docs/performance.md has its memory against full MARS.
"""

from mars_jax.training.config import paper_config


def get_config():
  c = paper_config(model_dir="runs/72b_sft", preset="qwen2.5-72b", kind="mars", fsdp=-1,
                   micro_batches=12, remat="full")
  c.mesh.data = 1
  c.lora.update(rank=32, alpha=64.0, dropout=0.05)
  c.optimizer.learning_rate = 1e-4
  return c
