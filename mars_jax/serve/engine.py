"""One thread owns the device: it runs `Server.step` round after round and hands each
request's tokens to the asyncio side as they are committed.

  engine = Engine(server)
  engine.start()
  handle = await engine.submit(prompt_ids, max_new_tokens=64, window="auto")  # ValueError
  async for event in handle:        # Tokens(...), then one Done(completion)
    ...
  engine.cancel(handle)             # frees the row at the next round
  engine.stop()                     # cancels what is left, joins the thread

Every call on the `Server` happens on the engine thread, between rounds: `submit` and
`cancel` are posted to its inbox and taken before the next round, so a request waits
at most one round to be admitted (it starts in a free row at once, or queues). The
thread blocks on the inbox while the server is idle. A round that raises fails the
requests in flight (each gets an `Error`) and the thread goes on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

from mars_jax.serve.server import Completion, Server

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Tokens:
  tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Done:
  completion: Completion


@dataclasses.dataclass(frozen=True)
class Error:
  message: str


class Handle:
  """A submitted request: its id, prompt length, and the events the engine posts."""

  def __init__(self, request_id: int, prompt_len: int, events: asyncio.Queue):
    self.request_id, self.prompt_len, self.events = request_id, prompt_len, events
    self.finished = False

  def __aiter__(self):
    return self

  async def __anext__(self):
    if self.finished:
      raise StopAsyncIteration
    event = await self.events.get()
    self.finished = isinstance(event, (Done, Error))
    return event


@dataclasses.dataclass
class Metrics:
  """Counters of a serving process (read by `GET /metrics`)."""
  requests: dict[str, int] = dataclasses.field(default_factory=dict)  # by finish reason
  cancelled: int = 0
  failed: int = 0
  prompt_tokens: int = 0
  generated_tokens: int = 0
  request_forwards: int = 0   # sum over requests of the forwards each took part in
  drafter_forwards: int = 0   # likewise, the drafter forwards (a server with a drafter)
  steps: int = 0              # forwards run for the batch
  rounds: int = 0
  running: int = 0
  queued: int = 0
  window: int = 0             # the W of the last round
  batch: int = 0              # the batch bucket of the last round


class Engine:
  """The serving thread over one `Server` (see the module doc)."""

  def __init__(self, server: Server):
    self.server = server
    self.metrics = Metrics()
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._handles: dict[int, tuple[Handle, asyncio.AbstractEventLoop]] = {}
    self._thread = threading.Thread(target=self._run, name="mars-engine", daemon=True)
    self._admitting = True
    self.error: BaseException | None = None

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops admitting, cancels the requests left, and joins the thread."""
    self._admitting = False
    self._inbox.put(("stop",))
    self._thread.join(timeout)

  async def submit(self, prompt: list[int], **kwargs: Any) -> Handle:
    """Queues a request (`Server.submit`'s arguments) -> its handle; raises what
    `Server.submit` raises (ValueError on a request it cannot serve), or RuntimeError
    when the engine no longer admits requests."""
    if not self._admitting or not self.alive:
      raise RuntimeError("the server is shutting down; no new requests are admitted.")
    reply: concurrent.futures.Future = concurrent.futures.Future()
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    self._inbox.put(("submit", prompt, kwargs, reply, loop, events))
    return await asyncio.wrap_future(reply)

  def cancel(self, handle: Handle) -> None:
    if not handle.finished:
      self._inbox.put(("cancel", handle.request_id))

  def _post(self, request_id: int, event, *, last: bool = False) -> None:
    entry = self._handles.pop(request_id, None) if last else self._handles.get(request_id)
    if entry is not None:
      handle, loop = entry
      loop.call_soon_threadsafe(handle.events.put_nowait, event)

  def _take(self, command) -> bool:
    """Carries out one inbox command; -> False on "stop"."""
    kind = command[0]
    if kind == "stop":
      return False
    if kind == "cancel":
      if self.server.cancel(command[1]):
        self._handles.pop(command[1], None)
        self.metrics.cancelled += 1
      return True
    _, prompt, kwargs, reply, loop, events = command
    try:
      rid = self.server.submit(prompt, **kwargs)
    except Exception as e:  # the request's own fault: back to its handler (HTTP 400)
      reply.set_exception(e)
      return True
    handle = Handle(rid, len(prompt), events)
    self._handles[rid] = (handle, loop)
    self.metrics.prompt_tokens += len(prompt)
    reply.set_result(handle)
    return True

  def _drain(self, block: bool) -> bool:
    """Takes the inbox's commands (waiting for one when `block`); -> False on "stop"."""
    try:
      command = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
    except queue.Empty:
      return True
    while True:
      if not self._take(command):
        return False
      try:
        command = self._inbox.get_nowait()
      except queue.Empty:
        return True

  def _round(self) -> None:
    m, server = self.metrics, self.server
    steps = int(server.decoded.steps)
    begin = time.perf_counter()
    updates = server.step()
    m.rounds += 1
    m.steps += int(server.decoded.steps) - steps
    m.window, m.batch = server.window, len(server.slots)
    for u in updates:
      if u.tokens:
        self._post(u.request_id, Tokens(u.tokens))
      if u.done:
        completion = server.completed.pop(u.request_id)
        m.requests[completion.finish_reason] = m.requests.get(completion.finish_reason, 0) + 1
        m.generated_tokens += len(completion.tokens)
        m.request_forwards += completion.forwards
        m.drafter_forwards += completion.drafter_forwards
        self._post(u.request_id, Done(completion), last=True)
    m.running, m.queued = server.active, len(server.queue)
    log.debug("round: %d updates, W=%d, %.1f ms", len(updates), server.window,
              1e3 * (time.perf_counter() - begin))

  def _fail_in_flight(self, error: BaseException) -> None:
    for rid in list(self._handles):
      self.server.cancel(rid)
      self.metrics.failed += 1
      self._post(rid, Error(f"decoding failed: {type(error).__name__}: {error}"), last=True)

  def _run(self) -> None:
    try:
      while self._drain(block=self.server.idle):
        if self.server.idle:
          continue
        try:
          self._round()
        except Exception as e:  # noqa: BLE001 - keep serving; the requests hear why
          log.exception("a decoding round failed")
          self.error = e
          self._fail_in_flight(e)   # their rows are freed by the next round
    finally:
      self._admitting = False
      for rid in list(self._handles):
        self.metrics.cancelled += 1
        self._post(rid, Error("the server shut down before the request finished."),
                   last=True)
