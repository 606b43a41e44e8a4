"""The decoder's building blocks, shared by the model (`qwen2`), its attention
(`attention`) and the splash kernel's wrapper (`splash`): activation sharding
(`fit_spec`, `constrain`), the 2-D matmul `dense`, weights with logical axes
(`param`) and their LoRA adapters (`low_rank`), `RMSNorm` and rotate-half RoPE.

Activations carry logical axis names (`activation_batch`, `activation_length`,
`activation_embed`, `activation_heads`, `activation_kv_heads`, `activation_mlp`,
`activation_vocab`; head_dim is never split), pinned with `constrain`: a no-op unless
the model is traced under `mars_jax.parallel.sharding.activation_sharding`, which binds a mesh
and the rules (unit tests, the sampler and decoding run without one):

  residual stream, final hidden   [b, t, embed]               EMBED_AXES
  queries, attention output       [b, t, heads, head_dim]     HEADS_AXES
  keys, values                    [b, t, kv_heads, head_dim]  KV_HEADS_AXES
  MLP hidden silu(gate) * up      [b, t, mlp]                 MLP_AXES
  logits                          [b, t, vocab]               VOCAB_AXES
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mars_jax.models import rope
from mars_jax.models.flash import TokenMask
from mars_jax.models.config import DEFAULT_RUNTIME, Qwen2Config, Runtime

Array = jax.Array

EMBED_AXES = ("activation_batch", "activation_length", "activation_embed")
HEADS_AXES = ("activation_batch", "activation_length", "activation_heads", None)
KV_HEADS_AXES = ("activation_batch", "activation_length", "activation_kv_heads", None)
MLP_AXES = ("activation_batch", "activation_length", "activation_mlp")
VOCAB_AXES = ("activation_batch", "activation_length", "activation_vocab")

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


def param(module: nn.Module, name: str, shape, axes, dtype, init=None):
  """`module`'s weight `name` of `shape` and `dtype`, boxed with its logical `axes`;
  init: normal(0.02) unless given."""
  init = init or nn.initializers.normal(0.02)
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _lora_a_init(key, shape, dtype):
  """A: [*in, rank] uniform in +-1/sqrt(fan_in) (PEFT's default, Kaiming with a=sqrt 5)."""
  bound = 1.0 / math.sqrt(int(np.prod(shape[:-1])))
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def dropout_ids(rows: Array, mask: Any, length: int) -> Array:
  """uint32[b, length, 3]: what each token's LoRA dropout masks are drawn with
  (`low_rank`): its row's id (rows: uint32[b], e.g. a hash of the row's tokens), then
  what places the token in its row however the pass is laid out (context parallelism
  deals positions out, and the target stream's slots move with its length). From a
  per-token mask (`flash.TokenMask`): a clean token's index in the row, (0, index); a
  noisy one's segment and in-segment position, (segment, position). From any other mask
  (or None): (0, its index in the pass)."""
  b = rows.shape[0]
  if isinstance(mask, TokenMask):
    kind = jnp.where(mask.noisy, mask.segment, 0).astype(jnp.uint32)
    place = jnp.where(mask.noisy, mask.position, mask.index).astype(jnp.uint32)
  else:
    kind = jnp.zeros((b, length), jnp.uint32)
    place = jnp.broadcast_to(jnp.arange(length, dtype=jnp.uint32), (b, length))
  return jnp.stack([jnp.broadcast_to(rows.astype(jnp.uint32)[:, None], (b, length)),
                    kind, place], axis=-1)


def low_rank(module: nn.Module, x: Array, name: str, in_shape: tuple[int, ...],
             in_axes: tuple[str, ...], out_shape: tuple[int, ...],
             out_axes: tuple[str, ...], rows: Array | None = None) -> Array | None:
  """The adapter of projection `name` (a `LORA_PROJECTIONS` entry, "attn/q_kernel"), or
  None when `runtime.lora` has none for it: (alpha / rank) (drop(x) A) B.

  x: [..., *in_shape] -> [..., *out_shape]. Params `{p}_lora_a` [*in, rank] and
  `{p}_lora_b` [rank, *out] (p: the kernel's name without "_kernel"), with the logical
  axes of the kernel's dims and "lora_rank". Dropout only when the caller passes a
  "dropout" rng (training): each token's mask is drawn from that key folded with its
  `dropout_ids` (rows: uint32[b, t, 3]; None: the row's index and the token's), so a
  token gets the same mask wherever its row sits in the batch and wherever the token
  sits in the pass."""
  spec, rt = module.runtime.lora, module.runtime
  if spec is None or not spec.targets_projection(name):
    return None
  prefix = name.split("/")[-1].removesuffix("_kernel")
  a = param(module, f"{prefix}_lora_a", (*in_shape, spec.rank), (*in_axes, "lora_rank"),
            rt.jnp_param_dtype, _lora_a_init)
  b = param(module, f"{prefix}_lora_b", (spec.rank, *out_shape), ("lora_rank", *out_axes),
            rt.jnp_param_dtype, nn.initializers.zeros)
  if spec.dropout > 0 and module.has_rng("dropout"):
    key = module.make_rng("dropout")
    if rows is None:
      rows = dropout_ids(jnp.arange(x.shape[0], dtype=jnp.uint32), None, x.shape[1])

    def draw(ids):
      token = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, ids[0]), ids[1]),
                                 ids[2])
      return jax.random.bernoulli(token, 1.0 - spec.dropout, x.shape[2:])
    keep = jax.vmap(jax.vmap(draw))(rows)
    x = jnp.where(keep, x / (1.0 - spec.dropout), 0).astype(x.dtype)
  h = dense(x, a.astype(rt.jnp_dtype), in_dims=len(in_shape))
  return dense(h, b.astype(rt.jnp_dtype)) * jnp.asarray(spec.scale, rt.jnp_dtype)


class RMSNorm(nn.Module):
  """y = x / rms(x) * scale, computed in float32 (as HF), cast back to x.dtype."""
  config: Qwen2Config
  runtime: Runtime = DEFAULT_RUNTIME

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = param(self, "scale", (x.shape[-1],), ("norm",), self.runtime.jnp_param_dtype,
                  nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                              + self.config.rms_norm_eps)
    return (scale.astype(jnp.float32) * x32).astype(x.dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float,
                 scaling: rope.RopeScaling | None = None) -> tuple[Array, Array]:
  """Rotate-half RoPE tables, scaled as the checkpoint says (`rope.frequencies`).
  positions: int32[b, t] -> cos, sin: float32[b, t, head_dim]."""
  if scaling is None:
    inv_freq, factor = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32)
                                        / head_dim)), 1.0
  else:
    inv_freq, factor = rope.frequencies(head_dim, theta, scaling)
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  if factor == 1.0:
    return jnp.cos(emb), jnp.sin(emb)
  return jnp.cos(emb) * factor, jnp.sin(emb) * factor


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x: [b, t, heads, head_dim]; cos, sin: [b, t, head_dim] (HF rotate-half layout)."""
  half = x.shape[-1] // 2
  x32 = x.astype(jnp.float32)
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)
