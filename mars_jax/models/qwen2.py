"""Qwen2 / Qwen2.5 and Qwen3 (dense) decoder in Flax linen, with the pure functions of
an uncached pass (`forward`, `forward_hidden`, `unembed`) and of its params
(`init_params`, `abstract_params`, `logical_axes`, `relayout`); a cached decoding step
is `mars_jax.models.cached.forward_cached`. One module for both families;
`config.family` switches the attention's extras (docs/models.md):

  Qwen2  q/k/v projections with biases;
  Qwen3  no biases; an RMSNorm over head_dim on each head's queries and keys (one
         [head_dim] scale per layer, shared by the heads), before RoPE.

Parameter tree (layers stacked on a leading axis when `runtime.scan_layers`):

  embedding                      [vocab, embed]
  layers/input_norm/scale        [L, embed]
  layers/attn/{q,k,v}_kernel     [L, embed, heads|kv_heads, head_dim]
  layers/attn/{q,k,v}_bias       [L, heads|kv_heads, head_dim]   (Qwen2 only)
  layers/attn/{q,k}_norm/scale   [L, head_dim]                   (Qwen3 only)
  layers/attn/o_kernel           [L, heads, head_dim, embed]
  layers/post_norm/scale         [L, embed]
  layers/mlp/{gate,up}_kernel    [L, embed, mlp]
  layers/mlp/down_kernel         [L, mlp, embed]
  final_norm/scale               [embed]
  lm_head                        [embed, vocab]   (absent when embeddings are tied)

With `runtime.lora` (a `LoraSpec`), each targeted projection P_kernel [*in, *out] has
`P_lora_a` [*in, rank] and `P_lora_b` [rank, *out] beside it (`layers.low_rank`), and
with its `mask_token_id` the tree holds `mask_embedding` [embed], the trained row of
that token.

Every function takes the architecture (`Qwen2Config`) and, as the keyword
`runtime`, how to compute it (`Runtime`: dtypes, attention, remat, scan); the
default runtime is float32 with the plain einsum attention.

Every weight carries logical axis names (`layers`, `vocab`, `embed`, `heads`,
`kv_heads`, `head_dim`, `mlp`, `norm`, `lora_rank`) that `mars_jax.parallel.sharding` maps to
mesh axes.
Without scan (`runtime.scan_layers=False`) the layers are `layers_0 .. layers_{L-1}`
with the same leaves minus the leading axis. Activations carry logical axis names too,
pinned with `layers.constrain` (the table is in `mars_jax.models.layers`).

Named checkpoints (`jax.ad_checkpoint.checkpoint_name`, `CHECKPOINT_NAMES`) tag the
values a remat policy may keep: "query", "key" (after the Qwen3 norm and RoPE),
"value", "attn_out" (attention before the output projection) and "mlp_hidden".
`runtime.remat` picks the policy of each decoder layer (`_REMAT`): "none" (no remat),
"full" (save nothing), "dots" / "dots_with_no_batch_dims" (JAX's matmul policies) or
"names" (save exactly the named checkpoints, recompute the rest). The blockwise
attention's residuals (its output and log-sum-exp, `flash.RESIDUALS`) are kept by
"names" and both "dots" policies, and no policy sees inside its tiles, so each stays
linear in the row (a matmul policy would otherwise keep every tile's scores).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mars_jax.models import attention, context, flash, paged
from mars_jax.models.attention import Spans, cached_attention, uncached_attention
from mars_jax.models.flash import TokenMask
from mars_jax.models.config import (  # noqa: F401  (re-exported)
    DEFAULT_RUNTIME, PRESETS, LoraSpec, Qwen2Config, Runtime, preset, scan_layers_of)
from mars_jax.models.layers import (
    EMBED_AXES, HEADS_AXES, KV_HEADS_AXES, MLP_AXES, VOCAB_AXES, RMSNorm, apply_rope,
    constrain, dense, dropout_ids, low_rank, param, rope_cos_sin)

Array = jax.Array
CHECKPOINT_NAMES = ("query", "key", "value", "attn_out", "mlp_hidden")

_FLASH = jax.checkpoint_policies.save_only_these_names(*flash.RESIDUALS)
_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, _FLASH),
    "dots_with_no_batch_dims": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, _FLASH),
    "names": jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES,
                                                           *flash.RESIDUALS),
}


def _plus(y: Array, delta: Array | None) -> Array:
  return y if delta is None else y + delta


class Attention(nn.Module):
  """spans: the static query/key spans of an uncached pass (`span_attention`, "xla"
  only); None: every query scores every key."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME
  spans: Spans | None = None

  def _proj(self, x, name, heads, heads_axis, rows=None):
    """x: [b, t, embed] -> [b, t, heads, head_dim] (plus the bias where the family has one)."""
    c, rt = self.config, self.runtime
    kernel = param(self, f"{name}_kernel", (c.hidden_size, heads, c.head_dim),
                   ("embed", heads_axis, "head_dim"), rt.jnp_param_dtype)
    out = _plus(dense(x, kernel.astype(rt.jnp_dtype)),
                low_rank(self, x, f"attn/{name}_kernel", (c.hidden_size,), ("embed",),
                         (heads, c.head_dim), (heads_axis, "head_dim"), rows))
    if not c.attention_bias:
      return out
    bias = param(self, f"{name}_bias", (heads, c.head_dim), (heads_axis, "head_dim"),
                 rt.jnp_param_dtype, nn.initializers.zeros)
    return out + bias.astype(rt.jnp_dtype)

  def _query_or_key(self, x, name, heads, heads_axis, cos, sin, rows=None):
    """Projected, per-head RMS-normed where the family says (Qwen3), then rotated."""
    h = self._proj(x, name, heads, heads_axis, rows)
    if self.config.qk_norm:
      h = RMSNorm(self.config, self.runtime, name=f"{name}_norm")(h)
    return apply_rope(h, cos, sin)

  @nn.compact
  def __call__(self, x, cos, sin, mask, layer=None, cache=None, write_index=None, rows=None):
    c, rt = self.config, self.runtime
    q = checkpoint_name(constrain(
        self._query_or_key(x, "q", c.num_attention_heads, "heads", cos, sin, rows), HEADS_AXES),
        "query")
    k = checkpoint_name(constrain(
        self._query_or_key(x, "k", c.num_key_value_heads, "kv_heads", cos, sin, rows),
        KV_HEADS_AXES), "key")
    v = checkpoint_name(constrain(self._proj(x, "v", c.num_key_value_heads, "kv_heads", rows),
                                  KV_HEADS_AXES), "value")
    new_kv = None
    if cache is None:
      out = uncached_attention(q, k, v, mask, rt.attention_impl, self.spans)
    elif isinstance(cache, paged.Paged):  # a flat batch over a page pool: hands the pool back
      out, new_kv = paged.attend(q, k, v, cache, layer)
    else:  # decoding: read the cache, hand this step's K/V back for one write of all layers
      new_kv = {"k": k.astype(cache["k"].dtype), "v": v.astype(cache["v"].dtype)}
      out = cached_attention(q, new_kv["k"].astype(rt.jnp_dtype),
                             new_kv["v"].astype(rt.jnp_dtype), cache["k"], cache["v"], layer,
                             mask, write_index)
    out = checkpoint_name(constrain(out, HEADS_AXES), "attn_out")
    o_kernel = param(self, "o_kernel", (c.num_attention_heads, c.head_dim, c.hidden_size),
                     ("heads", "head_dim", "embed"), rt.jnp_param_dtype)
    delta = low_rank(self, out, "attn/o_kernel", (c.num_attention_heads, c.head_dim),
                     ("heads", "head_dim"), (c.hidden_size,), ("embed",), rows)
    return _plus(dense(out, o_kernel.astype(rt.jnp_dtype), in_dims=2), delta), new_kv


class MLP(nn.Module):
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME

  @nn.compact
  def __call__(self, x, rows=None):
    c, pdt = self.config, self.runtime.jnp_param_dtype
    gate = param(self, "gate_kernel", (c.hidden_size, c.intermediate_size),
                 ("embed", "mlp"), pdt)
    up = param(self, "up_kernel", (c.hidden_size, c.intermediate_size),
               ("embed", "mlp"), pdt)
    down = param(self, "down_kernel", (c.intermediate_size, c.hidden_size),
                 ("mlp", "embed"), pdt)
    dt, e, m = self.runtime.jnp_dtype, c.hidden_size, c.intermediate_size
    g = _plus(dense(x, gate.astype(dt)),
              low_rank(self, x, "mlp/gate_kernel", (e,), ("embed",), (m,), ("mlp",), rows))
    u = _plus(dense(x, up.astype(dt)),
              low_rank(self, x, "mlp/up_kernel", (e,), ("embed",), (m,), ("mlp",), rows))
    h = checkpoint_name(constrain(nn.silu(g) * u, MLP_AXES), "mlp_hidden")
    return _plus(dense(h, down.astype(dt)),
                 low_rank(self, h, "mlp/down_kernel", (m,), ("mlp",), (e,), ("embed",), rows))


class DecoderLayer(nn.Module):
  """Pre-norm block. Call signature matches `nn.scan`: (carry, layer index) -> (carry, new
  K/V of this step's tokens: {"k","v"}: [b, t, kv_heads, head_dim], or None). The cache,
  all layers' (or None), is passed whole and read at `layer`."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME
  spans: Spans | None = None

  @nn.compact
  def __call__(self, x, layer, cache, cos, sin, mask, write_index, rows=None):
    c, rt = self.config, self.runtime
    h, new_kv = Attention(c, rt, self.spans, name="attn")(
        RMSNorm(c, rt, name="input_norm")(x), cos, sin, mask, layer, cache, write_index, rows)
    x = constrain(x + h, EMBED_AXES)
    x = constrain(x + MLP(c, rt, name="mlp")(RMSNorm(c, rt, name="post_norm")(x), rows),
                  EMBED_AXES)
    return x, new_kv


class Qwen2ForCausalLM(nn.Module):
  """spans: see `Attention` (uncached passes only)."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME
  spans: Spans | None = None

  def setup(self):
    c, rt = self.config, self.runtime
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                  ("vocab", "embed")),
        (c.vocab_size, c.hidden_size), rt.jnp_param_dtype)
    layer = DecoderLayer
    if rt.remat != "none":
      layer = nn.remat(layer, policy=_REMAT[rt.remat], prevent_cse=not rt.scan_layers)
    if rt.scan_layers:
      self.layers = nn.scan(
          layer, variable_axes={"params": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast,
                   nn.broadcast),
          length=c.num_hidden_layers, metadata_params={nn.PARTITION_NAME: "layers"},
      )(c, rt, self.spans, name="layers")
    else:
      self.layers = [layer(c, rt, self.spans, name=f"layers_{i}")
                     for i in range(c.num_hidden_layers)]
    self.final_norm = RMSNorm(c, rt, name="final_norm")
    self.mask_id = rt.lora.mask_token_id if rt.lora is not None else None
    if self.mask_id is not None:   # the trained `<|mask|>` row (see `LoraSpec`)
      self.mask_embedding = self.param(
          "mask_embedding", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
          (c.hidden_size,), rt.jnp_param_dtype)
    if not c.tie_word_embeddings:
      self.lm_head = self.param(
          "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                  ("embed", "vocab")),
          (c.hidden_size, c.vocab_size), rt.jnp_param_dtype)

  def hidden(self, tokens, positions, attn_mask, cache=None, write_index=None,
             dropout_rows=None):
    """Final-normed hidden states [b, t, embed] (compute dtype) and the updated cache.

    With a cache, every layer reads it as it is (`cached_attention`) and returns its new
    K/V; all layers' K/V are then written in one scatter, which XLA keeps in place when
    the cache buffer is donated (the sampler's while_loop carry). dropout_rows: see
    `low_rank`."""
    c = self.config
    length, shards = tokens.shape[1], context.size() if cache is None else 1
    if shards > 1:  # context parallelism: the positions dealt out over the shards
      if not isinstance(attn_mask, TokenMask):
        raise ValueError("context parallelism (a mesh whose `context` axis is > 1) needs "
                         "the pass's mask per token (flash.TokenMask), not a bool[b, t, t] "
                         "array.")
      split = lambda a: context.split(a, shards)
      tokens, positions, attn_mask = split(tokens), split(positions), attn_mask.map(split)
    if dropout_rows is not None:   # [b] -> each token's ids, read off the mask as laid out
      dropout_rows = dropout_ids(dropout_rows, attn_mask, tokens.shape[1])
    if shards == 1 and not attention.keeps_token_mask(self.runtime.attention_impl):
      attn_mask = attention.dense(attn_mask)  # drawn out once, not in every layer
    x = self.embed(tokens)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)
    if self.runtime.scan_layers:
      x, new_kv = self.layers(x, jnp.arange(c.num_hidden_layers), cache, cos, sin, attn_mask,
                              write_index, dropout_rows)
    else:
      new = []
      for i, layer in enumerate(self.layers):
        x, layer_kv = layer(x, i, cache, cos, sin, attn_mask, write_index, dropout_rows)
        new.append(layer_kv)
      new_kv = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new)
    if cache is not None:  # cache[:, row, :, slot] <- [b, t, L, kv_heads, d]
      rows = jnp.arange(tokens.shape[0])[:, None]
      cache = {n: cache[n].at[:, rows, :, write_index].set(
          new_kv[n].transpose(1, 2, 0, 3, 4), mode="drop") for n in ("k", "v")}
    if shards > 1:
      x = context.merge(x, shards, length)
    return self.final(x), cache

  def embed(self, tokens):
    """tokens: int32[b, t] -> their embeddings [b, t, embed] (compute dtype; the trained
    `<|mask|>` row where the params hold one)."""
    x = jnp.take(self.embedding, tokens, axis=0)
    if self.mask_id is not None:
      x = jnp.where((tokens == self.mask_id)[..., None], self.mask_embedding, x)
    return constrain(x.astype(self.runtime.jnp_dtype), EMBED_AXES)

  def final(self, x):
    """The final norm of the last layer's output [b, t, embed]."""
    return constrain(self.final_norm(x), EMBED_AXES)

  def unembed(self, hidden):
    """hidden: [b, t, embed] -> float32 logits [b, t, vocab]."""
    if self.config.tie_word_embeddings:  # contract on the embedding's minor axis, no transpose
      logits = jnp.einsum("...e,ve->...v", hidden, self.embedding.astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
      if self.mask_id is not None:   # the tied head's row of the trained mask embedding
        logits = logits.at[..., self.mask_id].set(jnp.einsum(
            "...e,e->...", hidden, self.mask_embedding.astype(hidden.dtype),
            preferred_element_type=jnp.float32))
    else:
      logits = jnp.einsum("...e,ev->...v", hidden, self.lm_head.astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
    return constrain(logits, VOCAB_AXES)

  def __call__(self, tokens, positions, attn_mask, cache=None, write_index=None):
    hidden, cache = self.hidden(tokens, positions, attn_mask, cache, write_index)
    return self.unembed(hidden), cache


# ---- pure functional API ---------------------------------------------------------


def forward(config: Qwen2Config, params, tokens: Array, positions: Array,
            attn_mask: Array | TokenMask, *, runtime: Runtime = DEFAULT_RUNTIME) -> Array:
  """Logits of a full (uncached) pass.

  tokens, positions: int32[b, t]; attn_mask: bool[b, t, t] (True = may attend), or the
  same mask per token (`flash.TokenMask`) -> float32[b, t, vocab].
  """
  logits, _ = Qwen2ForCausalLM(config, runtime).apply({"params": params}, tokens, positions,
                                                       attn_mask)
  return logits


def forward_hidden(config: Qwen2Config, params, tokens: Array, positions: Array,
                   attn_mask: Array | TokenMask, *, runtime: Runtime = DEFAULT_RUNTIME,
                   spans: Spans | None = None, dropout_rng: Array | None = None,
                   dropout_rows: Array | None = None) -> Array:
  """Final-normed hidden states [b, t, embed] of an uncached pass (for chunked losses);
  attn_mask as `forward`'s. A `flash.TokenMask` goes into every layer where the
  attention takes it per token (`attention.keeps_token_mask`: "flash", "splash" and
  "auto"); elsewhere it is drawn out once, bool[b, t, t].
  spans: static query/key spans that hold every key the mask allows (`span_attention`).
  dropout_rng: the LoRA adapters' dropout (`runtime.lora`, training); None: none.
  dropout_rows: uint32[b], each row's id in its tokens' dropout masks (`dropout_ids`)."""
  hidden, _ = Qwen2ForCausalLM(config, runtime, spans).apply(
      {"params": params}, tokens, positions, attn_mask, method="hidden",
      dropout_rows=dropout_rows, rngs=None if dropout_rng is None else {"dropout": dropout_rng})
  return hidden


def unembed(config: Qwen2Config, params, hidden: Array, *,
            runtime: Runtime = DEFAULT_RUNTIME) -> Array:
  """hidden: [b, t, embed] -> float32 logits [b, t, vocab] (tied or separate head)."""
  return Qwen2ForCausalLM(config, runtime).apply({"params": params}, hidden, method="unembed")


def _dummy_inputs(config: Qwen2Config):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return tokens, tokens, jnp.ones((1, 1, 1), bool)


def abstract_params(config: Qwen2Config, *, runtime: Runtime = DEFAULT_RUNTIME,
                    boxed: bool = False) -> Any:
  """ShapeDtypeStructs of the params, allocating nothing (boxed: with logical axes)."""
  out = jax.eval_shape(lambda: Qwen2ForCausalLM(config, runtime).init(
      jax.random.key(0), *_dummy_inputs(config)))
  return out["params"] if boxed else nn.meta.unbox(out["params"])


def logical_axes(config: Qwen2Config, *, runtime: Runtime = DEFAULT_RUNTIME) -> Any:
  """Pytree of `PartitionSpec`s of logical axis names, matching the params tree."""
  return nn.get_partition_spec(abstract_params(config, runtime=runtime, boxed=True))


def init_params(config: Qwen2Config, rng: Array, *, runtime: Runtime = DEFAULT_RUNTIME) -> Any:
  """Random params (normal(0.02) weights, zero biases, unit norms)."""
  variables = Qwen2ForCausalLM(config, runtime).init(rng, *_dummy_inputs(config))
  return nn.meta.unbox(variables["params"])


def num_params(tree: Any) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))


def relayout(params: Any, runtime: Runtime) -> Any:
  """The same weights in `runtime`'s layout: param dtype, and layers stacked
  (`layers/...`) or unrolled (`layers_0..`) as `runtime.scan_layers` says."""
  params = jax.tree.map(lambda x: x.astype(runtime.jnp_param_dtype), params)
  scanned = scan_layers_of(params)
  if scanned == runtime.scan_layers:
    return params
  rest = {k: v for k, v in params.items() if k != "layers" and not k.startswith("layers_")}
  if scanned:
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**rest, **{f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], params["layers"])
                       for i in range(n)}}
  n = sum(k.startswith("layers_") for k in params)
  return {**rest, "layers": jax.tree.map(lambda *xs: jnp.stack(xs),
                                         *[params[f"layers_{i}"] for i in range(n)])}
