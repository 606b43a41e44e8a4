"""Blockwise attention with the mask from per-token vectors (`mars_jax.models.flash`):
its mask is the two-stream rule of `training.masks`; its outputs and gradients equal
the dense attention's, and the MARS and AR-SFT losses and gradients through it equal
the "xla" ones (fp32, 1e-5) over packed rows, random block offsets, the target-block
stream, both intra-block modes, B 4 and 16, GQA and Qwen3's q/k norm; and nothing it
computes, forward or backward, is [T, T]."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_objective import MASK, TOL, max_tree_diff, random_params, tiny_config

from mars_jax.models import attention, flash, qwen2
from mars_jax.training import masks, objective

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

RT = qwen2.Runtime(scan_layers=False)
FLASH = RT.replace(attention_impl="flash")


def random_rows(b: int, length: int, seed: int) -> dict:
  """Packed rows of random segments (some padding at the end), random prompts and
  responses, and random block offsets."""
  rng = np.random.default_rng(seed)
  segments = np.zeros((b, length), np.int32)
  loss_mask = np.zeros((b, length), bool)
  for r in range(b):
    start, seg = 0, 1
    while start < length - 8:
      n = int(rng.integers(8, max(9, length // 2)))
      end = min(start + n, length - int(rng.integers(0, 4)))
      segments[r, start:end] = seg
      prompt = start + int(rng.integers(1, max(2, (end - start) // 2)))
      loss_mask[r, prompt:end] = True
      start, seg = end, seg + 1
  return {"tokens": rng.integers(0, MASK, (b, length)).astype(np.int32),
          "loss_mask": loss_mask, "segment_ids": segments,
          "positions": np.asarray(masks.segment_positions(jnp.asarray(segments))),
          "block_offset": rng.integers(0, 16, b).astype(np.int32)}


def two_stream_mask(batch, block_size, intra_block, stream_length=None):
  """The objective's [clean | target stream] TokenMask of `batch`."""
  f = objective.prepare(batch)
  stream = objective.target_stream(f, block_size, stream_length or f["tokens"].shape[1])
  return objective._two_stream(f, stream, block_size, MASK, intra_block)[2], f, stream


@pytest.mark.parametrize("block_size,intra_block", [(4, "causal"), (16, "bidirectional")])
def test_token_mask_is_the_two_stream_rule(block_size, intra_block):
  batch = random_rows(3, 96, seed=block_size)
  mask, f, stream = two_stream_mask(batch, block_size, intra_block, stream_length=64)
  want = masks.two_stream_target_mask(
      f["segment_ids"], f["block_pos"], objective._gather(f["segment_ids"], stream),
      objective._gather(f["block_pos"], stream), block_size, intra_block=intra_block)
  np.testing.assert_array_equal(np.asarray(flash.dense_mask(mask)), np.asarray(want))
  causal = flash.dense_mask(flash.causal(jnp.asarray(batch["segment_ids"])))
  np.testing.assert_array_equal(np.asarray(causal), np.asarray(
      masks.segment_causal_mask(jnp.asarray(batch["segment_ids"]))))


@pytest.mark.parametrize("heads,kv_heads,tile", [(4, 2, 16), (4, 4, 8), (6, 2, 128)])
def test_outputs_and_gradients_equal_the_dense_attention(heads, kv_heads, tile):
  """Every query that sees a key gets the dense attention's output; the gradients of a
  loss over them are the dense ones (tiles that do and do not divide T)."""
  batch = random_rows(2, 56, seed=heads + tile)
  mask = two_stream_mask(batch, 4, "causal", stream_length=40)[0]
  dense = flash.dense_mask(mask)
  t, d = dense.shape[1], 8
  rng = np.random.default_rng(0)
  q, k, v, w = (jnp.asarray(rng.normal(size=(2, t, n, d)), jnp.float32)
                for n in (heads, kv_heads, kv_heads, heads))
  sees = jnp.any(dense, axis=-1)[:, :, None, None]

  def loss(fn, q, k, v):
    return jnp.sum(jnp.where(sees, fn(q, k, v), 0.0) * w)
  want, g_want = jax.value_and_grad(functools.partial(
      loss, lambda *a: attention.attention(*a, dense, "xla")), argnums=(0, 1, 2))(q, k, v)
  got, g_got = jax.value_and_grad(functools.partial(
      loss, lambda *a: flash.flash_attention(*a, mask, tile=tile)), argnums=(0, 1, 2))(q, k, v)
  assert abs(float(want) - float(got)) < TOL * abs(float(want))
  assert max_tree_diff(g_want, g_got) < TOL
  out = flash.flash_attention(q, k, v, mask, tile=tile)
  assert float(jnp.max(jnp.abs(jnp.where(sees, 0.0, out)))) == 0.0  # blind queries: zeros


def _losses(config, params, batch, runtime, **kw):
  mars = jax.value_and_grad(lambda p: objective.mars_loss(
      config, p, batch, mask_token_id=MASK, runtime=runtime, attention_chunk=None, **kw),
      has_aux=True)(params)
  ar = jax.value_and_grad(lambda p: objective.ar_sft_loss(
      config, p, batch, runtime=runtime, attention_chunk=None,
      stream_length=kw.get("stream_length")), has_aux=True)(params)
  return mars, ar


@pytest.mark.parametrize("family,block_size,intra_block,length", [
    ("qwen2", 4, "causal", 80),
    pytest.param("qwen3", 16, "bidirectional", 80, marks=pytest.mark.e2e),
    pytest.param("qwen2", 16, "causal", 2048, marks=pytest.mark.e2e)])
def test_losses_and_gradients_equal_the_dense_ones(family, block_size, intra_block, length):
  config = tiny_config()
  if family == "qwen3":
    config = dataclasses.replace(config, model_type="qwen3", head_dim=8)
  params = random_params(config)
  batch = random_rows(2 if length < 1024 else 1, length, seed=length + block_size)
  stream = int(np.max(objective.target_block_lengths(objective.prepare(batch), block_size)))
  kw = dict(block_size=block_size, intra_block=intra_block, stream_length=stream)
  (mars, g_mars), (ar, g_ar) = _losses(config, params, batch, RT, **kw)
  (mars_f, g_mars_f), (ar_f, g_ar_f) = _losses(config, params, batch, FLASH, **kw)
  assert abs(float(mars[0]) - float(mars_f[0])) < TOL
  assert abs(float(ar[0]) - float(ar_f[0])) < TOL
  assert max_tree_diff(g_mars, g_mars_f) < TOL and max_tree_diff(g_ar, g_ar_f) < TOL
  for key in mars[1]:
    assert abs(float(mars[1][key]) - float(mars_f[1][key])) < TOL, key


def _largest(jaxpr) -> int:
  """The most elements of any value in a jaxpr and the jaxprs inside it (loops, conds,
  remat, custom derivatives)."""
  most = 0
  for eqn in jaxpr.eqns:
    most = max([most] + [int(np.prod(v.aval.shape)) for v in eqn.outvars
                         if hasattr(v.aval, "shape")])
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          most = max(most, _largest(inner))
  return most


@pytest.mark.parametrize("remat", ["none", "full"])
def test_nothing_grows_with_the_square_of_the_row(remat):
  """The MARS loss's value and gradients through flash, traced at L = 512 and 1024 (a
  layer scan, with and without remat): its largest value doubles with the row, where
  the "xla" pass's grows four times (its [T, T] scores). Tile-by-tile values stacked
  over the tiles of both axes would grow four times too."""
  config = tiny_config()
  runtime = qwen2.Runtime(remat=remat)
  params = qwen2.relayout(random_params(config), runtime)

  def largest(length, impl):
    batch = random_rows(1, length, seed=3)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: objective.mars_loss(
        config, p, batch, block_size=4, mask_token_id=MASK, stream_length=length,
        runtime=runtime.replace(attention_impl=impl), attention_chunk=None)[0]))(params)
    return _largest(jaxpr.jaxpr)
  assert largest(1024, "xla") >= 3.5 * largest(512, "xla")
  assert largest(1024, "flash") <= 2.2 * largest(512, "flash")


def test_a_mars_train_step_at_8192_positions_runs_in_linear_memory():
  """One MARS train step (value, gradients, AdamW) over a row of 4096 tokens a stream
  (T = 8192 with every block kept), attention "auto": off TPU it runs blockwise from
  `attention.FLASH_FROM` positions on. XLA's temporaries stay under 64 MiB (the [T, T]
  scores alone would be 256 MiB a head), and the step's loss is finite."""
  from mars_jax.parallel import sharding  # pylint: disable=import-outside-toplevel
  from mars_jax.training import optimizer, step as train_step  # pylint: disable=import-outside-toplevel
  length = 4096
  assert 2 * length >= attention.FLASH_FROM
  config = tiny_config()
  runtime = qwen2.Runtime(attention_impl="auto", remat="full")
  obj = objective.ObjectiveConfig(kind="mars", block_size=16, mask_token_id=MASK,
                                  stream_length=length)
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(learning_rate=1e-3, total_steps=10))
  mesh = sharding.make_mesh(sharding.MeshConfig(-1, 1, 1), devices=jax.devices()[:1])
  state = train_step.init_train_state(config, tx, mesh, runtime=runtime,
                                      params=qwen2.relayout(random_params(config), runtime))
  step = train_step.make_train_step(config, obj, tx, mesh, runtime=runtime)
  batch = {k: jnp.asarray(v) for k, v in random_rows(1, length, seed=9).items()
           if k in ("tokens", "loss_mask", "segment_ids", "positions")}
  compiled = step.lower(state, batch).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2 ** 20
  _, metrics = compiled(state, batch)
  assert np.isfinite(float(metrics["loss"]))
