"""Qwen2 / Qwen2.5 and Qwen3 (dense) decoder in Flax linen, with a pure `forward` and a
KV-cache path. One module for both families; `config.family` switches the attention's
extras (docs/models.md):

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
`P_lora_a` [*in, rank] and `P_lora_b` [rank, *out] beside it (`low_rank`), and with its
`mask_token_id` the tree holds `mask_embedding` [embed], the trained row of that token.

Every function takes the architecture (`Qwen2Config`) and, as the keyword
`runtime`, how to compute it (`Runtime`: dtypes, attention, remat, scan); the
default runtime is float32 with the plain einsum attention.

Every weight carries logical axis names (`layers`, `vocab`, `embed`, `heads`,
`kv_heads`, `head_dim`, `mlp`, `norm`, `lora_rank`) that `mars_jax.sharding` maps to mesh axes.
Without scan (`runtime.scan_layers=False`) the layers are `layers_0 .. layers_{L-1}`
with the same leaves minus the leading axis.

Activations carry logical axis names too (`activation_batch`, `activation_length`,
`activation_embed`, `activation_heads`, `activation_kv_heads`, `activation_mlp`,
`activation_vocab`; head_dim is never split), pinned with `constrain`: a no-op unless
the model is traced under `mars_jax.sharding.activation_sharding`, which binds a mesh
and the rules (unit tests, the sampler and decoding run without one):

  residual stream, final hidden   [b, t, embed]               EMBED_AXES
  queries, attention output       [b, t, heads, head_dim]     HEADS_AXES
  keys, values                    [b, t, kv_heads, head_dim]  KV_HEADS_AXES
  MLP hidden silu(gate) * up      [b, t, mlp]                 MLP_AXES
  logits                          [b, t, vocab]               VOCAB_AXES

Named checkpoints (`jax.ad_checkpoint.checkpoint_name`, `CHECKPOINT_NAMES`) tag the
values a remat policy may keep: "query", "key" (after the Qwen3 norm and RoPE),
"value", "attn_out" (attention before the output projection) and "mlp_hidden".
`runtime.remat` picks the policy of each decoder layer (`_REMAT`): "none" (no remat),
"full" (save nothing), "dots" / "dots_with_no_batch_dims" (JAX's matmul policies) or
"names" (save exactly the named checkpoints, recompute the rest).

KV cache (see `init_cache`): `{"k", "v"}: [L, b, kv_heads, max_len, head_dim]` (each
kv head's slots contiguous: the attention reads the cache in the layout it is stored).
A cached call writes the new K/V of token `j` of sample `i` at cache slot
`write_index[i, j]` (an index `>= max_len` drops the write) and then lets each
query attend to the cache slots its mask row allows:

  cache slot      0 1 2 3 4 5 6 7        attn_mask[i, j, s], True = may attend
  query j=0 (p=5) 1 1 1 1 1 1 . .        RoPE positions are passed separately
  query j=1 (p=6) 1 1 1 1 1 1 1 .        from write indices (`positions`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from mars_jax.models import splash
from mars_jax.models.config import (  # noqa: F401  (re-exported)
    DEFAULT_RUNTIME, PRESETS, LoraSpec, Qwen2Config, Runtime, preset, scan_layers_of)

Array = jax.Array
Cache = dict[str, Array]
Spans = tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]  # see `span_attention`
CACHE_CHUNK = 64  # cache slots `cached_attention` reads per block

EMBED_AXES = ("activation_batch", "activation_length", "activation_embed")
HEADS_AXES = ("activation_batch", "activation_length", "activation_heads", None)
KV_HEADS_AXES = ("activation_batch", "activation_length", "activation_kv_heads", None)
MLP_AXES = ("activation_batch", "activation_length", "activation_mlp")
VOCAB_AXES = ("activation_batch", "activation_length", "activation_vocab")
CHECKPOINT_NAMES = ("query", "key", "value", "attn_out", "mlp_hidden")

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "names": jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES),
}


def fit_spec(spec: P, shape: Sequence[int], mesh: Any) -> P:
  """`spec` with the mesh axes of any dimension they do not divide dropped (replicated).
  mesh: a `Mesh` or `AbstractMesh`."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = math.prod(mesh.shape[a] for a in names)
    out.append(axes if names and dim % size == 0 else None)
  return P(*out)


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
  """x: [...] pinned to the mesh axes its logical `axes` (one per dimension) map to under
  the bound `nn.logical_axis_rules` on the abstract mesh in context; x itself when either
  is missing, or when the mesh is one device (where a constraint changes nothing but
  XLA's fusion choices, and with them the float rounding of a run). A dimension its mesh
  axes do not divide stays replicated, as in the weights."""
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty or mesh.size == 1:
    return x
  spec = fit_spec(nn.logical_to_mesh_axes(axes, rules), x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, spec)


def dense(x: Array, kernel: Array, in_dims: int = 1) -> Array:
  """x: [..., *in] @ kernel: [*in, *out] -> [..., *out] as one 2-D matmul.

  Flattening the leading (batch, time) dims first matters on CPU: XLA's dot over
  two batch-like dims makes the backward pass (whose weight gradient contracts over
  them) about twice as slow as the same 2-D product."""
  lead, inner = x.shape[:x.ndim - in_dims], kernel.shape[:in_dims]
  out = kernel.shape[in_dims:]
  y = x.reshape(-1, int(np.prod(inner))) @ kernel.reshape(int(np.prod(inner)), -1)
  return y.reshape(*lead, *out)


def _param(module: nn.Module, name: str, shape, axes, dtype, init=None):
  init = init or nn.initializers.normal(0.02)
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _lora_a_init(key, shape, dtype):
  """A: [*in, rank] uniform in +-1/sqrt(fan_in) (PEFT's default, Kaiming with a=sqrt 5)."""
  bound = 1.0 / math.sqrt(int(np.prod(shape[:-1])))
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def low_rank(module: nn.Module, x: Array, name: str, in_shape: tuple[int, ...],
             in_axes: tuple[str, ...], out_shape: tuple[int, ...],
             out_axes: tuple[str, ...], rows: Array | None = None) -> Array | None:
  """The adapter of projection `name` (a `LORA_PROJECTIONS` entry, "attn/q_kernel"), or
  None when `runtime.lora` has none for it: (alpha / rank) (drop(x) A) B.

  x: [..., *in_shape] -> [..., *out_shape]. Params `{p}_lora_a` [*in, rank] and
  `{p}_lora_b` [rank, *out] (p: the kernel's name without "_kernel"), with the logical
  axes of the kernel's dims and "lora_rank". Dropout only when the caller passes a
  "dropout" rng (training): row i's mask is drawn from that key folded with rows[i]
  (uint32[b], e.g. a hash of the row's tokens: the same mask wherever the row sits in
  the batch and however the batch is split; None: the row's index)."""
  spec, rt = module.runtime.lora, module.runtime
  if spec is None or not spec.targets_projection(name):
    return None
  prefix = name.split("/")[-1].removesuffix("_kernel")
  a = _param(module, f"{prefix}_lora_a", (*in_shape, spec.rank), (*in_axes, "lora_rank"),
             rt.jnp_param_dtype, _lora_a_init)
  b = _param(module, f"{prefix}_lora_b", (spec.rank, *out_shape), ("lora_rank", *out_axes),
             rt.jnp_param_dtype, nn.initializers.zeros)
  if spec.dropout > 0 and module.has_rng("dropout"):
    key = module.make_rng("dropout")
    ids = jnp.arange(x.shape[0], dtype=jnp.uint32) if rows is None else rows
    keep = jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(key, i),
                                                   1.0 - spec.dropout, x.shape[1:]))(ids)
    x = jnp.where(keep, x / (1.0 - spec.dropout), 0).astype(x.dtype)
  h = dense(x, a.astype(rt.jnp_dtype), in_dims=len(in_shape))
  return dense(h, b.astype(rt.jnp_dtype)) * jnp.asarray(spec.scale, rt.jnp_dtype)


def _plus(y: Array, delta: Array | None) -> Array:
  return y if delta is None else y + delta


class RMSNorm(nn.Module):
  """y = x / rms(x) * scale, computed in float32 (as HF), cast back to x.dtype."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = _param(self, "scale", (x.shape[-1],), ("norm",), self.runtime.jnp_param_dtype,
                   nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                              + self.config.rms_norm_eps)
    return (scale.astype(jnp.float32) * x32).astype(x.dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """Rotate-half RoPE tables. positions: int32[b, t] -> cos, sin: float32[b, t, head_dim]."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x: [b, t, heads, head_dim]; cos, sin: [b, t, head_dim] (HF rotate-half layout)."""
  half = x.shape[-1] // 2
  x32 = x.astype(jnp.float32)
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)


def _queries_head_major(q: Array, kv_heads: int) -> Array:
  """q: [b, t, heads, d] -> scaled queries [b, kv_heads, group * t, d] (group = heads /
  kv_heads), the row layout both attentions multiply against [b, kv_heads, s, d] keys."""
  b, t, h, d = q.shape
  qh = (q / jnp.sqrt(d).astype(q.dtype)).reshape(b, t, kv_heads, h // kv_heads, d)
  return qh.transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, h // kv_heads * t, d)


def _heads_back(out: Array) -> Array:
  """[b, kv_heads, group, t, d] -> [b, t, heads, d]."""
  b, kvh, g, t, d = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * g, d)


def _mask_bias(mask: Array) -> Array:
  """bool[b, t, s] -> float32[b, 1, 1, t, s]: 0 where a query may attend, finfo.min where
  not, added to scores laid out [b, kv_heads, group, t, s]."""
  return jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None]


def attention(q: Array, k: Array, v: Array, mask: Array, impl: str) -> Array:
  """Grouped-query attention.

  q: [b, t, heads, d]; k, v: [b, s, kv_heads, d]; mask: bool[b, t, s] -> [b, t, heads, d].
  A query whose mask row is all False gets a uniform average instead of NaN.

  "xla" computes it head-major, [b, kv_heads, group * t, d] against [b, kv_heads, s, d]
  (two batch dims and one row dim, the layout XLA:CPU's batched matmul takes as it is),
  with the softmax's division moved after the value product: out = (e @ v) / sum(e),
  e = exp(scores + bias - max), the mask an additive bias and the max a constant to the
  gradient. The [t, s] tensors then see one elementwise pass forward and two backward
  (docs/performance.md, "Fifth round"). "splash" runs JAX's Pallas TPU kernel
  (`mars_jax.models.splash`).
  """
  if impl == "splash":
    return splash.splash_attention(q, k, v, mask)
  if impl != "xla":
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None], implementation="cudnn" if impl == "cudnn" else None)
  b, t, h, d = q.shape
  s, kvh = k.shape[1], k.shape[2]
  g = h // kvh
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, kv_heads, s, d]
  scores = jnp.einsum("bkqd,bksd->bkqs", _queries_head_major(q, kvh), kh,
                      preferred_element_type=jnp.float32).reshape(b, kvh, g, t, s)
  scores = scores + _mask_bias(mask)
  e = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  out = jnp.einsum("bkqs,bksd->bkqd", e.reshape(b, kvh, g * t, s).astype(v.dtype), vh,
                   preferred_element_type=jnp.float32).reshape(b, kvh, g, t, d)
  return _heads_back(out / jnp.sum(e, axis=-1)[..., None]).astype(v.dtype)


def uncached_attention(q: Array, k: Array, v: Array, mask: Array, impl: str,
                       spans: Spans | None) -> Array:
  """`attention` of an uncached pass as `impl` says, span by span where "xla" has
  `spans` (`span_attention`); "auto" is "splash" where the computation is lowered for
  TPU and "xla" on every other backend (`jax.lax.platform_dependent`)."""
  if impl == "auto":
    return jax.lax.platform_dependent(
        q, k, v, mask, tpu=splash.splash_attention,
        default=lambda *a: uncached_attention(*a, impl="xla", spans=spans))
  if spans is not None and impl == "xla":
    return span_attention(q, k, v, mask, spans)
  return attention(q, k, v, mask, impl)


def span_attention(q: Array, k: Array, v: Array, mask: Array, spans: Spans) -> Array:
  """`attention` ("xla") computed span by span: the queries [q0, q1) of each span score
  only the keys of its static key ranges, which must hold every key `mask` lets them
  see (`mars_jax.masks.causal_spans`, `two_stream_spans`). Equal to `attention` on every
  query that may see some key; the FLOPs and the score tensors shrink to the ranges
  (about half of them for a causal pass).

  q: [b, t, heads, d]; k, v: [b, s, kv_heads, d]; mask: bool[b, t, s];
  spans: ((q0, q1, ((k0, k1), ...)), ...) covering [0, t) in order -> [b, t, heads, d].
  """
  out = []
  for q0, q1, ranges in spans:
    def keys(a, ranges=ranges):
      return jnp.concatenate([a[:, k0:k1] for k0, k1 in ranges], axis=1)
    seen = jnp.concatenate([mask[:, q0:q1, k0:k1] for k0, k1 in ranges], axis=2)
    out.append(attention(q[:, q0:q1], keys(k), keys(v), seen, "xla"))
  return jnp.concatenate(out, axis=1)


def cached_attention(q: Array, k: Array, v: Array, cache_k: Array, cache_v: Array,
                     layer: Array, mask: Array, write_index: Array, *,
                     chunk: int = CACHE_CHUNK) -> Array:
  """Grouped-query attention over a KV cache as it is once this step's K/V are written,
  without writing them: the cache is only read here, and the caller writes every
  layer's new K/V into it once (no per-layer copy of the cache).

  q: [b, t, heads, d]; k, v: [b, t, kv_heads, d] (this step's); cache_k, cache_v:
  [L, b, kv_heads, S, d], all layers' (read here at `layer`: int32[], one block at a
  time, so no layer's slice of the cache is ever copied out whole);
  mask: bool[b, t, S] over cache slots after the writes;
  write_index: int32[b, t] (>= S: not written). A slot that this step writes is read
  from k/v, every other slot from the cache:

    scores = [ q.cache_k  masked by mask & slot not written | q.k  masked by mask at
               the slot each new token goes to ]  -> one softmax over S + t

  The cache part is read in blocks of `chunk` slots, only up to the last block that
  any query may see (a `fori_loop` with an online softmax), so a step costs what the
  live part of the cache costs, not the whole bucket. A query that may see nothing
  gets zeros. -> [b, t, heads, d].
  """
  b, t, h, d = q.shape
  kvh, slots = cache_k.shape[2], cache_k.shape[3]
  g = h // kvh
  live = write_index < slots
  written = jnp.any((write_index[:, :, None] == jnp.arange(slots)) & live[..., None], axis=1)
  at_slot = jnp.broadcast_to(jnp.where(live, write_index, 0)[:, None, :], (b, t, t))
  mask_new = jnp.take_along_axis(mask, at_slot, axis=2) & live[:, None, :]
  mask_old = mask & ~written[:, None, :]
  qh = _queries_head_major(q, kvh)  # transposed once, outside the block loop
  # Masked scores get the bias finfo.min; the running max starts at `floor`, far below any
  # real score and far above a biased one, so exp(biased - max) is exactly 0 with no select,
  # and a query that has seen nothing keeps sum 0.
  floor = jnp.float32(-1e30)

  def scores_of(keys):
    """keys: [b, kv_heads, n, d] -> float32 scores [b, kv_heads, group, t, n]."""
    return jnp.einsum("bkqd,bksd->bkqs", qh, keys,
                      preferred_element_type=jnp.float32).reshape(b, kvh, g, t, -1)

  def update(carry, scores, visible, values):
    """Online softmax: fold one block of scores [b, k, g, t, n] (values [b, k, n, d];
    visible: bool[b, t, n]) into (max, sum, acc)."""
    m, l, acc = carry
    scores = scores + _mask_bias(visible)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.exp(scores - m_new[..., None])
    decay = jnp.exp(m - m_new)
    pv = jnp.einsum("bkqs,bksd->bkqd", p.reshape(b, kvh, g * t, -1).astype(values.dtype),
                    values, preferred_element_type=jnp.float32)
    acc = acc * decay[..., None] + pv.reshape(b, kvh, g, t, d)
    return m_new, l * decay + jnp.sum(p, axis=-1), acc

  def block(i, carry):
    start = i * chunk
    ks, vs = (jax.lax.dynamic_slice(c, (layer, 0, 0, start, 0), (1, b, kvh, chunk, d))[0]
              .astype(q.dtype) for c in (cache_k, cache_v))
    seen = jax.lax.dynamic_slice_in_dim(mask_old, start, chunk, axis=2)
    return update(carry, scores_of(ks), seen, vs)

  init = (jnp.full((b, kvh, g, t), floor, jnp.float32),
          jnp.zeros((b, kvh, g, t), jnp.float32),
          jnp.zeros((b, kvh, g, t, d), jnp.float32))
  if slots % chunk:
    chunk = slots
  seen_slots = jnp.max(jnp.where(jnp.any(mask_old, axis=(0, 1)), jnp.arange(slots) + 1, 0))
  carry = jax.lax.fori_loop(0, (seen_slots + chunk - 1) // chunk, block, init)
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # this step's, [b, k, t, d]
  _, l, acc = update(carry, scores_of(kh), mask_new, vh)
  return _heads_back(acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]
                     ).astype(v.dtype)


class Attention(nn.Module):
  """spans: the static query/key spans of an uncached pass (`span_attention`, "xla"
  only); None: every query scores every key."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME
  spans: Spans | None = None

  def _proj(self, x, name, heads, heads_axis, rows=None):
    """x: [b, t, embed] -> [b, t, heads, head_dim] (plus the bias where the family has one)."""
    c, rt = self.config, self.runtime
    kernel = _param(self, f"{name}_kernel", (c.hidden_size, heads, c.head_dim),
                    ("embed", heads_axis, "head_dim"), rt.jnp_param_dtype)
    out = _plus(dense(x, kernel.astype(rt.jnp_dtype)),
                low_rank(self, x, f"attn/{name}_kernel", (c.hidden_size,), ("embed",),
                         (heads, c.head_dim), (heads_axis, "head_dim"), rows))
    if not c.attention_bias:
      return out
    bias = _param(self, f"{name}_bias", (heads, c.head_dim), (heads_axis, "head_dim"),
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
    else:  # decoding: read the cache, hand this step's K/V back for one write of all layers
      new_kv = {"k": k.astype(cache["k"].dtype), "v": v.astype(cache["v"].dtype)}
      out = cached_attention(q, new_kv["k"].astype(rt.jnp_dtype),
                             new_kv["v"].astype(rt.jnp_dtype), cache["k"], cache["v"], layer,
                             mask, write_index)
    out = checkpoint_name(constrain(out, HEADS_AXES), "attn_out")
    o_kernel = _param(self, "o_kernel", (c.num_attention_heads, c.head_dim, c.hidden_size),
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
    gate = _param(self, "gate_kernel", (c.hidden_size, c.intermediate_size),
                  ("embed", "mlp"), pdt)
    up = _param(self, "up_kernel", (c.hidden_size, c.intermediate_size),
                ("embed", "mlp"), pdt)
    down = _param(self, "down_kernel", (c.intermediate_size, c.hidden_size),
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
    x = jnp.take(self.embedding, tokens, axis=0)
    if self.mask_id is not None:
      x = jnp.where((tokens == self.mask_id)[..., None], self.mask_embedding, x)
    x = constrain(x.astype(self.runtime.jnp_dtype), EMBED_AXES)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
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
    return constrain(self.final_norm(x), EMBED_AXES), cache

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
            attn_mask: Array, *, runtime: Runtime = DEFAULT_RUNTIME) -> Array:
  """Logits of a full (uncached) pass.

  tokens, positions: int32[b, t]; attn_mask: bool[b, t, t] (True = may attend)
  -> float32[b, t, vocab].
  """
  logits, _ = Qwen2ForCausalLM(config, runtime).apply({"params": params}, tokens, positions,
                                                       attn_mask)
  return logits


def forward_hidden(config: Qwen2Config, params, tokens: Array, positions: Array,
                   attn_mask: Array, *, runtime: Runtime = DEFAULT_RUNTIME,
                   spans: Spans | None = None, dropout_rng: Array | None = None,
                   dropout_rows: Array | None = None) -> Array:
  """Final-normed hidden states [b, t, embed] of an uncached pass (for chunked losses).
  spans: static query/key spans that hold every key the mask allows (`span_attention`).
  dropout_rng: the LoRA adapters' dropout (`runtime.lora`, training); None: none.
  dropout_rows: uint32[b], what each row's dropout masks are drawn with beside the key
  (`low_rank`)."""
  hidden, _ = Qwen2ForCausalLM(config, runtime, spans).apply(
      {"params": params}, tokens, positions, attn_mask, method="hidden",
      dropout_rows=dropout_rows, rngs=None if dropout_rng is None else {"dropout": dropout_rng})
  return hidden


def unembed(config: Qwen2Config, params, hidden: Array, *,
            runtime: Runtime = DEFAULT_RUNTIME) -> Array:
  """hidden: [b, t, embed] -> float32 logits [b, t, vocab] (tied or separate head)."""
  return Qwen2ForCausalLM(config, runtime).apply({"params": params}, hidden, method="unembed")


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
