"""pyproject.toml: a non-editable install of the project (no dependencies, no network)
gives an importable mars_jax with its package data and requirements.txt's requirements.

The build runs on a copy of the source tree: pip builds a local directory in place and
would leave build/ and mars_jax.egg-info/ in the checkout.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "mars_jax")

# Never copied: version control, virtual environments, caches, run outputs and any
# build outputs of an earlier in-place build.
_SKIP = {".git", ".venv", ".venv-ci", "__pycache__", ".pytest_cache", "build", "dist",
         "runs", "workdir"}


def _ignore(directory, names):
  return [n for n in names
          if n in _SKIP or n.endswith(".egg-info") or n.endswith(".pyc")]


def _files(top):
  """Relative paths of the plain files under `top`, caches and bytecode left out."""
  out = set()
  for dirpath, dirnames, filenames in os.walk(top):
    dirnames[:] = [d for d in dirnames if d != "__pycache__"]
    for f in filenames:
      if not f.endswith(".pyc"):
        out.add(os.path.relpath(os.path.join(dirpath, f), top))
  return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """Directory that `pip install --no-deps --target` filled from a copy of the repo."""
  base = tmp_path_factory.mktemp("packaging")
  src = base / "src"
  target = base / "site"
  shutil.copytree(ROOT, src, ignore=_ignore, symlinks=True)
  env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
  env.pop("PIP_USER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
       "--no-index", "--target", str(target), str(src)],
      capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
  return str(target)


def test_installed_copy_imports_from_another_directory(installed, tmp_path):
  code = """
import importlib.resources, json, sys
import mars_jax, mars_jax.data, mars_jax.checkpoints.hf, mars_jax.training.config
tasks = importlib.resources.files("mars_jax.evaluation") / "lm_eval_tasks"
print(json.dumps({
    "mars_jax": mars_jax.__file__,
    "submodules": [m.__file__ for m in (mars_jax.data, mars_jax.checkpoints.hf,
                                        mars_jax.training.config)],
    "tasks": str(tasks),
}))
"""
  env = dict(os.environ, PYTHONPATH=installed, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  target = os.path.realpath(installed) + os.sep
  for path in [got["mars_jax"], *got["submodules"], got["tasks"]]:
    assert os.path.realpath(path).startswith(target), (path, installed)

  # Every module of the source package is in the installed copy, and the
  # evaluation/lm_eval_tasks data files (YAML and JSONL) are there byte for byte.
  installed_pkg = os.path.join(installed, "mars_jax")
  src_files, got_files = _files(PACKAGE), _files(installed_pkg)
  assert src_files == got_files
  data = {p for p in src_files if p.startswith(os.path.join("evaluation", "lm_eval_tasks", ""))}
  assert {os.path.splitext(p)[1] for p in data} == {".yaml", ".jsonl"}
  for rel in data:
    with open(os.path.join(PACKAGE, rel), "rb") as a, \
        open(os.path.join(installed_pkg, rel), "rb") as b:
      assert a.read() == b.read(), rel


def _requirement_lines(path):
  with open(path) as f:
    lines = [line.strip() for line in f]
  return [line for line in lines if line and not line.startswith("#")]


def test_installed_requirements_are_requirements_txt(installed):
  (dist,) = importlib.metadata.distributions(name="mars-jax", path=[installed])
  assert dist.version == "0.1.0"
  assert dist.metadata["Requires-Python"] == ">=3.10"
  lines = _requirement_lines(os.path.join(ROOT, "requirements.txt"))
  assert lines and not any(line.startswith("-") for line in lines)
  assert [Requirement(r) for r in dist.requires] == [Requirement(r) for r in lines]
