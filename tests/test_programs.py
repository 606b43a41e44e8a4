"""Saved executables (`mars_jax.decoding.programs`): a variant per static value and input
shape, loaded by a second store instead of compiled, and compiled again when its file is
damaged or its code does not run."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.decoding import programs


@functools.partial(jax.jit, static_argnames=("scale",), donate_argnums=0)
def affine(x, shift, *, scale):
  return x * scale + shift["b"]


def _call(store, n=4, scale=3):
  return store(affine, jnp.ones((n,)), {"b": np.float32(1.0)}, scale=scale)


def test_a_second_store_loads_what_the_first_compiled(tmp_path):
  first = programs.Programs(str(tmp_path))
  assert _call(first).tolist() == [4.0] * 4
  assert _call(first, n=8).shape == (8,) and _call(first, scale=2).tolist() == [3.0] * 4
  assert (first.compiled, first.loaded, len(first)) == (3, 0, 3)
  assert len(os.listdir(tmp_path)) == 3
  second = programs.Programs(str(tmp_path))
  assert _call(second).tolist() == [4.0] * 4 and _call(second, n=8).shape == (8,)
  assert (second.compiled, second.loaded) == (0, 2)


def test_a_damaged_file_or_one_whose_code_does_not_run_is_compiled_again(tmp_path, caplog,
                                                                          monkeypatch):
  _call(programs.Programs(str(tmp_path)))
  (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
  path.write_bytes(path.read_bytes()[:100])
  store = programs.Programs(str(tmp_path))
  assert _call(store).tolist() == [4.0] * 4 and (store.compiled, store.loaded) == (1, 0)
  assert "did not load" in caplog.text

  class Missing:   # what XLA:CPU raises for an executable without its code
    def __call__(self, *args, **kwargs):
      raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion.1 not found (type id: 1)")
  monkeypatch.setattr(programs.serialize_executable, "deserialize_and_load",
                      lambda *a: Missing())
  store = programs.Programs(str(tmp_path))
  assert _call(store).tolist() == [4.0] * 4 and (store.compiled, store.loaded) == (1, 0)
  assert "did not run" in caplog.text
  monkeypatch.undo()
  store = programs.Programs(str(tmp_path))      # the file was replaced by a good one
  assert _call(store).tolist() == [4.0] * 4 and (store.compiled, store.loaded) == (0, 1)


def test_an_argument_without_arrays_must_be_static():
  @jax.jit
  def add(x, y):
    return x + y
  with pytest.raises(TypeError, match="static"):
    programs.Programs()(add, jnp.ones(2), 1.0)
