"""attention_impl="splash" (the Pallas TPU kernel, interpreted on CPU) gives the losses and
gradients of "xla"; "auto" is "xla" on CPU and compiles the kernel for a TPU mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.parallel import sharding
from mars_jax.training import masks, objective, optimizer, step as train_step
from mars_jax.models import attention, flash, qwen2, splash

from test_objective import MASK, random_params, tiny_config

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

TOL = 1e-5
# Unrolled layers, as test_objective's params: they compile faster on CPU.
XLA = qwen2.Runtime(attention_impl="xla", scan_layers=False)
SPLASH = qwen2.Runtime(attention_impl="splash", scan_layers=False)
AUTO = qwen2.Runtime(attention_impl="auto", scan_layers=False)


def packed_batch(block_size):
  """Two packed rows (segments of different lengths, padding at the end) with random
  block offsets."""
  rng = np.random.default_rng(5)
  segs = np.array([[1] * 7 + [2] * 9 + [0] * 2, [3] * 12 + [4] * 5 + [0]], np.int32)
  loss_mask = np.zeros(segs.shape, bool)
  loss_mask[0, 4:7] = loss_mask[0, 13:16] = True
  loss_mask[1, 9:12] = loss_mask[1, 15:17] = True
  tokens = rng.integers(0, MASK, segs.shape).astype(np.int32)
  offsets = objective.block_offsets(jax.random.key(3), jnp.asarray(tokens), block_size)
  return {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": segs,
          "block_offset": offsets}


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def loss_and_grads(config, params, batch, obj, runtime):
  """(loss, metrics), grads of the normalised objective."""
  return jax.value_and_grad(lambda p: objective.finalize(objective.objective_sums(
      config, p, batch, obj, runtime=runtime)), has_aux=True)(params)


def max_tree_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))


@pytest.mark.parametrize("kind", ["mars", "ar_sft"])
def test_splash_loss_and_gradients_equal_xla(kind):
  """MARS ([clean | target stream], packed, padded, shifted blocks) and AR-SFT: the
  splash loss, metrics and gradients equal the dense "xla" reference's."""
  config = tiny_config()
  params = random_params(config)
  batch = packed_batch(4)
  assert len(set(np.asarray(batch["block_offset"]).tolist())) > 1
  dense = objective.ObjectiveConfig(kind=kind, mask_token_id=MASK, attention_chunk=None)
  default = objective.ObjectiveConfig(kind=kind, mask_token_id=MASK)
  (ref, m_ref), g_ref = loss_and_grads(config, params, batch, dense, XLA)
  (out, m_out), g_out = loss_and_grads(config, params, batch, default, SPLASH)
  assert float(ref) > 1.0
  assert abs(float(ref) - float(out)) < TOL
  assert max_tree_diff(g_ref, g_out) < TOL
  for key in m_ref:
    assert abs(float(m_ref[key]) - float(m_out[key])) < TOL, key


def test_splash_skips_empty_blocks_and_keeps_blind_queries_finite(monkeypatch):
  """A two-stream mask over 2 x 100 positions in 128-wide tiles, one of the four empty:
  outputs and gradients of the queries that see a key equal "xla"; padding queries,
  which see none, stay finite."""
  monkeypatch.setattr(splash, "MAX_BLOCK", 128)
  length, b, h, kvh, d = 100, 1, 2, 1, 16
  seg = jnp.asarray(np.r_[[1] * 60, [2] * 32, [0] * 8][None], jnp.int32)
  mask = masks.two_stream_segment_mask(seg, masks.segment_positions(seg), 4)
  blocks = splash.kernel_mask(mask, 256, 256).reshape(2, 128, 2, 128).any(axis=(1, 3))
  np.testing.assert_array_equal(blocks, [[True, False], [True, True]])
  q, k, v = (jax.random.normal(key, (b, 2 * length, n, d)) for key, n in
             zip(jax.random.split(jax.random.key(0), 3), (h, kvh, kvh)))
  seen = jnp.any(mask, axis=-1)[..., None, None]
  loss = lambda impl: lambda *qkv: jnp.sum(
      jnp.where(seen, attention.attention(*qkv, mask, impl), 0.0) ** 2)
  out = jax.jit(splash.splash_attention)(q, k, v, mask)
  assert bool(jnp.all(jnp.isfinite(out))) and not bool(jnp.all(seen))
  ref = attention.attention(q, k, v, mask, "xla")
  assert float(jnp.max(jnp.abs(jnp.where(seen, out - ref, 0.0)))) < TOL
  g_ref = jax.grad(loss("xla"), (0, 1, 2))(q, k, v)
  g_out = jax.jit(jax.grad(loss("splash"), (0, 1, 2)))(q, k, v)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in g_out)
  scale = max(float(jnp.max(jnp.abs(g))) for g in g_ref)
  assert max_tree_diff(g_ref, g_out) < TOL * scale


def _packed_mars_mask(intra_block):
  """Three packed rows of 300 tokens (one, two and three segments, padding at the ends,
  random block offsets), their MARS pass with a target stream of 171: 471 positions."""
  rng = np.random.default_rng(1)
  segs = np.zeros((3, 300), np.int32)
  segs[0, :140], segs[0, 140:280], segs[1] = 1, 2, 5
  segs[2, :30], segs[2, 30:61], segs[2, 61:100] = 1, 2, 3
  batch = {"tokens": np.zeros(segs.shape, np.int32), "segment_ids": segs,
           "loss_mask": (segs != 0) & (rng.random(segs.shape) < 0.6),
           "block_offset": rng.integers(0, 4, 3).astype(np.int32)}
  return objective.two_stream_token_mask(batch, block_size=4, stream_length=171,
                                         intra_block=intra_block)


@pytest.mark.parametrize("intra_block", ["causal", "bidirectional"])
def test_splash_from_token_vectors_equals_flash_and_falls_back(intra_block, monkeypatch):
  """`token_splash_attention` (the kernel interpreted, 128-wide blocks: 471 positions in
  4 x 4 blocks, empty, partial and full, packed MARS rows with padding) equals
  `flash_attention` and the dense "xla" attention, outputs and gradients, its block
  table and partial blocks read off the per-token vectors, nothing [t, t] in its
  program (its table has a slot for every block up to 8 tiles a side, as many entries
  as the padded mask, but no [t, t] mask is drawn): with room for every block, and with
  a capacity under lax.cond; a batch with a row of more partial blocks than the
  capacity runs flash instead, gradients too."""
  monkeypatch.setattr(splash, "MAX_BLOCK", 128)
  mask = _packed_mars_mask(intra_block)
  b, t = mask.segment.shape
  kinds = np.asarray(splash.block_kinds(mask, 128))   # padded to 512 inside
  partial = (kinds == 1).sum(axis=(1, 2))
  assert t == 471 and kinds.shape == (3, 4, 4) and (kinds == 0).any() and (kinds == 2).any()
  q, k, v = (jax.random.normal(key, (b, t, n, 16)) for key, n in
             zip(jax.random.split(jax.random.key(0), 3), (4, 2, 2)))
  live = (mask.segment != 0)[:, :, None, None]
  loss = lambda fn: lambda *qkv: jnp.sum(jnp.where(live, fn(*qkv, mask), 0.0) ** 2
                                         * jnp.cos(jnp.arange(16)))
  ref = flash.flash_attention(q, k, v, mask)
  g_ref = jax.grad(loss(flash.flash_attention), (0, 1, 2))(q, k, v)
  scale = max(float(jnp.max(jnp.abs(g))) for g in g_ref)
  dense = attention.attention(q, k, v, flash.dense_mask(mask), "xla")
  real_flash = flash.flash_attention
  monkeypatch.setattr(flash, "flash_attention", lambda *a, **kw: jnp.full(q.shape, jnp.nan))
  fresh = lambda: jax.jit(lambda *a: splash.token_splash_attention(*a))  # traced anew
  # room for every block (the default up to 8 tiles), then 3 a tile under lax.cond
  for whole, per_tile in ((splash.WHOLE_TABLE_TILES, splash.PARTIAL_PER_TILE), (2, 3)):
    monkeypatch.setattr(splash, "WHOLE_TABLE_TILES", whole)
    monkeypatch.setattr(splash, "PARTIAL_PER_TILE", per_tile)
    assert 4 < max(partial) <= splash.partial_capacity(4) == (16 if whole >= 4 else 12)
    jaxpr = str(jax.make_jaxpr(splash.token_splash_attention)(q, k, v, mask))
    assert f"{t},{t}]" not in jaxpr and "512,512]" not in jaxpr
    out = fresh()(q, k, v, mask)   # the kernel: flash would give NaN
    assert float(jnp.max(jnp.abs(out - ref))) < TOL
    assert float(jnp.max(jnp.abs(jnp.where(live, out - dense, 0.0)))) < TOL
    g_out = jax.jit(jax.grad(loss(lambda *a: splash.token_splash_attention(*a)),
                             (0, 1, 2)))(q, k, v)
    assert max_tree_diff(g_ref, g_out) < TOL * scale
  monkeypatch.setattr(splash, "PARTIAL_PER_TILE", 1)   # capacity 4: a row exceeds it
  assert bool(jnp.all(jnp.isnan(fresh()(q, k, v, mask))))
  monkeypatch.setattr(flash, "flash_attention", real_flash)
  assert max_tree_diff(fresh()(q, k, v, mask), ref) == 0.0
  g_out = jax.jit(jax.grad(loss(lambda *a: splash.token_splash_attention(*a)),
                           (0, 1, 2)))(q, k, v)
  assert max_tree_diff(g_ref, g_out) == 0.0


def test_auto_is_xla_on_cpu():
  """attention_impl="auto" lowered for CPU is the "xla" attention, bit for bit."""
  config, batch = tiny_config(), packed_batch(4)
  params = random_params(config)
  obj = objective.ObjectiveConfig(mask_token_id=MASK)
  (ref, _), g_ref = loss_and_grads(config, params, batch, obj, XLA)
  (out, _), g_out = loss_and_grads(config, params, batch, obj, AUTO)
  assert float(ref) == float(out) and max_tree_diff(g_ref, g_out) == 0.0


@pytest.mark.e2e   # time: the default suite's 12 minutes
def test_auto_train_step_compiles_splash_for_tpu():
  """The MARS train step with attention_impl="auto" (the shipped configs') compiles for
  4 TPU v5p chips (fsdp=4, compile only: JAX_PLATFORMS=cpu) with the splash kernel's
  Mosaic custom call in it."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=1),
                            devices=topo.devices)
  config = tiny_config()
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig())
  obj = objective.ObjectiveConfig(mask_token_id=MASK, random_block_offset=True)
  step = train_step.make_train_step(config, obj, tx, mesh, runtime=AUTO)
  state = train_step.abstract_train_state(config, tx, runtime=AUTO)
  batch = {"tokens": jax.ShapeDtypeStruct((8, 256), jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct((8, 256), bool),
           "segment_ids": jax.ShapeDtypeStruct((8, 256), jnp.int32)}
  lowered = step.lower(state, batch)
  assert "tpu_custom_call" in lowered.as_text()
  compiled = lowered.compile()
  assert compiled.memory_analysis().temp_size_in_bytes > 0
