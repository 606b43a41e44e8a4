"""launch/gpu_slurm.sbatch under a real SLURM (launch/slurm_localhost.sh: munge, slurmctld
and slurmd on this machine, 2 CPUs as 2 tasks): two tasks form one JAX job and train to
the weights of launch/local.sh bit for bit; scancel and the time-limit signal stop every
task at the same step, the script requeues the job, and the requeued job resumes to the
uninterrupted run's weights bit for bit.

Marked `slurm`: it needs root and apt (or SLURM installed), and takes minutes; the
default run leaves it out, `.ci/run` runs it (`python -m pytest -m slurm`). Where SLURM
cannot be had it is skipped, saying why."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from test_multiprocess import free_port, train_2proc
from test_train import ROOT, SMALL, assert_bitwise, losses, params_of, train

pytestmark = pytest.mark.slurm

CLUSTER = os.path.join(ROOT, "launch", "slurm_localhost.sh")
SBATCH = os.path.join(ROOT, "launch", "gpu_slurm.sbatch")
SHORT = ["--config.train.steps=8", "--config.train.checkpoint_every=4"]
# The preempted job's run: long enough that the time-limit signal of --time=3
# --signal=TERM@90, which SLURM sends 60 to 90 s into an attempt, finds the run in its
# training loop after two short attempts (stopped at their first step). Its step count is
# sized to this machine by `long_ref`: at least TRAIN_S[0] s of 2-process training, aiming
# at TRAIN_S[1] (700 steps took 31 s on CI's machine; 5062 took 144 s here). No regular
# checkpoint before the end, so one found is a SIGTERM's.
def long_args(steps):
  return [f"--config.train.steps={steps}", "--config.train.checkpoint_every=1000000",
          "--config.train.eval_batches=0", "--config.train.log_every=1"]


LONG_STEPS, TRAIN_S = 700, (110, 180)   # first guess; the reference's training seconds
SIZES = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
SUBMITTED = []   # job ids of this module, cancelled at its end


def sh(*cmd, check=True):
  r = subprocess.run(cmd, capture_output=True, text=True)
  if check and r.returncode:
    raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
  return r.stdout.strip()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  """The one-machine cluster, brought up for this module (and down after it, when this
  module brought it up); compiled steps shared by every run of the module."""
  was_up = subprocess.run(["bash", CLUSTER, "status"], capture_output=True).returncode == 0
  r = subprocess.run(["bash", CLUSTER, "up"], capture_output=True, text=True)
  if r.returncode == 3:
    pytest.skip(r.stderr.strip().splitlines()[-1])
  assert r.returncode == 0, r.stdout + r.stderr
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    mp.delenv("JAX_PLATFORMS", raising=False)   # the script's own CPU-node rule decides
    yield
  if SUBMITTED:   # a job of a failed test must not hold the node
    sh("scancel", *SUBMITTED, check=False)
  if not was_up:
    sh("bash", CLUSTER, "down")


def sbatch(out, workdir, *train_args, sizes=SIZES):
  """Submits the shipped script as a user would (its environment exported, the test's
  virtual environment activated on the node) -> job id."""
  venv = ["--venv", sys.prefix] if sys.prefix != sys.base_prefix else []
  job = sh("sbatch", "--parsable", *sizes, f"--output={out}", f"--chdir={ROOT}", SBATCH,
           "--port", str(free_port()), *venv, "--", *SMALL, f"--workdir={workdir}",
           *train_args)
  SUBMITTED.append(job)
  return job


def job_state(job):
  """-> (state, reason, restarts) from scontrol."""
  text = sh("scontrol", "show", "job", job)
  get = lambda key: re.search(rf"\b{key}=(\S+)", text).group(1)
  return get("JobState"), get("Reason"), int(get("Restarts"))


def wait_for(job, predicate, what, timeout=400):
  deadline = time.time() + timeout
  while time.time() < deadline:
    state = job_state(job)
    if predicate(*state):
      return state
    time.sleep(0.5)
  raise AssertionError(f"job {job}: not {what} after {timeout} s: {job_state(job)}")


def logged(run_dir):
  """-> the steps in metrics.jsonl, in the order logged (a requeued attempt appends)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [int(re.match(r'{"step": (\d+)', l).group(1)) for l in f if l.endswith("\n")]


def wait_for_new_step(job, run_dir, restarts):
  """Waits until attempt `restarts` of `job` is in its training loop (it logged a step)."""
  wait_for(job, lambda s, r, n: n == restarts and s == "RUNNING", f"running attempt {restarts}")
  before = len(logged(run_dir))
  deadline = time.time() + 300
  while time.time() < deadline:
    if len(logged(run_dir)) > before:
      return
    assert job_state(job)[:1] + job_state(job)[2:] == ("RUNNING", restarts), job_state(job)
    time.sleep(0.05)
  raise AssertionError(f"job {job}: attempt {restarts} logged no step in 300 s")


def stop_steps(log, run_dir):
  """The step at which each process said it stopped, per SIGTERM, in the job's output."""
  found = re.findall(rf"process (\d+): {re.escape(run_dir)}: stopped by SIGTERM after step "
                     r"(\d+)", log)
  return [(int(p), int(s)) for p, s in found]


def test_two_tasks_equal_local_sh_and_one_process(cluster, tmp_path):
  """sbatch with the shipped script's directives resized by sbatch's own flags: two tasks
  of one node form one JAX job (2 processes x 1 CPU device) and end bitwise equal to
  launch/local.sh with the same process and device count, within 1e-5 of one process."""
  d, out = str(tmp_path / "slurm"), str(tmp_path / "slurm-%j.out")
  job = sbatch(out, d, *SHORT)
  state = wait_for(job, lambda s, r, n: s in ("COMPLETED", "FAILED", "CANCELLED"), "done")
  log = open(out.replace("%j", job)).read()
  assert state[0] == "COMPLETED", log[-4000:]
  assert f"job {job}: attempt 1 on " in log and "2 tasks, JAX_PLATFORMS=cpu" in log
  assert "process 0/2, 1 local / 2 global devices (cpu)" in log
  assert "process 1/2, 1 local / 2 global devices (cpu)" in log
  assert f"job {job}: srun status 0" in log
  local, one = str(tmp_path / "local"), str(tmp_path / "one")
  train_2proc(local, *SHORT, devices=1)
  assert losses(d) == losses(local)
  assert_bitwise(params_of(d), params_of(local))
  train(one, *SHORT)
  import jax
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0),
               params_of(d), params_of(one))


def trained_seconds(logdir):
  """The main stage's wall-clock, as process 0 logged it ('... step N loss L (Ss)')."""
  text = "".join(open(os.path.join(logdir, f)).read() for f in sorted(os.listdir(logdir)))
  found = re.findall(r"\[main\] \w+: step \d+ loss \S+(?: eval_loss \S+)? \((\d+)s\)", text)
  assert found, f"no stage wall-clock in {logdir}:\n{text[-2000:]}"
  return int(found[-1])


@pytest.fixture(scope="module")
def long_ref(cluster, tmp_path_factory):
  """(run dir, train args): the uninterrupted 2-process run (launch/local.sh), the
  reference of the preempted jobs, sized to train at least TRAIN_S[0] s on this machine
  (the first guess, rerun longer where this machine is faster); it also fills the
  compilation cache that their attempts start from."""
  steps, seen = LONG_STEPS, [(0, 0)]
  for _ in range(3):
    d = str(tmp_path_factory.mktemp("long") / "local")
    secs = trained_seconds(train_2proc(d, *long_args(steps), devices=1))
    if secs >= TRAIN_S[0]:
      return d, long_args(steps)
    # Steps a second from the last two runs, so that start-up and compile time cancel
    # (from the first run alone they count as training, which undershoots).
    seen.append((steps, secs))
    (s0, t0), (s1, t1) = seen[-2:]
    steps = s1 + int((s1 - s0) / max(t1 - t0, 1) * (TRAIN_S[1] - t1))
  raise AssertionError(f"{seen[-1][0]} steps still trained in {seen[-1][1]} s < {TRAIN_S[0]} s")


def test_preempted_requeued_resumes_bitwise(long_ref, tmp_path):
  """One job under --time=3 --signal=TERM@90, stopped three ways, each time requeued by
  the script and resumed:
  1. scancel --signal=TERM --full: srun is signalled too and SIGKILLs its tasks (SLURM's
     srun turns its own SIGTERM into SIGKILL), so nothing is saved at the signal; the
     script still requeues, and the next attempt starts over from the last checkpoint;
  2. scancel --signal=TERM (the steps only, as preemption signals them): both tasks save
     the same step and exit 143, the script requeues;
  3. SLURM's own time-limit signal (60 to 90 s into an attempt): the same, at every
     attempt that is still training then.
  The last attempt finishes, bitwise equal to the uninterrupted 2-process run."""
  ref, args = long_ref
  d, out = str(tmp_path / "slurm"), str(tmp_path / "slurm-%j.out")
  job = sbatch(out, d, *args, sizes=[*SIZES, "--time=3", "--signal=TERM@90"])
  wait_for_new_step(job, d, restarts=0)
  sh("scancel", "--signal=TERM", "--full", job)
  wait_for_new_step(job, d, restarts=1)
  sh("scancel", "--signal=TERM", job)
  wait_for(job, lambda s, r, n: n == 2, "requeued after scancel --signal=TERM")
  by_scancel = logged(d)[-1]
  # From here only SLURM stops the job: its time-limit signal, until the run is done.
  state = wait_for(job, lambda s, r, n: s in ("COMPLETED", "FAILED", "CANCELLED"), "done",
                   timeout=900)
  log = open(out.replace("%j", job)).read()
  assert state[0] == "COMPLETED", log[-4000:]
  restarts = state[2]
  assert restarts >= 3, f"the time-limit signal never stopped the run:\n{log[-4000:]}"
  for attempt in range(1, restarts + 2):
    assert f"job {job}: attempt {attempt} on " in log
  assert log.count("srun: forcing job termination") == 1
  assert log.count("srun killed the tasks on SIGTERM (scancel --full)") == 1
  assert log.count("stopped on SIGTERM with a checkpoint saved; requeueing") == restarts - 1
  # Every SIGTERM after the first: both processes stopped at the same step, and exited 143.
  stops = stop_steps(log, d)
  by_step = {}
  for p, s in stops:
    by_step.setdefault(s, set()).add(p)
  assert len(by_step) == restarts - 1 and all(ps == {0, 1} for ps in by_step.values()), stops
  assert by_scancel in by_step
  exits = re.findall(r"srun: error: \S+: tasks? ([0-9-]+): Exited with exit code 143", log)
  assert sum(2 if t == "0-1" else 1 for t in exits) == 2 * (restarts - 1), exits
  assert f"job {job}: srun status 0" in log
  steps = int(args[0].split("=")[1])
  got, want = losses(d), losses(ref)
  assert sorted(got) == list(range(1, steps + 1))
  assert [got[s] for s in range(1, steps + 1)] == [want[s] for s in range(1, steps + 1)]
  assert_bitwise(params_of(d), params_of(ref))


def test_plain_scancel_is_not_requeued(long_ref, tmp_path):
  """A plain scancel cancels: the script does not bring the job back."""
  d, out = str(tmp_path / "slurm"), str(tmp_path / "slurm-%j.out")
  job = sbatch(out, d, *long_ref[1])
  wait_for_new_step(job, d, restarts=0)
  sh("scancel", job)
  state = wait_for(job, lambda s, r, n: s not in ("RUNNING", "COMPLETING", "PENDING"),
                   "ended")
  log = open(out.replace("%j", job)).read()
  assert state[0] == "CANCELLED" and state[2] == 0, (state, log[-3000:])
  assert "so it is not requeued: submit the same sbatch command to resume" in log, log[-3000:]
  time.sleep(25)   # past cred_expire: a requeued job would be back by now
  assert job_state(job)[0] == "CANCELLED"
