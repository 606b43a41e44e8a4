"""The engine process's bookkeeping (`mars_jax.serve.engine._Core`) over a stand-in for the
decoding server whose admissions and rounds fail on cue: every accepted request is
answered exactly once, and nothing a request or a round raises stops the engine.
(Through HTTP on a real model: tests/test_http_server.py.)"""

import dataclasses

from mars_jax.serve import engine


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
  errors = {fid: e for fid, e in c.events if isinstance(e, engine.Error)}
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
