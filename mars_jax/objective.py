"""Moved to mars_jax.training.objective; this import path stays for one release."""
import sys
from mars_jax.training import objective as _moved
sys.modules[__name__] = _moved
