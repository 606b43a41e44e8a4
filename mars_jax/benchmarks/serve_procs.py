"""The servers of `python -m mars_jax.bench serve` as subprocesses: our server's command,
start until /health answers, stop, and what the logs and /metrics say (compiles after
ready, rows and tokens per forward). The peers' commands are serve_peers', the load
serve_load's."""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPILE_LINE = re.compile(r"Compiling (\S+) with global shapes")


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(**extra: str) -> dict:
  """This environment, the repository on PYTHONPATH, unbuffered output, and `extra`."""
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def ours_command(model_dir: str, port: int, window: str, name: str, args) -> list[str]:
  return [sys.executable, "-m", "mars_jax.serve", "--model", model_dir, "--host", "127.0.0.1",
          "--port", str(port), "--served-model-name", name, "--log-level", "warning",
          *shape_flags(window, args)]


def shape_flags(window: str, args) -> list[str]:
  """Our server's flags besides where it listens: --window, and the bench's --batch-size,
  --windows, --max-len and --server-args when given (else the server's defaults)."""
  return ["--window", window,
          *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
          *(["--windows", args.windows] if args.windows and window == "auto" else []),
          *(["--max-len", str(args.max_len)] if args.max_len else []),
          *shlex.split(args.server_args)]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
  """GET -> (HTTP status, body); (0, "") when nothing answers."""
  try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
      return r.status, r.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()
  except (urllib.error.URLError, ConnectionError, TimeoutError):
    return 0, ""


def tail(path: str, chars: int = 3000) -> str:
  with open(path, errors="replace") as f:
    return f.read()[-chars:]


class Launched:
  """A server subprocess, its output in `log` (stdout and stderr)."""

  def __init__(self, command: list[str], env: dict, log: str, port: int):
    self.command, self.log, self.url = command, log, f"http://127.0.0.1:{port}"
    with open(log, "w") as f:
      self.proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env,
                                   cwd=ROOT)
    self.begin = time.perf_counter()

  def wait_ready(self, timeout_s: float) -> dict:
    """Polls GET /health until it answers 200 -> {"ready_s", "startup_s" (the body's, or
    None), "log_offset" (the log's size then)}; RuntimeError (the log's tail) when the
    process exits or the time runs out first."""
    deadline = self.begin + timeout_s
    while time.perf_counter() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"{self.command[:4]} exited ({self.proc.returncode}) before it "
                           f"was ready:\n{tail(self.log)}")
      status, body = _get(f"{self.url}/health")
      if status == 200:
        ready_s = time.perf_counter() - self.begin
        startup = json.loads(body or "{}").get("startup_s")
        return {"ready_s": ready_s, "startup_s": startup,
                "log_offset": os.path.getsize(self.log)}
      time.sleep(0.5)
    raise RuntimeError(f"{self.url}/health did not answer 200 within {timeout_s:.0f} s:\n"
                       f"{tail(self.log)}")

  def stop(self, timeout_s: float) -> dict:
    """SIGTERM, then SIGKILL after timeout_s -> {"exit_code", "killed"}. The server stays
    in the bench's session and process group: vLLM for CPUs started in a session of its
    own (setsid) served about a third of the tokens (docs/serving.md)."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    try:
      return {"exit_code": self.proc.wait(timeout_s), "killed": False}
    except subprocess.TimeoutExpired:
      self.proc.kill()
      return {"exit_code": self.proc.wait(), "killed": True}


def compiles(log: str, start: int) -> collections.Counter:
  """jax's compile log lines past byte `start` of the log, by function name."""
  with open(log, "rb") as f:
    f.seek(start)
    text = f.read().decode(errors="replace")
  return collections.Counter(m.group(1) for m in COMPILE_LINE.finditer(text))


def ready_offset(log: str, fallback: int) -> int:
  """The byte offset past the server's "ready in" line, else `fallback`."""
  with open(log, "rb") as f:
    text = f.read()
  at = text.find(b"ready in")
  if at < 0:
    return fallback
  end = text.find(b"\n", at)
  return len(text) if end < 0 else end + 1


def scrape(url: str) -> dict[str, float]:
  """GET /metrics (Prometheus text) -> {metric name: its samples summed over labels}."""
  status, body = _get(f"{url}/metrics")
  if status != 200:
    raise RuntimeError(f"GET {url}/metrics answered {status}.")
  totals: dict[str, float] = collections.defaultdict(float)
  for line in body.splitlines():
    if line and not line.startswith("#"):
      name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
      totals[name] += float((rest.rsplit("}", 1)[-1] if "}" in rest else rest).split()[0])
  return dict(totals)


def per_forward(before: dict, after: dict) -> dict:
  """Rows per forward and tokens per forward of the requests between two scrapes, and
  the counters' deltas (0 for a counter the server does not have)."""
  delta = {k: after.get(f"mars_{k}_total", 0) - before.get(f"mars_{k}_total", 0)
           for k in ("request_forwards", "batch_forwards", "generation_tokens",
                     "compiles_after_ready")}
  return {"rows_per_forward": delta["request_forwards"] / max(delta["batch_forwards"], 1),
          "tokens_per_forward": delta["generation_tokens"] / max(delta["request_forwards"], 1),
          "metrics_delta": delta}
