"""The engine process's bookkeeping (`mars_jax.serve.engine._Core`) over a stand-in for the
decoding server whose admissions and rounds fail on cue: every accepted request is
answered exactly once, and nothing a request or a round raises stops the engine.
(Through HTTP on a real model: tests/test_http_server.py.)"""

import argparse
import asyncio
import dataclasses
import os
import signal
import time

from mars_jax.serve import engine, messages


@dataclasses.dataclass
class Completion:
  tokens: list
  forwards: int = 1
  drafter_forwards: int = 0
  finish_reason: str = "length"


class StandIn:
  """What `_Core` reads of `serve.server.Server`: submit raises what its kwargs say; a
  round finishes the oldest running request, then raises when `fail` is set."""

  def __init__(self):
    self.queue, self.completed, self.running = [], {}, []
    self.next_id, self.steps, self.window, self.slots, self.fail = 0, 0, 1, [], False

  @property
  def idle(self):
    return not self.running

  @property
  def active(self):
    return len(self.running)

  def submit(self, prompt, **kwargs):
    if "raise" in kwargs:
      raise kwargs["raise"]
    rid, self.next_id = self.next_id, self.next_id + 1
    self.running.append(rid)
    return rid

  def cancel(self, rid):
    return rid in self.running   # a running request ends at the next round

  def reset(self):
    dropped, self.running = self.running, []
    return dropped

  def step(self):
    rid = self.running.pop(0)
    self.completed[rid] = Completion([1, 2])
    if self.fail:
      raise RuntimeError("the device went away")
    return [type("Update", (), dict(request_id=rid, tokens=[1, 2], done=True))()]


def core():
  return engine._Core(StandIn(), conn=None)


def answers(c):
  """{front id: [event class names]} of the events so far."""
  out = {}
  for fid, event in c.events:
    out.setdefault(fid, []).append(type(event).__name__)
  return out


def run_round(c):
  try:
    c.round()
  except Exception as e:  # noqa: BLE001 - as `_Core.serve` does
    c.fail_round(e)


def test_an_admission_that_raises_answers_that_request_and_the_engine_goes_on():
  c = core()
  assert c.take(("submit", 1, [5], {"raise": OverflowError("int too large")}))
  assert c.take(("submit", 2, [5], {"raise": ValueError("top_k=9; expected ...")}))
  assert c.take(("submit", 3, [5], {}))
  errors = {fid: e for fid, e in c.events if isinstance(e, messages.Error)}
  assert errors[1].status == 500 and "OverflowError" in errors[1].message
  assert errors[2].status == 400
  run_round(c)
  assert answers(c)[3] == ["Accepted", "Tokens", "Done"]


def test_a_cancel_then_a_failed_round_answers_the_rest_once():
  """A request cancelled while its row runs, then a round that fails after finishing
  another row: the finished one and the running ones hear the failure, once each (the
  cancelled one has no one to hear it), and the engine takes the next request."""
  c = core()
  for fid in (1, 2, 3):
    c.take(("submit", fid, [5], {}))
  c.take(("cancel", 3))
  c.server.fail = True
  run_round(c)     # finishes request 1 (fid 1), then raises
  got = answers(c)
  assert got == {1: ["Accepted", "Error"], 2: ["Accepted", "Error"], 3: ["Accepted"]}
  assert not c.front and not c.ids and c.metrics.failed == 2
  c.server.fail = False
  c.take(("submit", 4, [5], {}))
  run_round(c)
  assert answers(c)[4] == ["Accepted", "Tokens", "Done"]


# -- the HTTP side's restarts, over real engine processes that serve the stand-in ------

class Slow(StandIn):
  """A stand-in whose rounds take `seconds` each and finish a request every `per` rounds."""

  def __init__(self, seconds, per=3):
    super().__init__()
    self.seconds, self.per, self.rounds = seconds, per, 0

  def step(self):
    time.sleep(self.seconds)
    self.rounds += 1
    return super().step() if self.rounds % self.per == 0 else []


def fake_run(conn, args):
  """`engine.run` over `Slow`: dies before it loads while `args.die_loading` names a file
  (which it removes), else says it is loaded and ready and serves."""
  if args.die_loading and os.path.exists(args.die_loading):
    os.unlink(args.die_loading)
    os._exit(3)
  conn.send(messages.Loaded(None, (), 100, 1, False, 4))
  conn.send(messages.Ready(0.0, 0.0))
  engine._Core(Slow(args.round_s), conn).serve()


def fake_args(**kw):
  return argparse.Namespace(**{"watchdog_s": 0.0, "max_restarts": 3, "round_s": 0.0,
                               "die_loading": None, **kw})


async def until(predicate, seconds=60.0):
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    await asyncio.sleep(0.05)


async def served(e) -> list:
  """A request through `e` -> the class names of its events."""
  handle = e.submit([1], max_new_tokens=2)
  return [type(event).__name__ async for event in handle]


def with_engine(args, body):
  """Runs `body(engine)` in an event loop over an `Engine` of fake engine processes."""
  async def main():
    e = engine.Engine(args)
    e.on_failure = lambda: None
    try:
      e.start()
      await until(lambda: e.ready is not None)
      await body(e)
      await asyncio.sleep(0)
    finally:
      e.admitting = False
      e.close()
  asyncio.run(main())


def test_the_watchdog_counts_from_dispatch_not_from_the_last_message_before_an_idle_spell(
    monkeypatch):
  """--watchdog-s 1 over 0.4 s rounds: a request after 2 s idle is served (the engine's
  last message is stale, but no round was owed); one that stalls is killed."""
  monkeypatch.setattr(engine, "run", fake_run)

  async def body(e):
    assert await served(e) == ["Accepted", "Tokens", "Done"]
    await asyncio.sleep(2.0)
    assert await served(e) == ["Accepted", "Tokens", "Done"]
    assert e.deaths == [] and e.ready is not None
    os.kill(e._proc.pid, signal.SIGSTOP)   # hung: the watchdog kills it, it comes back
    events = await served(e)
    assert events == ["Error"] and len(e.deaths) == 1, events
    await until(lambda: e.ready is not None)
    assert await served(e) == ["Accepted", "Tokens", "Done"]
  with_engine(fake_args(watchdog_s=1.0, round_s=0.4), body)


def test_a_death_is_handled_once_and_a_death_while_loading_is_one_restart(monkeypatch,
                                                                         tmp_path):
  """An engine killed: a send on its pipe notices first and restarts it, then its
  reader's report of the same death is dropped (one death, not two). The restarted engine
  dies while loading: one more restart, and the third engine serves."""
  monkeypatch.setattr(engine, "run", fake_run)
  die = tmp_path / "die"

  async def body(e):
    old = e._proc
    os.kill(old.pid, signal.SIGKILL)
    old.join()   # dead; its reader's report waits for this coroutine to yield
    die.write_text("")   # the next engine dies while loading
    e._send(("cancel", 99))
    e._flush()           # the send fails: a restart
    assert len(e.deaths) == 1 and e._proc is not old
    await until(lambda: e.ready is not None)
    assert len(e.deaths) == 2 and e.failure is None and not die.exists()
    assert await served(e) == ["Accepted", "Tokens", "Done"]
  with_engine(fake_args(die_loading=str(die), max_restarts=2), body)


def test_one_death_reported_twice_ends_the_server_once(monkeypatch):
  """--max-restarts 0: a send on a dead engine's pipe gives up (one death, the server
  told to exit once); that engine's reader reports the same death after, and it is
  dropped, not a second failure."""
  monkeypatch.setattr(engine, "run", fake_run)
  exits = []

  async def body(e):
    e.on_failure = lambda: exits.append(1)
    old = e._proc
    os.kill(old.pid, signal.SIGKILL)
    old.join()
    e._send(("cancel", 99))
    e._flush()
    assert e.failure and "giving up" in e.failure and exits == [1]
    await asyncio.sleep(1.0)   # the reader's report arrives, and is dropped
    assert exits == [1] and len(e.deaths) == 1
  with_engine(fake_args(max_restarts=0), body)
