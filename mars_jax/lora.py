"""Moved to mars_jax.training.lora; this import path stays for one release."""
import sys
from mars_jax.training import lora as _moved
sys.modules[__name__] = _moved
