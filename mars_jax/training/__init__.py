"""Training: the MARS objective and masks, the sharded train step, the training loop, its
config, checkpoints, the optimizer, LoRA and its PEFT export, the stages of an
experiment, and the toy-scale study.

Not decoding or serving: those live in mars_jax.decoding and mars_jax.serve. The CLIs
are mars_jax/train.py and mars_jax/study.py.
"""
