"""Moved to mars_jax.training.config; this import path stays for one release."""
import sys
from mars_jax.training import config as _moved
sys.modules[__name__] = _moved
