"""Decoding on a mesh: `sampling.generate` and `serve.Server` give one device's tokens and
forwards, and `lower_decode` compiles for compile-only TPU devices with a quarter of the
weights per device on tensor=4.

Everything runs in one child process started with
`--xla_force_host_platform_device_count=8` (the device count is fixed when a process
first touches its CPU backend, see tests/test_sharding.py). The model is a random tiny
Qwen2 whose output head is scaled up, so that some MASK proposals pass tau=0.9 and
others do not.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from mars_jax import serve
from mars_jax.decoding import sampler as sampling
from mars_jax.parallel import sharding
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.models import qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

VOCAB = 128
MASK = VOCAB - 1
EOS_NEVER = VOCAB - 2
PROMPTS = [[11, 52, 3], [7, 90, 33, 64, 25, 18, 41, 9, 100], [60, 61], [5, 77, 12, 98, 43],
           [1, 2, 3, 4]]
MESHES = {"data=2,tensor=4": (2, 1, 4), "tensor=8": (1, 1, 8)}  # 4 kv heads: split, replicated
SETTINGS = {"ar": dict(window=1), "mars": dict(window=3, tau=0.9)}
# (mesh, setting) of the generate runs; MARS on data=2,tensor=4 runs in the server test
RUNS = [("data=2,tensor=4", "ar"), ("tensor=8", "mars")]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def tiny_model(head_scale=40.0):
  config = qwen2.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             rope_theta=10000.0)
  params = jax.device_get(qwen2.init_params(config, jax.random.key(3)))
  return config, {**params, "lm_head": params["lm_head"] * head_scale}


def serve_all(config, params, mesh):
  """Five requests through a server of 2..4 rows (resized, refilled), MARS at W=3,
  tau=0.9 -> [tokens, forwards] per request."""
  server = serve.Server(config, params, mask_token_id=MASK, eos_token_ids=(EOS_NEVER,),
                        batch_size=4, min_batch_size=2, max_len=64, window=3, tau=0.9,
                        prefill_chunk=3, round_steps=4, mesh=mesh)
  ids = [server.submit(p, max_new_tokens=10 + 2 * i) for i, p in enumerate(PROMPTS)]
  done = server.run()
  return [[done[i].tokens, done[i].forwards] for i in ids]


def sharded_vs_single_device():
  """Child body (8 CPU devices): generate and serve results per mesh, and one device's."""
  config, params = tiny_model()
  kw = dict(max_new_tokens=12, mask_token_id=MASK, eos_token_ids=(EOS_NEVER,))
  meshes = {name: sharding.make_mesh(sharding.MeshConfig(*s)) for name, s in MESHES.items()}
  out = {"devices": jax.device_count(), "generate": {}, "cache_spec": {}}
  for name, setting in [("one", s) for s in SETTINGS] + RUNS:
    args = dict(**kw, **SETTINGS[setting], mesh=meshes.get(name))
    res = sampling.generate(config, params, PROMPTS, **args)
    out["generate"][f"{name}/{setting}"] = [res.tokens, res.num_forwards]
    if name in meshes:  # the same compiled loop again, for its final state
      state = sampling.decode_batch(config, params, PROMPTS, **args)
      out["cache_spec"][name] = str(state.cache["k"].sharding.spec)
  out["serve"] = {"one": serve_all(config, params, None),
                  "data=2,tensor=4": serve_all(config, params, meshes["data=2,tensor=4"])}
  if HAS_LIBTPU:
    out["tpu"] = tpu_lowering()
  return out


def tpu_lowering():
  """`lower_decode` on v5p:2x2x1 (4 compile-only chips), tensor=4: argument bytes per
  device (its share of the weights and the small per-row inputs) and the params' bytes.
  The model's dims are multiples of 128, so TPU tiling pads next to nothing."""
  from jax.experimental import topologies
  devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
  config = qwen2.Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                             rope_theta=10000.0)
  out = {"param_bytes": sum(x.size * x.dtype.itemsize
                            for x in jax.tree.leaves(qwen2.abstract_params(config)))}
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 4), devices)
  compiled = decode_mesh.lower_decode(config, mesh, batch=4, prompt_len=8, cache_len=64,
                                      window=3).compile()
  return {**out, "tensor=4": compiled.memory_analysis().argument_size_in_bytes}


@pytest.fixture(scope="module")
def eight_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             # compile-only TPU devices touch no chip: skip libtpu's one-process lock
             ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                         os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh,setting", RUNS)
@pytest.mark.e2e  # the eight-device child process (a minute)
def test_generate_on_a_mesh_equals_one_device(eight_devices, mesh, setting):
  assert eight_devices["devices"] == 8
  one = eight_devices["generate"][f"one/{setting}"]
  assert eight_devices["generate"][f"{mesh}/{setting}"] == one  # tokens and forwards
  tokens, forwards = one
  if setting == "mars":  # some MASK proposals passed the gate, some did not
    assert sum(forwards) < sum(map(len, tokens)) < 3 * sum(forwards), one


@pytest.mark.e2e  # the eight-device child process (a minute)
def test_server_on_a_mesh_equals_one_device(eight_devices):
  one = eight_devices["serve"]["one"]
  assert eight_devices["serve"]["data=2,tensor=4"] == one  # tokens and forwards
  assert sum(f for _, f in one) < sum(len(t) for t, _ in one)  # MASK proposals passed


@pytest.mark.e2e  # the eight-device child process (a minute)
def test_the_cache_splits_on_kv_heads_where_tensor_divides_them(eight_devices):
  specs = eight_devices["cache_spec"]
  assert specs["data=2,tensor=4"] == str(P(None, "data", "tensor"))  # [L, b, kv_heads, ..]
  assert specs["tensor=8"] == str(P())  # 4 kv heads on 8: replicated, as their weights


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")
@pytest.mark.e2e  # the eight-device child process (a minute)
def test_lower_decode_on_tpu_puts_a_quarter_of_the_weights_on_each_chip(eight_devices):
  tpu = eight_devices["tpu"]
  assert 0.24 < tpu["tensor=4"] / tpu["param_bytes"] < 0.26, tpu


def test_decode_rules_leave_embed_and_positions_unsplit_and_buckets_divide_over_data():
  rules = dict(sharding.DECODE_RULES)
  assert rules["embed"] is None and rules["heads"] == rules["kv_heads"] == "tensor"
  assert rules["activation_length"] is None   # a decoding mesh has no context axis
  unsplit = ("embed", "activation_length")
  assert {k: v for k, v in rules.items() if k not in unsplit} == {
      k: v for k, v in sharding.LOGICAL_AXIS_RULES if k not in unsplit}
  assert decode_mesh.batch_rows(3, None) == 4
  assert decode_mesh.parse_mesh("data=2,tensor=4") == sharding.MeshConfig(2, 1, 4)
  assert decode_mesh.parse_mesh("tensor=8") == sharding.MeshConfig(-1, 1, 8)
  with pytest.raises(ValueError, match="AXIS=SIZE"):
    decode_mesh.parse_mesh("model=8")
  with pytest.raises(ValueError, match="decoding has no context axis"):
    decode_mesh.parse_mesh("data=2,context=4")
  with pytest.raises(ValueError, match="e.g. tensor=1"):
    decode_mesh.mesh_from_flag("tensor=3")


if __name__ == "__main__":
  jax.config.update("jax_default_matmul_precision", "highest")
  print(json.dumps(sharded_vs_single_device()))
