"""GET /metrics: the engine's counters in the Prometheus text format, under our names
(`mars_*`, label `model`) and under vLLM's (`vllm:*`, label `model_name`), so that
dashboards and alerts built for vLLM read them as they are.

vLLM's names: vllm:num_requests_running and _waiting, vllm:prompt_tokens_total and
vllm:generation_tokens_total (tokens as they are generated), vllm:kv_cache_usage_perc,
vllm:request_success_total by finish reason ("stop", "length"), vllm:num_preemptions_total,
vllm:prefix_cache_queries_total and _hits_total, the histograms vllm:request_queue_time_seconds,
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds, and speculative decoding's four counters, with the MARS
meaning (`mars_jax.serve.dense.SpecCounts`): a draft is the W - 1 MASK proposals of one
decoding step of a row at W > 1; its accepted tokens are those the step committed beyond
its first, position j counting the steps that committed more than j + 1. So
1 + accepted / drafts is the tokens per forward of the rows at W > 1 (vLLM's mean
acceptance length), and accepted / draft tokens their acceptance rate.
"""

from __future__ import annotations

from mars_jax.serve import protocol


def family(name: str, kind: str, help_: str, samples) -> list[str]:
  """One metric's lines in the Prometheus text format: samples [(labels, value)]."""
  return ([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
          + [f"{name}{{{labels}}} {value}" for labels, value in samples])


def vllm_lines(m, label: str) -> list[str]:
  """The engine's counters `m` (`engine.Metrics`) under vLLM's names."""
  lines = []

  def metric(name, kind, help_, samples):
    lines.extend(family(f"vllm:{name}", kind, help_, samples))

  metric("num_requests_running", "gauge", "Requests decoding now.", [(label, m.running)])
  metric("num_requests_waiting", "gauge", "Requests waiting for a row.", [(label, m.queued)])
  metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [(label, m.prompt_tokens)])
  metric("generation_tokens_total", "counter", "Tokens generated (as they are committed).",
         [(label, m.tokens_streamed)])
  metric("kv_cache_usage_perc", "gauge", "The share of the KV cache's pages that requests "
         "hold (1: full).", [(label, round(m.kv_pages_used / m.kv_pages, 6)
                                  if m.kv_pages else 0.0)])
  success: dict[str, int] = {}
  for reason, n in m.requests.items():
    key = protocol.finish_reason(reason)
    success[key] = success.get(key, 0) + n
  metric("request_success_total", "counter", "Requests finished, by finish reason.",
         [(f'{label},finished_reason="{r}"', success.get(r, 0)) for r in ("stop", "length")])
  metric("num_preemptions_total", "counter", "Requests preempted for want of KV pages.",
         [(label, m.preemptions)])
  metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix "
         "cache.", [(label, m.prefix_query_tokens)])
  metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
         [(label, m.prefix_hit_tokens)])
  lines += m.queue_time.text("vllm:request_queue_time_seconds",
                             "Seconds a request waited for a row.", label)
  s = m.spec
  metric("spec_decode_num_drafts_total", "counter", "Decoding steps of rows at W > 1 (each "
         "proposes W - 1 tokens from its MASK slots).", [(label, s.drafts)])
  metric("spec_decode_num_draft_tokens_total", "counter", "MASK proposals those steps made.",
         [(label, s.draft_tokens)])
  metric("spec_decode_num_accepted_tokens_total", "counter", "Tokens those steps committed "
         "beyond their first.", [(label, s.accepted)])
  metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Steps that committed "
         "more than position + 1 tokens.",
         [(f'{label},position="{j}"', n) for j, n in enumerate(s.per_position)])
  return lines


def metrics_text(engine, model_name: str, drafter: bool) -> str:
  """The engine's counters (`engine.Engine`'s metrics, rejections and latencies) in the
  Prometheus text format, under our names and vLLM's (module doc)."""
  m = engine.metrics
  label = f'model="{model_name}"'
  lines = []

  def metric(name, kind, help_, samples):
    lines.extend(family(f"mars_{name}", kind, help_, samples))

  metric("requests_total", "counter", "Requests finished, by finish reason.",
         [(f'{label},finish_reason="{r}"', n) for r, n in sorted(m.requests.items())]
         or [(f'{label},finish_reason="stop"', 0)])
  metric("requests_cancelled_total", "counter", "Requests cancelled (client gone, shutdown).",
         [(label, m.cancelled)])
  metric("requests_failed_total", "counter", "Requests a failed round ended.",
         [(label, m.failed)])
  metric("rounds_failed_total", "counter", "Rounds that raised (the engine reset and went "
         "on).", [(label, m.failed_rounds)])
  metric("requests_rejected_total", "counter", "Requests answered 503 at once: the queue "
         "was full (--max-queued).", [(label, engine.rejected)])
  metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [(label, m.prompt_tokens)])
  metric("generation_tokens_total", "counter", "Tokens generated by finished requests.",
         [(label, m.generated_tokens)])
  metric("request_forwards_total", "counter",
         "Forwards the finished requests took part in (summed over requests).",
         [(label, m.request_forwards)])
  metric("tokens_per_forward", "gauge", "generation_tokens_total / request_forwards_total.",
         [(label, round(m.generated_tokens / max(m.request_forwards, 1), 4))])
  metric("batch_forwards_total", "counter", "Forwards run for the whole batch.",
         [(label, m.steps)])
  if drafter:
    metric("drafter_forwards_total", "counter",
           "Drafter forwards the finished requests drafted in (summed over requests).",
           [(label, m.drafter_forwards)])
  metric("rounds_total", "counter", "Rounds of decoding steps.", [(label, m.rounds)])
  metric("requests_running", "gauge", "Requests decoding now.", [(label, m.running)])
  metric("requests_queued", "gauge", "Requests waiting for a row.", [(label, m.queued)])
  metric("window", "gauge", "Proposals per forward W of the last round.", [(label, m.window)])
  metric("batch_rows", "gauge", "Rows of the compiled batch of the last round.",
         [(label, m.batch)])
  if m.kv_pages:
    metric("forward_tokens_total", "counter", "Tokens the forwards ran in their flat "
           "batches (padding excluded).", [(label, m.forward_tokens)])
    metric("kv_cache_pages", "gauge", "Pages of the KV pool.", [(label, m.kv_pages)])
    metric("preemptions_total", "counter", "Requests preempted for want of KV pages "
           "(resumed where they were).", [(label, m.preemptions)])
    metric("kv_cache_pages_used", "gauge", "Pages of the KV pool that requests hold.",
           [(label, m.kv_pages_used)])
    metric("kv_cache_pages_cached", "gauge", "Pages of the KV pool that hold a prefix-cache "
           "entry (held or free to evict).", [(label, m.kv_pages_cached)])
    metric("kv_cache_usage_perc", "gauge", "kv_cache_pages_used / kv_cache_pages.",
           [(label, round(m.kv_pages_used / m.kv_pages, 6))])
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix "
           "cache.", [(label, m.prefix_query_tokens)])
    metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache "
           "(their prefill skipped).", [(label, m.prefix_hit_tokens)])
  metric("compiles_after_ready_total", "counter",
         "XLA programs lowered after the server said it was ready.",
         [(label, m.compiles_after_ready)])
  lines += engine.latency.text(label, f'model_name="{model_name}"')
  lines += vllm_lines(m, f'model_name="{model_name}"')
  return "\n".join(lines) + "\n"


