"""Evaluation: exact-match accuracy and tokens per forward on GSM8K-format problems
(evaluate), and the lm-evaluation-harness backend with its example tasks (lm_eval,
lm_eval_tasks/).

Not the decoding itself (mars_jax.decoding, behind mars_jax.sampling) nor training's
in-run eval loss (mars_jax.training). The CLIs are mars_jax/evaluate.py and
mars_jax/lm_eval.py.
"""
