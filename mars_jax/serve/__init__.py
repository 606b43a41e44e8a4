"""Serving: continuous batching in process (`Server`) and the OpenAI-compatible HTTP
server over it (`python -m mars_jax.serve --model DIR`, docs/serving.md).

Not a gateway for several models, and not the place for one batch of prompts:
`mars_jax.sampling.generate` decodes those (docs/decoding.md)."""

from mars_jax.serve.requests import Completion, Request, Update
from mars_jax.serve.server import Server

__all__ = ["Completion", "Request", "Server", "Update"]
