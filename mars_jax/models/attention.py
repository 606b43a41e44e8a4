"""Grouped-query attention of the decoder: `attention` (one call over whole queries and
keys, "xla" or another `impl`), `uncached_attention` (a training or scoring pass: "auto"
resolved, static spans for "xla", `span_attention`) and `cached_attention` (a decoding
step over a KV cache, read block by block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mars_jax.models import context, flash, splash

Array = jax.Array
Spans = tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]  # see `span_attention`
CACHE_CHUNK = 64  # cache slots `cached_attention` reads per block
FLASH_FROM = 4096  # positions from which "auto" runs the blockwise attention


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


def dense(mask: Array | flash.TokenMask) -> Array:
  """A pass's mask as bool[b, t, t] (a `flash.TokenMask` drawn out whole)."""
  return flash.dense_mask(mask) if isinstance(mask, flash.TokenMask) else mask


def keeps_token_mask(impl: str) -> bool:
  """Whether an uncached pass under `impl` takes its mask per token
  (`flash.TokenMask`) into every layer rather than drawn out once, bool[b, t, t]:
  "flash" and "splash", which never draw it; "auto", which runs "flash" from FLASH_FROM
  positions on, and below them splash from the vectors on TPU and "xla" elsewhere, which
  draws it inside each layer (`uncached_attention`)."""
  return impl in ("flash", "splash", "auto")


def runs_flash(impl: str, length: int) -> bool:
  """Whether an uncached pass of `length` positions under `impl` runs
  `flash.flash_attention`, on every backend: "flash", and "auto" from FLASH_FROM on."""
  return impl == "flash" or (impl == "auto" and length >= FLASH_FROM)


def uncached_attention(q: Array, k: Array, v: Array, mask: Array | flash.TokenMask,
                       impl: str, spans: Spans | None) -> Array:
  """`attention` of an uncached pass as `impl` says, span by span where "xla" has
  `spans` (`span_attention`). Given a `flash.TokenMask`: "flash" is
  `flash.flash_attention`; "splash" is `splash.token_splash_attention`; "auto" is
  "flash" from FLASH_FROM positions on (`runs_flash`) and below them
  "splash" where the computation is lowered for TPU and "xla" on every other backend
  (`jax.lax.platform_dependent`), the mask drawn out there. Given a dense mask (a pass
  that built one, e.g. decoding's prefill), "auto" is splash on TPU and "xla"
  elsewhere, and "flash" is "xla". The other impls take the mask whole (bool[b, t, t],
  or a TokenMask drawn out by `dense`). Under context parallelism (`context.size() >
  1`) a TokenMask pass is `context.attention`, whatever `impl` says."""
  if isinstance(mask, flash.TokenMask):
    if context.size() > 1:
      return context.attention(q, k, v, mask)
    if runs_flash(impl, q.shape[1]):
      return flash.flash_attention(q, k, v, mask)
    if impl == "splash":
      return splash.token_splash_attention(q, k, v, mask)
    if impl == "auto":
      return jax.lax.platform_dependent(
          q, k, v, mask, tpu=splash.token_splash_attention,
          default=lambda *a: uncached_attention(*a[:3], dense(a[3]), impl="xla",
                                                spans=spans))
  impl = "xla" if impl == "flash" else impl
  mask = dense(mask)
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
  see (`mars_jax.training.masks.causal_spans`, `two_stream_spans`). Equal to `attention` on every
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
