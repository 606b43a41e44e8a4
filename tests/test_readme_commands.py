"""The README's `## Common commands`, run as written on a trained default run (e2e).

The module trains configs/tiny.py, shortened (the model and data of test_train.py, a
few steps a stage, both stages and the export kept), into <tmp>/runs/tiny, where
<tmp>/configs is the repository's configs/; each command of the section's first
```bash block then runs with `bash -c` in <tmp> and must exit 0.
"""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Common commands"
# Not run: training and the study take minutes to hours (and some need real checkpoints
# and data), the launchers need a cluster, pip changes the environment.
NOT_RUN = ("python -m mars_jax.train", "python -m mars_jax.study", "sbatch", "bash launch/",
           "launch/", "pip ")
# A server does not exit; the section should not start one, and one it starts is skipped.
SERVER = "python -m mars_jax.serve"
SHORT = [
    "--config.model.overrides.hidden_size=32", "--config.model.overrides.intermediate_size=64",
    "--config.model.overrides.num_hidden_layers=2",
    "--config.model.overrides.num_attention_heads=2",
    "--config.model.overrides.num_key_value_heads=1", "--config.data.synthetic.num_train=400",
    "--config.data.synthetic.num_test=16", "--config.train.batch_size=8",
    "--config.train.steps=4", "--config.stage1.steps=4", "--config.train.log_every=1",
    "--config.train.eval_every=1000", "--config.train.eval_batches=1",
    "--config.final_eval.num_problems=0",
]


def readme_commands() -> list[str] | None:
  """The command lines of the section's first ```bash block (continuations joined,
  comments and blank lines left out), or None when the README has no such section."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  section = re.search(rf"^{re.escape(SECTION)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
  block = section and re.search(r"```bash\n(.*?)```", section.group(1), re.S)
  if not block:
    return None
  lines = block.group(1).replace("\\\n", " ").splitlines()
  return [l.strip() for l in lines if l.strip() and not l.strip().startswith("#")]


COMMANDS = readme_commands()


def env() -> dict:
  """This interpreter's bin first on PATH (`python` is the venv's), the repo importable."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
          "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """<tmp> holding configs/ (a link to the repo's) and the trained runs/tiny."""
  tmp = tmp_path_factory.mktemp("readme")
  os.symlink(os.path.join(ROOT, "configs"), tmp / "configs")
  r = subprocess.run([sys.executable, "-m", "mars_jax.train", "--config", "configs/tiny.py",
                      *SHORT, "--workdir", "runs/tiny"], cwd=tmp, env=env(),
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, f"training failed ({r.returncode}):\n{r.stderr[-4000:]}"
  return tmp


@pytest.mark.parametrize("command", COMMANDS or [None],
                         ids=lambda c: "no-section" if c is None else c[:80])
def test_readme_command_runs(workdir, command):
  if command is None:
    pytest.fail(f"README.md has no `{SECTION}` section with a ```bash block of commands.")
  if command.startswith(NOT_RUN):
    pytest.skip("not run here: training, the study, cluster launchers and pip")
  if command.startswith(SERVER):
    pytest.skip("starts a server, which does not exit")
  r = subprocess.run(["bash", "-c", command], cwd=workdir, env=env(), capture_output=True,
                     text=True, timeout=900)
  assert r.returncode == 0, (f"{command}\nexit {r.returncode}\n{r.stdout[-2000:]}\n"
                             f"{r.stderr[-4000:]}")


def test_export_of_a_run_in_stages_names_the_stage(workdir):
  r = subprocess.run([sys.executable, "-m", "mars_jax.export", "--checkpoint", "runs/tiny",
                      "--out", "exports/tiny"], cwd=workdir, env=env(), capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "runs/tiny: a run in stages; reading its last stage, runs/tiny/stage2" in r.stderr
  assert os.path.isfile(workdir / "exports" / "tiny" / "config.json")
