"""The HTTP front end's own gates, in process over an engine that never started (no model,
no compile): the API key, the request-size limit, the 503 of a starting server on every
/v1 endpoint, the per-request timeout, and the latency histograms of /metrics under our
names and vLLM's.
(Through a real server and client: tests/test_http_server.py.)"""

import argparse

from fastapi.testclient import TestClient

from mars_jax.serve import app as serve_app
from mars_jax.serve.engine import Accepted, Engine, Handle, Loaded, Ready

KEY = "sk-test-123"


class NotStarted:
  """`Engine.loaded` before the engine process said anything."""

  @staticmethod
  def done():
    return False


def client(**kwargs) -> TestClient:
  engine = Engine(argparse.Namespace())
  engine.loaded = NotStarted()
  app = serve_app.create_app(engine, model_name="m", max_queued=4, sampling_defaults={},
                             **kwargs)
  return TestClient(app), engine


def test_the_api_key_guards_every_v1_endpoint_and_only_them():
  http, _ = client(api_key=KEY)
  body = {"model": "m", "prompt": "x"}
  for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
    assert http.get("/v1/models", headers=headers).status_code == 401
    r = http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 401 and "--api-key" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 401
  good = {"Authorization": f"Bearer {KEY}"}
  # past the key: the engine is still starting, so 503 with Retry-After, models included
  for r in (http.get("/v1/models", headers=good),
            http.post("/v1/completions", json=body, headers=good)):
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
  assert http.get("/health").status_code == 503    # no key needed: "starting"
  assert http.get("/metrics").status_code == 200
  assert client()[0].get("/v1/models").status_code == 503   # no key set: none asked


def test_a_body_past_the_limit_is_answered_413_declared_or_streamed():
  http, _ = client(max_request_bytes=1000)
  big = b'{"model": "m", "prompt": "' + b"x" * 2000 + b'"}'
  r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
  assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
  chunked = http.post("/v1/completions", content=iter([big[:600], big[600:]]))
  assert chunked.status_code == 413
  small = http.post("/v1/completions", json={"model": "m", "prompt": "x"})
  assert small.status_code == 503   # read whole, then: the engine is starting


def test_metrics_have_the_latency_histograms_under_both_names():
  http, engine = client()
  engine.latency.first_token(0.03)
  engine.latency.first_token(3.0)
  engine.latency.between_tokens(0.3, tokens=3)
  engine.latency.request(4.0)
  text = http.get("/metrics").text
  for name in ("mars_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"):
    assert f'{name}_bucket{{model="m",le="0.04"}} 1' in text
    assert f'{name}_bucket{{model="m",le="+Inf"}} 2' in text
    assert f'{name}_count{{model="m"}} 2' in text
    assert f"# TYPE {name} histogram" in text
  for name in ("mars_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"):
    assert f'{name}_bucket{{model="m",le="0.1"}} 3' in text   # 3 tokens 0.1 s apart
    assert f'{name}_count{{model="m"}} 3' in text
  assert 'vllm:e2e_request_latency_seconds_bucket{model="m",le="5.0"} 1' in text


class Stalled(Engine):
  """A ready engine that takes every request and never answers it."""
  alive = True

  def __init__(self):
    super().__init__(argparse.Namespace())
    self.ready = Ready(startup_s=0.0, warmup_s=0.0)
    self.loaded = Known()
    self.cancelled = []

  def submit(self, prompt, **kwargs):
    handle = Handle(self._next_id, len(prompt))
    self._next_id += 1
    self.handles[handle.request_id] = handle
    handle.events.put_nowait(Accepted())
    return handle

  def cancel(self, handle):
    self.cancelled.append(handle.request_id)


class Known:
  @staticmethod
  def done():
    return True

  @staticmethod
  def result():
    return Loaded(tokenizer=None, eos_token_ids=(0,), context_room=100, max_window=3,
                  drafter=False, max_batch=8)


def test_a_request_past_the_timeout_is_cancelled_and_answered_504():
  engine = Stalled()
  http = TestClient(serve_app.create_app(engine, model_name="m", max_queued=4,
                                         sampling_defaults={}, request_timeout=0.2))
  r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3]})
  assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
  assert engine.cancelled == [0]
