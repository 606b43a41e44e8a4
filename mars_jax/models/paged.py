"""The decoder over a page pool: one flat batch of tokens from many rows, each row's K/V
in pages of a pool that its page table names (vLLM V1's and tpu-inference's layout, in
pure JAX).

  pool:   {"k", "v"}: [layers, pages, page_size, kv_heads, head_dim]; page 0 is the
          trash page: writes that must not land anywhere go there, and nothing reads it
          unmasked.
  table:  int32[rows, max_pages]: row r's position p lives in page table[r, p // ps],
          slot p % ps.
  tokens: int32[T], the step's flat batch: each row's slots one after another, no row
          padded to another's width.

Each layer writes this step's K/V into the pool first (one scatter into the pool the
layers carry, in place), then every query attends the pool slots of its own row at
positions <= its own:

  query tiles   the flat tokens regrouped into tiles of `tq` slots, each tile one row's
                (`Tiles`: a row's span takes ceil(span / tq) tiles; the engine's tq is 1
                at W = 1 and 8 otherwise); a tile's queries share its row's page list;
  page blocks   a `fori_loop` over the row's logical pages, `block` pages at a time, up
                to the last page that any query of the step may see (a traced bound: no
                compile per context length); each block is gathered for every tile at
                once, [n_tiles, block * ps, kv_heads, head_dim], and folded into an online
                softmax.

So a step reads the pages that its rows use (up to the longest row's), never a row's
whole `--max-len`, and no array is [T, T] or [rows, max_len, ...]. The dense reference
is `mars_jax.models.cached.forward_cached` over the same positions; the decoder over the
pool is `mars_jax.models.cached.forward_paged`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mars_jax.models.config import Qwen2Config

Array = jax.Array
BLOCK_SLOTS = 128   # pool slots a block of the attention loop reads per tile (>= page_size)


@struct.dataclass
class Tiles:
  """The step's flat slots regrouped for attention (n tiles of tq slots).

  token: int32[n, tq]: the flat slot of each tile entry (>= T: padding);
  row: int32[n]: the row whose pages the tile reads (any row for a padding tile);
  at: int32[T]: each flat slot's entry in the tiles, tile * tq + offset.
  """
  token: Array
  row: Array
  at: Array


@struct.dataclass
class Paged:
  """What a layer's attention needs besides its q, k, v: the pool (all layers'), each
  row's page table, where this step's K/V go, and the query tiles.

  k, v: [layers, pages, page_size, kv_heads, head_dim]; table: int32[rows, max_pages];
  page, slot: int32[T] (page 0: not written); positions: int32[T]; tiles: `Tiles`.
  """
  k: Array
  v: Array
  table: Array
  page: Array
  slot: Array
  positions: Array
  tiles: Tiles


def init_pool(config: Qwen2Config, pages: int, page_size: int, dtype) -> dict[str, Array]:
  """A zeroed pool {"k","v"}: [layers, pages, page_size, kv_heads, head_dim]."""
  shape = (config.num_hidden_layers, pages, page_size, config.num_key_value_heads,
           config.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attend(q: Array, k: Array, v: Array, paged: Paged, layer: Array) -> tuple[Array, Paged]:
  """One layer: this step's K/V written into the pool at (page, slot), then each query's
  grouped-query attention over its row's pool slots at positions <= its own.

  q: [1, T, heads, d]; k, v: [1, T, kv_heads, d] -> ([1, T, heads, d], the updated
  `Paged`). A query that sees nothing (a padding slot) gets zeros."""
  pool_k = paged.k.at[layer, paged.page, paged.slot].set(k[0].astype(paged.k.dtype))
  pool_v = paged.v.at[layer, paged.page, paged.slot].set(v[0].astype(paged.v.dtype))
  t, h, d = q.shape[1:]
  ps, kvh = pool_k.shape[2], pool_k.shape[3]
  g = h // kvh
  tiles = paged.tiles
  n, tq = tiles.token.shape
  valid = tiles.token < t
  at = jnp.minimum(tiles.token, t - 1)
  qpos = jnp.where(valid, paged.positions[at], -1)                       # [n, tq]
  qt = (q[0][at] / jnp.sqrt(d).astype(q.dtype)).reshape(n, tq, kvh, g, d).transpose(
      0, 2, 3, 1, 4)                                                      # [n, kvh, g, tq, d]
  table = paged.table[jnp.minimum(tiles.row, paged.table.shape[0] - 1)]  # [n, max_pages]
  block = max(BLOCK_SLOTS // ps, 1)
  pages_max = table.shape[1]
  blocks = (jnp.max(qpos) // ps + block) // block                         # traced bound
  floor = jnp.float32(-1e30)

  def body(i, carry):
    m, l, acc = carry
    cols = i * block + jnp.arange(block)
    pages = jnp.take(table, jnp.minimum(cols, pages_max - 1), axis=1)      # [n, block]
    keys = pool_k[layer, pages].reshape(n, block * ps, kvh, d)
    values = pool_v[layer, pages].reshape(n, block * ps, kvh, d)
    kpos = (cols[:, None] * ps + jnp.arange(ps)[None]).reshape(-1)         # [block * ps]
    seen = (kpos[None, None] <= qpos[..., None]) & (cols < pages_max).repeat(ps)[None, None]
    s = jnp.einsum("nkgqd,nskd->nkgqs", qt, keys.astype(q.dtype),
                   preferred_element_type=jnp.float32)
    s = jnp.where(seen[:, None, None], s, jnp.finfo(jnp.float32).min)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    decay = jnp.exp(m - m_new)
    pv = jnp.einsum("nkgqs,nskd->nkgqd", p.astype(values.dtype), values.astype(q.dtype),
                    preferred_element_type=jnp.float32)
    return m_new, l * decay + jnp.sum(p, axis=-1), acc * decay[..., None] + pv

  init = (jnp.full((n, kvh, g, tq), floor), jnp.zeros((n, kvh, g, tq), jnp.float32),
          jnp.zeros((n, kvh, g, tq, d), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, blocks, body, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]                         # [n, kvh, g, tq, d]
  out = out.transpose(0, 3, 1, 2, 4).reshape(n * tq, h, d)[tiles.at]     # [T, heads, d]
  return out[None].astype(q.dtype), paged.replace(k=pool_k, v=pool_v)

