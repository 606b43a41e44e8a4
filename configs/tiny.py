"""The embedded default: a tiny Qwen2 on the synthetic arithmetic task, on 2 CPU cores.

Stage 1 trains AR-SFT from random init (WORKDIR/stage1); stage 2 trains MARS (B=4)
from it (WORKDIR/stage2); then both are evaluated on held-out problems, in AR mode
and, for MARS, at tau 1.0 and 0.9 with window B, and the MARS weights are exported
to WORKDIR/hf.

  python -m mars_jax.train --config configs/tiny.py --workdir runs/tiny

What makes it learn in minutes: the "words" tokenizer (whole words, single digits:
~55 tokens an example instead of 109 bytes), rows of 64, a 1.9M-parameter model
whose layer scan keeps only the projections' outputs for the backward pass (remat
"dots_with_no_batch_dims": on CPU the fastest step and the least memory of the scan
and unrolled runtimes, docs/performance.md), many small steps (batch 32) with AdamW
at beta2 0.95, and the easy task (operands up to 20), whose ~6,850 training problems
stage 1 sees about 6 times. Stage 2 runs at half stage 1's
learning rate with the AR term weighted 3x, and shifts each row's blocks by a random
offset every step (objective.random_block_offset, on by default), so the MASK slots
learn their place from the tokens before them, not from their position mod B: with
the fixed partition, MARS decoding of the previous default's child at tau 0.9 lost
52 points against its AR mode (docs/default.md).
"""

from mars_jax.training.config import base_config


def get_config():
  c = base_config()
  c.model.init = "random"
  c.model.overrides.update(dict(hidden_size=192, intermediate_size=576, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, tie_word_embeddings=True,
                                rope_theta=10000.0))
  c.model.remat = "dots_with_no_batch_dims"  # with the layer scan: see the docstring
  c.tokenizer = "words"
  c.data.max_length = 64
  c.data.synthetic.difficulty = "easy"   # small numbers: learnable in minutes
  c.data.synthetic.num_train = 6000
  c.data.synthetic.num_test = 500
  c.objective.kind = "mars"
  c.objective.block_size = 4
  c.objective.ar_weight = 3.0            # the tiny model's AR skill is fragile: weight it
  c.objective.chunk_size = 64
  c.optimizer.learning_rate = 1e-3
  c.optimizer.b2 = 0.95
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_ratio = 0.03
  c.train.batch_size = 32
  c.train.steps = 450                   # 300 left the child's AR mode level with the parent's
  c.train.log_every = 50
  c.train.eval_every = 250
  c.train.eval_batches = 2
  c.train.checkpoint_every = 250
  c.train.export_hf = True
  c.stage1.enabled = True
  c.stage1.steps = 1200
  c.stage1.learning_rate = 2e-3
  c.final_eval.num_problems = 500       # the whole held-out set: +-1.2 points, not +-2 at 200
  c.final_eval.taus = (1.0, 0.9)
  return c
