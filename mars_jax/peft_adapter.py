"""Moved to mars_jax.training.peft_adapter; this import path stays for one release."""
import sys
from mars_jax.training import peft_adapter as _moved
sys.modules[__name__] = _moved
