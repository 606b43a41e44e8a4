"""Multi-process start-up: `jax.distributed.initialize` from config, environment, SLURM or TPU.

Sources, first match wins:
  1. explicit: `coordinator_address`, `num_processes`, `process_id` (config or the
     environment variables MARS_COORDINATOR_ADDRESS, MARS_NUM_PROCESSES,
     MARS_PROCESS_ID);
  2. SLURM (`SLURM_JOB_ID` with more than one task): coordinator = first node of the
     job at `port`, one process per task;
  3. Cloud TPU VM slices: JAX's own auto-detection (`jax.distributed.initialize()`);
  4. otherwise a single process, nothing to initialise.

`local_device_ids` (which of this host's accelerators the process drives) comes from
the config, or under SLURM from `SLURM_LOCALID` when several tasks share a node and
each sees every GPU (the usual cause of "only GPU 0 is used" is the opposite: one
process per node restricted to one device).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Mapping

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Plan:
  coordinator_address: str | None = None
  num_processes: int = 1
  process_id: int = 0
  local_device_ids: tuple[int, ...] | None = None
  source: str = "single"   # explicit | slurm | tpu | single
  cpu_collectives: bool = False


def _first_slurm_host(nodelist: str) -> str:
  """'node[03-05,09],gpu7' -> 'node03' (the first host of a SLURM node list)."""
  first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
  if not first:
    raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
  prefix, _, ranges = first.groups()
  if not ranges:
    return prefix
  return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int:
  raw = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
  return int(re.match(r"\d+", raw).group())


def plan_from_env(env: Mapping[str, str], *, coordinator_address: str | None = None,
                  num_processes: int | None = None, process_id: int | None = None,
                  local_device_ids: tuple[int, ...] | None = None, port: int = 12355,
                  platform: str | None = None) -> Plan:
  """Decides how to initialise, from explicit values and the environment (pure)."""
  coordinator_address = coordinator_address or env.get("MARS_COORDINATOR_ADDRESS")
  if num_processes is None and env.get("MARS_NUM_PROCESSES"):
    num_processes = int(env["MARS_NUM_PROCESSES"])
  if process_id is None and env.get("MARS_PROCESS_ID"):
    process_id = int(env["MARS_PROCESS_ID"])
  cpu = (platform or env.get("JAX_PLATFORMS", "")).startswith("cpu")
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ValueError("a coordinator address needs num_processes and process_id too "
                       "(config distributed.* or MARS_NUM_PROCESSES / MARS_PROCESS_ID).")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id {process_id} is outside 0..{num_processes - 1}.")
    return Plan(coordinator_address, num_processes, process_id, local_device_ids,
                "explicit", cpu)
  if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1")) > 1:
    port = int(env.get("MARS_SLURM_PORT", port))
    host = _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    if local_device_ids is None:
      visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
      if _slurm_tasks_per_node(env) > 1 and len(visible) != 1:
        local_device_ids = (int(env.get("SLURM_LOCALID", "0")),)
    return Plan(f"{host}:{port}", int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]),
                local_device_ids, "slurm", cpu)
  if env.get("TPU_WORKER_HOSTNAMES") or env.get("CLOUD_TPU_TASK_ID") or env.get(
      "TPU_WORKER_ID"):
    return Plan(source="tpu")
  return Plan(local_device_ids=local_device_ids)


def initialize(plan: Plan) -> None:
  """Starts JAX's distributed runtime as planned (no-op for a single process)."""
  if plan.source == "single":
    return
  if plan.cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if plan.source == "tpu":
    jax.distributed.initialize()
    return
  jax.distributed.initialize(
      coordinator_address=plan.coordinator_address, num_processes=plan.num_processes,
      process_id=plan.process_id,
      local_device_ids=list(plan.local_device_ids) if plan.local_device_ids else None)


def assert_same_config(config_json: str) -> None:
  """Fails on every process when processes were started with different configs."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  digest = np.frombuffer(hashlib.sha256(config_json.encode()).digest()[:8], np.int64)
  everyone = multihost_utils.process_allgather(digest)
  if len(set(np.asarray(everyone).ravel().tolist())) != 1:
    raise ValueError(
        f"process {jax.process_index()}: processes disagree on the config (hashes "
        f"{np.asarray(everyone).ravel().tolist()}); launch every process with the same "
        "--config and overrides.")


def config_fingerprint(cfg) -> str:
  """Canonical JSON of a ConfigDict (minus per-process fields) for `assert_same_config`."""
  d = json.loads(cfg.to_json_best_effort(sort_keys=True))
  d.pop("distributed", None)
  return json.dumps(d, sort_keys=True)


def env_summary() -> str:
  return (f"process {jax.process_index()}/{jax.process_count()}, "
          f"{jax.local_device_count()} local / {jax.device_count()} global devices "
          f"({jax.devices()[0].platform})")

