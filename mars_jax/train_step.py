"""The train state and the sharded, jitted train step (MARS or AR-SFT).

  mesh  = sharding.make_mesh(sharding.MeshConfig(data=-1, fsdp=1, tensor=1))
  tx    = optimizer.make_optimizer(opt_config)
  state = init_train_state(model_config, tx, mesh, params=params, runtime=rt)   # or rng=...
  step  = make_train_step(model_config, objective_config, tx, mesh, micro_batches=4,
                          runtime=rt)
  state, metrics = step(state, batch)      # batch: dict of [global_batch, L] arrays

Params are the master copy in `runtime.param_dtype` (float32 by default); the
forward runs in `runtime.dtype` (e.g. "bfloat16", weights cast per use) with the
rematerialisation policy `runtime.remat`, its activations pinned to the mesh by the
logical axis rules (`sharding.activation_sharding`). The step is
`jax.jit(in_shardings=(state, batch), out_shardings=(state, replicated metrics),
donate_argnums=0)`: the state passed in is consumed.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from mars_jax import objective as objective_lib
from mars_jax import sharding
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Runtime

Array = jax.Array
Batch = dict[str, Array]


@flax.struct.dataclass
class TrainState:
  """step: int32[] (optimizer steps taken); params: model params; opt_state: tx state."""
  step: Array
  params: Any
  opt_state: Any


def abstract_train_state(model_config: qwen2.Qwen2Config, tx: optax.GradientTransformation,
                         *, runtime: Runtime = DEFAULT_RUNTIME) -> TrainState:
  """`TrainState` of `jax.ShapeDtypeStruct`s (nothing allocated), e.g. an orbax target."""
  params = qwen2.abstract_params(model_config, runtime=runtime)
  return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                    opt_state=jax.eval_shape(tx.init, params))


def train_state_shardings(model_config: qwen2.Qwen2Config, tx: optax.GradientTransformation,
                          mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES, *,
                          runtime: Runtime = DEFAULT_RUNTIME) -> TrainState:
  """`TrainState` of `NamedSharding`s: params by logical axes, moments like their params."""
  params = sharding.param_shardings(model_config, mesh, rules, runtime=runtime)
  opt_state = sharding.opt_state_shardings(
      tx, qwen2.abstract_params(model_config, runtime=runtime), params, mesh)
  return TrainState(step=sharding.replicated(mesh), params=params, opt_state=opt_state)


def init_train_state(model_config: qwen2.Qwen2Config, tx: optax.GradientTransformation,
                     mesh: Mesh, *, params: Any = None, rng: Array | None = None,
                     rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES,
                     runtime: Runtime = DEFAULT_RUNTIME) -> TrainState:
  """A sharded step-0 state from given `params` (e.g. `hf.load_pretrained`, in
  `runtime`'s layout), or a random init from `rng` computed directly in its shardings."""
  shardings = train_state_shardings(model_config, tx, mesh, rules, runtime=runtime)

  def build(p):
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p))

  if params is None:
    if rng is None:
      raise ValueError("init_train_state needs params or rng.")
    return jax.jit(lambda r: build(qwen2.init_params(model_config, r, runtime=runtime)),
                   out_shardings=shardings)(rng)
  params = jax.device_put(params, shardings.params)
  return jax.jit(build, in_shardings=(shardings.params,), out_shardings=shardings)(params)


def split_micro_batches(batch: Batch, micro_batches: int) -> Batch:
  """[b, ...] -> [micro_batches, b / micro_batches, ...], micro-batch k = rows k::m.

  Strided, so that each device's contiguous rows split locally into its share of
  every micro-batch (no cross-device traffic).
  """
  def split(x):
    b = x.shape[0]
    if b % micro_batches:
      raise ValueError(f"batch size {b} is not divisible by micro_batches={micro_batches}.")
    return x.reshape(b // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(split, batch)


def loss_and_grads(model_config: qwen2.Qwen2Config, objective: objective_lib.ObjectiveConfig,
                   params: Any, batch: Batch, *, micro_batches: int = 1,
                   micro_batch_sharding: NamedSharding | None = None,
                   runtime: Runtime = DEFAULT_RUNTIME) -> tuple[Any, dict[str, Array]]:
  """Gradients of the normalised loss and the objective's sums, accumulated over micro-batches.

  The loss is a sum over micro-batches divided once by the whole batch's
  denominator, so any `micro_batches` gives the gradient of the full batch.
  -> (grads: like params, sums: see `objective.objective_sums`).
  """
  def sum_loss(p, mb):
    sums = objective_lib.objective_sums(model_config, p, mb, objective, runtime=runtime)
    return sums["loss"], sums

  grad_fn = jax.grad(sum_loss, has_aux=True)
  if micro_batches == 1:
    grads, sums = grad_fn(params, batch)
  else:
    mbs = split_micro_batches(batch, micro_batches)
    first = jax.tree.map(lambda x: x[0], mbs)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32),
                         jax.eval_shape(grad_fn, params, first))

    def body(acc, mb):
      if micro_batch_sharding is not None:
        mb = jax.lax.with_sharding_constraint(mb, micro_batch_sharding)
      out = grad_fn(params, mb)
      return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out), None

    (grads, sums), _ = jax.lax.scan(body, zeros, mbs)
  denom = jnp.maximum(sums["denom"], 1.0)
  grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
  return grads, sums


def _with_block_offsets(objective: objective_lib.ObjectiveConfig, batch: Batch,
                        key: Array) -> Batch:
  """The batch with each row's block offset drawn from `key` and its tokens
  (`objective.block_offsets`) when the objective is MARS with
  `random_block_offset`; otherwise the batch as it is."""
  if objective.kind != "mars" or not objective.random_block_offset:
    return batch
  return {**batch, "block_offset": objective_lib.block_offsets(key, batch["tokens"],
                                                               objective.block_size)}


def make_train_step(model_config: qwen2.Qwen2Config, objective: objective_lib.ObjectiveConfig,
                    tx: optax.GradientTransformation, mesh: Mesh, *, micro_batches: int = 1,
                    learning_rate_fn: optax.Schedule | None = None,
                    rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES,
                    runtime: Runtime = DEFAULT_RUNTIME, seed: int = 0
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Array]]]:
  """The jitted step `(state, batch) -> (state, metrics)`.

  batch: {"tokens": int32[b, L], "loss_mask": bool[b, L]} (+ "segment_ids",
  "positions"), b the global batch, divisible by micro_batches and by each
  micro-batch's share of the (data, fsdp) devices. `objective.kind` picks MARS or
  AR-SFT; with `objective.random_block_offset` each row's block offset is drawn
  from (seed, step) and the row's tokens (`objective.block_offsets`), so a resumed
  run, or one on another number of processes, draws the same ones. metrics: float32
  scalars from `objective.finalize` plus grad_norm (before clipping) and, with
  `learning_rate_fn`, the learning rate of this step.
  The input state is donated.
  """
  if micro_batches < 1:
    raise ValueError(f"micro_batches={micro_batches}; must be >= 1.")
  state_shardings = train_state_shardings(model_config, tx, mesh, rules, runtime=runtime)
  batch_shardings = sharding.batch_sharding(mesh, rules)
  batch_shards = sharding.num_batch_shards(batch_shardings)

  def step(state: TrainState, batch: Batch):
    rows = batch["tokens"].shape[0]
    if rows % (micro_batches * batch_shards):
      raise ValueError(
          f"batch size {rows} must be divisible by micro_batches ({micro_batches}) x "
          f"the batch's device split ({batch_shards}: data x fsdp), so that every "
          "micro-batch splits over the devices.")
    batch = _with_block_offsets(objective, batch,
                                jax.random.fold_in(jax.random.key(seed), state.step))
    with sharding.activation_sharding(mesh, rules):
      grads, sums = loss_and_grads(model_config, objective, state.params, batch,
                                   micro_batches=micro_batches,
                                   micro_batch_sharding=batch_shardings, runtime=runtime)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    _, metrics = objective_lib.finalize(sums)
    metrics["grad_norm"] = optax.global_norm(grads)
    if learning_rate_fn is not None:
      metrics["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, sharding.replicated(mesh)),
                 donate_argnums=(0,))


def make_eval_step(model_config: qwen2.Qwen2Config, objective: objective_lib.ObjectiveConfig,
                   mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES, *,
                   runtime: Runtime = DEFAULT_RUNTIME
                   ) -> Callable[[Any, Batch], dict[str, Array]]:
  """The jitted `(params, batch) -> sums` of the objective (no gradient).

  Add the sums of several batches and call `objective.finalize` for their loss
  and metrics over the whole set. With `objective.random_block_offset`, each row's
  blocks are shifted by `objective.block_offsets` of a fixed key and the row's tokens
  (the same on every call, on any number of processes).
  """
  params_sharding = sharding.param_shardings(model_config, mesh, rules, runtime=runtime)

  def evaluate(params, batch):
    batch = _with_block_offsets(objective, batch, jax.random.key(0))
    with sharding.activation_sharding(mesh, rules):
      return objective_lib.objective_sums(model_config, params, batch, objective,
                                          runtime=runtime)

  return jax.jit(evaluate,
                 in_shardings=(params_sharding, sharding.batch_sharding(mesh, rules)),
                 out_shardings=sharding.replicated(mesh))
