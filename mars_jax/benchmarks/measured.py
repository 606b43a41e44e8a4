"""Measuring a benchmark's child processes (`python -m mars_jax.bench data`): wall and CPU
seconds, the peak of the process tree's summed RSS and PSS, the JSON a child prints on
its last line, the page cache dropped before a run, a process's descriptors and maps.

  run = run_measured(command, child_env(), log)   # {"wall_s", "cpu_s", "peak_rss_mb", ...}
  out = child_result(run)                    # the child's RESULT line, parsed
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DROP_CACHES = "/proc/sys/vm/drop_caches"
POLL_S = 0.2
RESULT = "BENCH_DATA_RESULT "   # a child's last stdout line: this prefix, then JSON


def child_env(**extra: str) -> dict:
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  env = {"JAX_PLATFORMS": "cpu", **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
         "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **extra}
  return env


class TreeMonitor:
  """Polls a process and its descendants every POLL_S seconds in a thread: the peaks of
  their summed RSS and summed PSS (None where PSS cannot be read)."""

  def __init__(self, pid: int):
    import psutil  # pylint: disable=import-outside-toplevel
    self._psutil = psutil
    try:
      self._root = psutil.Process(pid)
    except psutil.Error:  # already gone
      self._root = None
    self.peak_rss, self.peak_pss, self.samples, self.most_procs = 0, 0, 0, 0
    self._pss_ok, self._stop = True, threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _sample(self) -> None:
    psutil = self._psutil
    try:
      procs = [self._root, *self._root.children(recursive=True)]
    except (psutil.Error, AttributeError):
      return
    rss = pss = 0
    alive = 0
    for p in procs:
      try:
        if self._pss_ok:
          try:
            info = p.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
          except (psutil.AccessDenied, AttributeError):
            self._pss_ok = False
            rss += p.memory_info().rss
        else:
          rss += p.memory_info().rss
        alive += 1
      except psutil.Error:
        continue
    self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
    self.most_procs = max(self.most_procs, alive)
    self.samples += 1

  def _run(self) -> None:
    while not self._stop.is_set():
      self._sample()
      self._stop.wait(POLL_S)

  def stop(self) -> dict:
    self._stop.set()
    self._thread.join()
    return {"peak_rss_mb": self.peak_rss / 2**20,
            "peak_pss_mb": self.peak_pss / 2**20 if self._pss_ok else None,
            "most_processes": self.most_procs, "memory_samples": self.samples}


def run_measured(command: list[str], env: dict, log: str) -> dict:
  """Runs `command` (stdout to LOG.out, stderr to LOG.err), polling its process tree ->
  {"wall_s", "cpu_s" (user + sys of it and every descendant it reaped), peaks of
  `TreeMonitor`, "returncode", "stdout", "stderr" (their text)}."""
  import resource  # pylint: disable=import-outside-toplevel
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
    begin = time.perf_counter()
    proc = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=ROOT)
    monitor = TreeMonitor(proc.pid)
    code = proc.wait()
    wall = time.perf_counter() - begin
  facts = monitor.stop()
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  with open(f"{log}.out", errors="replace") as f:
    stdout = f.read()
  with open(f"{log}.err", errors="replace") as f:
    stderr = f.read()
  return {"command": command, "returncode": code, "wall_s": wall, "cpu_s": cpu, **facts,
          "stdout": stdout, "stderr": stderr, "log": log}


def check_can_drop_page_cache() -> None:
  """SystemExit, before anything is built, where this process may not drop the cache."""
  if not os.access(DROP_CACHES, os.W_OK):
    raise SystemExit(f"--drop-page-cache: cannot write {DROP_CACHES}; run as root on "
                     "Linux, or leave the flag off")


def drop_page_cache() -> None:
  """Writes dirty pages out and drops the kernel's page cache (needs root), so that the
  next process reads the cache, the chats and its own imports from the disk."""
  os.sync()
  with open(DROP_CACHES, "w") as f:
    f.write("3\n")


def handles(cache: str) -> dict:
  """This process's open file descriptors and the files under `cache` it has mapped
  (from /proc/self; None where there is no /proc)."""
  try:
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
      paths = {parts[5] for parts in (line.split(None, 5) for line in f) if len(parts) == 6}
  except OSError:
    return {"fds": None, "cache_maps": None}
  root = os.path.realpath(cache) + os.sep
  return {"fds": fds, "cache_maps": sum(p.strip().startswith(root) for p in paths)}


def check_exit(run: dict, what: str) -> None:
  if run["returncode"] != 0:
    raise RuntimeError(f"{what} exited with {run['returncode']}: {' '.join(run['command'])}"
                       f"\n{(run['stdout'] + run['stderr'])[-3000:]}")


def child_result(run: dict) -> dict:
  """The JSON a child printed on its RESULT line."""
  for line in reversed(run["stdout"].splitlines()):
    if line.startswith(RESULT):
      return json.loads(line[len(RESULT):])
  raise RuntimeError(f"no result line from {' '.join(run['command'])}:\n"
                     f"{(run['stdout'] + run['stderr'])[-3000:]}")


def tree_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


def started_at() -> float:
  import psutil  # pylint: disable=import-outside-toplevel
  return psutil.Process().create_time()


def rss_bytes() -> int:
  import psutil  # pylint: disable=import-outside-toplevel
  return psutil.Process().memory_info().rss


def max_rss_mb() -> float:
  import resource  # pylint: disable=import-outside-toplevel
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
