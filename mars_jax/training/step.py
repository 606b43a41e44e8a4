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

With `runtime.lora` (mars_jax/training/lora.py) the state's params hold the frozen weights and
the adapters; gradients, clipping and the optimizer state cover the adapters (and the
mask row) alone, and the frozen weights pass through the step unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from mars_jax.training import objective as objective_lib
from mars_jax.models import lora
from mars_jax.parallel import sharding
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Runtime

Array = jax.Array
Batch = dict[str, Array]


@flax.struct.dataclass
class TrainState:
  """step: int32[] (optimizer steps taken); params: model params; opt_state: tx state
  of the trainable params (`lora.partition`: all of them without LoRA)."""
  step: Array
  params: Any
  opt_state: Any


def abstract_train_state(model_config: qwen2.Qwen2Config, tx: optax.GradientTransformation,
                         *, runtime: Runtime = DEFAULT_RUNTIME) -> TrainState:
  """`TrainState` of `jax.ShapeDtypeStruct`s (nothing allocated), e.g. an orbax target."""
  params = qwen2.abstract_params(model_config, runtime=runtime)
  return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                    opt_state=jax.eval_shape(tx.init, lora.partition(params)[0]))


def train_state_shardings(model_config: qwen2.Qwen2Config, tx: optax.GradientTransformation,
                          mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES, *,
                          runtime: Runtime = DEFAULT_RUNTIME) -> TrainState:
  """`TrainState` of `NamedSharding`s: params by logical axes, moments like their params."""
  params = sharding.param_shardings(model_config, mesh, rules, runtime=runtime)
  opt_state = sharding.opt_state_shardings(
      tx, lora.partition(qwen2.abstract_params(model_config, runtime=runtime))[0],
      lora.partition(params)[0], mesh)
  return TrainState(step=sharding.replicated(mesh), params=params, opt_state=opt_state)


def init_train_state(model_config: qwen2.Qwen2Config, tx: optax.GradientTransformation,
                     mesh: Mesh, *, params: Any = None, rng: Array | None = None,
                     rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES,
                     runtime: Runtime = DEFAULT_RUNTIME) -> TrainState:
  """A sharded step-0 state from given `params` (e.g. `hf.load_pretrained`, in
  `runtime`'s layout), or a random init from `rng` computed directly in its shardings.
  With `runtime.lora`, `params` are the base weights (no adapters) and the adapters are
  added from `rng` (default key 0), `lora.add_adapters`."""
  shardings = train_state_shardings(model_config, tx, mesh, rules, runtime=runtime)
  base = lora.without_lora(runtime)
  key = jax.random.key(0) if rng is None else rng

  def build(p, r):
    if runtime.lora is not None:
      p = lora.add_adapters(model_config, p, runtime, jax.random.fold_in(r, 1))
    return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                      opt_state=tx.init(lora.partition(p)[0]))

  if params is None:
    if rng is None:
      raise ValueError("init_train_state needs params or rng.")
    return jax.jit(lambda r: build(qwen2.init_params(model_config, r, runtime=base), r),
                   out_shardings=shardings)(rng)
  base_shardings = sharding.param_shardings(model_config, mesh, rules, runtime=base)
  params = jax.device_put(params, base_shardings)
  return jax.jit(build, in_shardings=(base_shardings, None),
                 out_shardings=shardings)(params, key)


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
                   runtime: Runtime = DEFAULT_RUNTIME, dropout_rng: Array | None = None
                   ) -> tuple[Any, dict[str, Array]]:
  """Gradients of the normalised loss and the objective's sums, accumulated over micro-batches.

  The loss is a sum over micro-batches divided once by the whole batch's
  denominator, so any `micro_batches` gives the gradient of the full batch.
  Gradients are taken of the trainable params alone (`lora.partition`: the adapters
  and the mask row under LoRA, every param without). `dropout_rng`: the adapters'
  dropout, one key for every micro-batch (each token's masks are drawn from it, the
  row's tokens and the token's place in its row, `layers.dropout_ids`, so a token gets
  the same masks in whichever micro-batch, on whichever process or context shard, it
  lands); None: no dropout.
  -> (grads: like the trainable params, sums: see `objective.objective_sums`).
  """
  trainable, frozen = lora.partition(params)

  def sum_loss(t, mb):
    sums = objective_lib.objective_sums(model_config, lora.combine(t, frozen), mb, objective,
                                        runtime=runtime, dropout_rng=dropout_rng)
    return sums["loss"], sums

  grad_fn = jax.grad(sum_loss, has_aux=True)
  if micro_batches == 1:
    grads, sums = grad_fn(trainable, batch)
  else:
    mbs = split_micro_batches(batch, micro_batches)
    first = jax.tree.map(lambda x: x[0], mbs)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32),
                         jax.eval_shape(grad_fn, trainable, first))

    def body(acc, mb):
      if micro_batch_sharding is not None:
        mb = jax.lax.with_sharding_constraint(mb, micro_batch_sharding)
      out = grad_fn(trainable, mb)
      return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out), None

    (grads, sums), _ = jax.lax.scan(body, zeros, mbs)
  denom = jnp.maximum(sums["denom"], 1.0)
  grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, trainable)
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
    key = jax.random.fold_in(jax.random.key(seed), state.step)
    batch = _with_block_offsets(objective, batch, key)
    dropout = runtime.lora is not None and runtime.lora.dropout > 0
    with sharding.activation_sharding(mesh, rules):
      grads, sums = loss_and_grads(model_config, objective, state.params, batch,
                                   micro_batches=micro_batches,
                                   micro_batch_sharding=batch_shardings, runtime=runtime,
                                   dropout_rng=jax.random.fold_in(key, 1) if dropout else None)
    trainable, frozen = lora.partition(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, trainable)
    params = lora.combine(optax.apply_updates(trainable, updates), frozen)
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
