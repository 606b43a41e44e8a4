"""Moved to mars_jax.training.masks; this import path stays for one release."""
import sys
from mars_jax.training import masks as _moved
sys.modules[__name__] = _moved
