"""Moved to mars_jax.training.experiment; this import path stays for one release."""
import sys
from mars_jax.training import experiment as _moved
sys.modules[__name__] = _moved
