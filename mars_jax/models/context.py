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
are; attention (`attention`) runs each shard's queries against every shard's keys, K, V
and the keys' mask vectors all-gathered over the context axes, through
`flash.flash_attention` (its backward reduce-scatters dK and dV). Nothing of shape
[T, T] exists; per device a layer holds its T / c queries and the row's K and V.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
  of the gathered keys is one contiguous run of positions (the row is padded to whole
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


def attention(q: Array, k: Array, v: Array, mask: flash.TokenMask) -> Array:
  """Grouped-query attention of a pass whose positions are split over the context axes
  (each shard's queries against the keys of all).

  q: [b, T, heads, d]; k, v: [b, T, kv_heads, d]; mask: the pass's TokenMask ([b, T]
  fields), every array in the same (dealt-out) order -> [b, T, heads, d]. Batch, heads and
  positions are split as their logical axes say; kv heads that the tensor axes do not
  split like the query heads are repeated to one per query head first.
  """
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  spec = lambda x, names: fit_spec(nn.logical_to_mesh_axes(names, rules), x.shape, mesh)
  q_spec, kv_spec = spec(q, HEADS_AXES), spec(k, KV_HEADS_AXES)
  if kv_spec[2] != q_spec[2]:
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    kv_spec = q_spec
  token_spec = spec(mask.segment, TOKEN_AXES)
  gathered = axes()

  def local(q, k, v, mask):
    gather = lambda a: jax.lax.all_gather(a, gathered, axis=1, tiled=True)
    return flash.flash_attention(q, gather(k), gather(v), mask, key_mask=mask.map(gather))

  mask_spec = mask.map(lambda _: token_spec)
  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, mask_spec),
                       out_specs=q_spec, check_vma=False)(q, k, v, mask)
