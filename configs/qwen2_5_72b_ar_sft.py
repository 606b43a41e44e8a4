"""Stage 1 for Qwen2.5-72B-Instruct: plain AR SFT, the paper's recipe, FSDP over every chip.

  python -m mars_jax.train --config configs/qwen2_5_72b_ar_sft.py --workdir runs/72b_sft \
      --config.model.init=/models/Qwen2.5-72B-Instruct --config.data.source=/data/sft/*.jsonl

The float32 master weights and Adam moments alone are 1.16 TB: a slice, not a node.

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen2_5_72b_ar_sft.py
--topology v5p-64` (TPU) and `--topology h200-16` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  c = paper_config(model_dir="models/Qwen2.5-72B-Instruct", preset="qwen2.5-72b",
                   kind="ar_sft", fsdp=-1, micro_batches=12, remat="full")
  c.mesh.data = 1
  return c
