"""mars_jax: MARS (Mask AutoRegression) fine-tuning and multi-token decoding for Qwen2.5 in JAX."""

__version__ = "0.1.0"
