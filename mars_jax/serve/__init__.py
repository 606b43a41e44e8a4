"""Serving: continuous batching in process (`Server`) and the OpenAI-compatible HTTP
server over it (`python -m mars_jax.serve --model DIR`, docs/serving.md)."""

from mars_jax.serve.server import Completion, Request, Server, Update

__all__ = ["Completion", "Request", "Server", "Update"]
