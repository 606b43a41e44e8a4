"""transformers 4.57 beside the venv's 5.x, for checking that exports load with 4.x.

`transformers4_path()` installs transformers 4.57 and its whole dependency closure
(huggingface_hub < 1.0, tokenizers <= 0.23.0, safetensors, numpy, ...) into a cache
directory once; `run_transformers4(code, *args)` runs code in a Python that sees only
that directory and the standard library. The interpreter runs with -S (no site module,
so no venv site-packages): a dependency missing from the directory fails to import
instead of coming silently from the venv, where transformers 5.x and huggingface_hub 2.x
live. torch is not installed: loading tokenizers and reading configs does not need it.

The cache is `$MARS_JAX_TEST_CACHE/transformers-4.57` (default
~/.cache/mars_jax_tests). pip installs into a temporary sibling that is renamed into
place when complete, under a file lock, so pytest-xdist workers that ask at the same time
install it once and never see a partial directory. Without network the tests that use
it are skipped, with pip's last lines as the reason.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# the newest 4.57.x on PyPI when this was written, and jinja2 (an optional dependency of
# transformers that its chat templates need)
SPEC = "transformers==4.57.6 jinja2==3.1.6"
_NAME = "transformers-4.57"
_MARKER = ".mars_jax_complete"  # holds SPEC; written last, before the rename
_INSTALL_TIMEOUT = 900

_state = {}  # "path" or "skip" once decided in this process


def _cache_root():
  root = os.environ.get("MARS_JAX_TEST_CACHE")
  if not root:
    root = os.path.join(os.path.expanduser("~"), ".cache", "mars_jax_tests")
  return os.path.abspath(root)


def _complete(path):
  try:
    with open(os.path.join(path, _MARKER)) as f:
      return f.read().strip() == SPEC
  except OSError:
    return False


class _Lock:
  """An exclusive lock on a file (flock); a no-op where fcntl does not exist."""

  def __init__(self, path):
    self._path = path
    self._file = None

  def __enter__(self):
    try:
      import fcntl
    except ImportError:
      return self
    self._file = open(self._path, "a")
    fcntl.flock(self._file, fcntl.LOCK_EX)
    return self

  def __exit__(self, *exc):
    if self._file is not None:
      self._file.close()  # closing releases the lock


def _tail(text, lines=15):
  return "\n".join(text.strip().splitlines()[-lines:])


def _install(target):
  """Installs SPEC into `target` (absent or complete afterwards); returns None or the
  reason the install failed."""
  root = os.path.dirname(target)
  tmp = tempfile.mkdtemp(prefix=_NAME + ".tmp-", dir=root)
  try:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.pop("PIP_USER", None)
    env.pop("PIP_TARGET", None)
    cmd = [sys.executable, "-m", "pip", "install", "--no-user", "--target", tmp, *SPEC.split()]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                            timeout=_INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired as e:
      out = (e.stdout or b"") + (e.stderr or b"")
      if isinstance(out, bytes):
        out = out.decode(errors="replace")
      return f"pip ran past {_INSTALL_TIMEOUT} s:\n{_tail(out)}"
    if proc.returncode != 0:
      return f"pip exited {proc.returncode}:\n{_tail(proc.stdout + proc.stderr)}"
    with open(os.path.join(tmp, _MARKER), "w") as f:
      f.write(SPEC + "\n")
    if os.path.lexists(target):  # a stale or broken copy: move it out of the way
      stale = tempfile.mkdtemp(prefix=_NAME + ".old-", dir=root)
      os.rename(target, os.path.join(stale, "old"))
      shutil.rmtree(stale, ignore_errors=True)
    try:
      os.rename(tmp, target)
    except OSError:
      if not _complete(target):  # not a lost race with another installer
        raise
    return None
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def transformers4_path() -> str:
  """The directory holding transformers 4.57 and its dependencies; installs it the first
  time (minutes; pip and PyPI). Skips the calling test when that install fails."""
  if "skip" in _state:
    pytest.skip(_state["skip"])
  if "path" in _state:
    return _state["path"]
  root = _cache_root()
  target = os.path.join(root, _NAME)
  if not _complete(target):
    os.makedirs(root, exist_ok=True)
    with _Lock(os.path.join(root, _NAME + ".lock")):
      if not _complete(target):  # another process may have installed it meanwhile
        reason = _install(target)
        if reason is not None:
          _state["skip"] = f"cannot install {SPEC} into {target}: {reason}"
          pytest.skip(_state["skip"])
  _state["path"] = target
  return target


def _env(path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env.update(PYTHONPATH=path, PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
             HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
  return env


def run_transformers4(code: str, *args, timeout=300, cwd=None) -> subprocess.CompletedProcess:
  """Runs `python -S -s -c code *args` with only transformers4_path() (and the standard
  library) importable; hub access is off (HF_HUB_OFFLINE). Returns the finished process
  (text output); prints its output when it fails, so that pytest shows it."""
  path = transformers4_path()
  proc = subprocess.run([sys.executable, "-S", "-s", "-c", code, *map(str, args)],
                        capture_output=True, text=True, env=_env(path), cwd=cwd,
                        timeout=timeout)
  if proc.returncode != 0:
    print(f"transformers 4 subprocess exited {proc.returncode}")
    print("--- stdout ---\n" + proc.stdout)
    print("--- stderr ---\n" + proc.stderr)
  return proc
