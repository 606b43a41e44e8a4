"""Stage 2 for Qwen3-8B: MARS (B=4, ar_weight 1) from the stage-1 run, 8+ GPUs, FSDP.

  sbatch launch/gpu_slurm.sbatch -- --config configs/qwen3_8b_mars.py \
      --workdir runs/q3_8b_mars --config.model.init=runs/q3_8b_sft

Compiled and fitted by `python -m mars_jax.plan --config configs/qwen3_8b_mars.py
--topology v5p-16` (TPU) and `--topology h200-8` (GPU: the paper trained on 8 H200s);
docs/performance.md has the per-chip memory, headroom and step times.
"""

from mars_jax.training.config import paper_config


def get_config():
  c = paper_config(model_dir="runs/q3_8b_sft", preset="qwen3-8b", kind="mars", fsdp=-1,
                   micro_batches=16, remat="full")
  c.mesh.data = 1
  return c
