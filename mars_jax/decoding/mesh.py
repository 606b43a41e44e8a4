"""Decoding on a mesh: where the weights and the loop state live, the `--mesh` flag, and
the decode loop lowered for any mesh without allocating anything (`lower_decode`).

A decoding mesh has the training axes but context (data, fsdp, tensor) and its own
rule table,
`sharding.DECODE_RULES`: training's, with `embed` unsplit (a decoding forward gathers
no weights), so an fsdp axis splits rows, as data does:

  weights         heads, kv_heads, mlp, vocab on tensor; the rest replicated
  KV cache        [L, b, kv_heads, S, head_dim]: b on (data, fsdp), kv_heads on tensor
  seq             [b, S]: b on (data, fsdp)
  per-row state   [b] (cursors, budgets, gates, done, forwards): on (data, fsdp)
  steps           replicated

A dimension its mesh axes do not divide stays replicated (2 kv heads on tensor=4).
The loop kernels take the mesh as a static argument and pin the state to these
shardings as they run (`loop.pin`); the batch bucket is rounded up to a multiple of
data x fsdp (`batch_rows`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mars_jax.parallel import sharding
from mars_jax.core.choices import Mode
from mars_jax.decoding import batching, loop
from mars_jax.decoding.loop import DecodeState
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime


def param_shardings(config: Qwen2Config, mesh: Mesh,
                    runtime: Runtime = DEFAULT_RUNTIME) -> Any:
  """`NamedSharding` of every parameter for decoding (nothing allocated)."""
  return sharding.param_shardings(config, mesh, sharding.DECODE_RULES, runtime=runtime)


def state_shardings(config: Qwen2Config, mesh: Mesh, *, batch: int, cache_len: int,
                    runtime: Runtime = DEFAULT_RUNTIME,
                    stop_ids: int = loop.STOP_BUCKET) -> DecodeState:
  """A `DecodeState` of the `NamedSharding` of every field (b = batch, S = cache_len)."""
  shapes = jax.eval_shape(functools.partial(loop.new_state, config, batch, cache_len,
                                            runtime=runtime, stop_ids=stop_ids))
  return sharding.logical_shardings(loop.state_axes(), shapes, mesh, sharding.DECODE_RULES)


def row_shards(mesh: Mesh | None) -> int:
  """How many ways the rows are split (data x fsdp; 1 without a mesh)."""
  if mesh is None:
    return 1
  return sharding.num_batch_shards(sharding.batch_sharding(mesh, sharding.DECODE_RULES))


def batch_rows(n: int, mesh: Mesh | None) -> int:
  """The batch bucket of n rows: a power of two, rounded up to a multiple of the row
  shards."""
  k = row_shards(mesh)
  return -(-batching.pow2(n) // k) * k


def place_params(config: Qwen2Config, params: Any, mesh: Mesh,
                 runtime: Runtime = DEFAULT_RUNTIME) -> Any:
  """params (host arrays, or device arrays anywhere) placed with the decode shardings;
  params already placed so are returned as they are."""
  return jax.device_put(params, param_shardings(config, mesh, runtime))


def new_state(config: Qwen2Config, mesh: Mesh, batch: int, cache_len: int, *,
              runtime: Runtime = DEFAULT_RUNTIME, stop_ids: int = loop.STOP_BUCKET
              ) -> DecodeState:
  """`loop.new_state` created in place on the mesh, each device holding its shard."""
  make = functools.partial(loop.new_state, config, batch, cache_len, runtime=runtime,
                           stop_ids=stop_ids)
  return jax.jit(make, out_shardings=state_shardings(
      config, mesh, batch=batch, cache_len=cache_len, runtime=runtime, stop_ids=stop_ids))()


def parse_mesh(text: str) -> sharding.MeshConfig:
  """"tensor=8" or "data=2,tensor=4" -> `MeshConfig` (axes not named: fsdp and tensor
  1, data filled from the device count)."""
  sizes = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    axes = [a for a in sharding.AXES if a != "context"]
    if name.strip() == "context":
      raise ValueError(f"mesh {text!r}: decoding has no context axis (context parallelism "
                       "splits training rows); split rows with data or fsdp and heads with "
                       "tensor.")
    if name.strip() not in axes or not size.strip().lstrip("-").isdigit():
      raise ValueError(f"mesh {text!r}: expected AXIS=SIZE pairs joined by commas, "
                       f"AXIS one of {', '.join(axes)} (e.g. tensor=8 or "
                       "data=2,tensor=4).")
    sizes[name.strip()] = int(size)
  return sharding.MeshConfig(**sizes)


def mesh_from_flag(text: str | None, devices=None) -> Mesh | None:
  """The decoding mesh a `--mesh` flag (or lm-eval's `mesh=` model arg) asks for, over
  `devices` (default: all); None for no flag (one device)."""
  if not text:
    return None
  config = parse_mesh(text)
  devices = list(jax.devices() if devices is None else devices)
  try:
    return sharding.make_mesh(config, devices)
  except ValueError as e:
    raise ValueError(f"{e} Pick sizes whose product divides the {len(devices)} "
                     f"device(s), e.g. tensor={len(devices)}.") from None


def lower_decode(config: Qwen2Config, mesh: Mesh, *, batch: int, prompt_len: int,
                 cache_len: int, window: int, runtime: Runtime = DEFAULT_RUNTIME,
                 mode: Mode = "gated") -> jax.stages.Lowered:
  """`loop.decode` on `mesh` lowered on sharded `ShapeDtypeStruct`s (nothing allocated,
  so any mesh works, e.g. one of compile-only TPU devices): params as
  `param_shardings`, the prompt [batch, prompt_len] and the per-row inputs [batch] split
  over data x fsdp. `.compile().memory_analysis()` gives the per-device bytes."""
  if batch % row_shards(mesh):
    raise ValueError(f"batch={batch} rows do not divide over the mesh's data x fsdp = "
                     f"{row_shards(mesh)}; use a multiple of it.")
  def spec(shape, dtype, where):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=where)
  params = jax.tree.map(lambda x, s: spec(x.shape, x.dtype, s),
                        qwen2.abstract_params(config, runtime=runtime),
                        param_shardings(config, mesh, runtime))
  rows, one = sharding.batch_sharding(mesh, sharding.DECODE_RULES), sharding.replicated(mesh)
  per_row = [spec((batch,), jnp.int32, rows) for _ in range(2)]
  controls = jax.tree.map(lambda x: spec(x.shape, x.dtype, rows), loop.new_controls(batch))
  return loop.decode.lower(
      config, params, spec((batch, prompt_len), jnp.int32, rows), *per_row, controls,
      spec((batching.EOS_BUCKET,), jnp.int32, one), spec((), jnp.int32, one),
      window=window, mode=mode, cache_len=cache_len, runtime=runtime, mesh=mesh)
