"""Moved to mars_jax.training.objective; this import path stays for one release.

The old path is the moved module itself (an alias in sys.modules). The contract's names,
`mars_jax.objective.mars_loss` and `ar_sft_loss`, are spelled out below for readers who
look for them here.
"""
import sys
from mars_jax.training import objective as _moved
mars_loss = _moved.mars_loss
ar_sft_loss = _moved.ar_sft_loss
sys.modules[__name__] = _moved
