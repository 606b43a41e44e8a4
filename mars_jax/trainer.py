"""Moved to mars_jax.training.loop; this import path stays for one release."""
import sys
from mars_jax.training import loop as _moved
sys.modules[__name__] = _moved
