"""Stage 2 for Qwen2.5-7B: MARS (B=4, ar_weight 1) from the stage-1 run, 8+ GPUs, FSDP.

  sbatch launch/gpu_slurm.sbatch -- --config configs/qwen2_5_7b_mars.py \
      --workdir runs/7b_mars --config.model.init=runs/7b_sft
"""

from mars_jax.train_config import paper_config


def get_config():
  c = paper_config(model_dir="runs/7b_sft", kind="mars", fsdp=-1, micro_batches=16,
                   remat="full")
  c.mesh.data = 1
  return c
