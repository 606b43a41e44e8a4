"""Experiments made of several runs: the stages of `python -m mars_jax.train` (stage 1
AR-SFT, stage 2 MARS, each scored on the held-out problems and exported: `stages`), and
the toy-scale study over seeds (`study`) with its report (`study_report`). Above
training, decoding and evaluation, which they put together. The CLIs are
mars_jax/train.py and mars_jax/study.py."""
