"""Splash attention: JAX's Pallas TPU kernel (`jax.experimental.pallas.ops.tpu.
splash_attention`) behind the contract of `attention.attention`, and from a pass's mask
per token (`token_splash_attention`, a `flash.TokenMask`) with no [t, t] mask built.

The kernel tiles the [t, s] score matrix into [block_q, block_kv] blocks and reads a
block-sparse mask: each block is empty (skipped: no K/V fetched, no FLOPs), full (no
mask applied) or partial (its [block_q, block_kv] slice of the mask applied). A
two-stream pass over [clean (L = 512) | noisy target stream (n = 256)], one segment,
causal blocks, drawn in 128-wide tiles (rows are query tiles; "." empty, "#" full, "+"
partial):

              clean keys      noisy keys
    clean     + . . .         . .            causal: upper triangle skipped
              # + . .         . .
              # # + .         . .
              # # # +         . .
    noisy     # # + .         + .            the clean keys of earlier blocks and the
              # # # +         . +            noisy slots of the own block: the rest
                                             skipped (targets at positions 259..510)

Two ways in:
- `splash_attention` takes a boolean mask bool[b, t, s] (e.g. decoding's prefill), from
  which the kernel derives that block table at run time (`make_splash_mha` on a
  `jax.Array` mask, which keeps every block of the mask as a partial block: [t, s]).
- `token_splash_attention` takes the per-token vectors of a training or scoring pass.
  Its block table is read off the vectors' per-tile summaries (`flash.tile_kinds`), and
  only the partial blocks are drawn, each from its tiles' vectors, into a table with
  a slot for every block up to 4096 positions (as many entries as the padded [t, t]
  mask, though no such mask is built) and PARTIAL_PER_TILE slots a query tile beyond,
  linear in t (`partial_capacity` says what a slot costs). A batch with a row of more
  partial blocks runs `flash.flash_attention` instead (`lax.cond`), which needs no
  table at all.

Batch rows have masks of their own, so the kernel runs once per row (`vmap`, which
Pallas lowers to a loop over the rows). t and s are padded to whole tiles inside; a
query that may see no key is given key 0, so the kernel's softmax never divides by
zero: from a dense mask its output is key 0's value, finite and counted nowhere (as in
"xla"); from per-token vectors it is then set to zeros, as `flash` gives.

The kernel is Mosaic TPU code: the backend that the computation is lowered for picks
the real kernel (TPU) or Pallas' interpreter (anything else, e.g. CPU tests),
through `jax.lax.platform_dependent`. Under a mesh bound by
`sharding.activation_sharding`, the call is a `shard_map` with the batch split as
`activation_batch` (data, fsdp) and the heads as `activation_heads` (tensor), the
layout `layers.constrain` pins around it; kv heads that the tensor axis does not
divide are repeated to one per query head first.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

from mars_jax.models import flash
from mars_jax.models.layers import fit_spec

Array = jax.Array
MAX_BLOCK = 512  # tile of the q and kv axes on long sequences
LANES = 128  # the kernel's tiles are multiples of the TPU lane width
WHOLE_TABLE_TILES = 8  # up to this many tiles a side, room for every block to be partial
PARTIAL_PER_TILE = 4  # beyond it, partial blocks drawn per query tile

Q_AXES = ("activation_batch", "activation_heads", None, None)
KV_AXES = ("activation_batch", "activation_kv_heads", None, None)


def block_size(length: int) -> int:
  """Tile of an axis of `length` positions: MAX_BLOCK, or the length rounded up to
  LANES when that is shorter."""
  return min(MAX_BLOCK, -(-length // LANES) * LANES)


def _pad_to(x: Array, axis: int, length: int) -> Array:
  return jnp.pad(x, [(0, length - x.shape[axis]) if a == axis else (0, 0)
                     for a in range(x.ndim)])


def kernel_mask(mask: Array, q_len: int, kv_len: int) -> Array:
  """bool[b, t, s] -> bool[b, q_len, kv_len]: padded with False, and every row that
  sees no key given key 0.

    mask      padded, q_len = kv_len = 4
    1 . .     1 . . .
    . . .     1 . . .     <- a query that sees nothing (e.g. padding) sees key 0
    1 1 .     1 1 . .
              1 . . .     <- a padding query
  """
  mask = _pad_to(_pad_to(mask, 1, q_len), 2, kv_len)
  blind = ~jnp.any(mask, axis=-1)
  return mask.at[:, :, 0].set(mask[:, :, 0] | blind)


def _block_sizes(block_q: int, block_kv: int) -> sk.BlockSizes:
  return sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dkv=block_q,
                       block_kv_dkv=block_kv, block_q_dq=block_q, block_kv_dq=block_kv)


def _row_attention(q: Array, k: Array, v: Array, mask: Array, *, block_q: int,
                   block_kv: int, interpret: bool) -> Array:
  """One batch row. q: [heads, tq, d]; k, v: [kv_heads, ts, d]; mask: bool[tq, ts]
  (tq, ts whole tiles) -> [heads, tq, d]."""
  kernel = sk.make_splash_mha(mask[None], block_sizes=_block_sizes(block_q, block_kv),
                              head_shards=1, q_seq_shards=1, interpret=interpret)
  return _with_static_flag(kernel)(q, k, v)


def _with_static_flag(kernel: sk.SplashAttentionKernel) -> sk.SplashAttentionKernel:
  """The kernel with `MaskInfo.is_dynamic_mask` a Python bool again: `make_splash_mha`
  turns it into an array, a tracer under `jit`, which the kernel's `__call__` cannot
  branch on."""
  flag = lambda info: info and info._replace(is_dynamic_mask=True)
  return sk.SplashAttentionKernel(flag(kernel.fwd_mask_info), flag(kernel.dq_mask_info),
                                  flag(kernel.dkv_mask_info), **kernel.kwargs)


def _rows_on_backend(row, *args: Array, **static) -> Array:
  """`row` (one batch row, `interpret` a keyword) over the rows of args ([b, ...] each,
  `vmap`): the TPU kernel where lowered for TPU, interpreted elsewhere."""
  rows = lambda interpret: jax.vmap(functools.partial(row, interpret=interpret, **static))
  return jax.lax.platform_dependent(*args, tpu=rows(False), default=rows(True))


def _sharded(fn, q: Array, k: Array, v: Array, *masks: Array) -> Array:
  """fn over the shards of the mesh bound by `sharding.activation_sharding` (batch and
  heads split as their logical axes say), or over the whole arrays without one.
  q: [b, heads, tq, d]; k, v: [b, kv_heads, ts, d]; masks: [b, ...] each (split by
  batch only)."""
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty or mesh.size == 1:
    return fn(q, k, v, *masks)
  spec = lambda x, axes: fit_spec(nn.logical_to_mesh_axes(axes, rules), x.shape, mesh)
  q_spec, kv_spec = spec(q, Q_AXES), spec(k, KV_AXES)
  if kv_spec[1] != q_spec[1]:  # kv heads not split like the query heads: one per head
    k, v = (jnp.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    kv_spec = q_spec
  in_specs = (q_spec, kv_spec, kv_spec,
              *(spec(m, ("activation_batch",) + (None,) * (m.ndim - 1)) for m in masks))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=q_spec,
                       check_vma=False)(q, k, v, *masks)


def _through_kernel(row, q: Array, k: Array, v: Array, *masks: Array, q_len: int,
                    kv_len: int, **static) -> Array:
  """q: [b, t, heads, d]; k, v: [b, s, kv_heads, d] -> [b, t, heads, d]: the queries
  scaled by 1 / sqrt(d) (as "xla" scales them), q, k and v laid out head-major and
  padded to q_len / kv_len, `row` run over the batch rows with `masks` ([b, ...] each,
  already padded) on every shard (`_sharded`, `_rows_on_backend`)."""
  t, d = q.shape[1], q.shape[3]
  head_major = lambda x, length: _pad_to(x, 1, length).transpose(0, 2, 1, 3)
  local = lambda *a: _rows_on_backend(row, *a, **static)
  out = _sharded(local, head_major(q / jnp.sqrt(d).astype(q.dtype), q_len),
                 head_major(k, kv_len), head_major(v, kv_len), *masks)
  return out[:, :, :t].transpose(0, 2, 1, 3)


def splash_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
  """Grouped-query attention through the splash kernel (the contract of
  `attention.attention`).

  q: [b, t, heads, d]; k, v: [b, s, kv_heads, d]; mask: bool[b, t, s] (True = may
  attend) -> [b, t, heads, d]. Queries are scaled by 1 / sqrt(d) before the kernel, as
  "xla" scales them. A query whose mask row is all False gets a finite output (key
  0's value), never NaN.
  """
  t, s = q.shape[1], k.shape[1]
  block_q, block_kv = block_size(t), block_size(s)
  q_len, kv_len = -(-t // block_q) * block_q, -(-s // block_kv) * block_kv
  return _through_kernel(_row_attention, q, k, v, kernel_mask(mask, q_len, kv_len),
                         q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv)


def partial_capacity(tiles: int) -> int:
  """How many partial blocks a row's table holds, drawn from per-token vectors, for a
  pass of `tiles` tiles a side: every block up to WHOLE_TABLE_TILES tiles (4096
  positions in 512-wide blocks), so that no row can overflow; then PARTIAL_PER_TILE per
  query tile, linear in the pass. A MARS pass over packed chats needs about 3 per tile.

  What a slot costs: the kernel takes the blocks as bool, which Pallas hands to the TPU
  as int32, and keeps two copies (forward, and transposed for dK/dV): 2 x 4 x block^2
  bytes, 2 MiB at block 512. Up to 8 tiles that is 2 x 4 x T^2 bytes a row (128 MiB at
  4096 positions; the dense path, which also draws the mask, needs more), beyond it
  2 x 4 x 4 x T x block bytes.

  Below WHOLE_TABLE_TILES a capacity with a fallback costs more than it saves: the
  fallback's `lax.cond` keeps both branches' residuals, or recomputes the forward.
  Planned for v5p-8 (Qwen2.5-0.5B, MARS, 3000 positions, remat "none"), the train
  step's temporaries were 79.5 GiB with room for every block and 81.8 GiB with 4 per
  tile and the fallback (84.9 GiB without recomputing)."""
  if tiles <= WHOLE_TABLE_TILES:
    return tiles * tiles
  return min(tiles * tiles, PARTIAL_PER_TILE * tiles)


def block_kinds(mask: flash.TokenMask, block: int) -> Array:
  """The kernel's block table of each row: int32[b, n, n] (fields [b, t], padded here to
  n = ceil(t / block) whole blocks with segment 0), 0 empty, 1 partial, 2 full
  (`flash.tile_kinds`), with block (i, 0) partial where query tile i holds a query that
  sees no key (padding: it is given key 0, `kernel_mask`)."""
  kinds = flash.tile_kinds(mask, tile=block)
  b, n = kinds.shape[:2]
  blind = jnp.any((flash.pad(mask.segment, n * block) == 0).reshape(b, n, block), axis=-1)
  return kinds.at[:, :, 0].set(jnp.where(blind, jnp.maximum(kinds[:, :, 0], 1),
                                         kinds[:, :, 0]))


def _partial_blocks(kinds: Array, fields: tuple[Array, ...], *, block: int, capacity: int,
                    causal_blocks: bool) -> tuple[Array, Array]:
  """One row's partial blocks, drawn from its tiles' vectors. kinds: int32[n, n];
  fields: the TokenMask's vectors, [n * block] each -> (mask_next int32[n, n]: each
  partial block's slot, 0 elsewhere; blocks bool[capacity, block, block]: the mask of
  each slot, queries by keys; slots past the row's partial blocks are block (0, 0)'s,
  never read)."""
  n = kinds.shape[0]
  partial = (kinds == 1).reshape(-1)
  mask_next = jnp.where(partial, jnp.cumsum(partial, dtype=jnp.int32) - 1, 0).reshape(n, n)
  at = jnp.nonzero(partial, size=capacity, fill_value=0)[0]
  qi, kj = at // n, at % n
  tiles = lambda where: flash.TokenMask(*(a.reshape(n, block)[where] for a in fields),
                                        causal_blocks=causal_blocks)
  queries = tiles(qi)
  key_zero = kj[:, None] * block + jnp.arange(block) == 0
  blind = (queries.segment == 0)[:, :, None] & key_zero[:, None, :]
  return mask_next, flash.allowed(queries, tiles(kj)) | blind


def _token_row(q: Array, k: Array, v: Array, kinds: Array, *fields: Array, block: int,
               capacity: int, causal_blocks: bool, interpret: bool) -> Array:
  """One batch row from its per-token vectors. q: [heads, tq, d] (scaled); k, v:
  [kv_heads, tq, d]; kinds: int32[n, n] (`block_kinds`); fields: [tq] each (tq = n *
  block) -> [heads, tq, d].

  The three tables the kernel reads (forward, dQ and dK/dV), as `make_splash_mha` lays
  out those of a dynamic mask (one head's, [1, n, n]): the block kinds, the next block
  to fetch (its key tile forward and for dQ, its query tile for dK/dV), the partial
  block's slot, and the partial blocks (transposed for dK/dV), int32 where
  `make_splash_mha` would shrink the small tables to int8 or int16 (3 x 4 x n^2 bytes
  of the TPU's scalar memory a call). The kernel's options (`template.kwargs`) come
  from a kernel that `make_splash_mha` makes for one full block."""
  mask_next, blocks = _partial_blocks(kinds, fields, block=block, capacity=capacity,
                                      causal_blocks=causal_blocks)
  template = sk.make_splash_mha(np.ones((1, block, block), bool),
                                block_sizes=_block_sizes(block, block), head_shards=1,
                                q_seq_shards=1, interpret=interpret)
  tile = jnp.arange(kinds.shape[0], dtype=jnp.int32)
  info = lambda like, data_next, partial_blocks: like._replace(
      data_next=jnp.where(kinds == 0, 0, data_next)[None], mask_next=mask_next[None],
      block_mask=kinds[None], partial_mask_blocks=partial_blocks, q_sequence=None,
      is_dynamic_mask=True)
  kernel = sk.SplashAttentionKernel(
      info(template.fwd_mask_info, tile[None, :], blocks),
      info(template.dq_mask_info, tile[None, :], blocks),
      info(template.dkv_mask_info, tile[:, None], blocks.swapaxes(-1, -2)),
      **template.kwargs)
  return kernel(q, k, v)


def token_splash_attention(q: Array, k: Array, v: Array, mask: flash.TokenMask) -> Array:
  """Grouped-query attention over the pass that `mask` describes, through the splash
  kernel, its block table read off the per-token vectors and only its partial blocks
  drawn from them (no [t, t] mask is built; up to 4096 positions the table has a slot
  for every block, `partial_capacity`); a batch with a row of more partial blocks than
  the table holds runs `flash.flash_attention`.

  q: [b, t, heads, d]; k, v: [b, t, kv_heads, d] (self-attention over one pass);
  mask: [b, t] fields -> [b, t, heads, d] in q's dtype. A query that may see no key
  (padding) gets zeros, as `flash.flash_attention` gives.
  """
  t = q.shape[1]
  block = block_size(t)
  n = -(-t // block)
  padded = mask.map(lambda a: flash.pad(a, n * block))
  kinds = block_kinds(mask, block)
  capacity = partial_capacity(n)

  def kernel(q, k, v):
    out = _through_kernel(_token_row, q, k, v, kinds, *padded.fields(), q_len=n * block,
                          kv_len=n * block, block=block, capacity=capacity,
                          causal_blocks=mask.causal_blocks)
    return jnp.where((mask.segment != 0)[:, :, None, None], out, 0).astype(q.dtype)

  if capacity == n * n:   # every block fits: no row can overflow
    return kernel(q, k, v)

  # lax.cond's gradient keeps both branches' residuals whichever runs (splash's and
  # flash's outputs and log-sum-exps, q/k/v in both layouts): saving none of them, and
  # running the chosen forward again in the backward, costs less memory
  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def either(q, k, v):
    fallback = lambda q, k, v: flash.flash_attention(q, k, v, mask).astype(q.dtype)
    return jax.lax.cond(jnp.all(jnp.sum(kinds == 1, axis=(1, 2)) <= capacity), kernel,
                        fallback, q, k, v)
  return either(q, k, v)
