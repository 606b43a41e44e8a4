"""Blockwise ("flash") attention whose mask comes from per-token vectors: nothing of
shape [t, t] is ever built, forward or backward.

A pass over T positions (a causal row, or MARS's [clean | noisy] streams) describes its
mask by four int vectors per row (`TokenMask`), and query i may see key j when they are
in the same non-zero segment and

  clean -> clean   j <= i                                  (plain causal, by index)
  noisy -> noisy   block(j) == block(i), position(j) <= position(i)
                   (block(j) == block(i) alone, `causal_blocks=False`: Block Diffusion)
  noisy -> clean   block(j) < block(i)
  clean -> noisy   never

which is `mars_jax.training.masks`' two-stream rule read off each token (its segment,
stream, in-segment position and block, the row's random block offset included), so a
noisy stream that keeps only the blocks holding a target needs nothing else.

The [T, T] scores are computed in [tile, tile] tiles with an online softmax (fp32 max,
sum and accumulator, inputs in their own dtype), each tile's mask computed inside the
tile from the vectors. A tile that the mask leaves empty is skipped (`lax.cond`: no
FLOPs), judged from per-tile summaries of the vectors (the ranges of segments, indices,
positions and blocks of each stream), which hold no pair of positions. Its backward is
its own (`jax.custom_vjp`): the forward saves the output and each query's log-sum-exp,
and the backward recomputes each tile's probabilities from them, in one pass over the
key tiles of every query tile (dq) and one over the query tiles of every key tile (dk,
dv). Query and key tiles are loops (`lax.map`, `fori_loop`), so the program is the
same size whatever T is. Grouped-query attention multiplies each kv head against its
group of query heads; K and V are never repeated. A query that may see no key gets
zeros.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
TILE = 128  # positions per query and key tile
_FLOOR = -1e30  # the running max's start: far below a real score, far above a masked one
_BIG = 1 << 30  # the summaries' bound for an empty set


@flax.struct.dataclass
class TokenMask:
  """The mask of a pass, per token: int32[b, T] fields (noisy: bool[b, T]), and whether
  a noisy token sees only the earlier positions of its block (static)."""
  segment: Array   # 0: padding (sees nothing, seen by nothing)
  noisy: Array     # True: a token of the noisy (masked) stream
  position: Array  # in-segment position (block offset included): orders a block's tokens
  block: Array     # the token's block (position // B): only noisy tokens' rules read it
  causal_blocks: bool = flax.struct.field(pytree_node=False, default=True)

  def fields(self) -> tuple[Array, Array, Array, Array]:
    return self.segment, self.noisy, self.position, self.block

  def map(self, fn) -> "TokenMask":
    """The same mask with `fn` applied to every field."""
    return TokenMask(*(fn(a) for a in self.fields()), causal_blocks=self.causal_blocks)


def causal(segment: Array) -> TokenMask:
  """A plain causal pass over packed rows: segment int32[b, T] (0 = padding)."""
  zeros = jnp.zeros_like(segment)
  return TokenMask(segment, zeros.astype(bool), zeros, zeros)


def allowed(q: TokenMask, k: TokenMask, q_index: Array, k_index: Array) -> Array:
  """The rule above for queries `q` at indices q_index int32[tq] and keys `k` at
  k_index int32[tk] (each field [b, tq] / [b, tk]) -> bool[b, tq, tk]."""
  col = lambda a: a[:, :, None]
  row = lambda a: a[:, None, :]
  same = (col(q.segment) == row(k.segment)) & (col(q.segment) != 0)
  qn, kn = col(q.noisy), row(k.noisy)
  same_block = col(q.block) == row(k.block)
  in_block = same_block & (row(k.position) <= col(q.position)) if q.causal_blocks else same_block
  clean = ~qn & ~kn & (k_index[None, None, :] <= q_index[None, :, None])
  return same & (clean | qn & kn & in_block | qn & ~kn & (row(k.block) < col(q.block)))


def dense_mask(mask: TokenMask) -> Array:
  """The whole mask, bool[b, T, T]: the reference the tests compare with, and what the
  attention implementations that take a dense mask are given."""
  index = jnp.arange(mask.segment.shape[1])
  return allowed(mask, mask, index, index)


class _Summary(NamedTuple):
  """Per row and tile, int32[b, n] each: the ranges that decide whether a tile pair can
  hold an allowed pair (empty sets give lo = _BIG, hi = -_BIG)."""
  clean_seg: tuple[Array, Array]
  clean_index: tuple[Array, Array]
  clean_block: tuple[Array, Array]
  noisy_seg: tuple[Array, Array]
  noisy_pos: tuple[Array, Array]
  noisy_block: tuple[Array, Array]


def _summary(mask: TokenMask, tile: int) -> _Summary:
  b, t = mask.segment.shape
  tiles = lambda a: a.reshape(b, t // tile, tile)
  live = tiles(mask.segment != 0)
  noisy = tiles(mask.noisy)
  index = tiles(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))

  def span(values, where):
    return (jnp.min(jnp.where(where, values, _BIG), axis=-1),
            jnp.max(jnp.where(where, values, -_BIG), axis=-1))
  clean, dirty = live & ~noisy, live & noisy
  seg, pos, blk = tiles(mask.segment), tiles(mask.position), tiles(mask.block)
  return _Summary(span(seg, clean), span(index, clean), span(blk, clean),
                  span(seg, dirty), span(pos, dirty), span(blk, dirty))


def _nonempty(q: _Summary, i: Array, k: _Summary, j: Array, causal_blocks: bool) -> Array:
  """Whether query tile i and key tile j may hold an allowed pair in some row: bool[]."""
  at = lambda s, n: (s[0][:, n], s[1][:, n])
  overlap = lambda a, c: (a[0] <= c[1]) & (c[0] <= a[1])
  cq, ck = at(q.clean_seg, i), at(k.clean_seg, j)
  nq, nk = at(q.noisy_seg, i), at(k.noisy_seg, j)
  clean = overlap(cq, ck) & (at(k.clean_index, j)[0] <= at(q.clean_index, i)[1])
  noisy = overlap(nq, nk) & overlap(at(q.noisy_block, i), at(k.noisy_block, j))
  if causal_blocks:
    noisy &= at(k.noisy_pos, j)[0] <= at(q.noisy_pos, i)[1]
  cross = overlap(nq, ck) & (at(k.clean_block, j)[0] < at(q.noisy_block, i)[1])
  return jnp.any(clean | noisy | cross)


def _tile_mask(mask: TokenMask, n: Array, tile: int) -> TokenMask:
  """Tile n of every field: [b, tile] each."""
  return mask.map(lambda a: jax.lax.dynamic_slice_in_dim(a, n * tile, tile, axis=1))


def _scores(q: Array, k: Array) -> Array:
  """q [b, kvh, g, tq, d] (scaled), k [b, kvh, tk, d] -> float32 [b, kvh, g, tq, tk]."""
  return jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32)


def _bias(visible: Array) -> Array:
  """bool[b, tq, tk] -> float32[b, 1, 1, tq, tk]: 0 where visible, finfo.min where not."""
  return jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min)[:, None, None]


def _layout(q: Array, k: Array, v: Array, tile: int):
  """[b, T, h, d], [b, T, kvh, d] -> tiles: q [n, b, kvh, g, tile, d] (scaled by
  1/sqrt(d)), k and v [n, b, kvh, tile, d]."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  n = t // tile
  q = (q / jnp.sqrt(d).astype(q.dtype)).reshape(b, n, tile, kvh, h // kvh, d)
  q = q.transpose(1, 0, 3, 4, 2, 5)
  kv = lambda a: a.reshape(b, n, tile, kvh, d).transpose(1, 0, 3, 2, 4)
  return q, kv(k), kv(v)


def _forward(q, k, v, mask: TokenMask, tile: int):
  """-> (out [b, T, h, d] in v's dtype, residuals for the backward)."""
  b, t, h, d = q.shape
  # The mask's vectors tied to q: what the tiles compute from them then depends on q, so a
  # remat around the layer recomputes it in the backward instead of stacking every
  # tile's mask as a residual ([T, T] in all).
  q, fields = jax.lax.optimization_barrier((q, mask.fields()))
  mask = TokenMask(*fields, causal_blocks=mask.causal_blocks)
  qt, kt, vt = _layout(q, k, v, tile)
  summary = _summary(mask, tile)
  n, kvh, g = qt.shape[0], kt.shape[2], qt.shape[3]
  index = jnp.arange(tile, dtype=jnp.int32)

  def query_tile(i):
    qi, mi = qt[i], _tile_mask(mask, i, tile)

    def key_tile(j, carry):
      def update(carry):
        m, l, acc = carry
        visible = allowed(mi, _tile_mask(mask, j, tile), i * tile + index, j * tile + index)
        s = _scores(qi, kt[j]) + _bias(visible)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        decay = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vt.dtype), vt[j],
                        preferred_element_type=jnp.float32)
        return m_new, l * decay + jnp.sum(p, axis=-1), acc * decay[..., None] + pv
      return jax.lax.cond(_nonempty(summary, i, summary, j, mask.causal_blocks), update,
                          lambda c: c, carry)

    init = (jnp.full((b, kvh, g, tile), _FLOOR, jnp.float32),
            jnp.zeros((b, kvh, g, tile), jnp.float32),
            jnp.zeros((b, kvh, g, tile, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n, key_tile, init)
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]
    return out.astype(v.dtype), jnp.where(l > 0, m + jnp.log(l), jnp.inf)

  out, lse = jax.lax.map(query_tile, jnp.arange(n))   # [n, b, kvh, g, tile, (d)]
  merged = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, d)
  return merged, (q, k, v, mask, out, lse)


def _backward(tile: int, residuals, d_out: Array):
  q, k, v, mask, out, lse = residuals
  b, t, h, d = q.shape
  qt, kt, vt = _layout(q, k, v, tile)
  n, kvh, g = qt.shape[0], kt.shape[2], qt.shape[3]
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  summary = _summary(mask, tile)
  index = jnp.arange(tile, dtype=jnp.int32)
  do = d_out.reshape(b, n, tile, kvh, g, d).transpose(1, 0, 3, 4, 2, 5)  # as qt
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [n,b,k,g,tq]

  def probs(i, j):
    """Tile (i, j)'s probabilities and their score gradients' factor: float32
    [b, kvh, g, tile, tile] each."""
    visible = allowed(_tile_mask(mask, i, tile), _tile_mask(mask, j, tile), i * tile + index,
                      j * tile + index)
    p = jnp.exp(_scores(qt[i], kt[j]) + _bias(visible) - lse[i][..., None])
    dp = jnp.einsum("bkgqd,bksd->bkgqs", do[i], vt[j], preferred_element_type=jnp.float32)
    return p, p * (dp - delta[i][..., None])

  def dq_tile(i):
    def key_tile(j, acc):
      def update(acc):
        _, ds = probs(i, j)
        return acc + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(kt.dtype), kt[j],
                                preferred_element_type=jnp.float32)
      return jax.lax.cond(_nonempty(summary, i, summary, j, mask.causal_blocks), update,
                          lambda a: a, acc)
    return jax.lax.fori_loop(0, n, key_tile, jnp.zeros((b, kvh, g, tile, d), jnp.float32))

  def dkv_tile(j):
    def query_tile(i, acc):
      def update(acc):
        dk, dv = acc
        p, ds = probs(i, j)
        dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(do.dtype), do[i],
                             preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qt.dtype), qt[i],
                             preferred_element_type=jnp.float32)
        return dk, dv
      return jax.lax.cond(_nonempty(summary, i, summary, j, mask.causal_blocks), update,
                          lambda a: a, acc)
    zeros = jnp.zeros((b, kvh, tile, d), jnp.float32)
    return jax.lax.fori_loop(0, n, query_tile, (zeros, zeros))

  dq = jax.lax.map(dq_tile, jnp.arange(n))            # [n, b, kvh, g, tile, d]
  dk, dv = jax.lax.map(dkv_tile, jnp.arange(n))       # [n, b, kvh, tile, d]
  dq = (dq * scale).transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, d).astype(q.dtype)
  kv_back = lambda a, like: a.transpose(1, 0, 3, 2, 4).reshape(like.shape).astype(like.dtype)
  return dq, kv_back(dk, k), kv_back(dv, v), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q: Array, k: Array, v: Array, mask: TokenMask, tile: int) -> Array:
  return _forward(q, k, v, mask, tile)[0]


def _attention_fwd(q, k, v, mask, tile):
  return _forward(q, k, v, mask, tile)


_attention.defvjp(_attention_fwd, _backward)


def _pad(a: Array, length: int, value=0) -> Array:
  """a: [b, t, ...] -> [b, length, ...], `value` after t."""
  return jnp.pad(a, [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2),
                 constant_values=value)


def flash_attention(q: Array, k: Array, v: Array, mask: TokenMask, *,
                    tile: int = TILE) -> Array:
  """Grouped-query self-attention over the pass `mask` describes.

  q: [b, T, heads, d]; k, v: [b, T, kv_heads, d]; mask: a TokenMask of [b, T] fields
  -> [b, T, heads, d] in v's dtype. T is padded to whole tiles inside (padding is
  segment 0); a tile of `tile` positions, or T rounded up to 8 when that is shorter.
  """
  t = q.shape[1]
  tile = min(tile, -(-t // 8) * 8)
  length = -(-t // tile) * tile
  if length != t:
    q, k, v = (_pad(a, length) for a in (q, k, v))
    mask = mask.map(lambda a: _pad(a, length))
  return _attention(q, k, v, mask, tile)[:, :t]
