"""vLLM's clients against the OpenAI-compatible server (`python -m mars_jax.serve` in a
subprocess, the shape of tests/test_http_server.py, over the same tiny random Qwen2 with
the real vocabulary and chat template): its fields and routes, /metrics under vLLM's
names, logprobs and echo, and lm-eval's loglikelihood task over HTTP. A server of its
own: logprobs compile their forward on first use, which test_http_server.py's
"nothing compiles after ready" would count."""

import httpx
import pytest
from test_http_server import servers  # noqa: F401  (the module's fixture)
from test_http_server import NAME, PROMPTS

import user_path_fixtures as fx

pytestmark = pytest.mark.e2e


@pytest.fixture
def live(servers):  # noqa: F811
  return servers.get("vllm_clients")


def test_vllm_fields_endpoints_and_metrics(live):
  """What vLLM's clients send and read: the penalties at their neutral values (others
  refused by name), min_p, ignore_eos, chat_template_kwargs, response_format text,
  continuous usage in every chunk, /tokenize, /detokenize, /version, and /metrics under
  vLLM's names, the spec-decode counters moving under W = 3."""
  m0 = live.metrics()
  body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
          "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0,
          "min_p": 0.0, "ignore_eos": True, "window": 3}
  r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120)
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
  for field, value in (("repetition_penalty", 1.3), ("presence_penalty", 0.5)):
    r = httpx.post(f"{live.url}/v1/completions", json={**body, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
  client = live.client()
  got = client.chat.completions.create(
      model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=6,
      temperature=0, response_format={"type": "text"},
      extra_body={"chat_template_kwargs": {"enable_thinking": False}, "min_p": 0.1})
  assert got.choices[0].finish_reason in ("stop", "length")
  r = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
      "model": NAME, "messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"tokenize": False}})
  assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
  seen = [c.usage.completion_tokens for c in client.completions.create(
      model=NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True,
      stream_options={"include_usage": True, "continuous_usage_stats": True})
      if c.usage is not None]
  assert seen == sorted(seen) and seen[-1] == 10 and len(seen) > 2, seen
  ids = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPTS[3]}, timeout=30).json()
  assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] > 0
  text = httpx.post(f"{live.url}/detokenize", json={"tokens": ids["tokens"]}, timeout=30)
  assert text.json()["prompt"] == PROMPTS[3]
  chat_ids = httpx.post(f"{live.url}/tokenize", timeout=30, json={
      "messages": [{"role": "user", "content": PROMPTS[3]}]}).json()["tokens"]
  assert chat_ids[-3:] == httpx.post(f"{live.url}/tokenize", json={
      "prompt": "<|im_start|>assistant\n"}, timeout=30).json()["tokens"]
  assert httpx.get(f"{live.url}/version", timeout=30).json()["version"]
  m1 = live.metrics()
  assert m1["vllm:spec_decode_num_drafts_total"] > m0["vllm:spec_decode_num_drafts_total"]
  drafts = {k: m1[f"vllm:spec_decode_num_{k}_total"] - m0[f"vllm:spec_decode_num_{k}_total"]
            for k in ("drafts", "draft_tokens", "accepted_tokens")}
  assert drafts["draft_tokens"] == 2 * drafts["drafts"], drafts  # W = 3 (or 1): 2 a step
  assert 0 <= drafts["accepted_tokens"] <= drafts["draft_tokens"], drafts
  assert m1["vllm:generation_tokens_total"] - m0["vllm:generation_tokens_total"] >= 28
  assert m1["vllm:request_success_total"] >= m0["vllm:request_success_total"] + 3
  for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
               "vllm:request_queue_time_seconds_count"):
    assert name in m1, name


def test_logprobs_and_echo_are_the_models_and_lm_eval_scores_over_http(live, tmp_path):
  """Greedy chat with logprobs: each token is the top alternative, its logprob the top
  one's. Completions with echo and logprobs (max_tokens 0: the prompt scored): the prompt's
  tokens, the first without a logprob. lm-eval's loglikelihood task (multiple choice)
  through `local-completions` over HTTP scores as the in-process backend does."""
  import lm_eval
  from lm_eval.tasks import TaskManager

  from mars_jax.evaluation import lm_eval as mle
  got = live.client().chat.completions.create(
      model=NAME, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8,
      temperature=0, logprobs=True, top_logprobs=3)
  content = got.choices[0].logprobs.content
  assert len(content) == got.usage.completion_tokens == 8
  for tok in content:
    assert tok.top_logprobs[0].token == tok.token and len(tok.top_logprobs) == 3
    assert abs(tok.top_logprobs[0].logprob - tok.logprob) < 1e-5
    assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
  r = httpx.post(f"{live.url}/v1/completions", timeout=120, json={
      "model": NAME, "prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 1})
  choice = r.json()["choices"][0]
  prompt_ids = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPTS[0]},
                          timeout=30).json()["tokens"]
  assert choice["text"] == PROMPTS[0] and len(choice["logprobs"]["tokens"]) == len(prompt_ids)
  assert choice["logprobs"]["token_logprobs"][0] is None
  assert all(lp < 0 for lp in choice["logprobs"]["token_logprobs"][1:])
  mle.write_tasks(str(tmp_path / "tasks"), fx.task_records(6, seed=1, split="test"))

  def evaluate(model, model_args):
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                  tasks=["synthetic_arith_mc"], task_manager=manager,
                                  log_samples=True)
    samples = sorted(out["samples"]["synthetic_arith_mc"], key=lambda s: s["doc_id"])
    return out["results"]["synthetic_arith_mc"], [s["resps"] for s in samples]

  local, local_resps = evaluate("mars_jax", {"pretrained": live.path, "batch_size": 8})
  remote, remote_resps = evaluate(
      "local-completions", {"model": NAME, "base_url": f"{live.url}/v1/completions",
                            "tokenizer": live.path, "num_concurrent": 2, "max_retries": 1})
  assert remote["acc,none"] == local["acc,none"]
  for ours, theirs in zip(local_resps, remote_resps):
    for (a,), (b,) in zip(ours, theirs):
      assert abs(a[0] - b[0]) < 1e-3 and a[1] == b[1], (a, b)
