"""The decoder's cached (decoding) pass: `init_cache`, the KV cache, and
`forward_cached`, one step that writes this step's K/V into it and attends over it
(each layer through `attention.cached_attention`).

KV cache: `{"k", "v"}: [L, b, kv_heads, max_len, head_dim]` (each kv head's slots
contiguous: the attention reads the cache in the layout it is stored). A cached call
writes the new K/V of token `j` of sample `i` at cache slot `write_index[i, j]` (an
index `>= max_len` drops the write) and then lets each query attend to the cache slots
its mask row allows:

  cache slot      0 1 2 3 4 5 6 7        attn_mask[i, j, s], True = may attend
  query j=0 (p=5) 1 1 1 1 1 1 . .        RoPE positions are passed separately
  query j=1 (p=6) 1 1 1 1 1 1 1 .        from write indices (`positions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mars_jax.models.config import DEFAULT_RUNTIME, Qwen2Config, Runtime, scan_layers_of
from mars_jax.models.layers import rope_cos_sin
from mars_jax.models.paged import Paged
from mars_jax.models.qwen2 import DecoderLayer, Qwen2ForCausalLM

Array = jax.Array
Cache = dict[str, Array]


def forward_cached(config: Qwen2Config, params, tokens: Array, positions: Array,
                   cache: Cache, write_index: Array, attn_mask: Array, *,
                   runtime: Runtime = DEFAULT_RUNTIME) -> tuple[Array, Cache]:
  """One cached step: write K/V of `tokens` into the cache, attend over the cache.

  tokens, positions, write_index: int32[b, t] (write_index >= max_len drops the write);
  cache: {"k","v"}: [layers, b, kv_heads, max_len, head_dim];
  attn_mask: bool[b, t, max_len] over cache slots *after* this step's writes.
  -> (float32 logits [b, t, vocab], updated cache).
  """
  return Qwen2ForCausalLM(config, runtime).apply(
      {"params": params}, tokens, positions, attn_mask, cache, write_index)


def init_cache(config: Qwen2Config, batch: int, max_len: int, *,
               runtime: Runtime = DEFAULT_RUNTIME) -> Cache:
  """Zeroed KV cache {"k","v"}: [layers, batch, kv_heads, max_len, head_dim], in the
  runtime's compute dtype."""
  shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len,
           config.head_dim)
  dtype = runtime.jnp_dtype
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_paged(config: Qwen2Config, runtime: Runtime, params, tokens: Array,
                  paged: Paged) -> tuple[Array, Paged]:
  """The decoder over a flat batch through a page pool (`mars_jax.models.paged`): tokens
  int32[T] at paged.positions -> (final-normed hidden [T, embed], the `Paged` with this
  step's K/V written into its pool).

  The layers run in a `lax.scan` that carries the pool (stacked params), or a Python loop
  (unrolled params), so each layer's write is in place."""
  model = Qwen2ForCausalLM(config, runtime)
  x = model.apply({"params": params}, tokens[None], method="embed")
  cos, sin = rope_cos_sin(paged.positions[None], config.head_dim, config.rope_theta,
                          config.rope_scaling)
  layer_module = DecoderLayer(config, runtime)

  def run_layer(x, paged, layer_params, layer):
    return layer_module.apply({"params": layer_params}, x, layer, paged, cos, sin, None, None)

  if scan_layers_of(params):
    def body(carry, xs):
      return run_layer(*carry, *xs), None
    (x, paged), _ = jax.lax.scan(body, (x, paged),
                                 (params["layers"], jnp.arange(config.num_hidden_layers)))
  else:
    for i in range(config.num_hidden_layers):
      x, paged = run_layer(x, paged, params[f"layers_{i}"], jnp.int32(i))
  return model.apply({"params": params}, x, method="final")[0], paged
