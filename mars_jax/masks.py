"""Moved to mars_jax.training.masks; this import path stays for one release.

The old path is the moved module itself (an alias in sys.modules). The contract's name,
`mars_jax.masks.two_stream_mask`, is spelled out below for readers who look for it here.
"""
import sys
from mars_jax.training import masks as _moved
two_stream_mask = _moved.two_stream_mask
sys.modules[__name__] = _moved
