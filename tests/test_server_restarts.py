"""The server's engine dying, hanging or signalled while it starts, through a real server
(`python -m mars_jax.serve` in a subprocess, the module shape of
tests/test_http_server.py) and real clients: it comes back, gives up when it must, and a
SIGTERM while it compiles ends it at once."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from test_http_server import servers  # noqa: F401  (the module's fixture)
from test_http_server import PROMPTS, ROOT, _long, _post_all, _wait_for, complete, spawn

from mars_jax.benchmarks.serve_procs import free_port

pytestmark = pytest.mark.e2e


def _engine_pid(server_pid: int) -> int:
  """The engine process: the server's child that multiprocessing spawned (not its
  resource tracker)."""
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    except (OSError, ValueError, IndexError):
      continue
    if ppid == server_pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
      return int(entry)
  raise AssertionError(f"no engine process under {server_pid}")


def _kill_in_flight(server, sig: int) -> list[httpx.Response]:
  """Four requests in flight, then `sig` to the engine -> their responses."""
  held = []
  holder = threading.Thread(target=lambda: held.extend(
      _post_all(server.url, [_long(i, 120) for i in range(4)])))
  holder.start()
  _wait_for(server, "mars_requests_running", 4)
  os.kill(_engine_pid(server.proc.pid), sig)
  holder.join(120)
  return held


def _back(server) -> list[str]:
  """/health's statuses until it answers 200 again."""
  seen, deadline = [], time.time() + 600
  while time.time() < deadline:
    r = httpx.get(f"{server.url}/health", timeout=5)
    seen.append(r.json()["status"])
    if r.status_code == 200:
      break
    time.sleep(0.5)
  return seen


def test_a_dead_or_stuck_engine_comes_back_and_one_death_too_many_ends_the_server(servers):
  """--watchdog-s 3 over rounds of 1.2 s: the first request after an idle spell longer
  than that is served (silence counts from the dispatch, not from the engine's last
  message). SIGKILL of the engine (as the OOM killer sends) with requests in flight: they
  are answered 503 with Retry-After, /health says "restarting", and the new engine,
  killed while it loads, counts as one more restart; the next one serves. SIGSTOP (a hung
  engine): the watchdog kills it, and the same follows. With --max-restarts 3 the fourth
  death within the window ends the server with status 2, saying why."""
  server = servers.get("restartable", "--max-restarts", "3", "--watchdog-s", "3",
                       env={"MARS_JAX_SERVE_ROUND_DELAY_S": "1.2"})
  time.sleep(4.5)
  assert complete(server.client(), PROMPTS[1], max_tokens=30)[1] == "length"
  for sig in (signal.SIGKILL, signal.SIGSTOP):
    held = _kill_in_flight(server, sig)
    assert [r.status_code for r in held] == [503] * 4, [r.text for r in held]
    assert all(r.headers["Retry-After"] and "restarting" in r.json()["error"]["message"]
               for r in held)
    if sig == signal.SIGKILL:   # the next engine dies while it loads: one restart more
      os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
    seen = _back(server)
    assert "restarting" in seen and seen[-1] == "ok", seen
    health = httpx.get(f"{server.url}/health", timeout=5).json()  # the new engine's warmup:
    assert health["programs_compiled"] == 0 < health["programs_loaded"], health  # all saved
    assert complete(server.client(), PROMPTS[0], max_tokens=5)[1] == "length"
  log = open(server.log.name).read()
  assert re.findall(r"death (\d) of 3 allowed", log) == ["1", "2", "3"], log[-4000:]
  assert "ended no round for" in log
  os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
  assert server.proc.wait(120) == 2, server.output()
  assert "giving up" in server.output()


def test_sigterm_while_compiling_ends_the_server_at_once(servers, tmp_path):
  """A server compiling its variants (an empty compilation cache) answers 503 on every
  endpoint, /v1/models included, and SIGTERM then ends it within a few seconds, status
  0."""
  port = free_port()
  with open(tmp_path / "server.log", "w+") as log:
    proc = spawn(servers.checkpoint, port, log, "--compilation-cache",
                 str(tmp_path / "empty_cache"))
    try:
      deadline, statuses = time.time() + 300, []
      while time.time() < deadline and not statuses:
        try:
          r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
          if r.json()["status"] == "starting":
            statuses.append(httpx.get(f"http://127.0.0.1:{port}/v1/models",
                                      timeout=5).status_code)
        except httpx.TransportError:
          time.sleep(0.2)
      assert statuses == [503], statuses
      begin = time.time()
      proc.send_signal(signal.SIGTERM)
      assert proc.wait(30) == 0
      assert time.time() - begin < 10
    finally:
      proc.kill()


def test_default_flags_size_the_batch_from_the_free_memory(servers, tmp_path):
  """`python -m mars_jax.serve --model DIR` with its defaults (but --no-warmup: a cold
  warmup of the real vocabulary is minutes here) logs the KV pool it sized from the
  host's memory and XLA's figure for the widest step, and serves."""
  port = free_port()
  with open(tmp_path / "server.log", "w+") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mars_jax.serve", "--model", servers.checkpoint, "--port",
         str(port), "--no-warmup"],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}, cwd=ROOT,
        stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline = time.time() + 300
      while time.time() < deadline:
        try:
          if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            break
        except httpx.TransportError:
          pass
        assert proc.poll() is None, open(tmp_path / "server.log").read()
        time.sleep(0.5)
      client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                             max_retries=0, timeout=300)
      got = client.chat.completions.create(model="hf", max_tokens=4,
                                           messages=[{"role": "user", "content": PROMPTS[1]}])
      assert got.usage.completion_tokens == 4
      proc.send_signal(signal.SIGTERM)
      assert proc.wait(60) == 0
      text = open(tmp_path / "server.log").read()
      assert re.search(r"KV pool: \d+ pages of \d+ KiB \([\d.]+ GiB\): 0\.9 x [\d.]+ GiB "
                       r"available on the host(, at most 4 GiB of pool on the CPU backend)?, "
                       r"less the widest step's \d+ MiB of temporaries \(XLA's memory "
                       r"analysis\) and the state's \d+ MiB besides the pool, holds \d+", text), (
                           text[-3000:])
    finally:
      proc.kill()


def test_a_cache_others_can_write_stops_the_server_with_the_fix(servers, tmp_path):
  """`--compilation-cache` on a directory its group and others can write (a shared /tmp
  or NFS path): the engine refuses it before loading anything, and the server exits 2
  naming the directory and `chmod go-w`."""
  shared = tmp_path / "shared_cache"
  shared.mkdir()
  shared.chmod(0o777)
  with open(tmp_path / "server.log", "w+") as log:
    proc = spawn(servers.checkpoint, free_port(), log, "--compilation-cache", str(shared))
    try:
      assert proc.wait(300) == 2
    finally:
      proc.kill()
    log.seek(0)
    text = log.read()
  assert f"chmod go-w {shared}" in text and "run their code" in text, text[-3000:]
