"""What a decoding forward must at least cost on this machine: the bytes it moves, the
FLOPs it does, and this machine's measured bandwidth and matmul rate.

A forward reads every weight once and the K/V cache it attends over (the
memory-bandwidth roofline), and does ~2 FLOPs per parameter per token fed plus
the attention's (the compute roofline). A step costs at least the larger of the two.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.models import qwen2
from mars_jax.models.config import Qwen2Config


@functools.lru_cache(maxsize=None)
def _param_bytes(config: Qwen2Config, runtime: qwen2.Runtime) -> int:
  params = qwen2.abstract_params(config, runtime=runtime)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  if not config.tie_word_embeddings:
    total -= params["embedding"].size * params["embedding"].dtype.itemsize
  return int(total)


def forward_bytes(config: Qwen2Config, runtime: qwen2.Runtime, batch: int,
                  cache_len: int) -> tuple[int, int]:
  """Bytes one decoding forward must read -> (parameters, KV cache). Every weight
  is read once, except an untied embedding table (a few rows are gathered); the KV
  cache is read up to `cache_len` slots: [layers, batch, kv_heads, cache_len, head_dim],
  K and V."""
  kv = (2 * config.num_hidden_layers * batch * cache_len * config.num_key_value_heads
        * config.head_dim * np.dtype(runtime.jnp_dtype).itemsize)
  return _param_bytes(config, runtime), int(kv)


def forward_flops(config: Qwen2Config, tokens: int, cache_len: int) -> float:
  """FLOPs of a forward over `tokens` inputs attending over `cache_len` slots each:
  2 per weight (the embedding gather excluded) plus QK^T and PV, per token."""
  weights = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(qwen2.abstract_params(config)))
  if not config.tie_word_embeddings:  # the input table is gathered, not multiplied
    weights -= config.vocab_size * config.hidden_size
  attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
  return float(tokens) * (2 * weights + attention * cache_len)


def memory_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
  """Bytes per second of a large array copy (read + write), best of `repeats`."""
  a = np.ones(nbytes // 8, np.float64)
  b = np.empty_like(a)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(b, a)
    best = min(best, time.perf_counter() - t0)
  return 2 * nbytes / best


def matmul_rate(n: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of a float32 [n, n] @ [n, n] matmul under XLA on the default device."""
  x = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best
