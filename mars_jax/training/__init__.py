"""Training: the MARS objective and masks, the sharded train step, the training loop of
one stage, its config, its checkpoints as it trains, and the optimizer.

Not the stages of an experiment or the study (mars_jax.experiments, which also score
and export), not LoRA's weight arithmetic (mars_jax.models.lora), and not decoding or
serving (mars_jax.decoding, mars_jax.serve). The CLI is mars_jax/train.py.
"""
