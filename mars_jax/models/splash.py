"""Splash attention: JAX's Pallas TPU kernel (`jax.experimental.pallas.ops.tpu.
splash_attention`) behind the contract of `attention.attention`.

The kernel tiles the [t, s] score matrix into [block_q, block_kv] blocks and reads a
block-sparse mask: each block is empty (skipped: no K/V fetched, no FLOPs), full (no
mask applied) or partial (its [block_q, block_kv] slice of the mask applied). The
boolean mask of a pass, data-dependent in MARS (packed segments, random block
offsets, a compacted target stream), goes in as a dynamic mask, from which the kernel
derives that block table at run time (`make_splash_mha` on a `jax.Array` mask). One
mask serves every head. A two-stream pass over [clean (L = 512) | noisy target stream
(n = 256)], one segment, causal blocks, drawn in 128-wide tiles (rows are query tiles;
"." empty, "#" full, "+" partial):

              clean keys      noisy keys
    clean     + . . .         . .            causal: upper triangle skipped
              # + . .         . .
              # # + .         . .
              # # # +         . .
    noisy     # # + .         + .            the clean keys of earlier blocks and the
              # # # +         . +            noisy slots of the own block: the rest
                                             skipped (targets at positions 259..510)

Batch rows have masks of their own, so the kernel runs once per row (`vmap`, which
Pallas lowers to a loop over the rows). t and s are padded to whole tiles inside; a
query that may see no key is given key 0, so the kernel's softmax never divides by
zero (its output is finite and counts nowhere, as in "xla").

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
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

from mars_jax.models.layers import fit_spec

Array = jax.Array
MAX_BLOCK = 512  # tile of the q and kv axes on long sequences
LANES = 128  # the kernel's tiles are multiples of the TPU lane width

Q_AXES = ("activation_batch", "activation_heads", None, None)
KV_AXES = ("activation_batch", "activation_kv_heads", None, None)
MASK_AXES = ("activation_batch", None, None)


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


def _row_attention(q: Array, k: Array, v: Array, mask: Array, *, block_q: int,
                   block_kv: int, interpret: bool) -> Array:
  """One batch row. q: [heads, tq, d]; k, v: [kv_heads, ts, d]; mask: bool[tq, ts]
  (tq, ts whole tiles) -> [heads, tq, d]."""
  sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dkv=block_q,
                        block_kv_dkv=block_kv, block_q_dq=block_q, block_kv_dq=block_kv)
  kernel = sk.make_splash_mha(mask[None], block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
  return _with_static_flag(kernel)(q, k, v)


def _with_static_flag(kernel: sk.SplashAttentionKernel) -> sk.SplashAttentionKernel:
  """The kernel with `MaskInfo.is_dynamic_mask` a Python bool again: `make_splash_mha`
  turns it into an array, a tracer under `jit`, which the kernel's `__call__` cannot
  branch on."""
  flag = lambda info: info and info._replace(is_dynamic_mask=True)
  return sk.SplashAttentionKernel(flag(kernel.fwd_mask_info), flag(kernel.dq_mask_info),
                                  flag(kernel.dkv_mask_info), **kernel.kwargs)


def _local_attention(q: Array, k: Array, v: Array, mask: Array, *, block_q: int,
                     block_kv: int) -> Array:
  """q: [b, heads, tq, d]; k, v: [b, kv_heads, ts, d]; mask: bool[b, tq, ts]
  -> [b, heads, tq, d]: the TPU kernel where lowered for TPU, interpreted elsewhere."""
  def rows(interpret):
    return jax.vmap(functools.partial(_row_attention, block_q=block_q, block_kv=block_kv,
                                      interpret=interpret))
  return jax.lax.platform_dependent(q, k, v, mask, tpu=rows(False), default=rows(True))


def _sharded(fn, q: Array, k: Array, v: Array, mask: Array) -> Array:
  """fn over the shards of the mesh bound by `sharding.activation_sharding` (batch and
  heads split as their logical axes say), or over the whole arrays without one.
  q: [b, heads, tq, d]; k, v: [b, kv_heads, ts, d]; mask: bool[b, tq, ts]."""
  rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty or mesh.size == 1:
    return fn(q, k, v, mask)
  spec = lambda x, axes: fit_spec(nn.logical_to_mesh_axes(axes, rules), x.shape, mesh)
  q_spec, kv_spec = spec(q, Q_AXES), spec(k, KV_AXES)
  if kv_spec[1] != q_spec[1]:  # kv heads not split like the query heads: one per head
    k, v = (jnp.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    kv_spec = q_spec
  in_specs = (q_spec, kv_spec, kv_spec, spec(mask, MASK_AXES))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=q_spec,
                       check_vma=False)(q, k, v, mask)


def splash_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
  """Grouped-query attention through the splash kernel (the contract of
  `attention.attention`).

  q: [b, t, heads, d]; k, v: [b, s, kv_heads, d]; mask: bool[b, t, s] (True = may
  attend) -> [b, t, heads, d]. Queries are scaled by 1 / sqrt(d) before the kernel, as
  "xla" scales them. A query whose mask row is all False gets a finite output (key
  0's value), never NaN.
  """
  t, d, s = q.shape[1], q.shape[3], k.shape[1]
  block_q, block_kv = block_size(t), block_size(s)
  q_len, kv_len = -(-t // block_q) * block_q, -(-s // block_kv) * block_kv
  head_major = lambda x, length: _pad_to(x, 1, length).transpose(0, 2, 1, 3)
  out = _sharded(functools.partial(_local_attention, block_q=block_q, block_kv=block_kv),
                 head_major(q / jnp.sqrt(d).astype(q.dtype), q_len), head_major(k, kv_len),
                 head_major(v, kv_len), kernel_mask(mask, q_len, kv_len))
  return out[:, :, :t].transpose(0, 2, 1, 3)
