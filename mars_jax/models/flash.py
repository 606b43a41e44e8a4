"""Blockwise ("flash") attention whose mask comes from per-token vectors: nothing of
shape [t, t] is ever built, forward or backward.

A pass over T positions (a causal row, or MARS's [clean | noisy] streams) describes its
mask by five int vectors per row (`TokenMask`), and query i may see key j when they are
in the same non-zero segment and

  clean -> clean   index(j) <= index(i)                    (plain causal)
  noisy -> noisy   block(j) == block(i), position(j) <= position(i)
                   (block(j) == block(i) alone, `causal_blocks=False`: Block Diffusion)
  noisy -> clean   block(j) < block(i)
  clean -> noisy   never

which is `mars_jax.training.masks`' two-stream rule read off each token (its segment,
stream, in-segment position and block, the row's random block offset included), so a
noisy stream that keeps only the blocks holding a target needs nothing else.

The [T, T] scores are computed in [tile, tile] tiles with an online softmax (fp32 max,
sum and accumulator, inputs in their own dtype), each tile's mask computed inside the
tile from the vectors. Each batch row runs on its own (`lax.map`), and a tile that the
row's mask leaves empty is skipped (`lax.switch`: no FLOPs), judged from per-tile
summaries of the vectors (the ranges of segments, indices, positions and blocks of
each stream), which hold no pair of positions; a tile that the
mask allows whole (`_full`: one segment, keys all before the queries, say) is computed
with no mask at all. Every head shares the row's mask, so a tile is skipped for all of
its heads or none. Its backward is its own (`jax.custom_vjp`): the forward saves the
output and each query's log-sum-exp, and the backward recomputes each tile's
probabilities from them in one pass over the query tiles of every key tile, as
FlashAttention-2 does: five tile matmuls (the scores, dP, dV, dK, and dQ added into a
buffer of the whole dQ), against two for the forward. Query and key tiles are loops
(`lax.map`, `lax.scan`, `fori_loop`), so the program is the
same size whatever T is. Grouped-query attention multiplies each kv head against its
group of query heads; K and V are never repeated. A query that may see no key gets
zeros.

Each token carries its index in the pass, so the queries and keys need not be the whole
pass in order: `flash_attention` takes the keys' own mask (`key_mask`), and
`forward_tiles` / `backward_tiles` run queries against one block of keys at a time,
which context parallelism's ring uses to attend from one shard's queries, in a
load-balanced order, to each shard's keys in turn (`mars_jax.models.context`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array
TILE = 128  # positions per query and key tile
RESIDUALS = ("flash_out", "flash_lse")  # the backward's residuals, named for remat policies
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
  index: Array     # the token's place in the pass: orders the clean stream
  causal_blocks: bool = flax.struct.field(pytree_node=False, default=True)

  def fields(self) -> tuple[Array, Array, Array, Array, Array]:
    return self.segment, self.noisy, self.position, self.block, self.index

  def map(self, fn) -> "TokenMask":
    """The same mask with `fn` applied to every field."""
    return TokenMask(*(fn(a) for a in self.fields()), causal_blocks=self.causal_blocks)


def pass_index(segment: Array) -> Array:
  """int32[b, T]: each token's place in a pass laid out in order, 0 .. T-1."""
  return jnp.broadcast_to(jnp.arange(segment.shape[1], dtype=jnp.int32), segment.shape)


def causal(segment: Array) -> TokenMask:
  """A plain causal pass over packed rows: segment int32[b, T] (0 = padding)."""
  zeros = jnp.zeros_like(segment)
  return TokenMask(segment, zeros.astype(bool), zeros, zeros, pass_index(segment))


def allowed(q: TokenMask, k: TokenMask) -> Array:
  """The rule above for queries `q` and keys `k` (fields [b, tq] / [b, tk])
  -> bool[b, tq, tk]."""
  col = lambda a: a[:, :, None]
  row = lambda a: a[:, None, :]
  same = (col(q.segment) == row(k.segment)) & (col(q.segment) != 0)
  qn, kn = col(q.noisy), row(k.noisy)
  same_block = col(q.block) == row(k.block)
  in_block = same_block & (row(k.position) <= col(q.position)) if q.causal_blocks else same_block
  clean = ~qn & ~kn & (row(k.index) <= col(q.index))
  return same & (clean | qn & kn & in_block | qn & ~kn & (row(k.block) < col(q.block)))


def dense_mask(mask: TokenMask) -> Array:
  """The whole mask, bool[b, T, T]: the reference the tests compare with, and what the
  attention implementations that take a dense mask are given."""
  return allowed(mask, mask)


class _Summary(NamedTuple):
  """Per row and tile, int32[b, n] each: the ranges that decide whether a tile pair can
  hold an allowed pair (empty sets give lo = _BIG, hi = -_BIG)."""
  clean_seg: tuple[Array, Array]
  clean_index: tuple[Array, Array]
  clean_block: tuple[Array, Array]
  noisy_seg: tuple[Array, Array]
  noisy_pos: tuple[Array, Array]
  noisy_block: tuple[Array, Array]
  all_clean: Array   # bool[b, n]: every token of the tile is a live clean one
  all_noisy: Array   # bool[b, n]: every token of the tile is a live noisy one


def _summary(mask: TokenMask, tile: int) -> _Summary:
  b, t = mask.segment.shape
  tiles = lambda a: a.reshape(b, t // tile, tile)
  live = tiles(mask.segment != 0)
  noisy = tiles(mask.noisy)
  index = tiles(mask.index)

  def span(values, where):
    return (jnp.min(jnp.where(where, values, _BIG), axis=-1),
            jnp.max(jnp.where(where, values, -_BIG), axis=-1))
  clean, dirty = live & ~noisy, live & noisy
  seg, pos, blk = tiles(mask.segment), tiles(mask.position), tiles(mask.block)
  return _Summary(span(seg, clean), span(index, clean), span(blk, clean),
                  span(seg, dirty), span(pos, dirty), span(blk, dirty),
                  jnp.all(clean, axis=-1), jnp.all(dirty, axis=-1))


def _nonempty(q: _Summary, i: Array, k: _Summary, j: Array, causal_blocks: bool) -> Array:
  """Whether query tile i and key tile j may hold an allowed pair, per row: bool[b]."""
  at = lambda s, n: (s[0][:, n], s[1][:, n])
  overlap = lambda a, c: (a[0] <= c[1]) & (c[0] <= a[1])
  cq, ck = at(q.clean_seg, i), at(k.clean_seg, j)
  nq, nk = at(q.noisy_seg, i), at(k.noisy_seg, j)
  clean = overlap(cq, ck) & (at(k.clean_index, j)[0] <= at(q.clean_index, i)[1])
  noisy = overlap(nq, nk) & overlap(at(q.noisy_block, i), at(k.noisy_block, j))
  if causal_blocks:
    noisy &= at(k.noisy_pos, j)[0] <= at(q.noisy_pos, i)[1]
  cross = overlap(nq, ck) & (at(k.clean_block, j)[0] < at(q.noisy_block, i)[1])
  return clean | noisy | cross


def _full(q: _Summary, i: Array, k: _Summary, j: Array, causal_blocks: bool) -> Array:
  """Whether the mask allows every pair of query tile i and key tile j (then the tile
  needs no mask), per row: both tiles one segment, and clean keys at or before every
  clean query, clean keys of earlier blocks than every noisy query, or noisy keys of
  the noisy queries' one block (at or before each, `causal_blocks`): bool[b]."""
  at = lambda s, n: (s[0][:, n], s[1][:, n])
  one = lambda a, c: (a[0] == a[1]) & (a[0] == c[0]) & (c[0] == c[1])
  qc, kc, qn, kn = q.all_clean[:, i], k.all_clean[:, j], q.all_noisy[:, i], k.all_noisy[:, j]
  clean = (qc & kc & one(at(q.clean_seg, i), at(k.clean_seg, j))
           & (at(k.clean_index, j)[1] <= at(q.clean_index, i)[0]))
  cross = (qn & kc & one(at(q.noisy_seg, i), at(k.clean_seg, j))
           & (at(k.clean_block, j)[1] < at(q.noisy_block, i)[0]))
  noisy = (qn & kn & one(at(q.noisy_seg, i), at(k.noisy_seg, j))
           & one(at(q.noisy_block, i), at(k.noisy_block, j)))
  if causal_blocks:
    noisy &= at(k.noisy_pos, j)[1] <= at(q.noisy_pos, i)[0]
  return clean | cross | noisy


def _row_kinds(q: _Summary, i: Array, k: _Summary, j: Array, causal_blocks: bool) -> Array:
  """int32[b]: per row, 0 where tile (i, j) holds no allowed pair (`_nonempty`), 2 where
  the mask allows all of it (`_full`), 1 elsewhere."""
  return jnp.where(_nonempty(q, i, k, j, causal_blocks),
                   jnp.where(_full(q, i, k, j, causal_blocks), 2, 1), 0)


def _kind(q: _Summary, i: Array, k: _Summary, j: Array, causal_blocks: bool) -> Array:
  """int32[]: 0 skip tile (i, j) (empty in every row), 2 compute it with no mask (full in
  every row), 1 compute it masked. The tiles run one row at a time (`forward_tiles`),
  so "every row" is that row alone."""
  rows = _row_kinds(q, i, k, j, causal_blocks)
  return jnp.where(jnp.all(rows == 2), 2, jnp.where(jnp.any(rows > 0), 1, 0))


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
  """[b, tq, h, d], [b, tk, kvh, d] -> tiles: q [nq, b, kvh, g, tile, d] (scaled by
  1/sqrt(d)), k and v [nk, b, kvh, tile, d]."""
  b, tq, h, d = q.shape
  kvh = k.shape[2]
  q = (q / jnp.sqrt(d).astype(q.dtype)).reshape(b, tq // tile, tile, kvh, h // kvh, d)
  q = q.transpose(1, 0, 3, 4, 2, 5)
  kv = lambda a: a.reshape(b, a.shape[1] // tile, tile, kvh, d).transpose(1, 0, 3, 2, 4)
  return q, kv(k), kv(v)


def _rows(fn, *args):
  """fn over the batch rows of args (arrays and TokenMasks, rows first) one row at a
  time (`lax.map`: each row's tiles are skipped by its own mask; rows vmapped would turn
  the tiles' `lax.switch` into a select that runs every branch). fn gets arrays of one
  row ([1, ...]); its results are stacked on a new first axis."""
  one = lambda a: a[:, None]
  return jax.lax.map(lambda row: fn(*row), tuple(
      x.map(one) if isinstance(x, TokenMask) else one(x) for x in args))


def forward_tiles(q: Array, k: Array, v: Array, q_mask: TokenMask, k_mask: TokenMask,
                  tile: int) -> tuple[Array, Array]:
  """The blockwise forward over whole tiles (tq, tk multiples of `tile`), each batch row
  on its own, so a tile pair runs only where that row's mask needs it.

  q: [b, tq, h, d]; k, v: [b, tk, kv_heads, d]; masks [b, tq] / [b, tk] fields ->
  (out float32 [nq, b, kv_heads, group, tile, d], each query's log-sum-exp float32
  [nq, b, kv_heads, group, tile], +inf where a query sees no key: its probabilities
  exp(s - lse) are then 0). `mars_jax.models.context`'s ring adds up such partial
  results over blocks of keys (`merge_partials`)."""
  if q.shape[0] == 1:
    return _forward_row(q, k, v, q_mask, k_mask, tile)
  out, lse = _rows(lambda *a: _forward_row(*a, tile), q, k, v, q_mask, k_mask)
  return out[:, :, 0].swapaxes(0, 1), lse[:, :, 0].swapaxes(0, 1)   # [b, nq, ...] -> [nq, b, ...]


def _forward_row(q, k, v, q_mask: TokenMask, k_mask: TokenMask, tile: int):
  """`forward_tiles` of one row (b = 1)."""
  b, d = q.shape[0], q.shape[3]
  # The masks' vectors tied to q: what the tiles compute from them then depends on q, so
  # a remat around the layer recomputes it in the backward instead of stacking every
  # tile's mask as a residual ([T, T] in all).
  q, q_fields, k_fields = jax.lax.optimization_barrier((q, q_mask.fields(), k_mask.fields()))
  q_mask = TokenMask(*q_fields, causal_blocks=q_mask.causal_blocks)
  k_mask = TokenMask(*k_fields, causal_blocks=q_mask.causal_blocks)
  qt, kt, vt = _layout(q, k, v, tile)
  q_sum, k_sum = _summary(q_mask, tile), _summary(k_mask, tile)
  nk, kvh, g = kt.shape[0], kt.shape[2], qt.shape[3]

  def query_tile(i):
    qi, mi = qt[i], _tile_mask(q_mask, i, tile)

    def key_tile(j, carry):
      def update(carry, masked):
        m, l, acc = carry
        s = _scores(qi, kt[j])
        if masked:
          s = s + _bias(allowed(mi, _tile_mask(k_mask, j, tile)))
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        decay = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vt.dtype), vt[j],
                        preferred_element_type=jnp.float32)
        return m_new, l * decay + jnp.sum(p, axis=-1), acc * decay[..., None] + pv
      return jax.lax.switch(_kind(q_sum, i, k_sum, j, q_mask.causal_blocks),
                            [lambda c: c, lambda c: update(c, True),
                             lambda c: update(c, False)], carry)

    init = (jnp.full((b, kvh, g, tile), _FLOOR, jnp.float32),
            jnp.zeros((b, kvh, g, tile), jnp.float32),
            jnp.zeros((b, kvh, g, tile, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, nk, key_tile, init)
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]
    return out, jnp.where(l > 0, m + jnp.log(l), jnp.inf)

  # Under a layer's remat the policy reads this forward: nothing of a tile (its scores,
  # a `dots` policy's pick) is kept, and the residuals are named (`RESIDUALS`).
  query_tile = jax.checkpoint(query_tile, policy=jax.checkpoint_policies.nothing_saveable)
  return jax.lax.map(query_tile, jnp.arange(qt.shape[0]))


def merge_partials(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
  """Two `forward_tiles` results of the same queries over disjoint sets of keys (out
  float32 [nq, b, kv_heads, group, tile, d], lse [nq, b, kv_heads, group, tile] each)
  -> the result over both, out weighted by each part's share of the softmax's sum. A
  forward-only helper (inside a custom VJP): its gradient at two empty parts is NaN."""
  (out_a, lse_a), (out_b, lse_b) = a, b
  none = lambda lse: jnp.where(jnp.isposinf(lse), -jnp.inf, lse)   # empty: weight 0
  lse_a, lse_b = none(lse_a), none(lse_b)
  lse = jnp.logaddexp(lse_a, lse_b)
  anchor = jnp.where(jnp.isneginf(lse), 0.0, lse)
  weight = lambda part: jnp.exp(part - anchor)[..., None]
  return out_a * weight(lse_a) + out_b * weight(lse_b), jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def untile(out: Array, dtype) -> Array:
  """`forward_tiles`' out [nq, b, kv_heads, group, tile, d] -> [b, nq * tile, heads, d]
  in `dtype`."""
  nq, b, kvh, g, tile, d = out.shape
  return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * tile, kvh * g, d).astype(dtype)


def _forward(q, k, v, q_mask: TokenMask, k_mask: TokenMask, tile: int):
  """-> (out [b, tq, h, d] in v's dtype, residuals for the backward)."""
  out, lse = forward_tiles(q, k, v, q_mask, k_mask, tile)
  out = checkpoint_name(untile(out, v.dtype), RESIDUALS[0])
  return out, (q, k, v, q_mask, k_mask, out, checkpoint_name(lse, RESIDUALS[1]))


def backward_tiles(q: Array, k: Array, v: Array, q_mask: TokenMask, k_mask: TokenMask,
                   out: Array, lse: Array, d_out: Array, tile: int
                   ) -> tuple[Array, Array, Array]:
  """The blockwise backward over whole tiles: the gradients through these keys, given
  the output `out` [b, tq, h, d] and log-sum-exp `lse` ([nq, b, kv_heads, group, tile])
  of the attention over all keys, of which k, v ([b, tk, kv_heads, d]) may be a part
  (the softmax's gradient splits over blocks of keys once lse and out are the whole's)
  -> (dq float32 [b, tq, h, d], dk, dv float32 [b, tk, kv_heads, d]). Each batch row on
  its own, as in `forward_tiles`."""
  if q.shape[0] == 1:
    return _backward_row(q, k, v, q_mask, k_mask, out, lse, d_out, tile)
  row = lambda q, k, v, qm, km, out, lse, do: _backward_row(
      q, k, v, qm, km, out, lse.swapaxes(0, 1), do, tile)   # lse [1, nq, ...] -> [nq, 1, ...]
  grads = _rows(row, q, k, v, q_mask, k_mask, out, lse.swapaxes(0, 1), d_out)
  return tuple(g[:, 0] for g in grads)


def _backward_row(q, k, v, q_mask: TokenMask, k_mask: TokenMask, out, lse, d_out,
                  tile: int):
  """`backward_tiles` of one row (b = 1)."""
  b, d = q.shape[0], q.shape[3]
  qt, kt, vt = _layout(q, k, v, tile)
  nq, nk, kvh, g = qt.shape[0], kt.shape[0], kt.shape[2], qt.shape[3]
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  q_sum, k_sum = _summary(q_mask, tile), _summary(k_mask, tile)
  kind = lambda i, j: _kind(q_sum, i, k_sum, j, q_mask.causal_blocks)
  as_qt = lambda a: a.reshape(b, nq, tile, kvh, g, d).transpose(1, 0, 3, 4, 2, 5)
  do = as_qt(d_out)
  delta = jnp.sum(do.astype(jnp.float32) * as_qt(out).astype(jnp.float32), axis=-1)  # [n,b,k,g,tq]

  def probs(i, j, masked):
    """Tile (i, j)'s probabilities and their score gradients' factor: float32
    [b, kvh, g, tile, tile] each."""
    s = _scores(qt[i], kt[j])
    if masked:
      s = s + _bias(allowed(_tile_mask(q_mask, i, tile), _tile_mask(k_mask, j, tile)))
    p = jnp.exp(s - lse[i][..., None])
    dp = jnp.einsum("bkgqd,bksd->bkgqs", do[i], vt[j], preferred_element_type=jnp.float32)
    return p, p * (dp - delta[i][..., None])

  def key_tile(dq, j):
    """One pass over the query tiles of key tile j: its dK and dV, and each query
    tile's share of dQ added into dq [nq, b, kvh, g, tile, d] (five tile matmuls: S,
    dP, dV, dK, dQ)."""
    def query_tile(i, carry):
      def update(carry, masked):
        dq_i, dk, dv = carry
        p, ds = probs(i, j, masked)
        dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(do.dtype), do[i],
                             preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qt.dtype), qt[i],
                             preferred_element_type=jnp.float32)
        dq_i = dq_i + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(kt.dtype), kt[j],
                                 preferred_element_type=jnp.float32)
        return dq_i, dk, dv
      # Only tile i's dQ goes through the branches: a whole-dQ operand would be copied
      # into each of them (XLA's copy insertion), every tile pair.
      dq, dk, dv = carry
      dq_i, dk, dv = jax.lax.switch(kind(i, j), [lambda c: c, lambda c: update(c, True),
                                                 lambda c: update(c, False)], (dq[i], dk, dv))
      return dq.at[i].set(dq_i), dk, dv
    zeros = jnp.zeros((b, kvh, tile, d), jnp.float32)
    dq, dk, dv = jax.lax.fori_loop(0, nq, query_tile, (dq, zeros, zeros))
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_tile, jnp.zeros((nq, b, kvh, g, tile, d), jnp.float32),
                              jnp.arange(nk))          # dq as qt; dk, dv [nk, b, kvh, tile, d]
  kv_back = lambda a: a.transpose(1, 0, 3, 2, 4).reshape(k.shape)
  return untile(dq * scale, jnp.float32), kv_back(dk), kv_back(dv)


def _backward(tile: int, residuals, d_out: Array):
  q, k, v = residuals[:3]
  dq, dk, dv = backward_tiles(*residuals, d_out, tile)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q: Array, k: Array, v: Array, q_mask: TokenMask, k_mask: TokenMask,
               tile: int) -> Array:
  return _forward(q, k, v, q_mask, k_mask, tile)[0]


def _attention_fwd(q, k, v, q_mask, k_mask, tile):
  return _forward(q, k, v, q_mask, k_mask, tile)


_attention.defvjp(_attention_fwd, _backward)


def tile_size(tq: int, tk: int, tile: int = TILE) -> int:
  """The tile of a pass of tq queries and tk keys: `tile`, or the longer of the two
  rounded up to 8 when that is shorter."""
  return min(tile, -(-max(tq, tk) // 8) * 8)


def pad(a: Array, length: int, value=0) -> Array:
  """a: [b, t, ...] -> [b, length, ...], `value` after t."""
  return jnp.pad(a, [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2),
                 constant_values=value)


def flash_attention(q: Array, k: Array, v: Array, mask: TokenMask, *,
                    key_mask: TokenMask | None = None, tile: int = TILE) -> Array:
  """Grouped-query attention over the pass `mask` describes.

  q: [b, tq, heads, d]; k, v: [b, tk, kv_heads, d]; mask: a TokenMask of the queries
  ([b, tq] fields); key_mask: the keys' ([b, tk] fields), default `mask` (self-attention
  over one pass, tq = tk) -> [b, tq, heads, d] in v's dtype. Queries and keys are padded
  to whole tiles inside (padding is segment 0); a tile of `tile` positions, or the longer
  of tq and tk rounded up to 8 when that is shorter.
  """
  key_mask = mask if key_mask is None else key_mask
  tq, tk = q.shape[1], k.shape[1]
  tile = tile_size(tq, tk, tile)
  whole = lambda t: -(-t // tile) * tile
  if whole(tq) != tq:
    q, mask = pad(q, whole(tq)), mask.map(lambda a: pad(a, whole(tq)))
  if whole(tk) != tk:
    k, v = pad(k, whole(tk)), pad(v, whole(tk))
    key_mask = key_mask.map(lambda a: pad(a, whole(tk)))
  return _attention(q, k, v, mask, key_mask, tile)[:, :tq]


def tile_kinds(mask: TokenMask, key_mask: TokenMask | None = None, *,
               tile: int = TILE) -> Array:
  """Each row's tile pairs as the blockwise attention treats them: int32[b, nq, nk], 0
  where query tile i and key tile j hold no allowed pair (skipped), 2 where the mask
  allows every pair (computed with no mask), 1 elsewhere (computed masked). Fields are
  padded to whole tiles (segment 0); nq, nk: the tiles of the queries and the keys.
  From the per-tile summaries alone: nothing [t, t] is built. Splash's block table
  (`mars_jax.models.splash`) reads its own tiles the same way."""
  key_mask = mask if key_mask is None else key_mask
  whole = lambda m: m.map(lambda a: pad(a, -(-a.shape[1] // tile) * tile))
  q_sum, k_sum = _summary(whole(mask), tile), _summary(whole(key_mask), tile)
  nq, nk = q_sum.clean_seg[0].shape[1], k_sum.clean_seg[0].shape[1]
  pair = lambda i, j: _row_kinds(q_sum, i, k_sum, j, mask.causal_blocks)
  kinds = jax.vmap(jax.vmap(pair, (None, 0)), (0, None))(jnp.arange(nq), jnp.arange(nk))
  return kinds.transpose(2, 0, 1).astype(jnp.int32)   # [nq, nk, b] -> [b, nq, nk]


def tile_pairs(mask: TokenMask, key_mask: TokenMask | None = None, *,
               tile: int = TILE) -> Array:
  """How many [tile, tile] tiles of scores `flash_attention` computes for these queries
  and keys (every tile pair of every row, less those it skips): int32[]. Its attention
  FLOPs are 4 * tile^2 * head_dim * heads per tile pair forward, twice that backward."""
  return jnp.sum(tile_kinds(mask, key_mask, tile=tile) > 0, dtype=jnp.int32)


def allowed_pairs(mask: TokenMask, key_mask: TokenMask | None = None, *,
                  tile: int = TILE) -> int:
  """How many (query, key) pairs the mask allows, over all rows (counted a query tile
  at a time, nothing [T, T] held; added up in int64 on the host: a 128k-token MARS row
  allows more than 2^31)."""
  key_mask = mask if key_mask is None else key_mask
  length = -(-mask.segment.shape[1] // tile) * tile
  padded = mask.map(lambda a: pad(a, length))
  count = lambda i: jnp.sum(allowed(_tile_mask(padded, i, tile), key_mask), dtype=jnp.int32)
  return int(np.sum(np.asarray(jax.lax.map(count, jnp.arange(length // tile))), dtype=np.int64))
