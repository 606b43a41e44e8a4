"""SIGTERM mid-run, with real processes: every process saves the same step and exits
143; the same command then resumes to the uninterrupted run's weights, bit for bit."""

import os
import signal
import subprocess
import sys
import time

import pytest

from test_multiprocess import free_port, train_2proc
from test_train import ROOT, SMALL, assert_bitwise, losses, params_of, train

# Long enough that the run is still going when the test sees its first logged step
# (~20 ms a step here); no regular checkpoint before the end, so the one found is the
# SIGTERM's; no eval loss, whose compilation adds seconds to every run.
STEPS = ["--config.train.steps=40", "--config.train.checkpoint_every=100",
         "--config.train.eval_batches=0"]
PREEMPTED_EXIT = 143   # mars_jax.training.loop.PREEMPTED_EXIT, as a caller writes it


def wait_for_logged_step(run_dir, procs):
  """Returns once metrics.jsonl holds a step; fails if `procs` end or 300 s pass."""
  path = os.path.join(run_dir, "metrics.jsonl")
  deadline = time.time() + 300
  while time.time() < deadline and all(p.poll() is None for p in procs):
    if os.path.isfile(path) and os.path.getsize(path):
      return
    time.sleep(0.02)
  ended = [p.poll() for p in procs if p.poll() is not None]
  raise AssertionError(f"the run ended (status {ended}) before logging a step" if ended
                       else "the run logged no step in 300 s")


def assert_saved_at(run_dir, nproc):
  """-> the one checkpoint step, finalised, with every process's data state; the
  metrics stop there."""
  from mars_jax.checkpoints import runs
  ckpts = os.listdir(os.path.join(run_dir, "checkpoints"))
  step = runs.resolve_checkpoint(run_dir)[1]
  assert ckpts == [str(step)], ckpts   # no orbax tmp directory left
  assert 0 < step < 40
  assert sorted(os.listdir(os.path.join(run_dir, "data_state", str(step)))) == [
      f"process_{i}.json" for i in range(nproc)]
  assert sorted(losses(run_dir)) == list(range(1, step + 1))
  return step


@pytest.mark.e2e
def test_sigterm_saves_then_resumes_exactly(tmp_path):
  straight = str(tmp_path / "straight")
  reference = train(straight, *STEPS, background=True)   # uninterrupted, meanwhile
  d = str(tmp_path / "run")
  proc = train(d, *STEPS, background=True)
  wait_for_logged_step(d, [proc])
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == PREEMPTED_EXIT, out[-3000:]
  step = assert_saved_at(d, 1)
  assert f"stopped by SIGTERM after step {step}, checkpoint saved" in out
  r = train(d, *STEPS)
  assert f"resumed {d} from step {step}" in r.stderr
  assert sorted(losses(d)) == list(range(1, 41))
  ref_out = reference.communicate(timeout=300)[0]
  assert reference.returncode == 0, ref_out[-3000:]
  assert_bitwise(params_of(d), params_of(straight))


def test_handler_only_during_the_loop():
  """A library caller's SIGTERM handler is back once the loop ends."""
  from mars_jax.training import loop as trainer
  mine = lambda *_: None
  previous = signal.signal(signal.SIGTERM, mine)
  try:
    with trainer.sigterm_notice(lambda step: False) as stop:
      assert signal.getsignal(signal.SIGTERM) is not mine and not stop(1)
      os.kill(os.getpid(), signal.SIGTERM)
      assert stop(2)
    assert signal.getsignal(signal.SIGTERM) is mine
  finally:
    signal.signal(signal.SIGTERM, previous)


def child_with_process_id(launcher, process_id):
  """The pid of launch/local.sh's child with MARS_PROCESS_ID=`process_id`."""
  for pid in subprocess.check_output(["pgrep", "-P", str(launcher.pid)], text=True).split():
    with open(f"/proc/{pid}/environ", "rb") as f:
      if f"MARS_PROCESS_ID={process_id}".encode() in f.read().split(b"\0"):
        return int(pid)
  raise AssertionError(f"no process {process_id} under the launcher")


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step(tmp_path):
  """SIGTERM to process 1 alone: both save the same step and exit 143, so does the
  launcher; rerun, the weights are those of the uninterrupted 2-process run."""
  straight2 = str(tmp_path / "straight")
  train_2proc(straight2, *STEPS)
  d, logdir = str(tmp_path / "run"), str(tmp_path / "run_logs")
  launcher = subprocess.Popen(
      ["bash", os.path.join(ROOT, "launch/local.sh"), "--num-processes", "2",
       "--devices-per-process", "2", "--port", str(free_port()), "--logdir", logdir, "--",
       *SMALL, f"--workdir={d}", *STEPS],
      env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ROOT}, cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  wait_for_logged_step(d, [launcher])
  os.kill(child_with_process_id(launcher, 1), signal.SIGTERM)
  out = launcher.communicate(timeout=300)[0]
  assert launcher.returncode == PREEMPTED_EXIT, out
  step = assert_saved_at(d, 2)
  for i in (0, 1):
    log = open(os.path.join(logdir, f"process_{i}.log")).read()
    assert f"process {i}: {d}: stopped by SIGTERM after step {step}" in log, log[-3000:]
  train_2proc(d, *STEPS)
  assert sorted(losses(d)) == list(range(1, 41))
  assert_bitwise(params_of(d), params_of(straight2))


def test_slurm_script_requeues_on_sigterm_status(tmp_path):
  """gpu_slurm.sbatch with stand-ins for srun and scontrol: status 143 requeues the job
  while SLURM has it RUNNING and is the script's status; a job being cancelled (plain
  scancel: COMPLETING) is not requeued, nor is any other failure."""
  calls = tmp_path / "calls"
  for name, body in (("srun", 'echo "srun $*" >> "$CALLS"; exit "$SRUN_STATUS"'),
                     ("scontrol", 'echo "scontrol $*" >> "$CALLS"\n'
                                  '[ "$1" = show ] && echo "JobId=77 JobState=$JOB_STATE"; exit 0')):
    (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
    (tmp_path / name).chmod(0o755)
  for status, state, requeued in ((143, "RUNNING", True), (143, "COMPLETING", False),
                                  (1, "RUNNING", False)):
    calls.write_text("")
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/gpu_slurm.sbatch"), "--", "--config", "c"],
        env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "CALLS": str(calls),
             "SRUN_STATUS": str(status), "SLURM_JOB_ID": "77", "JOB_STATE": state},
        capture_output=True, text=True)
    assert r.returncode == status
    lines = calls.read_text().splitlines()
    assert "exec python -m mars_jax.train --config c" in lines[0]
    assert [l for l in lines[1:] if "requeue" in l] == (
        ["scontrol requeue 77"] if requeued else [])
    if status == 143 and not requeued:
      assert "the job is COMPLETING (cancelled, or out of time), so it is not requeued" in r.stderr
