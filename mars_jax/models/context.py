"""Context parallelism: the positions of each row split over the mesh axes that the logical
axis `activation_length` maps to (the `context` axis of `mars_jax.parallel.sharding`),
for an uncached pass whose mask is per token (`flash.TokenMask`).

A transformer whose positions (RoPE) and mask (each token's own vectors, its place in
the pass included) travel with its tokens is the same function of any order of them. So
the pass is dealt out before the first layer (`split`) and put back in order after the
last (`merge`). It is cut into chunks of one attention tile (`flash.TILE`; the row
padded to whole rounds), dealt to the c shards in rounds, every other round in reverse
("snake" order: round 0 gives chunk s to shard s, round 1 chunk 2c - 1 - s, ...; on a
row shorter than 2c tiles, two rounds of T / 2c: MaxText's zigzag). Each shard then
holds early and late positions of both streams, so causal attention costs every shard
the same (a contiguous split's last shard would score c times the keys of its first),
and a chunk is a whole tile, so the blockwise attention's tile skipping sees contiguous
positions: on packed rows of short
segments a shard computes the tiles one device would (dealing single positions round
robin made each tile span c times the positions, and 3 to 4 times the tiles ran).
Everything but attention is per position, and runs on each shard's positions as they
are; attention (`attention`) runs each shard's queries against every shard's keys: K, V
and the keys' mask vectors pass round a ring of the shards (`ring_attention`: c steps,
each sending the block on while `flash.forward_tiles` runs against it; the backward
sends dK and dV after their block, so they end at its owner). Nothing of shape [T, T]
exists; per device a layer holds its T / c queries, its T / c of K and V, and the two
blocks in flight.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from mars_jax.models import flash
from mars_jax.models.layers import HEADS_AXES, KV_HEADS_AXES, fit_spec

Array = jax.Array
TOKEN_AXES = ("activation_batch", "activation_length")


def axes() -> tuple[str, ...]:
  """The mesh axes of more than one device that `activation_length` maps to under the
  rules bound by `sharding.activation_sharding` (none without them)."""
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return ()
  spec = nn.logical_to_mesh_axes(("activation_length",), rules)[0]
  names = (spec,) if isinstance(spec, str) else tuple(spec or ())
  return tuple(a for a in names if mesh.shape[a] > 1)


def length_shards() -> int:
  """How many pieces the length of an activation may be cut into when XLA propagates
  shardings: the product of the mesh axes of more than one device that do not split the
  batch (`activation_batch`), under the rules bound by `sharding.activation_sharding`
  (1 without them). An array whose length these do not divide may be split unevenly,
  and XLA's SPMD partitioner mis-scatters a gather's gradient split so (the padding of
  its indices adds into position 0): `objective` pads its target streams to a multiple."""
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return 1
  spec = nn.logical_to_mesh_axes(("activation_batch",), rules)[0]
  batch = (spec,) if isinstance(spec, str) else tuple(spec or ())
  return math.prod(n for a, n in mesh.shape.items() if a not in batch)


def size() -> int:
  """How many shards the positions of a row are split into (1: no context parallelism)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in axes())


def _rounds(length: int, shards: int) -> tuple[int, int]:
  """(rounds, chunk) of a row of `length` positions dealt to `shards`: two rounds of
  chunks of at most one tile when the row is shorter than 2 * shards tiles (the
  zigzag), else chunks of one whole tile, so that every tile of a shard's queries and
  of each shard's keys is one contiguous run of positions (the row is padded to whole
  rounds: less than shards tiles); rounds * shards * chunk >= length."""
  if length <= 2 * shards * flash.TILE:
    return 2, -(-length // (2 * shards))
  return -(-length // (shards * flash.TILE)), flash.TILE


def _snake(rounds: int) -> np.ndarray:
  """bool[rounds]: the rounds dealt in reverse (every other one)."""
  return np.arange(rounds) % 2 == 1


def split(a: Array, shards: int) -> Array:
  """a: [b, t, ...] -> [b, T, ...] dealt out in snake order (the module's doc): shard s
  holds positions [s * T / shards, (s + 1) * T / shards) of the result. T is t rounded
  up to rounds * shards * chunk (`_rounds`; zeros after t: padding, segment 0 in a
  mask)."""
  b, t = a.shape[:2]
  rounds, chunk = _rounds(t, shards)
  a = jnp.pad(a, [(0, 0), (0, rounds * shards * chunk - t)] + [(0, 0)] * (a.ndim - 2))
  a = a.reshape(b, rounds, shards, chunk, *a.shape[2:])
  flip = _snake(rounds).reshape((1, rounds) + (1,) * (a.ndim - 2))
  a = jnp.where(flip, jnp.flip(a, axis=2), a)
  return a.swapaxes(1, 2).reshape(b, rounds * shards * chunk, *a.shape[4:])


def merge(a: Array, shards: int, length: int) -> Array:
  """The inverse of `split`: [b, T, ...] dealt out -> [b, length, ...] in order."""
  b, t = a.shape[:2]
  rounds, chunk = _rounds(length, shards)
  a = a.reshape(b, shards, rounds, chunk, *a.shape[2:]).swapaxes(1, 2)
  flip = _snake(rounds).reshape((1, rounds) + (1,) * (a.ndim - 2))
  a = jnp.where(flip, jnp.flip(a, axis=2), a)
  return a.reshape(b, t, *a.shape[4:])[:, :length]


def _shift(x, names: tuple[str, ...], shards: int):
  """Every array of the tree x sent to the next shard of the ring over `names` (a
  ppermute per array, which the GPU compiler combines into one collective)."""
  return jax.lax.ppermute(x, names, [(s, (s + 1) % shards) for s in range(shards)])


def _pack(mask: flash.TokenMask) -> Array:
  """The mask's five [b, t] vectors as one int32[5, b, t] (one send, not five)."""
  return jnp.stack([a.astype(jnp.int32) for a in mask.fields()])


def _unpack(packed: Array, causal_blocks: bool) -> flash.TokenMask:
  """`_pack`'s int32[5, b, t] -> the TokenMask ([b, t] fields)."""
  segment, noisy, position, block, index = packed
  return flash.TokenMask(segment, noisy.astype(bool), position, block, index,
                         causal_blocks=causal_blocks)


def _ring_forward(q, k, v, mask, names, shards, tile):
  """-> (out [b, t, h, d], residuals): the queries against each shard's block of keys
  in turn, c steps that each send their block on while its tiles run (the last send
  brings the block home, unused), the partial results merged in float32."""
  def step(carry, _):
    block, part = carry
    nxt = _shift(block, names, shards)   # independent of this step's tiles: overlapped
    keys = _unpack(block[2], mask.causal_blocks)
    return (nxt, flash.merge_partials(part, flash.forward_tiles(q, *block[:2], mask, keys,
                                                                tile))), None
  b, _, h, d = q.shape
  shape = (q.shape[1] // tile, b, k.shape[2], h // k.shape[2], tile)
  empty = (jnp.zeros(shape + (d,), jnp.float32), jnp.full(shape, jnp.inf, jnp.float32))
  (_, (out, lse)), _ = jax.lax.scan(step, ((k, v, _pack(mask)), empty), length=shards)
  out = checkpoint_name(flash.untile(out, v.dtype), flash.RESIDUALS[0])
  return out, (q, k, v, mask, out, checkpoint_name(lse, flash.RESIDUALS[1]))


def _ring_backward(names, shards, tile, residuals, d_out):
  """The ring again: each step computes the held block's dK and dV and adds them to
  that block's running sum (float32), which follows its block one step behind (sent
  while the next block's tiles run) and, after a last send, ends at its owner; dQ
  stays. c sends of the blocks (the last unused) and c + 1 of the sums (the first
  carries zeros): uniform steps, one copy of the tiles' code in the program."""
  q, k, v, mask, out, lse = residuals

  def step(carry, _):
    block, dkv, dq = carry   # dkv: the previous block's sum, with this shard's share
    nxt, dkv = _shift((block, dkv), names, shards)   # now this block's sum so far
    dq_s, dk, dv = flash.backward_tiles(q, *block[:2], mask,
                                        _unpack(block[2], mask.causal_blocks), out, lse,
                                        d_out, tile)
    return (nxt, (dkv[0] + dk, dkv[1] + dv), dq + dq_s), None
  zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
  init = ((k, v, _pack(mask)), (zeros(k), zeros(v)), zeros(q))
  (_, dkv, dq), _ = jax.lax.scan(step, init, length=shards)
  dk, dv = _shift(dkv, names, shards)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, mask, names, shards, tile):
  return _ring_forward(q, k, v, mask, names, shards, tile)[0]


_ring.defvjp(_ring_forward, _ring_backward)


def ring_attention(q: Array, k: Array, v: Array, mask: flash.TokenMask,
                   names: tuple[str, ...]) -> Array:
  """Inside a `shard_map` over the mesh axes `names` (this shard's part of the pass):
  its queries against every shard's keys, each shard's K, V and key mask passed round
  the ring (`ppermute`, the mask's vectors packed into one array), one block a step,
  each send independent of the step's tiles so that it can overlap them, forward and
  backward (whose dK and dV ride the ring back to their owner). A device holds its own
  T / c of K and V as residuals, and two blocks in flight.

  q: [b, t, heads, d]; k, v: [b, t, kv_heads, d]; mask: [b, t] fields -> [b, t, heads, d].
  """
  shards = math.prod(jax.lax.axis_size(n) for n in names)
  t = q.shape[1]
  tile = flash.tile_size(t, t)
  whole = -(-t // tile) * tile
  fill = lambda a: flash.pad(a, whole)
  return _ring(fill(q), fill(k), fill(v), mask.map(fill), names, shards, tile)[:, :t]


def _local_kv_heads(k: Array, v: Array, heads: int, names: tuple[str, ...]):
  """Inside a `shard_map` whose `heads` query heads a shard are split over the mesh axes
  `names` and whose kv heads are whole (the axes do not divide them): k, v [b, t,
  kv_heads, d] -> the kv heads this shard's query heads read, [b, t, n, d]. With the
  shard's heads inside one group (the group a multiple of them), its one kv head (n =
  1); with heads that straddle groups unevenly, one per query head (n = heads, the
  only case that copies a kv head)."""
  group = jax.lax.axis_size(names) * heads // k.shape[2]
  first = jax.lax.axis_index(names) * heads
  if group % heads == 0:
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, first // group, 1, axis=2)
  else:
    take = lambda a: jnp.take(a, (first + jnp.arange(heads)) // group, axis=2)
  return take(k), take(v)


def attention(q: Array, k: Array, v: Array, mask: flash.TokenMask) -> Array:
  """Grouped-query attention of a pass whose positions are split over the context axes
  (each shard's queries against the keys of all, by `ring_attention`).

  q: [b, T, heads, d]; k, v: [b, T, kv_heads, d]; mask: the pass's TokenMask ([b, T]
  fields), every array in the same (dealt-out) order -> [b, T, heads, d]. Batch, heads and
  positions are split as their logical axes say; where the tensor axes split the query
  heads but cannot split the kv heads alike, each shard takes the kv heads its query
  heads read (`_local_kv_heads`) before anything moves.
  """
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  spec = lambda x, names: fit_spec(nn.logical_to_mesh_axes(names, rules), x.shape, mesh)
  q_spec, kv_spec = spec(q, HEADS_AXES), spec(k, KV_HEADS_AXES)
  head_axes = q_spec[2] if kv_spec[2] != q_spec[2] else None
  head_axes = (head_axes,) if isinstance(head_axes, str) else tuple(head_axes or ())
  token_spec = spec(mask.segment, TOKEN_AXES)
  names = axes()

  def local(q, k, v, mask):
    if head_axes:
      k, v = _local_kv_heads(k, v, q.shape[2], head_axes)
    return ring_attention(q, k, v, mask, names)

  mask_spec = mask.map(lambda _: token_spec)
  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, mask_spec),
                       out_specs=q_spec, check_vma=False)(q, k, v, mask)
