"""Stage 2 for Qwen3-8B: MARS (B=4, ar_weight 1) from the stage-1 run, 8+ GPUs, FSDP.

  sbatch launch/gpu_slurm.sbatch -- --config configs/qwen3_8b_mars.py \
      --workdir runs/q3_8b_mars --config.model.init=runs/q3_8b_sft
"""

from mars_jax.train_config import paper_config


def get_config():
  c = paper_config(model_dir="runs/q3_8b_sft", kind="mars", fsdp=-1, micro_batches=16,
                   remat="full")
  c.mesh.data = 1
  return c
