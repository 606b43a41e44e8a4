"""Mesh, shardings and the train step: sharded == single device, accumulated == full batch,
activation constraints and named remat checkpoints.

The 8-device comparison runs this file as a subprocess with
`--xla_force_host_platform_device_count=8`: the device count is fixed when a
process first touches its CPU backend, which the rest of the test session does.
The (data=2, tensor=2) comparison of loss and gradients runs there on 4 of them.
"""

import functools
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from test_flash import random_rows, two_stream_mask

from mars_jax.parallel import sharding
from mars_jax.training import objective, optimizer, step as train_step
from mars_jax.models import attention, context, flash, qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

TOL = 1e-5
VOCAB = 128
MASK = VOCAB - 1
LAYOUTS = [  # (data, fsdp, tensor, micro_batches, objective kind)
    (1, 8, 1, 1, "mars"), (2, 2, 2, 1, "mars"), (1, 2, 4, 2, "mars"), (4, 1, 2, 1, "ar_sft")]
# (objective, row length L, stream length n, mesh): n not a multiple of 8 or of the
# shards, T = L + n not a multiple of c, odd c, and tensor x context x fsdp.
CONTEXT_CASES = [("mars", 100, 63, dict(data=1, fsdp=2, context=2, tensor=2)),
                 ("mars", 101, 62, dict(data=1, context=3, tensor=2)),
                 ("ar_sft", 101, 63, dict(data=2, context=4))]
# The K/V ring alone (row length, stream length, mesh, query heads, rows; 2 kv heads):
# odd c beside tensor; query heads split where the kv heads cannot be, each shard's
# heads inside one group (tensor 4) and straddling two (6 heads on tensor 3); and a
# row long enough (T = 2200 > 2 * 8 tiles) to be dealt in whole tiles over 8 shards.
RING_CASES = [(101, 62, dict(data=1, context=3, tensor=2), 4, 2),
              (61, 30, dict(data=1, context=2, tensor=4), 4, 2),
              (61, 30, dict(data=1, context=2, tensor=3), 6, 2),
              (1600, 600, dict(data=1, context=8), 4, 1)]


def tiny_config():
  return qwen2.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           rope_theta=10000.0)


def packed_batch(rows=16, length=12, seed=0):
  """Rows holding one or two samples (segments), padding, varying prompt lengths."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, MASK, (rows, length)).astype(np.int32)
  segment_ids = np.ones((rows, length), np.int32)
  loss_mask = np.zeros((rows, length), bool)
  for r in range(rows):
    cut, end = 3 + r % 5, length - r % 3
    segment_ids[r, cut:] = 2 if r % 2 else 1
    segment_ids[r, end:] = 0
    loss_mask[r, cut // 2:cut] = True
    loss_mask[r, cut + 2:end] = True
  return {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": segment_ids}


def run_steps(config, obj, tx, mesh, params, batch, steps=3, micro_batches=1):
  """-> (per-step metrics, final params) on host."""
  state = train_step.init_train_state(config, tx, mesh, params=params)
  step = train_step.make_train_step(config, obj, tx, mesh, micro_batches=micro_batches)
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  return history, jax.device_get(state.params)


def max_tree_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def make_tx(total_steps=3):
  """AdamW with eps=1e-3. With the usual 1e-8, Adam maps a gradient that is zero up to
  float rounding (k_bias: softmax ignores a shift shared by all keys) to an update of
  about lr * noise / eps, so any two summation orders differ by ~1e-4 whatever the
  sharding; a larger eps keeps the update a well-conditioned function of the gradient."""
  return optimizer.make_optimizer(optimizer.OptimizerConfig(
      learning_rate=1e-2, total_steps=total_steps, warmup_steps=0, weight_decay=0.1,
      eps=1e-3))


def loss_and_grads_fn(config, obj, mesh):
  """Jitted (params, batch) -> (loss, grads) on `mesh`, activations pinned by the rules."""
  def loss_and_grads(params, batch):
    with sharding.activation_sharding(mesh):
      grads, sums = train_step.loss_and_grads(config, obj, params, batch)
    return objective.finalize(sums)[0], grads

  return jax.jit(loss_and_grads, in_shardings=(sharding.param_shardings(config, mesh),
                                               sharding.batch_sharding(mesh)))


def sharding_constraints(lowered_text):
  """Distinct sharding constraints of a lowered module: '<@mesh, [dims]> : tensor<shape>'."""
  return sorted(set(re.findall(r"sdy\.sharding_constraint %\S+ (<.*)", lowered_text)))


def tensor_parallel_vs_single_device():
  """Child process body, on 4 devices: MARS loss and gradients of a (data=2, tensor=2) mesh
  vs one device, and the sharding constraints of the lowered (data=2, tensor=2) function."""
  config, batch = tiny_config(), packed_batch(rows=8)
  params = jax.device_get(qwen2.init_params(config, jax.random.key(4)))
  obj = objective.ObjectiveConfig(kind="mars", block_size=4, mask_token_id=MASK)
  one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  mesh = sharding.make_mesh(sharding.MeshConfig(2, 1, 2), jax.devices()[:4])
  ref_loss, ref_grads = jax.device_get(loss_and_grads_fn(config, obj, one)(params, batch))
  fn = loss_and_grads_fn(config, obj, mesh)
  loss, grads = jax.device_get(fn(params, batch))
  return dict(loss_diff=abs(float(loss) - float(ref_loss)),
              grad_diff=max_tree_diff(grads, ref_grads),
              grad_max=max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads)),
              constraints=sharding_constraints(fn.lower(params, batch).as_text()))


def context_parallel_vs_single_device():
  """Child process body: MARS (random block offsets, the target-block stream) and AR-SFT
  loss and gradients over packed rows with the positions split over `context` (each
  case of `CONTEXT_CASES`), vs one device; and whether the context meshes lowered the
  sharded attention (shard_map)."""
  config = tiny_config()
  params = jax.device_get(qwen2.init_params(config, jax.random.key(4)))
  one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  out = []
  for kind, length, stream_length, layout in CONTEXT_CASES:
    batch = random_rows(4, length, seed=3)
    obj = objective.ObjectiveConfig(kind=kind, block_size=4, mask_token_id=MASK,
                                    stream_length=stream_length)
    ref_loss, ref_grads = jax.device_get(loss_and_grads_fn(config, obj, one)(params, batch))
    devices = jax.devices()[:math.prod(layout.values())]
    fn = loss_and_grads_fn(config, obj,
                           sharding.make_mesh(sharding.MeshConfig(**layout), devices))
    loss, grads = jax.device_get(fn(params, batch))
    out.append(dict(kind=kind, length=length, stream_length=stream_length, layout=layout,
                    loss_diff=abs(float(loss) - float(ref_loss)),
                    grad_diff=max_tree_diff(grads, ref_grads),
                    grad_max=max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)),
                    sharded_attention="sdy.manual_computation" in fn.lower(
                        params, batch).as_text()))
  return out


def lora_dropout_context_vs_single_device():
  """Child process body: the MARS loss and adapter gradients with LoRA dropout (0.3, its
  key fixed) on (fsdp 2, context 2, tensor 2) vs one device, at the first case of
  `CONTEXT_CASES`, and how far another dropout key moves the loss (the masks matter)."""
  _, length, stream_length, layout = CONTEXT_CASES[0]
  config, batch = tiny_config(), random_rows(4, length, seed=3)
  runtime = qwen2.Runtime(lora=qwen2.LoraSpec(rank=4, alpha=8.0, dropout=0.3,
                                              mask_token_id=MASK))
  params = jax.device_get(qwen2.init_params(config, jax.random.key(4), runtime=runtime))
  noise = iter(jax.random.split(jax.random.key(5), len(jax.tree.leaves(params))))
  params = jax.tree_util.tree_map_with_path(   # B != 0: the adapters (and masks) matter
      lambda path, a: a + 0.1 * np.asarray(jax.random.normal(next(noise), a.shape))
      if "lora_b" in jax.tree_util.keystr(path) else a, params)
  obj = objective.ObjectiveConfig(kind="mars", block_size=4, mask_token_id=MASK,
                                  stream_length=stream_length)

  def run(mesh, key):
    def loss_and_grads(params, batch):
      with sharding.activation_sharding(mesh):
        grads, sums = train_step.loss_and_grads(config, obj, params, batch, runtime=runtime,
                                                dropout_rng=key)
      return objective.finalize(sums)[0], grads
    return jax.device_get(jax.jit(loss_and_grads, in_shardings=(
        sharding.param_shardings(config, mesh, runtime=runtime),
        sharding.batch_sharding(mesh)))(params, batch))
  one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  ref_loss, ref_grads = run(one, jax.random.key(7))
  loss, grads = run(sharding.make_mesh(sharding.MeshConfig(**layout)), jax.random.key(7))
  other, _ = run(one, jax.random.key(8))   # the same program: no compile
  return dict(loss_diff=abs(float(loss) - float(ref_loss)),
              grad_diff=max_tree_diff(grads, ref_grads),
              grad_max=max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads)),
              dropout_moved=abs(float(ref_loss) - float(other)))


def ring_attention_vs_dense():
  """Child process body: `context.attention` (the K/V ring) over MARS passes dealt out
  on context meshes vs the dense attention on one device: loss and gradient differences
  of q, k, v, and whether its jaxpr passes K/V by `ppermute` and gathers nothing."""
  out = []
  for length, stream, layout, heads, rows in RING_CASES:
    mask = two_stream_mask(random_rows(rows, length, seed=5), 4, "causal",
                           stream_length=stream)[0]
    dense = flash.dense_mask(mask)
    t, rng = dense.shape[1], np.random.default_rng(1)
    q, k, v, w = (jnp.asarray(rng.normal(size=(rows, t, n, 8)), jnp.float32)
                  for n in (heads, 2, 2, heads))
    sees = jnp.any(dense, axis=-1)[:, :, None, None]
    devices = jax.devices()[:math.prod(layout.values())]
    mesh = sharding.make_mesh(sharding.MeshConfig(**layout), devices)

    def ring(q, k, v):
      with sharding.activation_sharding(mesh):
        deal = lambda a: context.split(a, context.size())
        dealt = context.attention(deal(q), deal(k), deal(v), mask.map(deal))
        return context.merge(dealt, context.size(), t)

    def loss(fn, q, k, v):
      return jnp.sum(jnp.where(sees, fn(q, k, v), 0.0) * w)
    dense_fn = lambda q, k, v: attention.attention(q, k, v, dense, "xla")
    want, g_want = jax.value_and_grad(functools.partial(loss, dense_fn), (0, 1, 2))(q, k, v)
    fn = jax.value_and_grad(functools.partial(loss, ring), (0, 1, 2))
    # the loss's scale: its terms' magnitudes (the sum itself may nearly cancel)
    scale = float(jnp.sum(jnp.abs(jnp.where(sees, dense_fn(q, k, v), 0.0) * w)))
    whole = NamedSharding(mesh, P())
    got, g_got = jax.jit(fn, in_shardings=(whole,) * 3)(q, k, v)
    jaxpr = str(jax.make_jaxpr(fn)(q, k, v))
    out.append(dict(length=length, layout=layout, heads=heads,
                    loss_diff=abs(float(got) - float(want)) / scale,
                    grad_diff=max_tree_diff(g_got, g_want),
                    ppermute="ppermute" in jaxpr, all_gather="all_gather" in jaxpr))
  return out


def sharded_vs_single_device():
  """Child process body (8 CPU devices): max differences of every layout vs 1 device."""
  config, tx, batch = tiny_config(), make_tx(), packed_batch()
  params = jax.device_get(qwen2.init_params(config, jax.random.key(0)))
  one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  refs, out = {}, {"devices": jax.device_count(), "layouts": []}
  for data, fsdp, tensor, micro, kind in LAYOUTS:
    obj = objective.ObjectiveConfig(kind=kind, block_size=4, mask_token_id=MASK)
    if kind not in refs:
      refs[kind] = run_steps(config, obj, tx, one, params, batch)
    mesh = sharding.make_mesh(sharding.MeshConfig(data, fsdp, tensor))
    history, final = run_steps(config, obj, tx, mesh, params, batch, micro_batches=micro)
    ref_history, ref_final = refs[kind]
    out["layouts"].append(dict(
        layout=[data, fsdp, tensor, micro, kind],
        loss_diff=max(abs(float(a["loss"]) - float(b["loss"]))
                      for a, b in zip(history, ref_history)),
        param_diff=max_tree_diff(final, ref_final),
        loss_moved=float(ref_history[0]["loss"]) - float(ref_history[-1]["loss"])))
  big = qwen2.preset("qwen2.5-72b")
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 2, 4))
  shardings = sharding.param_shardings(big, mesh)
  abstract = qwen2.abstract_params(big)
  out["72b"] = dict(
      params=qwen2.num_params(abstract),
      per_device=sum(int(np.prod(s.shard_shape(a.shape)))
                     for s, a in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract))),
      q_kernel=str(shardings["layers"]["attn"]["q_kernel"].spec),
      k_kernel=str(shardings["layers"]["attn"]["k_kernel"].spec),
      embedding=str(shardings["embedding"].spec))
  out["tensor_parallel"] = tensor_parallel_vs_single_device()
  out["context_parallel"] = context_parallel_vs_single_device()
  out["lora_dropout"] = lora_dropout_context_vs_single_device()
  out["ring"] = ring_attention_vs_dense()
  return out


@pytest.mark.parametrize("random_offset", [False, True])
def test_accumulated_micro_batches_equal_full_batch(random_offset):
  """Micro-batches hold different numbers of sequences (segments) and targets: the loss
  is a sum divided once by the whole batch's denominator, so accumulation is exact
  (with random block offsets too: drawn for the whole batch, split with its rows)."""
  config = tiny_config()
  tx = make_tx(2)
  obj = objective.ObjectiveConfig(block_size=4, mask_token_id=MASK,
                                  random_block_offset=random_offset)
  params = jax.device_get(qwen2.init_params(config, jax.random.key(1)))
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  batch = packed_batch(rows=8)
  full, full_params = run_steps(config, obj, tx, mesh, params, batch, steps=2)
  accumulated, acc_params = run_steps(config, obj, tx, mesh, params, batch, steps=2,
                                      micro_batches=4)
  for a, b in zip(full, accumulated):
    for key in a:
      assert abs(float(a[key]) - float(b[key])) < TOL, key
  assert max_tree_diff(full_params, acc_params) < TOL


def test_bfloat16_compute_keeps_float32_master_params():
  """dtype="bfloat16" with remat: float32 params and moments, the float32 step's loss."""
  config = tiny_config()
  obj = objective.ObjectiveConfig(block_size=4, mask_token_id=MASK)
  params = jax.device_get(qwen2.init_params(config, jax.random.key(3)))
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  batch = packed_batch(rows=4)
  f32_loss, _ = jax.jit(lambda p: objective.mars_loss(config, p, batch, block_size=4,
                                                      mask_token_id=MASK))(params)
  low = qwen2.Runtime(dtype="bfloat16", remat="full")
  state = train_step.init_train_state(config, make_tx(), mesh, params=params, runtime=low)
  state, metrics = train_step.make_train_step(config, obj, make_tx(), mesh,
                                              runtime=low)(state, batch)
  dtypes = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state[1][0].mu))}
  assert dtypes == {np.dtype(np.float32)}
  assert abs(float(metrics["loss"]) - float(f32_loss)) < 0.05 * float(f32_loss)


def test_random_block_offsets_of_the_train_and_eval_steps():
  """The train step's loss is the objective's with the offsets of (seed, step) and each
  row's tokens; the eval step's is the objective's with those of a fixed key."""
  config = tiny_config()
  obj = objective.ObjectiveConfig(block_size=4, mask_token_id=MASK, random_block_offset=True)
  # weights 4x the init's, so that which blocks a row has moves the loss well above TOL
  params = jax.device_get(jax.tree.map(lambda x: 4.0 * x,
                                       qwen2.init_params(config, jax.random.key(4))))
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  batch = packed_batch(rows=8)
  loss_with = jax.jit(lambda p, o: objective.mars_loss(
      config, p, {**batch, "block_offset": o}, block_size=4, mask_token_id=MASK)[0])
  state = train_step.init_train_state(config, make_tx(), mesh, params=params)
  _, metrics = train_step.make_train_step(config, obj, make_tx(), mesh, seed=5)(state, batch)
  drawn = objective.block_offsets(jax.random.fold_in(jax.random.key(5), 0), batch["tokens"], 4)
  assert abs(float(metrics["loss"]) - float(loss_with(params, drawn))) < TOL
  sums = train_step.make_eval_step(config, obj, mesh)(params, batch)
  fixed = objective.block_offsets(jax.random.key(0), batch["tokens"], 4)
  assert abs(float(objective.finalize(sums)[0]) - float(loss_with(params, fixed))) < TOL
  assert abs(float(loss_with(params, fixed)) - float(loss_with(params, 0 * fixed))) > 1e-4


def test_eval_step_sums_add_up_to_the_loss_of_the_whole_set():
  config = tiny_config()
  obj = objective.ObjectiveConfig(block_size=4, mask_token_id=MASK)
  params = qwen2.init_params(config, jax.random.key(2))
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  evaluate = train_step.make_eval_step(config, obj, mesh)
  batch = packed_batch(rows=8)
  halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
  total = jax.tree.map(lambda a, b: a + b, *[evaluate(params, h) for h in halves])
  loss, _ = objective.finalize(total)
  whole, _ = jax.jit(lambda p: objective.mars_loss(config, p, batch, block_size=4,
                                                   mask_token_id=MASK))(params)
  assert abs(float(loss) - float(whole)) < TOL


@pytest.mark.parametrize("scan", [pytest.param(True, marks=pytest.mark.slow), False])
def test_named_remat_equals_no_remat_and_saves_the_named_values(scan, capsys):
  """remat="names": the loss and gradients of remat="none"; unrolled, the residuals the
  backward pass keeps from the layers are exactly the named checkpoints of each layer
  (the scanned stack, equality only, is in the slow set)."""
  config, batch = tiny_config(), packed_batch(rows=4)
  params = qwen2.relayout(qwen2.init_params(config, jax.random.key(5)),
                          qwen2.Runtime(scan_layers=scan))

  def loss_fn(remat):
    runtime = qwen2.Runtime(remat=remat, scan_layers=scan)
    return lambda p: objective.mars_loss(config, p, batch, block_size=4, mask_token_id=MASK,
                                         runtime=runtime)[0]

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn("none")))(params)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn("names")))(params)
  assert abs(float(loss) - float(ref_loss)) < TOL
  assert max_tree_diff(grads, ref_grads) < TOL
  if not scan:  # under scan, residuals leave the loop stacked and unnamed
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(loss_fn("names"), params)
    names = re.findall(r"named '(\w+)'", capsys.readouterr().out)
    assert sorted(names) == sorted(qwen2.CHECKPOINT_NAMES * config.num_hidden_layers)


def test_mesh_config_fills_and_rejects():
  # sizes in AXES order: data, fsdp, context, tensor
  assert sharding.MeshConfig(-1, 2, 2).shape(8) == (2, 2, 1, 2)
  assert sharding.MeshConfig(1, -1, 1).shape(8) == (1, 8, 1, 1)
  assert sharding.MeshConfig(1, 1, 2, context=-1).shape(8) == (1, 1, 4, 2)
  with pytest.raises(ValueError, match="needs 16 devices, but 8"):
    sharding.MeshConfig(2, 4, 2).shape(8)
  with pytest.raises(ValueError, match="not divisible"):
    sharding.MeshConfig(-1, 3, 1).shape(8)
  with pytest.raises(ValueError, match="at most one"):
    sharding.MeshConfig(-1, -1, 1).shape(8)
  with pytest.raises(ValueError, match="needs 2 devices"):
    sharding.make_mesh(sharding.MeshConfig(2, 1, 1), jax.devices()[:1])


def test_fit_spec_replicates_dimensions_the_mesh_does_not_divide():
  mesh = jax.sharding.AbstractMesh((1, 2, 1, 4), sharding.AXES)
  assert sharding.fit_spec(P(None, "fsdp", "tensor", None), (2, 32, 2, 8), mesh) == P(
      None, "fsdp", None, None)
  assert sharding.fit_spec(P(("data", "fsdp")), (6, 5), mesh) == P(("data", "fsdp"), None)
  assert sharding.fit_spec(P(("data", "fsdp")), (5,), mesh) == P(None)


def test_batch_not_divisible_by_micro_batches_and_devices_is_a_clear_error():
  config = tiny_config()
  tx = make_tx()
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  step = train_step.make_train_step(config, objective.ObjectiveConfig(kind="ar_sft"), tx, mesh,
                                    micro_batches=3)
  with pytest.raises(ValueError, match="divisible by micro_batches"):
    step.lower(train_step.abstract_train_state(config, tx), packed_batch(rows=4))


def test_schedule_warmup_then_decay():
  cfg = optimizer.OptimizerConfig(learning_rate=1.0, total_steps=200, final_lr_ratio=0.1)
  assert cfg.num_warmup_steps == 6  # ceil(0.03 * 200)
  lr = optimizer.make_schedule(cfg)
  assert float(lr(0)) == 0.0 and abs(float(lr(3)) - 0.5) < 1e-6
  assert abs(float(lr(6)) - 1.0) < 1e-6
  assert abs(float(lr(6 + 97)) - 0.55) < 1e-2  # cosine midpoint between 1.0 and 0.1
  assert abs(float(lr(200)) - 0.1) < 1e-6
  linear = optimizer.make_schedule(optimizer.OptimizerConfig(
      learning_rate=1.0, total_steps=106, warmup_steps=6, decay="linear"))
  assert abs(float(linear(56)) - 0.5) < 1e-6
  with pytest.raises(ValueError, match="learning_rate"):
    optimizer.OptimizerConfig(learning_rate=-1.0)


def test_weight_decay_skips_biases_and_norms():
  mask = optimizer.decay_mask(qwen2.abstract_params(tiny_config()))
  assert mask["embedding"] and mask["lm_head"] and mask["layers"]["mlp"]["up_kernel"]
  assert not mask["layers"]["attn"]["q_bias"] and not mask["final_norm"]["scale"]
  assert not mask["layers"]["input_norm"]["scale"]


def test_opt_state_shards_like_params():
  config = tiny_config()
  tx = make_tx()
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  shardings = train_step.train_state_shardings(config, tx, mesh)
  abstract = train_step.abstract_train_state(config, tx)
  assert jax.tree.structure(shardings.opt_state) == jax.tree.structure(abstract.opt_state)
  adam = shardings.opt_state[1][0]
  assert jax.tree.map(lambda s: s.spec, adam.mu) == jax.tree.map(lambda s: s.spec,
                                                                 shardings.params)


@pytest.fixture(scope="module", autouse=True)
def eight_device_run():
  """Starts the 8-device child when the module starts, so it runs alongside the
  in-process tests; the tests at the end of the module wait for its result."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                         os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  yield proc
  proc.kill()
  proc.communicate()


@pytest.fixture(scope="module")
def eight_devices(eight_device_run):
  out, err = eight_device_run.communicate(timeout=600)
  assert eight_device_run.returncode == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])


def test_sharded_step_equals_single_device(eight_devices):
  assert eight_devices["devices"] == 8
  for result in eight_devices["layouts"]:
    assert result["loss_moved"] > 0.1, result  # the three steps really train
    assert result["loss_diff"] < TOL, result
    assert result["param_diff"] < TOL, result


def test_72b_params_shard_over_fsdp_and_tensor(eight_devices):
  big = eight_devices["72b"]
  assert 72e9 < big["params"] < 73e9
  assert big["per_device"] < 1.001 * big["params"] / 8  # only norms stay replicated
  zero = ("fsdp", "context")   # the parameters' ZeRO axes (context is 1 here)
  assert big["q_kernel"] == str(P(None, zero, "tensor", None))
  assert big["k_kernel"] == str(P(None, zero, "tensor", None))
  assert big["embedding"] == str(P("tensor", zero))


def test_tensor_parallel_activations_equal_single_device(eight_devices):
  """(data=2, tensor=2) on 4 devices: the loss and gradients of one device, and the lowered
  function pins the residual stream (batch split) and the q/k/v heads, the MLP hidden and
  the logits (batch and tensor split)."""
  tp = eight_devices["tensor_parallel"]
  assert tp["grad_max"] > 1e-3, tp  # the gradients are not trivially zero
  assert tp["loss_diff"] < TOL and tp["grad_diff"] < TOL, tp
  c = tiny_config()
  split = '<@mesh, [{"data", "fsdp"}, {"context"}, {"tensor"}'
  for tail in (f"x{c.num_attention_heads}x{c.head_dim}xf32>",
               f"x{c.num_key_value_heads}x{c.head_dim}xf32>",
               f"x{c.intermediate_size}xf32>", f"x{c.vocab_size}xf32>"):
    assert any(s.startswith(split) and s.endswith(tail) for s in tp["constraints"]), (
        tail, tp["constraints"])
  assert any(s.startswith('<@mesh, [{"data", "fsdp"}, {"context"}, {}]>')
             and s.endswith(f"x{c.hidden_size}xf32>") for s in tp["constraints"]), tp


def test_context_parallel_loss_and_gradients_equal_single_device(eight_devices):
  """Each row's positions split over 2 devices beside fsdp and tensor and over 3 beside
  tensor (MARS), and over 4 beside data (AR-SFT), at lengths no shard count divides: the
  sharded attention runs, and loss and gradients are one device's, packing included.
  (Stream length 63 on fsdp x context x tensor got gradients 1.3e-2 off while the
  target stream's arrays could be split unevenly: `objective._stream`.)"""
  results = eight_devices["context_parallel"]
  assert len(results) == len(CONTEXT_CASES)
  for r in results:
    assert r["sharded_attention"] and r["grad_max"] > 1e-3, r
    assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


def test_the_kv_ring_equals_the_dense_attention_and_gathers_nothing(eight_devices):
  """`context.attention` on (context 3, tensor 2), (context 2, tensor 4: 2 kv heads for
  4 query heads, each shard taking the one its queries read), (context 2, tensor 3: 6
  query heads, a shard's two straddling the groups) and (context 8, a row dealt in
  whole tiles): outputs and gradients are the dense attention's on one device, and
  K/V move by `ppermute` only (no all-gather, so no device holds the row's K/V)."""
  results = eight_devices["ring"]
  assert len(results) == len(RING_CASES)
  for r in results:
    assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r
    assert r["ppermute"] and not r["all_gather"], r


def test_lora_dropout_under_context_parallelism_draws_one_devices_masks(eight_devices):
  """LoRA dropout on (fsdp 2, context 2, tensor 2): each token's masks are drawn from
  where it sits in its row, not where context parallelism deals it (nor the target
  stream's padded length), so loss and adapter gradients are one device's."""
  r = eight_devices["lora_dropout"]
  assert r["dropout_moved"] > 1e-3 and r["grad_max"] > 1e-4, r
  assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


def test_one_device_mesh_leaves_activations_unconstrained():
  """On one device a constraint only changes XLA's fusion choices (and with them a run's
  float rounding): the model traced under a 1x1x1 mesh's rules lowers without any."""
  config, batch = tiny_config(), packed_batch(rows=2)
  params = qwen2.init_params(config, jax.random.key(0))
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])

  def loss(p):
    with sharding.activation_sharding(mesh):
      return objective.mars_loss(config, p, batch, block_size=4, mask_token_id=MASK)[0]
  assert "sharding_constraint" not in jax.jit(loss).lower(params).as_text()


if __name__ == "__main__":
  jax.config.update("jax_default_matmul_precision", "highest")
  print(json.dumps(sharded_vs_single_device()))
