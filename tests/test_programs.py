"""Saved executables (`mars_jax.decoding.programs`): a variant per static value and input
shape, loaded by a second store instead of compiled, and compiled again when its file is
damaged or its code does not run."""

import functools
import os
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.core import private
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


def test_a_directory_or_file_others_can_write_is_refused_before_anything_is_read(tmp_path):
  """As ssh treats its keys: a store directory that its group or others can write, or
  that sits in such a directory, and a file that another user owns or others can write,
  are refused with the fix; nothing planted is unpickled."""
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o777)
  with pytest.raises(private.NotPrivate, match=r"chmod go-w .*shared"):
    programs.Programs(str(shared))
  with pytest.raises(private.NotPrivate, match=r"sits in .*shared"):
    programs.Programs(str(shared / "store"))
  store = tmp_path / "store"
  _call(programs.Programs(str(store)))
  assert oct(store.stat().st_mode & 0o777) == "0o700"   # made private
  deep = tmp_path / "made" / "for" / "it"
  programs.Programs(str(deep))   # every directory it made is 0700, parents too
  assert {oct(d.stat().st_mode & 0o777) for d in (deep, deep.parent, deep.parent.parent)} == {
      "0o700"}
  (path,) = [store / f for f in os.listdir(store)]
  path.write_bytes(pickle.dumps(Planted(tmp_path / "planted")))
  for change in (lambda: path.chmod(0o666), lambda: os.chown(path, 4242, 4242)):
    path.chmod(0o600)
    change()
    with pytest.raises(private.NotPrivate, match=str(path)):
      _call(programs.Programs(str(store)))
    assert not (tmp_path / "planted").exists()
  os.chown(path, os.getuid(), os.getgid())
  store.chmod(0o770)
  with pytest.raises(private.NotPrivate, match="mode 770"):
    programs.Programs(str(store))


class Planted:
  """A pickle that runs a shell command when it is loaded."""

  def __init__(self, target):
    self.target = target

  def __reduce__(self):
    return (os.system, (f"touch {self.target}",))


def test_the_salt_covers_jax_flags_flax_and_the_cpu():
  """A program compiled with JAX_ENABLE_X64 is another program: its salt differs."""
  plain = programs.salt()
  was = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", not was)
  try:
    assert programs.salt() != plain
  finally:
    jax.config.update("jax_enable_x64", was)
  assert programs.salt() == plain
  assert "flax" not in plain and programs.metadata.version("flax") in plain
  cpu = programs._cpu()   # the CPU's model and instruction-set features
  if os.path.exists("/proc/cpuinfo"):
    flags = [line for line in open("/proc/cpuinfo") if line.split(":")[0].strip() in (
        "flags", "Features")]
    assert flags and flags[0].split(":", 1)[1].strip() in cpu, cpu


def test_stale_temporary_files_go_and_the_store_keeps_its_bound_least_recent_first(tmp_path):
  """Temporary files of a dead writer (or, unnamed, an hour old) are removed at start;
  a live writer's, a young one and the user's own files are kept. Past max_bytes the
  least recently used executables go, never the one just written."""
  tmp_path.chmod(0o700)
  host = programs._HOST
  dead = tmp_path / f".tmp-{host}+999999999-abc"
  alive = tmp_path / f".tmp-{host}+{os.getpid()}-abc"
  elsewhere = tmp_path / ".tmp-otherhost+999999999-abc"   # a shared cache: another host's
  old, young, mine = tmp_path / ".tmp-xyz", tmp_path / ".tmp-qrs", tmp_path / "notes.xla"
  for f in (dead, alive, elsewhere, old, young, mine):
    f.write_bytes(b"x")
  os.utime(old, (time.time() - 7200,) * 2)
  store = programs.Programs(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(f.name for f in (alive, elsewhere, young,
                                                                  mine))
  _call(store, n=4)
  size = max(f.stat().st_size for f in tmp_path.glob("affine-*.xla"))
  first = next(tmp_path.glob("affine-*.xla"))
  os.utime(first, (time.time() - 100,) * 2)
  store.max_bytes = 2 * size + size // 2   # room for two
  _call(store, n=8)
  _call(store, n=16)
  kept = sorted(tmp_path.glob("affine-*.xla"))
  assert len(kept) == 2 and first not in kept and mine.exists()
  again = programs.Programs(str(tmp_path))
  _call(again, n=4)     # the evicted variant compiles again
  assert (again.compiled, again.loaded) == (1, 0)
