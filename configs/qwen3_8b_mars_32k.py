"""Stage 2 for Qwen3-8B on reasoning chats: MARS (B=4, ar_weight 1) over rows of 32768
tokens a stream (T = 65536 positions in the two-stream pass), 8 H100s or H200s, FSDP.

  sbatch launch/gpu_slurm.sbatch -- --config configs/qwen3_8b_mars_32k.py \
      --workdir runs/q3_8b_mars_32k --config.model.init=runs/q3_8b_sft

Chats up to 32768 tokens are packed into rows of that length (shorter ones share a
row; none sees another); attention runs blockwise from the tokens' own vectors
("auto": `mars_jax.models.flash` on GPU, never a [T, T] array), and every layer is
recomputed in the backward (remat "full"). Past 32k a stream, split each row's positions
over devices with the context axis, e.g. 128k on 16 H200s:

  --config.data.max_length=131072 --config.mesh.context=8

`python -m mars_jax.plan --config configs/qwen3_8b_mars_32k.py --topology h100-8` fits
it; docs/long_rows.md has the table (8k to 128k, h100-8 to v5p-64).
"""

from mars_jax.training.config import paper_config


def get_config():
  c = paper_config(model_dir="runs/q3_8b_sft", preset="qwen3-8b", kind="mars", fsdp=-1,
                   micro_batches=1, remat="full")
  c.mesh.data = 1
  c.data.source = "data/reasoning_sft/*.jsonl"
  c.data.max_length = 32768
  c.data.packing = True
  c.data.num_eval = 64
  c.train.batch_size = 8   # 262,144 tokens a step, the paper's 384 x 512 = 196,608 scaled up
  return c
