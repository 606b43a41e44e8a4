"""Moved to mars_jax.training.optimizer; this import path stays for one release."""
import sys
from mars_jax.training import optimizer as _moved
sys.modules[__name__] = _moved
