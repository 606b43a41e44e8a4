"""Device mesh, logical axis rules, and the shardings of params, optimizer state and batches.

The mesh has four axes:

  data     pure data parallelism: batch split, params replicated
  fsdp     batch split and params sharded on their `embed` axis (ZeRO-3 style)
  context  context parallelism: each row's positions split (`mars_jax.models.context`),
           params sharded on `embed` with fsdp's
  tensor   Megatron-style: heads, kv_heads, mlp and vocab split

Weights and activations carry logical axis names (see `mars_jax.models.qwen2` and
`mars_jax.models.layers`); the ordered table `LOGICAL_AXIS_RULES` maps them to mesh
axes (for each array dimension the first rule whose mesh axis is still free wins).
A dimension that its mesh axes do not divide (e.g. 2 kv heads on tensor=4) stays
replicated. Shardings of weights are derived from `jax.eval_shape` of the init, so
nothing is allocated to compute them; activations are pinned while the model is
traced under `activation_sharding` (the train and eval steps do that), and left to the
compiler elsewhere:

  activation_batch                            data, fsdp
  activation_heads, _kv_heads, _mlp, _vocab   tensor
  activation_length                           context
  activation_embed                            replicated

Decoding uses `DECODE_RULES`, the same table with `embed` and `activation_length`
unsplit (see `mars_jax.decoding.mesh`); a decoding mesh has no context axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mars_jax.models import qwen2
from mars_jax.models.layers import fit_spec  # noqa: F401  (re-exported)

AXES = ("data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

LOGICAL_AXIS_RULES: Rules = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", ("fsdp", "context")),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("lora_rank", None),
    ("activation_batch", BATCH_AXES),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("activation_length", "context"),
    ("activation_embed", None),
)

# Decoding: the training table with `embed` unsplit, so a decoding forward gathers no
# weights over fsdp (an fsdp axis of a decoding mesh splits rows, like data), and the
# positions unsplit.
DECODE_RULES: Rules = tuple((name, None if name in ("embed", "activation_length") else axes)
                            for name, axes in LOGICAL_AXIS_RULES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; one of them may be -1 (filled from the device count)."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  context: int = 1

  def shape(self, num_devices: int) -> tuple[int, int, int, int]:
    """The sizes in `AXES` order (data, fsdp, context, tensor) for `num_devices`
    devices, or a ValueError that says why not."""
    sizes = [getattr(self, a) for a in AXES]
    desc = ", ".join(f"{a}={s}" for a, s in zip(AXES, sizes))
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
      raise ValueError(f"mesh {desc}: each size must be >= 1, and at most one may be -1.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(f"mesh {desc}: {num_devices} devices are not divisible by the "
                         f"fixed axes' product {known}.")
      sizes[sizes.index(-1)] = num_devices // known
    elif known != num_devices:
      raise ValueError(f"mesh {desc} needs {known} devices, but {num_devices} are "
                       f"available ({jax.process_count()} process(es)); make the product "
                       "of the sizes equal the device count, or set one size to -1.")
    return tuple(sizes)


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[Any] | None = None) -> Mesh:
  """A `Mesh` with axes (data, fsdp, context, tensor) over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = config.shape(len(devices))
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
                       devices=devices)


def logical_shardings(logical: Any, shapes: Any, mesh: Mesh, rules: Rules) -> Any:
  """Tree of logical `PartitionSpec`s + matching shapes -> tree of `NamedSharding`s."""
  shardings = nn.logical_to_mesh_sharding(logical, mesh, rules)
  return jax.tree.map(
      lambda s, x: NamedSharding(mesh, fit_spec(s.spec, x.shape, mesh)), shardings, shapes,
      is_leaf=lambda s: isinstance(s, NamedSharding))


def param_shardings(config: qwen2.Qwen2Config, mesh: Mesh,
                    rules: Rules = LOGICAL_AXIS_RULES, *,
                    runtime: qwen2.Runtime = qwen2.DEFAULT_RUNTIME) -> Any:
  """`NamedSharding` of every parameter, from its logical axes (nothing allocated)."""
  return logical_shardings(qwen2.logical_axes(config, runtime=runtime),
                           qwen2.abstract_params(config, runtime=runtime), mesh, rules)


def opt_state_shardings(tx: optax.GradientTransformation, abstract_params: Any,
                        params_sharding: Any, mesh: Mesh) -> Any:
  """Shardings of `tx.init(params)`: per-parameter moments shard like their parameter,
  everything else (counts, scalars) is replicated."""
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  return optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract_state, params_sharding,
      transform_non_params=lambda _: replicated(mesh),
      is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_sharding(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> NamedSharding:
  """Batch arrays [b, ...]: rows split as the logical axis `batch` (data, fsdp), the
  rest replicated."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch",), rules))


def num_batch_shards(batch: NamedSharding) -> int:
  """How many ways `batch_sharding` splits the rows."""
  axes = batch.spec[0] if batch.spec else None
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return math.prod(batch.mesh.shape[a] for a in names)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Iterator[None]:
  """Binds `mesh` (as the abstract mesh) and `rules`, so that the model traced inside
  pins its activations (`layers.constrain`). Enter it inside the jitted function, where
  the model is traced: jit does not key its cache on the rules."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
    yield


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
