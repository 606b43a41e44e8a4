"""LoRA over frozen weights: which leaves train, adapters added to a model, merged back.

  runtime = qwen2.Runtime(lora=LoraSpec(rank=8, alpha=16, mask_token_id=mask_id))
  params  = add_adapters(config, base_params, runtime, rng)   # A random, B zero
  trainable, frozen = partition(params)                       # adapters + mask row | rest
  params  = combine(trainable, frozen)
  plain   = merge(params, runtime.lora)                       # W + (alpha/r) A B, row set

The adapters live in the model's own params tree (mars_jax/models/qwen2.py,
`low_rank`): `P_lora_a` [*in, rank] and `P_lora_b` [rank, *out] beside each targeted
kernel `P_kernel` [*in, *out], layers stacked or not, and `mask_embedding` [embed] at the
top when the spec trains the `<|mask|>` row. Why an implementation of our own and not
qwix: docs/design.md, "LoRA".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from mars_jax.models import qwen2
from mars_jax.models.config import LoraSpec, Qwen2Config, Runtime

MASK_EMBEDDING = "mask_embedding"
_SUFFIXES = ("_lora_a", "_lora_b")


def is_trainable(path: tuple[str, ...]) -> bool:
  """Whether the leaf at `path` (a params tree key path) trains under LoRA."""
  return path == (MASK_EMBEDDING,) or path[-1].endswith(_SUFFIXES)


def partition(params: Any) -> tuple[dict, dict]:
  """params -> (trainable, frozen): two nested dicts of the same layout with disjoint
  leaves (the adapters and the mask row | everything else). A tree without adapters
  gives (params, {}): everything trains."""
  flat = traverse_util.flatten_dict(params)
  if not any(is_trainable(p) for p in flat):
    return params, {}
  pick = lambda keep: traverse_util.unflatten_dict(
      {p: v for p, v in flat.items() if is_trainable(p) == keep})
  return pick(True), pick(False)


def combine(trainable: Any, frozen: Any) -> dict:
  """The inverse of `partition`."""
  if not frozen:
    return trainable
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen),
                                       **traverse_util.flatten_dict(trainable)})


def without_lora(runtime: Runtime) -> Runtime:
  return runtime.replace(lora=None)


def add_adapters(config: Qwen2Config, params: Any, runtime: Runtime, rng: jax.Array) -> dict:
  """Base `params` (in `runtime`'s layout, no adapters) with the adapters `runtime.lora`
  asks for: each A uniform in +-1/sqrt(fan_in), each B zero (so the model computes what
  the base does), `mask_embedding` the base's row of the mask token."""
  spec = runtime.lora
  abstract = traverse_util.flatten_dict(qwen2.abstract_params(config, runtime=runtime))
  flat = dict(traverse_util.flatten_dict(params))
  new = [p for p in abstract if p not in flat]
  for i, path in enumerate(sorted(new)):
    a = abstract[path]
    if path == (MASK_EMBEDDING,):
      flat[path] = params["embedding"][spec.mask_token_id].astype(a.dtype)
    elif path[-1].endswith("_lora_a"):
      fan_in = int(np.prod(a.shape[1 if runtime.scan_layers else 0:-1]))
      bound = 1.0 / np.sqrt(fan_in)
      flat[path] = jax.random.uniform(jax.random.fold_in(rng, i), a.shape, a.dtype,
                                      -bound, bound)
    elif path[-1].endswith("_lora_b"):
      flat[path] = jnp.zeros(a.shape, a.dtype)
    else:
      raise ValueError(f"params lack {'/'.join(path)}, which is not an adapter.")
  return traverse_util.unflatten_dict(flat)


def _delta(a: jax.Array, b: jax.Array, kernel_shape: tuple[int, ...], scale: float,
           stacked: bool) -> jax.Array:
  """(scale A B) in float32, shaped as its kernel. a: [(L,) *in, r]; b: [(L,) r, *out]."""
  lead = a.shape[:1] if stacked else ()
  r = a.shape[-1]
  a2 = a.astype(jnp.float32).reshape(*lead, -1, r)
  b2 = b.astype(jnp.float32).reshape(*lead, r, -1)
  return (scale * (a2 @ b2)).reshape(kernel_shape)


def merge(params: Any, spec: LoraSpec | None) -> dict:
  """Adapters folded into their kernels (W + scale A B, summed in float32, stored in
  W's dtype) and the mask row written into the embedding: a tree without adapters that
  the model without `runtime.lora` computes as the adapted model. A tree without
  adapters comes back as it is."""
  if spec is None:
    return params
  flat = dict(traverse_util.flatten_dict(params))
  out = {p: v for p, v in flat.items() if not is_trainable(p)}
  for path, a in flat.items():
    if not path[-1].endswith("_lora_a"):
      continue
    prefix = path[-1].removesuffix("_lora_a")
    kpath = (*path[:-1], f"{prefix}_kernel")
    b = flat[(*path[:-1], f"{prefix}_lora_b")]
    kernel = flat[kpath]
    stacked = path[0] == "layers"
    out[kpath] = (kernel.astype(jnp.float32)
                  + _delta(a, b, kernel.shape, spec.scale, stacked)).astype(kernel.dtype)
  if (MASK_EMBEDDING,) in flat:
    emb = flat[("embedding",)]
    out[("embedding",)] = emb.at[spec.mask_token_id].set(
        flat[(MASK_EMBEDDING,)].astype(emb.dtype))
  return traverse_util.unflatten_dict(out)


def count(params: Any) -> tuple[int, int]:
  """-> (trainable, total) parameter counts of a params tree under LoRA (everything
  trains in a tree without adapters)."""
  trainable, frozen = partition(params)
  n = qwen2.num_params(trainable)
  return n, n + qwen2.num_params(frozen)
