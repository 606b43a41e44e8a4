"""The engine process: it owns the device and runs `Server.step` round after round; the
HTTP process (`mars_jax.serve.app`) talks to it through a pipe, one batched message
each way per round.

  engine = Engine(args)             # the parsed `python -m mars_jax.serve` arguments
  engine.start()                    # spawns the process (called in the event loop)
  await engine.loaded               # facts: tokenizer, context room, windows, ...
  handle = engine.submit(prompt_ids, max_new_tokens=64, window="auto")
  async for event in handle:        # Accepted, then Tokens(...), then Done or Error
    ...
  engine.cancel(handle)             # frees its row at the next round
  await engine.stop()               # answers what is left, ends the process

Why a process: the HTTP side (parsing, chat templates, tokenizing, detokenizing, SSE)
and the decoding loop's host work (admission, harvest, stop strings) both hold the
GIL; in one process each stalls the other, and the batch drains while requests wait
in the event loop. Here each has its interpreter, and the only traffic is what a round
changes: the HTTP side sends the submits and cancels gathered since its last message,
the engine answers with every request's new tokens and finishes of the round.

The engine process (`run`):
  1. loads the model and builds the `Server` (`build.build_server`), sends `Loaded` facts
     (the tokenizer among them);
  2. with warmup on, compiles every variant the rounds can meet (`Server.warmup`),
     through JAX's persistent compilation cache (`compilation_cache`), and sends
     `Ready` with the start-up seconds; it counts compiles after that (JAX's lowering
     events), which `/metrics` reports;
  3. loops: takes every waiting command (blocking only while idle), submits, cancels
     and scores (the AR model's logprobs, `decoding.scoring`) between rounds, runs a
     round, sends one `Round` message.
A round that raises fails only the requests in it (an `Error` each, HTTP 500); the
server is `reset` to a fresh state and goes on with the queue. An engine process that
dies once ready (killed, out of memory, a crash), or again while it starts anew, is
started again by the HTTP side (through the warm compilation cache), its open requests
answered 503 with Retry-After; a death is handled once, for the process it belongs to
(each process has its own reader thread; a failed send and that reader report the same
death). After more than `--max-restarts` deaths within `RESTART_WINDOW_S` the HTTP
process gives up and exits with status 2, for a supervisor to take over. An engine that
owes a round for `--watchdog-s` seconds is stuck: a round is owed from the moment work is
sent to an idle engine, and from each round's message while requests stay open (never
across an idle spell). The HTTP side kills it, and it is restarted like a dead one.
While it is starting (or starting again) a shutdown kills it at once: it holds no
request. Test hooks (environment
variables): MARS_JAX_SERVE_FAIL_ROUNDS="3,7" makes those rounds raise;
MARS_JAX_SERVE_ROUND_DELAY_S=0.2 sleeps that long after every round, so that requests
stay in flight long enough for a test to act on them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from mars_jax.core.private import check_tree, private_dir
from mars_jax.decoding import scoring
from mars_jax.decoding.programs import DEFAULT_MAX_BYTES
from mars_jax.serve.latency import Latency
from mars_jax.serve.messages import (Accepted, Done, Error, Failed, Loaded, Metrics, Ready,
                                     Round, Scored, Tokens)

log = logging.getLogger(__name__)

FAIL_ROUNDS_ENV = "MARS_JAX_SERVE_FAIL_ROUNDS"
ROUND_DELAY_ENV = "MARS_JAX_SERVE_ROUND_DELAY_S"
COMPILATION_CACHE_ENV = "MARS_JAX_COMPILATION_CACHE"
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


# -- the engine process ------------------------------------------------------------------

def compilation_cache(directory: str | None, max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
  """Turns on JAX's persistent compilation cache in `directory` (default:
  $MARS_JAX_COMPILATION_CACHE, else ~/.cache/mars_jax/jax; "" or "none": off), every
  compile cached however small, the cache bounded to `max_bytes` (JAX evicts the least
  recently used; an entry written without the bound gets the access-time file that
  eviction reads) -> the directory used. The directory holds executables this process
  will run, so it, every directory above it and every file in it must be the user's and
  writable by no one else (`mars_jax.core.private.NotPrivate` says what to fix), and
  the process's umask gains go-w so that what JAX writes there stays so."""
  import jax  # pylint: disable=import-outside-toplevel
  if directory is None:
    directory = os.environ.get(COMPILATION_CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "mars_jax", "jax")
  if directory in ("", "none"):
    return None
  what = "--compilation-cache (its executables run in this server)"
  os.umask(os.umask(0o022) | 0o022)   # what JAX writes there: writable by the user alone
  directory = private_dir(directory, what)
  check_tree(directory, what)
  for entry in os.listdir(directory):   # JAX's LRU eviction reads an entry's -atime file,
    if entry.endswith("-cache"):        # which a cache written without the bound lacks
      atime = os.path.join(directory, entry[:-len("-cache")] + "-atime")
      if not os.path.exists(atime):
        with open(atime, "wb") as f:
          f.write(time.time_ns().to_bytes(8, "little"))
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", max_bytes)
  return directory


class _Core:
  """The engine process's state: the server, the front end's request ids, counters."""

  def __init__(self, server, conn: Connection):
    self.server, self.conn = server, conn
    self.metrics = Metrics()
    self.ids: dict[int, int] = {}      # front end id -> server id
    self.front: dict[int, int] = {}    # server id -> front end id
    self.events: list[tuple[int, Any]] = []
    self.waiting: dict[int, float] = {}   # server id -> when submitted, until it gets a row
    self.fail_rounds = {int(r) for r in os.environ.get(FAIL_ROUNDS_ENV, "").split(",") if r}
    self.delay_s = float(os.environ.get(ROUND_DELAY_ENV) or 0)

  def take(self, command) -> bool:
    """Carries out one command from the HTTP side; -> False on "stop"."""
    kind = command[0]
    if kind == "stop":
      return False
    if kind == "cancel":
      rid = self.ids.pop(command[1], None)
      if rid is not None and self.server.cancel(rid):
        del self.front[rid]
        self.waiting.pop(rid, None)
        self.metrics.cancelled += 1
      return True
    if kind == "score":
      _, fid, ids, top = command
      try:
        scoring.check(self.server.config, ids, top)
      except ValueError as e:  # the request's own fault (ids outside the vocabulary)
        self.events.append((fid, Error(str(e), 400)))
        return True
      try:
        self.events.append((fid, Scored(scoring.token_logprobs(
            self.server.config, self.server.params, ids, runtime=self.server.runtime,
            top=top))))
      except Exception as e:  # noqa: BLE001 - this request hears it, the engine goes on
        log.exception("scoring a request raised; it fails, the engine goes on")
        self.events.append((fid, Error(f"scoring failed: {type(e).__name__}: {e}", 500)))
      return True
    _, fid, prompt, kwargs = command
    try:
      rid = self.server.submit(prompt, **kwargs)
    except ValueError as e:  # the request's own fault: HTTP 400
      self.events.append((fid, Error(str(e), 400)))
      return True
    except Exception as e:  # noqa: BLE001 - the engine's fault: this request hears it
      log.exception("admitting a request raised; it fails, the engine goes on")
      self.events.append((fid, Error(f"the server could not admit the request: "
                                     f"{type(e).__name__}: {e}", 500)))
      return True
    self.ids[fid], self.front[rid] = rid, fid
    self.waiting[rid] = time.monotonic()
    self.metrics.prompt_tokens += len(prompt)
    self.events.append((fid, Accepted()))
    return True

  def round(self) -> None:
    m, server = self.metrics, self.server
    steps = server.steps
    m.rounds += 1
    if m.rounds in self.fail_rounds:
      raise RuntimeError(f"round {m.rounds} failed ({FAIL_ROUNDS_ENV})")
    begin = time.monotonic()
    updates = server.step()
    if self.waiting:   # admitted at this round's start: their wait ends there
      queued = {r.request_id for r in server.queue}
      for rid in [r for r in self.waiting if r not in queued]:
        m.queue_time.observe(begin - self.waiting.pop(rid))
    m.steps += server.steps - steps
    m.window, m.batch = server.window, len(server.slots)
    for u in updates:
      fid = self.front[u.request_id]
      m.tokens_streamed += len(u.tokens)
      if u.tokens:
        self.events.append((fid, Tokens(u.tokens)))
      if u.done:
        c = server.completed.pop(u.request_id)
        m.requests[c.finish_reason] = m.requests.get(c.finish_reason, 0) + 1
        m.generated_tokens += len(c.tokens)
        m.request_forwards += c.forwards
        m.drafter_forwards += c.drafter_forwards
        del self.front[u.request_id], self.ids[fid]
        self.events.append((fid, Done(c)))

  def fail_round(self, error: BaseException) -> None:
    """Fails the requests the round ran (its rows, and any it finished before it raised,
    whose answers it never sent) and starts from a fresh state; the queue is kept. A
    request cancelled meanwhile has no one to answer."""
    log.exception("a decoding round failed; its requests fail, the engine goes on")
    self.metrics.failed_rounds += 1
    self.metrics.last_failure = f"{type(error).__name__}: {error}"
    self.server.reset()
    queued = {r.request_id for r in self.server.queue}
    for rid in [r for r in self.front if r not in queued]:
      self.server.completed.pop(rid, None)
      fid = self.front.pop(rid)
      del self.ids[fid]
      self.waiting.pop(rid, None)
      self.metrics.failed += 1
      self.events.append((fid, Error(f"decoding failed: {self.metrics.last_failure}")))

  def flush(self) -> None:
    """Sends the events and counters (after every round and every batch of commands,
    so the counters are current even when a round produced no event)."""
    m, server = self.metrics, self.server
    m.running, m.queued = server.active, len(server.queue)
    m.spec = getattr(server, "spec", m.spec)
    pool = getattr(server, "pool", None)
    if pool is not None:
      m.forward_tokens, m.preemptions = server.forward_tokens, server.preemptions
      m.kv_pages_used, m.kv_pages_cached = pool.in_use, pool.cached
      m.kv_pages = pool.num_pages - pool.reserved
      m.prefix_query_tokens, m.prefix_hit_tokens = pool.query_tokens, pool.hit_tokens
    self.conn.send(Round(self.events, m))
    self.events = []

  def serve(self) -> None:
    """Rounds until "stop" (or the HTTP side is gone), then fails what is left."""
    try:
      while True:
        if self.server.idle:
          self.conn.poll(None)   # nothing to decode: wait for a command
        stop = False
        while not stop and self.conn.poll(0):
          stop = not all(self.take(c) for c in self.conn.recv())
        if stop:
          break
        if not self.server.idle:
          try:
            self.round()
          except Exception as e:  # noqa: BLE001 - keep serving; the requests hear why
            self.fail_round(e)
          time.sleep(self.delay_s)
        self.flush()
    except (EOFError, OSError):
      return   # the HTTP process is gone
    for fid in list(self.ids):
      self.metrics.cancelled += 1
      self.events.append((fid, Error("the server shut down before the request finished.",
                                     503)))
    self.flush()


def run(conn: Connection, args) -> None:
  """The engine process: build, warm up, serve (see the module doc). It ignores SIGTERM
  and SIGINT, which a terminal, `timeout` or a scheduler sends the whole process group:
  the HTTP process leads the shutdown, and a gone HTTP process ends this one."""
  begin = time.perf_counter()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
  logging.basicConfig(level=args.log_level.upper(),
                      format="%(asctime)s %(levelname)s engine: %(message)s", force=True)
  try:
    cache = compilation_cache(args.compilation_cache, int(args.cache_max_gib * (1 << 30)))
    # pylint: disable=import-outside-toplevel
    from mars_jax.decoding.programs import Programs
    from mars_jax.serve.build import build_server
    server, model, cost_path = build_server(args, cache)
    conn.send(Loaded(model.tokenizer, tuple(model.eos_token_ids),
                     min(server.max_len - server.extra_slots,
                         server.config.max_position_embeddings),
                     server.max_window, server.drafter is not None, server.max_batch,
                     server.config.vocab_size))
    warm_begin = time.perf_counter()
    if args.warmup:
      server.warmup(args.warmup_prompt_len)
      if cost_path and hasattr(server.policy, "costs"):
        server.policy.costs.save(cost_path)
    programs = server.call if isinstance(server.call, Programs) else None
    ready = Ready(time.perf_counter() - begin, time.perf_counter() - warm_begin,
                  programs.loaded if programs else 0, programs.compiled if programs else 0)
    log.info("ready in %.1f s (warmup %.1f s: %s; compilation cache %s)", ready.startup_s,
             ready.warmup_s, f"{len(programs)} programs, {programs.loaded} loaded, "
             f"{programs.compiled} compiled" if programs else "jit", cache)
  except Exception as e:  # noqa: BLE001 - the HTTP side reports it and exits
    log.exception("the engine could not start")
    conn.send(Failed(f"{type(e).__name__}: {e}"))
    return
  core = _Core(server, conn)
  import jax  # pylint: disable=import-outside-toplevel

  def count(event: str, *_, **__):
    if event == LOWERING_EVENT:
      core.metrics.compiles_after_ready += 1
  jax.monitoring.register_event_duration_secs_listener(count)
  conn.send(ready)
  core.serve()
  if cost_path and hasattr(server.policy, "costs"):
    server.policy.costs.save(cost_path)


# -- the HTTP side -----------------------------------------------------------------------

RESTART_WINDOW_S = 600.0  # the window in which at most --max-restarts deaths are restarted


class Handle:
  """A submitted request: its id, prompt length, and the events the engine sends."""

  def __init__(self, request_id: int, prompt_len: int):
    self.request_id, self.prompt_len = request_id, prompt_len
    self.events: asyncio.Queue = asyncio.Queue()
    self.finished = False
    self.submitted = time.monotonic()
    self.last_tokens: float | None = None   # when its latest tokens came

  def __aiter__(self):
    return self

  async def __anext__(self):
    if self.finished:
      raise StopAsyncIteration
    event = await self.events.get()
    self.finished = isinstance(event, (Done, Error, Scored))
    return event


class Engine:
  """The HTTP side's view of the engine process (see the module doc). Every method is
  called from the event loop."""

  def __init__(self, args):
    self.args = args
    self.metrics = Metrics()
    self.latency = Latency()
    self.handles: dict[int, Handle] = {}
    self.admitting = True
    self.rejected = 0     # requests answered 503 at once (a full queue)
    self.ready: Ready | None = None
    self.failure: str | None = None
    self._next_id = 0
    self._outbox: list[tuple] = []
    self._conn: Connection | None = None
    self._proc = None
    self.loop: asyncio.AbstractEventLoop | None = None
    self.loaded: asyncio.Future | None = None
    self.on_failure = None   # called when the server must exit: no engine will serve
    self.restarting: str | None = None   # why the engine is being started again
    self.deaths: list[float] = []        # when served engines died (monotonic seconds)
    self._handled = None                 # the engine process whose end was handled last
    self.due_since: float | None = None  # since when a round is owed (monotonic; None: idle)
    self._watching = False

  @property
  def alive(self) -> bool:
    return self._proc is not None and self._proc.is_alive() and self.failure is None

  def start(self) -> None:
    """Spawns the engine process and starts reading its messages."""
    self.loop = asyncio.get_running_loop()
    if self.loaded is None:   # a restarted engine's facts are the first one's
      self.loaded = self.loop.create_future()
    ctx = mp.get_context("spawn")
    self._conn, child = ctx.Pipe()
    self._proc = ctx.Process(target=run, args=(child, self.args), name="mars-engine",
                             daemon=True)
    self._proc.start()
    child.close()
    self.due_since = None
    threading.Thread(target=self._read, args=(self._proc, self._conn),
                     name="mars-engine-reader", daemon=True).start()
    if self.args.watchdog_s > 0 and not self._watching:   # one watchdog a server
      self._watching = True
      self.loop.call_later(1.0, self._watch)

  def _watch(self) -> None:
    """Every second: kills an engine that was ready and has owed a round for
    --watchdog-s seconds (a hung device, a deadlock): silence counts from the dispatch
    of work to an idle engine, or from its last round while requests stay open, never
    across an idle spell. The reader then sees it gone and it is restarted."""
    if self.failure is not None or not self.admitting:
      return
    due = self.due_since
    quiet = 0.0 if due is None else time.monotonic() - due
    if (self.ready is not None and self.handles and quiet > self.args.watchdog_s
        and self._proc.is_alive()):
      log.error("the engine ended no round for %.0f s with %d requests open "
                "(--watchdog-s %g); killing it", quiet, len(self.handles),
                self.args.watchdog_s)
      self._proc.kill()
      self.due_since = None
    self.loop.call_later(1.0, self._watch)

  def _read(self, proc, conn: Connection) -> None:
    """The reader thread of one engine process: hands each message to the event loop
    (one per round), then that process's end, once."""
    try:
      while True:
        self.loop.call_soon_threadsafe(self._take, conn.recv(), proc)
    except (EOFError, OSError):
      proc.join(5)
      try:
        self.loop.call_soon_threadsafe(
            self._gone, f"the engine process exited (status {proc.exitcode})", proc)
      except RuntimeError:   # the event loop closed first
        pass
    except RuntimeError:   # the event loop closed first
      pass

  def _take(self, message, proc) -> None:
    if proc is not self._proc:   # a message the dead engine sent before it went
      return
    now = time.monotonic()
    if isinstance(message, Round):
      self.metrics = message.metrics
      for fid, event in message.events:
        handle = self.handles.get(fid)
        if handle is None:
          continue
        self._time(handle, event, now)
        if isinstance(event, (Done, Error, Scored)):
          del self.handles[fid]
        handle.events.put_nowait(event)
      self.due_since = now if self.handles else None   # the next round is owed from now
    elif isinstance(message, Loaded):
      if not self.loaded.done():
        self.loaded.set_result(message)
    elif isinstance(message, Ready):
      self.ready, self.restarting = message, None
    elif isinstance(message, Failed):
      self._gone(f"the engine could not start: {message.message}", proc)

  def _time(self, handle: Handle, event, now: float) -> None:
    """Counts the request's latencies as its events arrive."""
    if isinstance(event, Tokens) and event.tokens:
      if handle.last_tokens is None:
        self.latency.first_token(now - handle.submitted)
      else:
        self.latency.between_tokens(now - handle.last_tokens, len(event.tokens))
      handle.last_tokens = now
    elif isinstance(event, Done):
      self.latency.request(now - handle.submitted)

  def _gone(self, why: str, proc) -> None:
    """The engine process `proc` ended (its reader saw the pipe close, a send on it
    failed, or it said it could not start); a death is handled once, for the process
    that is current (a stale report of an earlier one is dropped). One that was serving,
    or starting again after such a death, is started again (its open requests answered
    503, retry shortly) unless engines died more than `--max-restarts` times within
    `RESTART_WINDOW_S`; otherwise every open request fails, /health says why, and the
    server exits (`on_failure`) when no engine ever served or it gave up. During a
    shutdown an engine that ends is no failure: what it held is answered 503."""
    if proc is not self._proc or proc is self._handled:
      return
    self._handled = proc
    self.due_since = None
    self._outbox = []   # commands of requests answered below: for no engine
    if not self.admitting:
      self.answer_all("the server shut down before the request finished.", 503)
      return
    if self.failure is None and (self.ready is not None or self.restarting is not None):
      now = time.monotonic()
      self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
      allowed = self.args.max_restarts
      if len(self.deaths) <= allowed:
        log.error("%s; starting it again (death %d of %d allowed in %.0f s)", why,
                  len(self.deaths), allowed, RESTART_WINDOW_S)
        self.answer_all(f"{why}; the engine is restarting, retry shortly.", 503)
        self.ready, self.restarting = None, why
        if proc.is_alive():   # a send failed on a pipe the process has not closed yet
          proc.kill()
          proc.join(5)       # its device memory freed before the next one loads
        self.start()
        return
      why = (f"{why}; the engine died {len(self.deaths)} times in "
             f"{RESTART_WINDOW_S:.0f} s, giving up")
      self.ready = None
    if self.failure is None:
      self.failure = why
      log.error("%s", why)
    if not self.loaded.done():
      self.loaded.set_exception(RuntimeError(why))
      self.loaded.exception()   # retrieved: the failure is reported through `failure`
    self.answer_all(f"{why}; the request did not finish.", 500)
    if self.ready is None and self.on_failure is not None:
      self.on_failure()

  def answer_all(self, message: str, status: int) -> None:
    """Ends every open request with an `Error` (shutdown, a dead engine)."""
    for handle in self.handles.values():
      handle.events.put_nowait(Error(message, status))
    self.handles.clear()

  def _send(self, command: tuple) -> None:
    """Queues a command; the commands of one event-loop iteration go as one message."""
    if not self._outbox:
      self.loop.call_soon(self._flush)
    self._outbox.append(command)

  def _flush(self) -> None:
    commands, self._outbox = self._outbox, []
    if commands and self.failure is None:
      if self.due_since is None:   # work dispatched to an idle engine: a round is owed
        self.due_since = time.monotonic()
      try:
        self._conn.send(commands)
      except (BrokenPipeError, OSError):
        self._gone("the engine process exited", self._proc)

  def submit(self, prompt: list[int], **kwargs: Any) -> Handle:
    """Sends a request (`Server.submit`'s arguments) -> its handle; its first event says
    whether the engine took it (`Accepted`) or refused it (`Error`, status 400).
    RuntimeError when no new request is admitted (shutdown, no engine)."""
    return self._open("submit", prompt, kwargs)

  def score(self, ids: list[int], top: int) -> Handle:
    """Asks the engine for the AR model's logprobs over `ids` (between two rounds) -> a
    handle whose one event is `Scored` (or `Error`). RuntimeError as `submit`."""
    return self._open("score", list(ids), top)

  def _open(self, kind: str, ids: list[int], *rest) -> Handle:
    """A new request's handle, its command (kind, its id, ids, *rest) sent."""
    if not self.admitting or not self.alive or self.ready is None:
      raise RuntimeError("the server is not admitting requests (starting, shutting down "
                         "or its engine stopped).")
    handle = Handle(self._next_id, len(ids))
    self._next_id += 1
    self.handles[handle.request_id] = handle
    self._send((kind, handle.request_id, ids, *rest))
    return handle

  def cancel(self, handle: Handle) -> None:
    """Frees the request's row at the next round (nothing when it already ended)."""
    if self.handles.pop(handle.request_id, None) is not None:
      self._send(("cancel", handle.request_id))

  async def stop(self, timeout: float = 30.0) -> None:
    """Ends the engine: the open requests are answered (503), the process joined."""
    self.admitting = False
    self.answer_all("the server shut down before the request finished.", 503)
    if self._proc is None:
      return
    if self.ready is None:   # loading or compiling: nothing in flight, nothing to wait for
      self.close()
      return
    if self.failure is None:
      self._send(("stop",))
      self._flush()
    await asyncio.get_running_loop().run_in_executor(None, self._proc.join, timeout)
    self.close()

  def close(self) -> None:
    """Kills the engine process if it is still running (after `stop`, or when the HTTP
    side could not start)."""
    if self._proc is not None and self._proc.is_alive():
      self._proc.kill()
      self._proc.join()
