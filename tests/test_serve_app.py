"""The HTTP front end's own gates, in process over an engine that never started (no model,
no compile): the API key, the request-size limit, the 503 of a starting server on every
/v1 endpoint, the per-request timeout, the queue counting requests still tokenizing,
bodies parsed off the event loop, header and body deadlines and the connection cap
(under uvicorn), and /metrics under our names and vLLM's.
(Through a real server and client: tests/test_http_server.py.)"""

import argparse
import asyncio
import dataclasses
import socket
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mars_jax.benchmarks.serve_procs import free_port
from mars_jax.serve import app as serve_app
from mars_jax.serve.engine import Engine, Handle
from mars_jax.serve.messages import Accepted, Loaded, Ready
from mars_jax.serve.http_limits import limited_protocol

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


def test_metrics_have_vllms_names_with_the_mars_meaning_of_spec_decoding():
  http, engine = client()
  engine.latency.first_token(0.03)
  engine.latency.first_token(3.0)
  engine.latency.between_tokens(0.3, tokens=3)
  engine.latency.request(4.0)
  engine.metrics.spec.count(3, 3)   # a W = 3 step that committed 3 tokens
  engine.metrics.spec.count(3, 2)
  engine.metrics.spec.count(1, 1)   # W = 1: no draft
  engine.metrics.requests = {"eos": 2, "stop": 1, "length": 4}
  engine.metrics.queue_time.observe(0.4)
  text = http.get("/metrics").text
  for name, label in (("mars_time_to_first_token_seconds", 'model="m"'),
                      ("vllm:time_to_first_token_seconds", 'model_name="m"')):
    assert f'{name}_bucket{{{label},le="0.04"}} 1' in text
    assert f'{name}_bucket{{{label},le="+Inf"}} 2' in text
    assert f'{name}_count{{{label}}} 2' in text
    assert f"# TYPE {name} histogram" in text
  for name, label in (("mars_inter_token_latency_seconds", 'model="m"'),
                      ("vllm:inter_token_latency_seconds", 'model_name="m"')):
    assert f'{name}_bucket{{{label},le="0.1"}} 3' in text   # 3 tokens 0.1 s apart
    assert f'{name}_count{{{label}}} 3' in text
  assert 'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="5.0"} 1' in text
  for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 2',
               'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 4',
               'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3',
               'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2',
               'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1',
               'vllm:request_success_total{model_name="m",finished_reason="stop"} 3',
               'vllm:request_success_total{model_name="m",finished_reason="length"} 4',
               'vllm:request_queue_time_seconds_bucket{model_name="m",le="0.5"} 1',
               'vllm:num_requests_running{model_name="m"} 0',
               'vllm:kv_cache_usage_perc{model_name="m"} 0.0'):
    assert line in text, line


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
    if self.handles.pop(handle.request_id, None) is not None:
      self.cancelled.append(handle.request_id)

  def start(self):   # no engine process: the app's lifespan starts nothing
    pass

  async def stop(self, timeout=30.0):
    pass


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


def in_event_loop() -> bool:
  try:
    asyncio.get_running_loop()
    return True
  except RuntimeError:
    return False


class SlowTokenizer:
  """Blocks every encode until `go` is set (a long prompt being tokenized)."""

  def __init__(self):
    self.go, self.started = threading.Event(), threading.Semaphore(0)

  def encode(self, text, add_special_tokens=False):
    self.started.release()
    self.go.wait(30)
    return [1, 2]


def test_requests_still_tokenizing_count_against_max_queued_and_big_bodies_parse_off_the_loop(
    monkeypatch):
  """max_queued 1 over 2 rows: 3 requests held in tokenizing fill rows and queue, the
  4th is answered 503 at once. A body past INLINE_PARSE_BYTES (a long id list) is parsed
  in a worker thread, not on the event loop."""
  engine = Stalled()
  tokenizer = SlowTokenizer()
  engine.loaded = type("K", (), {"done": staticmethod(lambda: True), "result": staticmethod(
      lambda: dataclasses.replace(Known.result(), tokenizer=tokenizer, max_batch=2))})()
  app = serve_app.create_app(engine, model_name="m", max_queued=1, sampling_defaults={},
                             request_timeout=0.2)
  threads = []
  parse = serve_app.protocol.parse_completion
  monkeypatch.setattr(serve_app.protocol, "parse_completion", lambda body, **kw: (
      threads.append(in_event_loop()) or parse(body, **kw)))
  with TestClient(app) as http:
    held = [threading.Thread(target=http.post, args=("/v1/completions",), kwargs=dict(
        json={"model": "m", "prompt": "text"})) for _ in range(3)]
    for t in held:
      t.start()
    for _ in held:
      assert tokenizer.started.acquire(timeout=30)
    r = http.post("/v1/completions", json={"model": "m", "prompt": "text"})
    assert r.status_code == 503 and "--max-queued" in r.json()["error"]["message"], r.text
    tokenizer.go.set()
    for t in held:
      t.join(30)
    big = http.post("/v1/completions", json={"model": "m", "prompt": [7] * 40000})
    assert big.status_code == 400 and "40000 tokens" in big.text   # parsed, then refused
  assert engine.rejected == 1 and threads[-1] is False and True in threads, threads


@pytest.fixture
def limited_server():
  """The app (over an engine that never started) under uvicorn with a 1 s header
  deadline, a 1 s body deadline and at most 3 connections -> its port."""
  import uvicorn
  engine = Engine(argparse.Namespace())
  engine.loaded = NotStarted()
  app = serve_app.create_app(engine, model_name="m", max_queued=4, sampling_defaults={},
                             body_timeout=1.0, max_request_bytes=1000)
  port = free_port()
  config = uvicorn.Config(app, port=port, log_level="error", lifespan="off",
                          http=limited_protocol(header_timeout=1.0, max_connections=3))
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not server.started:
    assert time.time() < deadline
    time.sleep(0.05)
  yield port
  server.should_exit = True
  thread.join(10)


def _read_all(sock) -> bytes:
  sock.settimeout(10)
  data = b""
  while True:
    got = sock.recv(65536)
    if not got:
      return data
    data += got


def _closed_while_trickling(sock, byte: bytes, tries: int = 20) -> bool:
  """Sends `byte` every 0.2 s -> whether the server closes the connection meanwhile."""
  sock.settimeout(0.2)
  for _ in range(tries):
    try:
      sock.sendall(byte)
      if not sock.recv(65536):
        return True
    except socket.timeout:
      continue   # still open
    except OSError:
      return True
  return False


def test_slow_headers_slow_bodies_and_connections_past_the_cap_are_refused(limited_server):
  port = limited_server
  slow_headers = socket.create_connection(("127.0.0.1", port))
  slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # never ends
  slow_body = socket.create_connection(("127.0.0.1", port))
  slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                    b"application/json\r\ncontent-length: 100\r\n\r\n{\"mo")
  idle = socket.create_connection(("127.0.0.1", port))
  time.sleep(0.3)
  extra = socket.create_connection(("127.0.0.1", port))   # the 4th: refused at once
  got = _read_all(extra)
  assert got.startswith(b"HTTP/1.1 503") and b"--max-connections" in got, got
  got = _read_all(slow_headers)
  assert got.startswith(b"HTTP/1.1 408") and b"--header-timeout" in got, got
  got = _read_all(slow_body)
  assert b" 408 " in got.split(b"\r\n")[0] and b"--body-timeout" in got, got
  assert _read_all(idle).startswith(b"HTTP/1.1 408")   # no request at all: closed too
  early = socket.create_connection(("127.0.0.1", port))   # answered 413 before its body
  early.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 5000\r\n\r\n")
  early.settimeout(10)
  got = early.recv(65536)
  assert _closed_while_trickling(early, b"x"), "the connection stayed open after its answer"
  assert got.startswith(b"HTTP/1.1 413") and b"connection: close" in got.lower(), got
  crlf = socket.create_connection(("127.0.0.1", port))   # kept alive, then blank lines
  crlf.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
  crlf.settimeout(10)
  assert crlf.recv(65536).startswith(b"HTTP/1.1 503")
  assert _closed_while_trickling(crlf, b"\r\n"), "blank lines held the connection"
  ok = socket.create_connection(("127.0.0.1", port))   # room again
  ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n")
  assert _read_all(ok).startswith(b"HTTP/1.1 503")     # "starting": served, not refused
  for sock in (slow_headers, slow_body, idle, extra, ok, early, crlf):
    sock.close()


class Pieces:
  """A tokenizer whose token i decodes to "<i>"."""

  @staticmethod
  def decode(ids):
    return "".join(f"<{i}>" for i in ids)


def test_logprobs_as_vllm_gives_them_and_stream_options_as_it_checks_them():
  """Echo of a one-token prompt lists it with a null logprob; -inf is sent as -9999.0;
  completions' top_logprobs hold the chosen token; stream_options need stream; an
  echo-only prompt with ids outside the vocabulary is refused."""
  spec = serve_app.protocol.parse_completion(
      {"model": "m", "prompt": [5], "echo": True, "logprobs": 1, "max_tokens": 0},
      model_name="m")
  done = serve_app.Completion(0, [], 0, "length", "")
  text, lp = serve_app.protocol.logprobs_of(Pieces, spec, [5], done, None)
  assert text == "<5>" and lp == {"tokens": ["<5>"], "token_logprobs": [None],
                                  "top_logprobs": [None], "text_offset": [0]}
  scores = type("S", (), dict(logprob=np.asarray([-np.inf]),
                              top_ids=np.asarray([[7]]), top_logprobs=np.asarray([[-0.1]])))
  spec = dataclasses.replace(spec, echo=False, max_tokens=1)
  _, lp = serve_app.protocol.logprobs_of(
      Pieces, spec, [5], serve_app.Completion(0, [9], 1, "length", "<9>"), scores)
  assert lp["token_logprobs"] == [-9999.0]
  assert lp["top_logprobs"] == [{"<7>": -0.1, "<9>": -9999.0}]
  with pytest.raises(serve_app.RequestError, match="only allowed with 'stream'"):
    serve_app.protocol.parse_completion({"model": "m", "prompt": "x", "stream_options": {
        "include_usage": True}}, model_name="m")
  engine = Stalled()
  engine.loaded = type("K", (), {"done": staticmethod(lambda: True), "result": staticmethod(
      lambda: dataclasses.replace(Known.result(), vocab_size=64, tokenizer=Pieces))})()
  http = TestClient(serve_app.create_app(engine, model_name="m", max_queued=4,
                                         sampling_defaults={}))
  r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 99], "echo": True,
                                         "max_tokens": 0})
  assert r.status_code == 400 and "outside the vocabulary" in r.text, r.text
  r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "echo": True,
                                         "max_tokens": 0})
  assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
