"""Stage 1 for Qwen3-0.6B: plain AR SFT with the paper's recipe (as the Qwen2.5-0.5B one).

  python -m mars_jax.train --config configs/qwen3_0_6b_ar_sft.py --workdir runs/q3_0.6b_sft \
      --config.model.init=/models/Qwen3-0.6B --config.data.source=/data/sft/*.jsonl

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen3_0_6b_ar_sft.py
--topology v5p-8` (TPU) and `--topology h200-8` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  return paper_config(model_dir="models/Qwen3-0.6B", preset="qwen3-0.6b", kind="ar_sft",
                      fsdp=1, micro_batches=4, remat="none")
