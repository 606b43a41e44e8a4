"""`mars_jax.plan` and `mars_jax.parallel.hardware`: a tiny model's MARS and AR-SFT steps
compiled by the real TPU (v5p:2x2x1, libtpu) and GPU (an 8 x H100 node, the jax CUDA pjrt plugin)
compilers on this CPU host, the plan's figures checked against the compiled memory,
and the one-line errors of the CLI.

The compilers are test dependencies (requirements-test.txt); a test skips when its
compiler is not installed.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mars_jax.benchmarks import plan
from mars_jax.models import context, flash
from mars_jax.parallel import hardware, sharding
from mars_jax.training import config as train_config, step as train_step
from mars_jax.training.optimizer import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4)


def needs(topology_name):
  missing = hardware.missing_compiler(hardware.parse_topology(topology_name))
  if missing:
    pytest.skip(missing)


def tiny_cfg(kind="mars", **mesh):
  """The embedded default's config shrunk to a model that compiles in seconds."""
  c = train_config.base_config()
  c.model.overrides.update(TINY)
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.objective.kind = kind
  c.objective.stream_length = 16
  c.data.max_length = 32
  c.train.batch_size = 16
  c.train.micro_batches = 2
  c.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh})
  return c


def sharded_bytes(tree, shardings):
  """Bytes of one device's shard of every leaf of `tree` placed with `shardings`."""
  leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
  return sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for x, s in leaves)


def state_and_batch_bytes(cfg, devices):
  """Per-device bytes of the train step's arguments, counted from the shardings alone."""
  config = plan.model_config(cfg)
  runtime = train_config.runtime(cfg)
  typed = train_config.typed(cfg, total_steps=1000, mask_token_id=127)
  mesh = sharding.make_mesh(typed.mesh, devices=devices)
  tx = make_optimizer(typed.optimizer)
  state = train_step.abstract_train_state(config, tx, runtime=runtime)
  shardings = train_step.train_state_shardings(config, tx, mesh, runtime=runtime)
  batch = plan._batch_spec(cfg, cfg.train.batch_size)
  batch_sharding = sharding.batch_sharding(mesh)
  return (sharded_bytes(state, shardings)
          + sharded_bytes(batch, jax.tree.map(lambda _: batch_sharding, batch)))


@pytest.mark.parametrize("name,chips,jax_name", [
    ("v5p-8", 4, "v5p:2x2x1"), ("v5p-16", 8, "v5p:2x2x2"), ("v5p-64", 32, "v5p:2x4x4"),
    ("v5p-256", 128, "v5p:4x4x8"), ("v5e-16", 16, "v5e:4x4"), ("v6e-8", 8, "v6e:2x4"),
    ("v5p:2x2x1", 4, "v5p:2x2x1"), ("h100-8", 8, "1x1x8"), ("h200-16", 16, "2x1x8"),
    ("a100-80-4", 4, "1x1x4"), ("b200-8", 8, "1x1x8")])
def test_topology_names(name, chips, jax_name):
  t = hardware.parse_topology(name)
  assert (t.chips, t.jax_topology) == (chips, jax_name)


@pytest.mark.parametrize("name,message", [
    ("v4-8", "unknown topology 'v4-8'; known: TPU: v5e-N"),
    ("v5p-6", "power-of-two"), ("v5p-4", "smallest slice of this generation has 4 chips"),
    ("h100-12", r"a multiple of 8 \(whole nodes\)")])
def test_bad_topologies_say_what_is_known(name, message):
  with pytest.raises(ValueError, match=message):
    hardware.parse_topology(name)


def test_a_missing_compiler_is_one_install_line(monkeypatch):
  monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
  assert hardware.missing_compiler(hardware.parse_topology("v5p-8")) == (
      f"compiling for v5p-8 needs libtpu (no TPU needed): pip install 'jax[tpu]=="
      f"{jax.__version__}'")
  with pytest.raises(ValueError, match="pip install jax-cuda12-pjrt=="):
    hardware.compile_devices(hardware.parse_topology("h100-8"))


@pytest.mark.parametrize("topology,mesh", [("v5p-8", dict(fsdp=4)), ("h100-8", dict(fsdp=8))])
def test_plan_compiles_mars_and_its_args_are_the_state_shards(topology, mesh, tmp_path):
  """The plan of a MARS step: compiled for the chip, its per-chip arguments equal (GPU)
  or, with the TPU's tiled layouts, at least (TPU) the state's and batch's shards as
  the shardings count them, and its figures consistent with the chip."""
  needs(topology)
  cfg = tiny_cfg("mars", **mesh)
  # conftest's "highest" matmul precision makes Mosaic refuse splash's bf16 dots ("Bad lhs
  # type"); the CLI runs at jax's default, as this does
  with jax.default_matmul_precision("default"):
    report = plan.plan(cfg, "tiny", topology)
  t = hardware.parse_topology(topology)
  train = report["train"]["train"]
  counted = state_and_batch_bytes(cfg, hardware.compile_devices(t))
  if t.chip.platform == "cuda":
    assert train["args"] == counted
  else:
    assert counted <= train["args"]   # the TPU pads small minor dimensions to its tiles
  assert train["total"] == train["args"] + train["temps"] + train["code"] + train["outputs"]
  # the new state reuses the donated one: the metrics alone (the TPU pads each scalar)
  assert 0 <= train["outputs"] < 64 << 10
  assert report["train"]["fits"] and report["train"]["suggestion"] is None
  assert report["train"]["mesh"] == {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, **mesh}
  f = report["flops"]
  assert f["positions_per_row"] == 32 + 16
  assert f["step_s_mfu50"] == pytest.approx(2 * f["flops_per_step"]
                                            / (t.chips * t.chip.bf16_flops))
  assert report["attention"]["xla"] == "compiles"
  if t.chip.platform == "tpu":
    assert report["attention"]["splash"] == report["attention"]["splash-tokens"] == "compiles"
  json.dumps(report)  # the CLI writes it as it is


@pytest.mark.parametrize("topology,mesh", [("v5p-8", dict(tensor=4)),
                                           ("h100-8", dict(data=2, tensor=4))])
def test_ar_sft_compiles_tensor_parallel(topology, mesh):
  needs(topology)
  cfg = tiny_cfg("ar_sft", **mesh)
  devices = hardware.compile_devices(hardware.parse_topology(topology))
  got = plan.compile_train(cfg, plan.model_config(cfg), devices, micro_batches=2,
                           remat="full")
  counted = state_and_batch_bytes(cfg, devices)
  assert got.args == counted if topology.startswith("h100") else got.args >= counted


def _scheduled(hlo: str) -> dict[str, list[str]]:
  """A compiled module's text -> each computation's collective-permute starts and dones
  and while loops, in schedule order."""
  order, current = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      current = order.setdefault(line.split(" ")[0], [])
    elif current is not None:
      for op in ("collective-permute-start(", "collective-permute-done(", " while("):
        if op in line:
          current.append(op.strip(" ("))
  return order


def ring_steps(topology_name: str, head_dim: int) -> list[list[str]]:
  """The ring's gradient (`context.ring_attention`, context 4, 4096 positions, 8 / 2
  heads) compiled for 4 chips of the topology -> each ring step's computation (one
  forward, one backward) as its collective-permute starts, dones and while loops in
  schedule order. Raises if anything is all-gathered."""
  devices = hardware.compile_devices(hardware.parse_topology(topology_name))[:4]
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, context=4), devices)
  mask = flash.causal(jnp.ones((1, 4096), jnp.int32))

  def loss(q, k, v):
    with sharding.activation_sharding(mesh):
      return jnp.sum(context.attention(q, k, v, mask).astype(jnp.float32))
  where = NamedSharding(mesh, P(None, "context"))
  args = [jax.ShapeDtypeStruct((1, 4096, n, head_dim), jnp.bfloat16, sharding=where)
          for n in (8, 2, 2)]
  hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile().as_text()
  assert "all-gather" not in hlo
  return [ops for name, ops in _scheduled(hlo).items() if name != "ENTRY"   # its send:
          and "collective-permute-start" in ops and "while" in ops]   # dK/dV home


def assert_sends_overlap(steps: list[list[str]]) -> None:
  """Every step's sends start before its tile loop and are waited for after it."""
  assert len(steps) == 2, steps   # the forward ring's step and the backward's
  for ops in steps:
    loop = ops.index("while")
    assert all(i < loop for i, op in enumerate(ops) if op == "collective-permute-start"), ops
    assert all(i > loop for i, op in enumerate(ops) if op == "collective-permute-done"), ops


def test_the_kv_ring_sends_overlap_the_tiles_on_gpu():
  """The ring's sends compiled by the GPU compiler for 4 of an H100 node's chips: every
  step's collective-permute starts before the step's tile loop and is waited for after
  it, forward and backward, and nothing is all-gathered."""
  needs("h100-8")
  assert_sends_overlap(ring_steps("h100-8", 64))


@pytest.mark.e2e  # a fresh process: libtpu reads its flags once
def test_the_kv_ring_sends_overlap_on_tpu_with_the_scheduler_flag():
  """At Qwen's head size (128) the TPU compiler (v5p) overlaps the ring's sends with its
  tiles under LIBTPU_INIT_ARGS=--xla_tpu_enable_all_experimental_scheduler_features=true,
  the setting docs/long_rows.md and launch/tpu_vm.sh name (without it, it schedules them
  after the tile loop)."""
  needs("v5p-8")
  code = "import json, test_plan; print(json.dumps(test_plan.ring_steps('v5p-8', 128)))"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "LIBTPU_INIT_ARGS": "--xla_tpu_enable_all_experimental_scheduler_features=true"}
  r = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "tests"), env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert_sends_overlap(json.loads(r.stdout.strip().splitlines()[-1]))


@pytest.mark.e2e  # whole programs through the TPU/GPU compilers
def test_a_step_that_does_not_fit_gets_the_micro_batches_that_do():
  """On a chip one byte smaller than the step needs at 2 micro-batches, the search
  compiles the next count that splits the batch (4) and reports it, with what it tried."""
  needs("v5p-8")
  cfg = tiny_cfg("mars", fsdp=4)
  cfg.train.batch_size = 64
  t = hardware.parse_topology("v5p-8")
  config, devices = plan.model_config(cfg), hardware.compile_devices(t)
  need = plan.compile_train(cfg, config, devices, micro_batches=2, remat="full").total
  small = hardware.Topology("v5p-8", dataclasses.replace(t.chip, hbm_bytes=need - 1),
                            4, t.jax_topology)
  got = plan.fit_train(cfg, config, small, devices, search=True)
  assert not got["fits"] and got["train"].total == need
  assert got["suggestion"]["micro_batches"] == 4
  assert got["suggestion"]["train"].total < need
  assert [(r["micro_batches"], r["remat"]) for r in got["tried"]] == [(2, "full"),
                                                                      (4, "full")]


@pytest.mark.parametrize("topology", ["v5p-8", "h100-8"])
@pytest.mark.e2e  # whole programs through the TPU/GPU compilers
def test_decode_plan_one_chip_and_tensor_parallel(topology):
  """The decoding loop compiled on one chip (AR) and tensor-parallel over four (AR and
  W = 3): the weights and the KV cache (4 kv heads) split four ways, so each chip's
  arguments are a quarter of one chip's and more; the roofline reads them once a forward."""
  needs(topology)
  cfg = tiny_cfg()
  t = hardware.parse_topology(topology)
  config, devices = plan.model_config(cfg), hardware.compile_devices(t)
  one = plan.decode_plan(cfg, config, t, devices[:1], batch=2, cache_len=64, window=1,
                         mesh_spec="tensor=1")
  four = plan.decode_plan(cfg, config, t, devices[:4], batch=2, cache_len=64, window=3,
                          mesh_spec="tensor=4")
  assert sorted(four["windows"]) == [1, 3] and sorted(one["windows"]) == [1]
  assert four["mesh"] == {"data": 1, "fsdp": 1, "context": 1, "tensor": 4}
  ar_one, ar_four, w3 = one["windows"][1], four["windows"][1], four["windows"][3]
  assert ar_one["args"] / 4 <= ar_four["args"] < ar_one["args"] / 2
  # the cache [layers 2, b 2, kv heads 4, S 64, d 8] in bf16, K and V: split 4 ways
  assert one["cache_bytes"] == 4 * four["cache_bytes"] == 2 * 2 * 2 * 4 * 64 * 8 * 2
  for d, c in ((one, ar_one), (four, ar_four)):
    assert c["outputs"] >= d["cache_bytes"]   # the final state returns the chip's cache
    assert c["forwards_per_s"] == pytest.approx(t.chip.hbm_bandwidth
                                                / (c["args"] + d["cache_bytes"]))
    assert c["tokens_per_s_max"] == pytest.approx(2 * c["forwards_per_s"])
  assert w3["tokens_per_s_max"] == pytest.approx(6 * w3["forwards_per_s"])


def test_a_mesh_that_does_not_divide_the_chips_is_refused_before_compiling():
  needs("v5p-8")
  with pytest.raises(ValueError, match="needs 3 devices, but 4 are available"):
    plan.plan(tiny_cfg(fsdp=3), "tiny", "v5p-8")
  with pytest.raises(ValueError, match=r"Pick sizes whose product divides the 4 device\(s\)"):
    plan.plan(tiny_cfg(), "tiny", "v5p-8", train=False, decode=(2, 64, 3),
              decode_mesh_spec="tensor=3")


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "mars_jax.plan", *args], cwd=ROOT,
                        capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})


def test_cli_errors_are_one_line():
  r = run_cli("--config", "configs/tiny.py", "--topology", "v4-8")
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1].startswith("error: unknown topology 'v4-8'")
  assert "Traceback" not in r.stderr


@pytest.mark.e2e
def test_plan_compiles_context_parallel_mars_and_counts_the_attention_work():
  """A MARS step with each row's positions split over 4 devices (fsdp 2 x context 4 on
  an H100 node, blockwise attention) compiles and fits; the plan counts the tiles the
  attention runs on one row (1.26x the pairs the mask allows at this short row, whose
  diagonal tiles are a larger share; 1.15x from 4096 a stream, `test_flash`) and per
  context shard (the same on every shard, within 10%), and prints them."""
  needs("h100-8")
  cfg = tiny_cfg("mars", fsdp=2, context=4)
  cfg.model.attention_impl = "flash"
  cfg.data.max_length = cfg.objective.stream_length = 1024
  cfg.train.batch_size, cfg.train.micro_batches = 2, 1
  report = plan.plan(cfg, "tiny", "h100-8", search=False)
  assert report["train"]["mesh"] == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
  assert report["train"]["fits"]
  work = report["attention_work"]
  assert work["positions"] == 2048 and 1.0 <= work["ratio"] <= 1.3, work
  shards = work["shard_tiles"]
  assert len(shards) == 4 and max(shards) <= 1.1 * min(shards), shards
  assert f"{work['ratio']:.3f}x the FLOPs the mask allows" in plan.format_table(report)
