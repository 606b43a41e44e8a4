"""Launch scripts (--help, --dry-run) and the distributed start-up plan."""

import os
import shlex
import subprocess

import pytest

from mars_jax.parallel.distributed import plan_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, env=None):
  return subprocess.run(["bash", os.path.join(ROOT, "launch", script), *args],
                        capture_output=True, text=True, env={**os.environ, **(env or {})},
                        check=True).stdout


@pytest.mark.parametrize("script", ["local.sh", "gpu_slurm.sbatch", "tpu_vm.sh",
                                    "device_check.sh", "slurm_localhost.sh", "vllm_venv.sh"])
def test_help(script):
  assert "Usage:" in run(script, "--help")


def test_local_dry_run():
  out = run("local.sh", "--dry-run", "--num-processes", "3", "--devices-per-process", "2",
            "--port", "2345", "--logdir", "/tmp/L", "--", "--config", "configs/tiny.py",
            "--workdir", "/tmp/w").splitlines()
  assert len(out) == 3
  for i, line in enumerate(out):
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in line
    assert "MARS_COORDINATOR_ADDRESS=localhost:2345" in line
    assert "MARS_NUM_PROCESSES=3" in line and f"MARS_PROCESS_ID={i}" in line
    assert "-m mars_jax.train --config configs/tiny.py --workdir /tmp/w" in line
    assert line.endswith(f"> /tmp/L/process_{i}.log")


def test_slurm_dry_run():
  out = run("gpu_slurm.sbatch", "--dry-run", "--port", "4444", "--venv", "/opt/v", "--",
            "--config", "configs/qwen2_5_7b_mars.py", "--workdir", "/runs/a b",
            env={"SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS": "4"})
  assert "# nodes=4 tasks=4" in out and "port 4444" in out
  cmd = out.splitlines()[-1]
  assert cmd.startswith("srun --kill-on-bad-exit=1")
  assert "MARS_SLURM_PORT=4444" in cmd and "/opt/v/bin/activate" in cmd
  assert "mars_jax.train" in cmd and "configs/qwen2_5_7b_mars.py" in cmd


def test_tpu_dry_run():
  out = run("tpu_vm.sh", "--name", "mars", "--zone", "us-east5-a", "--type", "v5p-16",
            "--project", "p", "--delete", "--dry-run", "--", "--config", "configs/x.py",
            env={"LIBTPU_INIT_ARGS": ""})
  lines = out.splitlines()
  assert lines[0].startswith("gcloud compute tpus tpu-vm create mars --zone us-east5-a "
                             "--project p --accelerator-type v5p-16")
  assert any("--worker=all" in l and "jax\\[tpu\\]" in l for l in lines)
  assert any("--worker=all" in l and "mars_jax.train" in l and "configs/x.py" in l
             for l in lines)
  assert lines[-1].startswith("gcloud compute tpus tpu-vm delete mars")
  assert "LIBTPU_INIT_ARGS" not in out
  flags = "--xla_tpu_enable_all_experimental_scheduler_features=true --xla_a=1"
  out = run("tpu_vm.sh", "--name", "mars", "--zone", "z", "--dry-run", "--",
            "--config", "configs/x.py", env={"LIBTPU_INIT_ARGS": flags})
  argv = shlex.split(next(l for l in out.splitlines() if "mars_jax.train" in l))
  remote = argv[argv.index("--command") + 1].split(" && ", 1)[1]
  assert shlex.split(remote)[:4] == ["LIBTPU_INIT_ARGS=" + flags, "python", "-m",
                                     "mars_jax.train"]


def test_device_check_dry_run(tmp_path):
  """The README's install order, the marked tests on the GPU, every bench section under
  its limit (the bench's own limit 15 s under the section's), then the report."""
  out = run("device_check.sh", "--dry-run", "--installer", "pip", "--limits", "decode=120",
            "--peak-tflops", "900", str(tmp_path / "dev")).splitlines()
  text = "\n".join(out)
  reqs = next(i for i, l in enumerate(out) if l.endswith("install -q -r requirements.txt"))
  jax_gpu = next(i for i, l in enumerate(out) if "install -q -U 'jax[cuda13]>=0.11,<0.12'" in l)
  torch_cpu = next(i for i, l in enumerate(out) if "torch==" in l and "whl/cpu" in l)
  test_deps = next(i for i, l in enumerate(out) if "pytest==" in l and "safetensors==" in l)
  assert reqs < jax_gpu < torch_cpu < test_deps and "lm-eval" not in text
  assert "assert d.platform == \"gpu\"" in text
  assert "JAX_PLATFORMS=cuda" in text and "-m pytest -q -m device -n 0" in text
  assert "tests/test_sampling.py" in text and "tests/test_lm_eval.py" not in text
  for name, soft in (("train", 50), ("decode", 105), ("decode_7b", 50)):
    assert f"--peak-tflops 900 --merge --sections {name} --limits {name}={soft}" in text
  assert out[-1].endswith("--report") and not (tmp_path / "dev").exists()


def test_device_check_skips_what_the_budget_cannot_hold(tmp_path):
  """Sections that would pass the overall budget are skipped and say so; the report is
  still written."""
  import sys  # pylint: disable=import-outside-toplevel
  r = subprocess.run(["bash", os.path.join(ROOT, "launch", "device_check.sh"), "--smoke",
                      "--budget", "20", "--venv", sys.prefix, str(tmp_path)],
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stdout + r.stderr
  for name in ("tests", "train", "decode", "decode_7b"):
    assert f"== {name}: SKIPPED" in r.stdout
  md = (tmp_path / "device.md").read_text()
  assert "| decode_7b | 65 | 0 | skipped (budget) |" in md


def test_scripts_refuse_missing_train_args():
  for script, extra in [("local.sh", []), ("tpu_vm.sh", ["--name", "a", "--zone", "z"])]:
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", script), *extra],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no train arguments" in r.stderr


def test_plan_slurm_one_process_per_gpu():
  plan = plan_from_env({
      "SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
      "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[003-004,010]",
      "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "MARS_SLURM_PORT": "999"})
  assert plan.source == "slurm" and plan.coordinator_address == "gpu003:999"
  assert (plan.num_processes, plan.process_id, plan.local_device_ids) == (16, 11, (3,))


def test_plan_slurm_one_process_per_node_uses_all_gpus():
  plan = plan_from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                        "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": "a1,a2",
                        "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
  assert plan.coordinator_address == "a1:12355" and plan.local_device_ids is None


def test_plan_explicit_and_errors():
  plan = plan_from_env({"MARS_COORDINATOR_ADDRESS": "h:1", "MARS_NUM_PROCESSES": "2",
                        "MARS_PROCESS_ID": "1", "JAX_PLATFORMS": "cpu"})
  assert plan.source == "explicit" and plan.cpu_collectives and plan.process_id == 1
  with pytest.raises(ValueError, match="needs num_processes and process_id"):
    plan_from_env({"MARS_COORDINATOR_ADDRESS": "h:1"})
  with pytest.raises(ValueError, match="outside 0..1"):
    plan_from_env({}, coordinator_address="h:1", num_processes=2, process_id=2)
  assert plan_from_env({"TPU_WORKER_HOSTNAMES": "a,b"}).source == "tpu"
  assert plan_from_env({}).source == "single"
