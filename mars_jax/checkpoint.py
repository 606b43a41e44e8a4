"""Moved to mars_jax.training.checkpoint; this import path stays for one release."""
import sys
from mars_jax.training import checkpoint as _moved
sys.modules[__name__] = _moved
