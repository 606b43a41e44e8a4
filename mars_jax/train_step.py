"""Moved to mars_jax.training.step; this import path stays for one release."""
import sys
from mars_jax.training import step as _moved
sys.modules[__name__] = _moved
