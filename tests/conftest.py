"""Shared fixtures: tiny random Qwen2 and Qwen3 checkpoints written by transformers itself."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _run_directory(env: str, prefix: str) -> str | None:
  """A directory for this test run in $env, made here unless already set -> the
  directory made (to remove at the end), or None. pytest-xdist's workers and every CLI
  subprocess inherit the variable from the controller, so they share one directory."""
  if env in os.environ:
    return None
  made = tempfile.mkdtemp(prefix=prefix)
  os.environ[env] = made
  return made


# The tokenized data cache of every test and CLI run, not the user's ~/.cache.
_DATA_CACHE = _run_directory("MARS_JAX_DATA_CACHE", "mars_jax_data_cache.")
# JAX's persistent compilation cache, one per test run: the same small programs are
# compiled once for the run's workers and CLI subprocesses instead of in each of them
# (`python -m mars_jax.serve`'s engine reads $MARS_JAX_COMPILATION_CACHE). Every
# compile is cached, however fast.
_JAX_CACHE = _run_directory("JAX_COMPILATION_CACHE_DIR", "mars_jax_jax_cache.")
os.environ.setdefault("MARS_JAX_COMPILATION_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# The test processes themselves compile without that cache; the CLI, server and
# multi-device subprocesses they start share it (through the environment above). In the
# e2e run a worker died in JAX's write of a cache entry (a segfault inside
# `executable.serialize()`, after many programs read from and written to the shared
# directory), and pytest-xdist then hung; a program compiled in a worker is seldom met in
# another process anyway. pytest.ini's --max-worker-restart=0 ends the run if a worker
# still dies, instead of waiting forever.
jax.config.update("jax_enable_compilation_cache", False)


def default_selection(config) -> str:
  """The marker expression of pytest.ini's addopts (`-m "..."`): the default selection."""
  addopts = config.getini("addopts")
  return addopts[addopts.index("-m") + 1].strip()


def pytest_configure(config):
  """The default selection compiles for the CPU without LLVM's optimisation passes: its
  programs are small and run a few times each, so compiling is most of their time, and
  each of its comparisons is between programs built alike or against a tolerance that
  the unoptimised code meets. Workers and CLI subprocesses inherit the flag. Every other
  selection compiles as users' runs do: `-m e2e` compares separately compiled
  multi-process and one-process runs to 1e-5, and .ci/run's `-m "parity and ..."` step
  runs the tight numerical comparisons at the default level too."""
  flags = os.environ.get("XLA_FLAGS", "")
  if (os.environ["JAX_PLATFORMS"] == "cpu"
      and (config.getoption("markexpr") or "").strip() == default_selection(config)
      and "--xla_backend_optimization_level" not in flags):
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Each test file's compiled programs are let go when it ends (`jax.clear_caches`).
  Every XLA:CPU executable holds memory mappings of its code, and jit's caches keep
  every executable alive: a worker that ran a few files held over 18,000 mappings, and
  past Linux's default limit (vm.max_map_count, 65,530) XLA's compiler died (segfaults
  and aborts in `backend_compile_and_load`, seen in -m e2e and the default run)."""
  yield
  jax.clear_caches()


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  """tests/test_ragged_engine.py first, so that pytest-xdist gives it a fresh worker:
  in `-m e2e`, run after other files in the same worker process, its test of arrivals
  and preemption died three times out of three in XLA's CPU compiler (a segfault in
  `backend_compile_and_load`, compiling `generate`'s reference); run first, alone, or
  with its own file only, it passed every time."""
  first = [item for item in items if item.nodeid.startswith("tests/test_ragged_engine.py")]
  items[:] = first + [item for item in items if item not in first]


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  for made in (_DATA_CACHE, _JAX_CACHE):
    if made:
      shutil.rmtree(made, ignore_errors=True)


jax.config.update("jax_default_matmul_precision", "highest")


def make_hf_model(path, *, family="qwen2", tie=True, num_kv_heads=2, num_heads=4, hidden=64,
                  layers=2, vocab=128, intermediate=96, seed=0, rope_theta=10000.0,
                  head_dim=None, rope_scaling=None):
  """Saves a random `Qwen2ForCausalLM` or `Qwen3ForCausalLM` (family "qwen2" | "qwen3",
  transformers' own init) to `path`; returns it. head_dim None: the transformers config
  class's default (Qwen2: hidden / heads, Qwen3: 128). rope_scaling: a tuple of items
  (hashable, for `hf_tiny`) of the rope dict, e.g. (("rope_type", "yarn"), ...)."""
  import torch
  import transformers

  config_cls, model_cls = {
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
  torch.manual_seed(seed)
  cfg = config_cls(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
      num_hidden_layers=layers, num_attention_heads=num_heads,
      num_key_value_heads=num_kv_heads, max_position_embeddings=256,
      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
      rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                       **dict(rope_scaling or ())},
      **({} if head_dim is None else {"head_dim": head_dim}))
  model = model_cls(cfg).eval()
  # transformers initialises biases to zero and norms to one; make them random so a
  # bias or norm bug shows (Qwen3's per-head q_norm / k_norm included).
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(torch.randn_like(p) * 0.1)
  model.save_pretrained(path)
  return model


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
  """Factory: hf_tiny(**kwargs) -> (dir, torch model), cached per kwargs."""
  cache = {}

  def get(**kwargs):
    key = tuple(sorted(kwargs.items()))
    if key not in cache:
      path = tmp_path_factory.mktemp("hf_tiny")
      cache[key] = (str(path), make_hf_model(str(path), **kwargs))
    return cache[key]

  return get
