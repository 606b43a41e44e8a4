"""Compiled decoding programs, kept in memory and on disk: a server's warm start loads
each variant's executable instead of tracing, lowering and compiling it again.

  programs = Programs("~/.cache/mars_jax/jax/executables")
  state = programs(loop.run_steps, config, params, state=state, ..., window=3)

`programs(fn, *args, **kwargs)` calls the jitted `fn` as `fn(*args, **kwargs)` would,
through the executable of that variant: an argument holding arrays (a jax or numpy
array, or a pytree of them) is an input, and its shapes and dtypes pick the variant;
any other argument (a config, a window, a mode, mesh=None) must be one of `fn`'s
static arguments, and its value picks the variant. A variant met for the first time
in the process is read from the directory when it is there (`deserialize_and_load`),
else lowered, compiled and written there (atomically); later calls go straight to the
executable. JAX's persistent compilation cache only skips XLA's compile: every start
still traces and lowers each variant, which is most of a warm start (docs/serving.md).

A file's name is a hash of the variant (the function, its static arguments, the
inputs' shapes and dtypes) salted with what else decides the program: the jax, jaxlib
and flax versions, JAX's config flags (JAX_ENABLE_X64 among them), the backend and
device kind, the CPU's model and instruction-set features, XLA_FLAGS, and the source of
the mars_jax package (an edit of any module makes a new set). A file that fails to load
(truncated, another jaxlib), or to run at its first call (code missing from it: XLA's
"Function ... not found"), is compiled again and replaced, with a warning. That code
is missing from an XLA:CPU executable read from JAX's compilation cache, so the
programs here are compiled with that cache off.

The files are unpickled, so whoever can write them can run code in this process: the
directory (and each directory above it) must be the user's and writable by no one else,
and so must each file before it is read (`mars_jax.core.private`; `NotPrivate` says the
fix). The store is bounded: past `max_bytes`, the least recently used files (a load or a
write marks a file used) are removed; so are temporary files that a killed process left.
Nothing else in the directory is touched.

One device only: an input placed on a mesh is refused (a mesh server calls its
programs through jit).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import platform
import re
import tempfile
import time
from importlib import metadata
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from mars_jax.core.private import NotPrivate, check_file, private_dir

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 30   # the store's size, past which the least recent files go
STALE_TMP_S = 3600.0          # a temporary file without a live writer, older than this
_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", platform.node()) or "host"
_FILE = re.compile(r"^[A-Za-z0-9_]+-[0-9a-f]{40}\.xla$")   # the names `_path` gives
_TMP = re.compile(r"^\.tmp-(?:([A-Za-z0-9.-]+)\+(\d+)-)?[A-Za-z0-9_]+$")  # host+pid of the writer

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_hash() -> str:
  """sha256 of every .py file of the mars_jax package (paths and contents)."""
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(_PACKAGE):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      digest.update(os.path.relpath(path, _PACKAGE).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


def _cpu() -> str:
  """The CPU's model and instruction-set features (what XLA:CPU compiles for)."""
  try:
    with open("/proc/cpuinfo") as f:
      info = {k.strip(): v for k, v in (line.split(":", 1) for line in
                                          f.read().split("\n\n")[0].splitlines()
                                          if ":" in line)}
    return " ".join(info.get(k, "").strip() for k in ("model name", "flags", "Features"))
  except OSError:
    return f"{platform.machine()} {platform.processor()}"


def _jax_flags() -> str:
  """JAX's config flags, bar those of its caches (`Programs` turns one off to compile)."""
  return repr(sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k))


def salt() -> str:
  """What decides a program besides its variant: versions, JAX's flags, backend, device,
  CPU, XLA_FLAGS, the package's source."""
  device = jax.devices()[0]
  return repr((jax.__version__, metadata.version("jaxlib"), metadata.version("flax"),
               _jax_flags(), jax.default_backend(), device.device_kind, _cpu(),
               os.environ.get("XLA_FLAGS", ""), _source_hash()))


def _signature(value: Any) -> tuple | None:
  """The tree and each leaf's shape and dtype; None for a value without arrays (a
  static argument)."""
  leaves, tree = jax.tree.flatten(value)
  if not any(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in leaves):
    return None
  out = [tree]
  for leaf in leaves:
    if isinstance(leaf, jax.Array):
      if len(leaf.sharding.device_set) > 1:
        raise ValueError("Programs serves one device; call a program on a mesh through jit.")
      out.append((leaf.shape, leaf.dtype, leaf.weak_type))
    else:
      leaf = np.asarray(leaf)
      out.append((leaf.shape, leaf.dtype, False))
  return tuple(out)


class Programs:
  """The executables of jitted functions' variants (see the module doc).

  directory: where executables are read and written (None: kept in memory only), made
  0700 when missing, and refused (`NotPrivate`) when another user could write it;
  max_bytes: the store's size bound (least recently used files removed past it).
  loaded, compiled: variants this process read from the directory, and compiled."""

  def __init__(self, directory: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
    self.directory = directory and private_dir(directory, "the executable store")
    self.max_bytes = max_bytes
    if self.directory:
      self._remove_stale()
    self._salt: str | None = None
    self._compiled: dict[tuple, Any] = {}
    self._constants: dict[int, tuple[Any, tuple]] = {}
    self._untried: set[tuple] = set()   # loaded, not called yet
    self.loaded = self.compiled = 0

  def __len__(self) -> int:
    return len(self._compiled)

  def salt(self) -> str:
    if self._salt is None:
      self._salt = salt()
    return self._salt

  def _input_signature(self, value: Any) -> tuple | None:
    """`_signature`; a dict of more than 16 leaves (the weights, the same object every
    call) is remembered by identity, and kept alive so its id is not reused."""
    if isinstance(value, dict):
      held = self._constants.get(id(value))
      if held is not None and held[0] is value:
        return held[1]
      sig = _signature(value)
      if sig is not None and len(sig) > 16:
        self._constants[id(value)] = (value, sig)
      return sig
    return _signature(value)

  def __call__(self, fn: Callable, *args, **kwargs):
    arg_sigs = [self._input_signature(a) for a in args]
    kwarg_sigs = {k: self._input_signature(v) for k, v in kwargs.items()}
    statics = (tuple((i, a) for i, (a, sig) in enumerate(zip(args, arg_sigs)) if sig is None),
               tuple(sorted((k, v) for k, v in kwargs.items() if kwarg_sigs[k] is None)))
    shapes = (tuple(sig for sig in arg_sigs if sig is not None),
              tuple(sorted((k, sig) for k, sig in kwarg_sigs.items() if sig is not None)))
    key = (fn, statics, shapes)
    compiled = self._compiled.get(key)
    dyn_args = tuple(a for a, sig in zip(args, arg_sigs) if sig is not None)
    dyn_kwargs = {k: v for k, v in kwargs.items() if kwarg_sigs[k] is not None}
    if compiled is None:
      compiled = self._compiled[key] = self._load_or_compile(fn, key, args, kwargs,
                                                             (dyn_args, dyn_kwargs))
    if key not in self._untried:
      return compiled(*dyn_args, **dyn_kwargs)
    self._untried.discard(key)
    try:   # a loaded executable's first call
      return compiled(*dyn_args, **dyn_kwargs)
    except jax.errors.JaxRuntimeError as e:
      if "not found" not in str(e).lower():
        raise
      log.warning("compiling %s again: its saved executable did not run (%s)", fn.__name__, e)
      self.loaded -= 1
      os.unlink(self._path(key))
      compiled = self._compiled[key] = self._load_or_compile(fn, key, args, kwargs,
                                                             (dyn_args, dyn_kwargs))
      return compiled(*dyn_args, **dyn_kwargs)

  def _path(self, key: tuple) -> str | None:
    if not self.directory:
      return None
    fn, statics, shapes = key
    name = f"{fn.__module__}.{fn.__name__}"
    digest = hashlib.sha256(repr((self.salt(), name, statics, shapes)).encode()).hexdigest()
    return os.path.join(self.directory, f"{fn.__name__}-{digest[:40]}.xla")

  def _load_or_compile(self, fn: Callable, key: tuple, args, kwargs, dynamic):
    path = self._path(key)
    if path and os.path.exists(path):
      try:
        check_file(path, "the executable store")   # unpickled below: refuse a planted one
        with open(path, "rb") as f:
          payload, in_tree, out_tree = pickle.load(f)
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        os.utime(path)   # used now: the last to be evicted
        self.loaded += 1
        self._untried.add(key)
        return compiled
      except NotPrivate:
        raise
      except FileNotFoundError:   # evicted by another process meanwhile: compile again
        pass
      except Exception as e:  # noqa: BLE001 - a damaged or foreign file: compile again
        log.warning("compiling %s again: its saved executable %s did not load (%s: %s)",
                    fn.__name__, path, type(e).__name__, e)
    with _without_compilation_cache():
      compiled = fn.lower(*args, **kwargs).compile()
    if compiled.in_tree != jax.tree.structure(dynamic):
      raise TypeError(f"{fn.__name__}: an argument without arrays is not one of its static "
                      "arguments (or a static one holds arrays); call it through jit.")
    self.compiled += 1
    if path:
      self._save(compiled, path)
    return compiled

  def _save(self, compiled, path: str) -> None:
    """Writes the executable to `path` atomically; a write that fails (a full disk, its
    temporary file removed under it) is logged, and the program serves all the same."""
    blob = pickle.dumps(serialize_executable.serialize(compiled))
    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".tmp-{_HOST}+{os.getpid()}-")
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(blob)
      os.replace(tmp, path)
    except OSError as e:
      log.warning("could not save the executable %s (%s); it is compiled again next time",
                  path, e)
      with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
      return
    self._evict(keep=path)

  def _remove_stale(self) -> None:
    """Removes the temporary files of writers that are gone (killed mid-write): those
    naming a process of this host that no longer runs, and those of another host (a
    shared directory) or of no name older than `STALE_TMP_S`."""
    now = time.time()
    for name in os.listdir(self.directory):
      match = _TMP.match(name)
      if not match:
        continue
      path = os.path.join(self.directory, name)
      try:
        if match.group(1) == _HOST:
          if _running(int(match.group(2))):
            continue
        elif now - os.lstat(path).st_mtime < STALE_TMP_S:
          continue
        os.unlink(path)
        log.info("removed %s, a temporary file its writer left", path)
      except FileNotFoundError:
        pass

  def _evict(self, keep: str) -> None:
    """Removes the least recently used executables (oldest mtime first) until the store
    holds at most `max_bytes`; never `keep` (the one just written), nor any file whose
    name `_path` does not give."""
    files = []
    for name in os.listdir(self.directory):
      if _FILE.match(name):
        path = os.path.join(self.directory, name)
        try:
          st = os.lstat(path)
        except FileNotFoundError:
          continue
        files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
      if total <= self.max_bytes:
        break
      if path == keep:
        continue
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass
      total -= size
      log.info("evicted %s (the store holds at most %d MiB)", path, self.max_bytes >> 20)


def _running(pid: int) -> bool:
  """Whether process `pid` of this host runs (another user's counts)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


@contextlib.contextmanager
def _without_compilation_cache():
  """JAX's persistent compilation cache off: an XLA:CPU executable read from it keeps no
  object code, and once serialized it fails to run in another process ("Function ...
  not found"). The executables here are compiled afresh; this store is their cache."""
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()   # JAX decides whether the cache is used once, then keeps it
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def direct(fn: Callable, *args, **kwargs):
  """Calls `fn` as it is (through jit): what a caller without `Programs` uses."""
  return fn(*args, **kwargs)
