"""The OpenAI-compatible server through real clients: `python -m mars_jax.serve` in a
subprocess on 127.0.0.1 (a free port), over a tiny random Qwen2 that transformers wrote
with the real Qwen2.5 vocabulary and chat template; the official `openai` package, raw
HTTP (httpx) for what a client library would not send, and lm-eval's
`local-chat-completions` model.

Sampled requests here use temperature alone (tests/test_sampled_decoding.py covers
the top-k/top-p cut).

The server runs 8 rows, W in {1, 3} for "auto" and windows up to 3 per request, so one
batch mixes every kind of request (a round runs at W = 1 or 3: few compilations). It
compiles them all before it says it is ready, and nothing after. A second server, on the
same compilation cache, has a fault injected into its third round and a queue of one:
the failure modes. Each test passes alone and in any order (`Servers` starts a server
again after a test stopped it); in file order each server starts once.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from qwen_tokenizers import make_qwen_checkpoint
import user_path_fixtures as fx

from mars_jax.benchmarks.serve_procs import free_port

# The server in its own processes, driven by real clients: `-m e2e`.
pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny-qwen"
PROMPTS = ["Tell me a story.", "What is 2+3?", "List three colours:", "Bonjour, ça va ?"]


def spawn(path, port, log, *extra_args, env=None) -> subprocess.Popen:
  """`python -m mars_jax.serve` on the module's shape (8 rows, windows 1 and 3)."""
  return subprocess.Popen(
      [sys.executable, "-m", "mars_jax.serve", "--model", path, "--port", str(port),
       "--served-model-name", NAME, "--batch-size", "8", "--min-batch-size", "8",
       "--windows", "1,3", "--max-window", "3", "--max-len", "160",
       "--shutdown-timeout", "60", "--log-level", os.environ.get("MARS_SERVE_LOG", "warning"),
       *extra_args],
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **(env or {})},
      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


class Live:
  def __init__(self, path, tmp, *extra_args, env=None, name="server"):
    self.path, self.port = path, free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = open(tmp / f"{name}.log", "w+")
    self.proc = spawn(path, self.port, self.log, *extra_args, env=env)
    self.starting = []   # the bodies /health answered before the server was ready
    deadline = time.time() + 900   # warmup compiles every variant (a shared cache helps)
    while time.time() < deadline:
      if self.proc.poll() is not None:
        raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
      try:
        r = httpx.get(f"{self.url}/health", timeout=2)
        if r.status_code == 200:
          self.health = r.json()
          return
        assert r.status_code == 503, r.text
        self.starting.append(r.json())
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    raise AssertionError(f"the server did not come up:\n{self.output()}")

  def output(self) -> str:
    self.log.flush()
    self.log.seek(0)
    return self.log.read()[-4000:]

  def client(self) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                         timeout=300)

  def metrics(self) -> dict[str, float]:
    text = httpx.get(f"{self.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
      if line and not line.startswith("#"):
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0]
        out[key] = out.get(key, 0) + float(value)
    return out


class Servers:
  """The module's servers by name, each started on first use and started again when a
  test has stopped it (or asks for a fresh one), so that every test passes alone and in
  any order. In file order each starts once: the tests that stop a server come last."""

  def __init__(self, tmp_path_factory):
    self.tmp_path_factory, self.running = tmp_path_factory, {}
    self.checkpoint = make_qwen_checkpoint(tmp_path_factory.mktemp("hf") / "hf", "qwen2.5")

  def get(self, name: str, *extra_args, env=None, fresh: bool = False) -> Live:
    server = self.running.get(name)
    if server is not None and (fresh or server.proc.poll() is not None):
      self._stop(server)
      server = None
    if server is None:
      server = self.running[name] = Live(self.checkpoint, self.tmp_path_factory.mktemp(name),
                                         *extra_args, env=env, name=name)
    return server

  @staticmethod
  def _stop(server: Live) -> None:
    if server.proc.poll() is None:
      server.proc.kill()
      server.proc.wait(120)
    server.log.close()

  def close(self) -> None:
    for server in self.running.values():
      self._stop(server)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  running = Servers(tmp_path_factory)
  yield running
  running.close()


@pytest.fixture
def live(servers):
  return servers.get("server")


def complete(client, prompt, *, stream=False, **kw):
  """A text completion -> (text, finish_reason, usage)."""
  kw = {"max_tokens": 16, "temperature": 0.0, **kw}
  extra = {k: kw.pop(k) for k in ("tau", "window", "mode", "gate", "top_k") if k in kw}
  if not stream:
    r = client.completions.create(model=NAME, prompt=prompt, extra_body=extra, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage
  text, reason, use = "", None, None
  for c in client.completions.create(model=NAME, prompt=prompt, stream=True,
                                     stream_options={"include_usage": True},
                                     extra_body=extra, **kw):
    if c.choices:
      text += c.choices[0].text
      reason = c.choices[0].finish_reason or reason
    if c.usage is not None:
      use = c.usage
  return text, reason, use


def chat(client, content, *, stream=False, **kw):
  kw = {"max_tokens": 16, "temperature": 0.0, **kw}
  extra = {k: kw.pop(k) for k in ("tau", "window", "mode", "gate", "top_k") if k in kw}
  messages = [{"role": "user", "content": content}]
  if not stream:
    r = client.chat.completions.create(model=NAME, messages=messages, extra_body=extra, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
  text, reason = "", None
  for c in client.chat.completions.create(model=NAME, messages=messages, stream=True,
                                          extra_body=extra, **kw):
    if c.choices:
      text += c.choices[0].delta.content or ""
      reason = c.choices[0].finish_reason or reason
  return text, reason, None


def test_models_health_and_a_chat_reply(live):
  assert all(b == {"status": "starting"} for b in live.starting), live.starting
  assert live.health["status"] == "ok" and live.health["startup_s"] > 0
  client = live.client()
  models = client.models.list().data
  assert [m.id for m in models] == [NAME]
  # Requests that leave sampling out get the model's generation_config.json values.
  assert models[0].model_extra["sampling_defaults"] == {"temperature": 0.7, "top_p": 0.8,
                                                        "top_k": 20}
  text, reason, use = chat(client, PROMPTS[0], max_tokens=12)
  assert reason in ("stop", "length") and isinstance(text, str)
  assert use.prompt_tokens > 0 and 1 <= use.completion_tokens <= 12
  assert use.model_extra["forwards"] >= 1
  assert use.model_extra["tokens_per_forward"] == pytest.approx(
      use.completion_tokens / use.model_extra["forwards"], abs=1e-3)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_chunks_concatenate_to_the_answer(live, kind):
  client = live.client()
  call = complete if kind == "completion" else chat
  greedy = call(client, PROMPTS[1], max_tokens=24)
  sampled = dict(max_tokens=24, temperature=1.0, seed=7)
  answer = call(client, PROMPTS[3], **sampled)
  assert call(client, PROMPTS[1], stream=True, max_tokens=24)[:2] == greedy[:2]
  assert call(client, PROMPTS[3], stream=True, **sampled)[:2] == answer[:2]
  assert call(client, PROMPTS[3], **sampled)[:2] == answer[:2]   # the seed decides
  # A stop string inside the sampled text: the answer ends before it, streamed or not.
  head = answer[0]
  stop = head[len(head) // 2:len(head) // 2 + 2]
  if stop.strip():
    cut = call(client, PROMPTS[3], stop=[stop], **sampled)
    assert cut[0] == head[:head.index(stop)] and cut[1] == "stop"
    assert call(client, PROMPTS[3], stream=True, stop=[stop], **sampled)[:2] == cut[:2]


def test_lossless_equals_w1_for_every_request(live):
  client = live.client()
  for prompt in PROMPTS:
    for sample in ({}, {"temperature": 0.8, "seed": 3}):
      ar = complete(client, prompt, window=1, mode="gated", tau=1.0, **sample)
      for window in ("auto", 3):
        out = complete(client, prompt, window=window, mode="lossless", **sample)
        assert out[:2] == ar[:2], (prompt, sample, window)


def _mixed_requests():
  """32 requests: greedy and seeded, gated at several tau and fixed windows, lossless at
  auto and fixed windows, AR."""
  kinds = [dict(mode="gated", tau=1.0, window=1),
           dict(mode="gated", tau=0.5, window=3),
           dict(mode="gated", tau=0.2, window=3, gate="margin"),
           dict(mode="lossless", window="auto"),
           dict(mode="lossless", window=2),
           dict(mode="gated", tau=0.9, window=2, temperature=0.9, seed=11),
           dict(mode="lossless", window="auto", temperature=1.0, seed=5),
           dict(mode="gated", tau=0.3, window=3, temperature=0.7, seed=2)]
  return [(PROMPTS[i % 4], {"max_tokens": 8 + 3 * (i % 5), **kinds[i % 8]})
          for i in range(32)]


def test_32_concurrent_mixed_requests_equal_each_alone(live):
  requests = _mixed_requests()
  client = live.client()
  alone = [complete(client, p, **dict(kw))[:2] for p, kw in requests]

  async def all_at_once():
    aclient = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0,
                                 timeout=300)

    async def one(prompt, kw):
      kw = {"temperature": 0.0, **kw}
      extra = {k: kw.pop(k) for k in ("tau", "window", "mode", "gate", "top_k") if k in kw}
      r = await aclient.completions.create(model=NAME, prompt=prompt, extra_body=extra, **kw)
      return r.choices[0].text, r.choices[0].finish_reason
    return await asyncio.gather(*(one(p, dict(kw)) for p, kw in requests))

  together = asyncio.run(all_at_once())
  assert together == alone
  m = live.metrics()
  assert m["mars_requests_running"] == 0 and m["mars_requests_queued"] == 0


BAD = [
    ("completions", b"{not json", None),
    ("completions", {"model": "other", "prompt": "x"}, "model"),
    ("completions", {"prompt": "x"}, "model"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hello " * 400}, "prompt"),
    ("completions", {"model": NAME, "prompt": [1, 2, 10 ** 9]}, None),
    ("completions", {"model": NAME, "prompt": ""}, "prompt"),
    ("completions", {"model": NAME, "prompt": "x", "tau": 1.5}, "tau"),
    ("completions", {"model": NAME, "prompt": "x", "window": 9}, "window"),
    ("completions", {"model": NAME, "prompt": "x", "window": "fast"}, "window"),
    ("completions", {"model": NAME, "prompt": "x", "mode": "exact"}, "mode"),
    ("completions", {"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"model": NAME, "prompt": "x", "n": 2}, "n"),
    ("completions", {"model": NAME, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"model": NAME, "prompt": "x", "logprobs": 1, "stream": True},
     "logprobs"),
    ("completions", {"model": NAME, "prompt": "x", "repetition_penalty": 1.2},
     "repetition_penalty"),
    ("completions", {"model": NAME, "prompt": "x", "min_p": 2}, "min_p"),
    ("completions", {"model": NAME, "prompt": "x", "response_format": {"type": "json_object"}},
     "response_format"),
    ("completions", b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     None),   # nested past the parser's recursion limit
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                          "logprobs": True, "stream": True}, "logprobs"),
    ("completions", {"model": NAME, "prompt": "x", "stop": [1]}, "stop"),
    ("completions", {"model": NAME, "prompt": "x", "seed": -1}, "seed"),
    ("completions", {"model": NAME, "prompt": "x", "colour": "red"}, "colour"),
    ("chat/completions", {"model": NAME, "messages": "hi"}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": 3}]},
     "messages[0].content"),
    ("chat/completions", [1, 2], None),
    # crafted to overflow the engine's int32 / float32 arrays, or to flood its stop scan
    ("completions", {"model": NAME, "prompt": "x", "top_k": 2 ** 64}, "top_k"),
    ("completions", {"model": NAME, "prompt": "x", "top_k": 2 ** 20}, None),  # > vocab
    ("completions", {"model": NAME, "prompt": "x", "stop_token_ids": [2 ** 31]},
     "stop_token_ids"),
    ("completions", {"model": NAME, "prompt": "x", "stop_token_ids": [10 ** 6]}, None),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 2 ** 70}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": [1, 2 ** 40]}, "prompt"),
    ("completions", f'{{"model": "{NAME}", "prompt": "x", "temperature": 1e400}}'.encode(),
     "temperature"),
    ("completions", f'{{"model": "{NAME}", "prompt": "x", "top_p": NaN}}'.encode(), "top_p"),
    ("completions", {"model": NAME, "prompt": "x", "temperature": 1e39}, "temperature"),
    ("completions", {"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
     "stop"),
    ("completions", {"model": NAME, "prompt": "x", "stop": ["z" * 257]}, "stop"),
]


def test_bad_requests_are_answered_400_and_the_server_keeps_serving(live):
  """Each bad body is answered 400 naming its field (the crafted ones that once stopped
  the engine included), and the engine goes on: a reply, and /health 200, after them."""
  for endpoint, body, param in BAD:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{live.url}/v1/{endpoint}", content=content,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, (body, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], body
    assert error["param"] == param, (body, error)
  with pytest.raises(openai.BadRequestError, match="tau"):
    live.client().completions.create(model=NAME, prompt="x", extra_body={"tau": -1})
  text, reason, _ = complete(live.client(), PROMPTS[0], max_tokens=5)
  assert reason == "length" and text
  assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200


def test_a_disconnect_mid_stream_does_not_stall_the_next_requests(live):
  before = live.metrics().get("mars_requests_cancelled_total", 0)
  body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 140, "temperature": 0,
          "stream": True, "window": 1}
  with httpx.Client(timeout=60) as http:
    with http.stream("POST", f"{live.url}/v1/completions", json=body) as r:
      lines = r.iter_lines()
      first = next(line for line in lines if line.startswith("data: "))
      assert json.loads(first[6:])["object"] == "text_completion"
  start = time.time()
  for prompt in PROMPTS[:3]:
    assert complete(live.client(), prompt, max_tokens=6)[1] == "length"
  assert time.time() - start < 120
  deadline = time.time() + 30
  while live.metrics()["mars_requests_cancelled_total"] <= before:
    assert time.time() < deadline, "the dropped stream was never cancelled"
    time.sleep(0.2)
  assert live.metrics()["mars_requests_running"] == 0


def test_metrics_count_requests_tokens_and_forwards(live):
  m0 = live.metrics()
  _, _, use = complete(live.client(), PROMPTS[2], max_tokens=10, window=3, mode="lossless")
  m1 = live.metrics()
  assert m1["mars_generation_tokens_total"] - m0["mars_generation_tokens_total"] == (
      use.completion_tokens)
  assert m1["mars_request_forwards_total"] - m0["mars_request_forwards_total"] == (
      use.model_extra["forwards"])
  assert m1["mars_requests_total"] == m0["mars_requests_total"] + 1
  assert m1["mars_window"] >= 1 and m1["mars_tokens_per_forward"] >= 1
  for name in ("mars_time_to_first_token_seconds", "mars_e2e_request_latency_seconds",
               "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
    assert m1[f"{name}_count"] == m0[f"{name}_count"] + 1, name
    assert m1[f"{name}_sum"] > m0[f"{name}_sum"], name


def test_lm_eval_chat_completions_scores_as_the_in_process_backend(live, tmp_path):
  import lm_eval
  from lm_eval.tasks import TaskManager

  from mars_jax.evaluation import lm_eval as mle
  mle.write_tasks(str(tmp_path / "tasks"), fx.task_records(5, seed=0, split="test"),
                  max_gen_toks=12)

  def evaluate(model, model_args):
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                  tasks=["synthetic_arith"], task_manager=manager,
                                  apply_chat_template=True, log_samples=True)
    samples = sorted(out["samples"]["synthetic_arith"], key=lambda s: s["doc_id"])
    return out["results"]["synthetic_arith"], [s["resps"] for s in samples]

  local, local_resps = evaluate("mars_jax", {"pretrained": live.path, "batch_size": 8})
  remote, remote_resps = evaluate(
      "local-chat-completions", {"model": NAME, "num_concurrent": 2, "max_retries": 1,
                                 "base_url": f"{live.url}/v1/chat/completions"})
  assert remote_resps == local_resps
  assert remote["exact_match,final-number"] == local["exact_match,final-number"]


def test_nothing_compiles_after_ready(live):
  """Every kind of request (windows, modes, gates, sampling, stops, streaming, short and
  long prompts, chat), all at once so that rounds mix them, runs on programs that warmup
  compiled."""
  bodies = [{"model": NAME, "prompt": prompt, "temperature": 0.0, **kw}
            for prompt, kw in _mixed_requests()]
  bodies += [{"model": NAME, "prompt": "word " * 100, "max_tokens": 20, "window": 3,
              "stop": ["the"], "temperature": 0.9, "seed": 1},
             {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 12, "stream": True}]
  assert {r.status_code for r in _post_all(live.url, bodies)} == {200}
  assert chat(live.client(), PROMPTS[1], max_tokens=6, window=3, tau=0.5)[1]
  assert live.metrics()["mars_compiles_after_ready_total"] == 0, live.output()


def test_sigterm_finishes_the_stream_in_flight_then_exits(live):
  body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0,
          "stream": True, "window": 1}
  seen, started = [], threading.Event()

  def read():
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=120) as r:
      for line in r.iter_lines():
        if line.startswith("data: "):
          seen.append(line[6:])
          started.set()
  reader = threading.Thread(target=read)
  reader.start()
  assert started.wait(120)
  live.proc.send_signal(signal.SIGTERM)
  reader.join(180)
  assert live.proc.wait(120) == 0, live.output()
  assert seen[-1] == "[DONE]"
  assert json.loads(seen[-2])["choices"][0]["finish_reason"] == "length"
  with pytest.raises(httpx.TransportError):
    httpx.get(f"{live.url}/health", timeout=5)


FAULTY = ("--max-queued", "1", "--shutdown-timeout", "3")
FAULTY_ENV = {"MARS_JAX_SERVE_FAIL_ROUNDS": "3", "MARS_JAX_SERVE_ROUND_DELAY_S": "0.2"}


@pytest.fixture
def faulty(servers):
  """A second server on the same model and compilation cache: its third round raises,
  every round takes 0.2 s more (requests stay in flight for seconds), one request may
  wait for a row, and shutdown gives requests 3 s. Its failing round is behind it: a
  test that finds it ahead runs short requests until it has failed."""
  server = servers.get("faulty", *FAULTY, env=FAULTY_ENV)
  while server.metrics()["mars_rounds_failed_total"] == 0:
    httpx.post(f"{server.url}/v1/completions", json=_long(0, 4), timeout=120)
  return server


@pytest.fixture
def faulty_ahead(servers):
  """The faulty server before its first round (started afresh if it has run one)."""
  server = servers.get("faulty", *FAULTY, env=FAULTY_ENV)
  if server.metrics()["mars_rounds_total"] > 0:
    server = servers.get("faulty", *FAULTY, env=FAULTY_ENV, fresh=True)
  return server


def _post_all(url: str, bodies: list[dict], timeout: float = 300) -> list[httpx.Response]:
  """The bodies POSTed to /v1/completions all at once -> their responses."""
  async def run():
    async with httpx.AsyncClient(timeout=timeout,
                                 limits=httpx.Limits(max_connections=len(bodies))) as http:
      return await asyncio.gather(*(http.post(f"{url}/v1/completions", json=b)
                                    for b in bodies))
  return asyncio.run(run())


def _long(i: int, max_tokens: int = 140) -> dict:
  return {"model": NAME, "prompt": PROMPTS[i % 4], "max_tokens": max_tokens,
          "temperature": 0, "window": 1}


def _wait_for(live, name: str, value: float, timeout: float = 60) -> None:
  deadline = time.time() + timeout
  while live.metrics()[name] != value:
    assert time.time() < deadline, (name, live.metrics()[name], value, live.output())
    time.sleep(0.1)


def test_a_failed_round_fails_only_its_requests_and_the_engine_goes_on(faulty_ahead):
  faulty = faulty_ahead
  # 9 requests for 8 rows: round 3 raises while 8 run; the one waiting for a row is
  # not in it and is answered in full after the engine reset.
  responses = _post_all(faulty.url, [_long(i, 40) for i in range(9)])
  codes = sorted(r.status_code for r in responses)
  failed = [r for r in responses if r.status_code == 500]
  assert failed and 200 in codes and set(codes) == {200, 500}, codes
  for r in failed:
    assert "decoding failed" in r.json()["error"]["message"]
  for r in responses:
    if r.status_code == 200:
      assert r.json()["usage"]["completion_tokens"] == 40
  m = faulty.metrics()
  assert m["mars_rounds_failed_total"] == 1 and m["mars_requests_failed_total"] == len(failed)
  health = httpx.get(f"{faulty.url}/health", timeout=10).json()
  assert health["status"] == "ok" and health["failed_rounds"] == 1
  assert "round 3 failed" in health["last_failure"]
  assert complete(faulty.client(), PROMPTS[0], max_tokens=5)[1] == "length"


def test_a_flood_past_the_queue_is_answered_503_with_retry_after(faulty):
  rejected = faulty.metrics()["mars_requests_rejected_total"]
  responses = _post_all(faulty.url, [_long(i, 60) for i in range(24)])
  busy = [r for r in responses if r.status_code == 503]
  assert len(busy) >= 24 - 8 - 1 - 4, [r.status_code for r in responses]
  for r in busy:
    assert r.headers["Retry-After"] == "1" and "--max-queued" in r.json()["error"]["message"]
  assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses
             if r.status_code == 200)
  assert {r.status_code for r in responses} == {200, 503}
  assert faulty.metrics()["mars_requests_rejected_total"] == rejected + len(busy)


def test_clients_gone_while_queued_or_before_their_first_chunk_free_their_rows(faulty):
  """8 long requests hold every row; a ninth waits for one and its client gives up, then
  a streamed one whose client leaves before reading: both are cancelled, and the rows
  are free once the 8 finish."""
  cancelled = faulty.metrics()["mars_requests_cancelled_total"]
  holders = threading.Thread(target=_post_all, args=(faulty.url,
                                                     [_long(i) for i in range(8)]))
  holders.start()
  _wait_for(faulty, "mars_requests_running", 8)
  with pytest.raises(httpx.ReadTimeout):   # queued: no row is free before it gives up
    httpx.post(f"{faulty.url}/v1/completions", json=_long(0), timeout=1.5)
  _wait_for(faulty, "mars_requests_cancelled_total", cancelled + 1)
  assert faulty.metrics()["mars_requests_queued"] == 0
  holders.join(300)
  with httpx.Client(timeout=60) as http:   # streamed: leaves before its first chunk
    with http.stream("POST", f"{faulty.url}/v1/completions",
                     json={**_long(1), "stream": True}) as r:
      assert r.status_code == 200
  _wait_for(faulty, "mars_requests_cancelled_total", cancelled + 2)
  _wait_for(faulty, "mars_requests_running", 0)


def test_shutdown_answers_every_request_it_accepted(faulty):
  """SIGTERM while 8 long requests run (18 rounds of 0.2 s each, past the 3 s the
  shutdown gives them) and a client keeps sending: the 8 get whole answers (503 with an
  error body once the time is up), the late ones 503 or a closed socket; none hangs."""
  held, late, stop = [], [], threading.Event()

  def holder(i):
    try:
      held.append(httpx.post(f"{faulty.url}/v1/completions", json=_long(i), timeout=120))
    except httpx.HTTPError as e:
      held.append(type(e).__name__)

  def racer():
    while not stop.is_set():
      try:
        late.append(httpx.post(f"{faulty.url}/v1/completions", json=_long(0),
                               timeout=120).status_code)
      except (httpx.ConnectError, httpx.RemoteProtocolError):
        late.append("closed")   # the listening socket, or an unread connection, closed
        return
  threads = [threading.Thread(target=holder, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  _wait_for(faulty, "mars_requests_running", 8)
  threads.append(threading.Thread(target=racer))
  threads[-1].start()
  faulty.proc.send_signal(signal.SIGTERM)
  assert faulty.proc.wait(120) == 0, faulty.output()
  stop.set()
  for t in threads:
    t.join(120)
  assert not any(t.is_alive() for t in threads)
  assert all(isinstance(r, httpx.Response) for r in held), held
  assert {r.status_code for r in held} <= {200, 503} and any(r.status_code == 503
                                                            for r in held)
  for r in held:
    assert r.status_code == 200 or "shut down" in r.json()["error"]["message"]
  assert set(late) <= {503, "closed"}, late
