"""`python -m mars_jax.bench serve`: the HTTP server under N concurrent streaming clients,
window "auto" vs W = 1, vs transformers' generate at batch N.

The toy (`mars_jax.benchmarks.toy`) is trained at start and exported (`toy.export`).
For each server kind in turn, "auto" (the load-aware window policy over --windows),
then W = 1 (our AR loop), `python -m mars_jax.serve` runs as a subprocess on 127.0.0.1
(lossless, up to 64 rows, the batch shrinking to 1 under light load). For each N in
--clients, N concurrent clients (asyncio, httpx) make an untimed pass (it compiles the
batch buckets and the moves between them that the load goes through, and runs the
policy's cost calibration), then --repeats timed passes: each client streams
--requests-per-client completions back to back (a toy prompt as token ids, --max-tokens
tokens, temperature 0; no request starts past --duration-s but the first); the pass with
the most output tokens/s counts (which buckets a load visits depends on how its
requests overlap, so a pass may still meet one the warm-up missed and wait for its
compilation; the next passes do not). Then the server is stopped with SIGTERM: it must
exit 0.

Per (server, N): requests/s and output tokens/s over the load's wall time; TTFT, from
sending a request to its first chunk with text; ITL, the gaps between a request's text
chunks (a chunk carries what one round committed: several tokens); TPOT, (last - first
text chunk) / (completion tokens - 1), over the requests streamed in more than one chunk;
tokens per forward, completion tokens / forwards summed over requests (usage chunks).
The peer: transformers' greedy `generate` (KV cache, EOS off) on the exported directory
at batch N, on the first prompt of each client, --max-tokens new tokens, timed alone
after the servers (`sample.best_times`). =AR: the auto server's texts equal the W = 1
server's prompt for prompt (lossless decoding is exact AR). This process trains on the
CPU and leaves the accelerator, if any, to the server; the clients share the CPU with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import numpy as np

from mars_jax.benchmarks import sample, toy

MODEL_NAME = "toy"
KINDS = {"auto": "auto", "w1": "1"}  # server kind -> its --window
SERVER_FLAGS = ("--mode", "lossless", "--batch-size", "64", "--min-batch-size", "1",
                "--served-model-name", MODEL_NAME, "--log-level", "warning")
HEALTH_TIMEOUT_S = 300.0  # JAX import and model load
STOP_TIMEOUT_S = 90.0     # the server's graceful shutdown (30 s) and exit
REQUEST_TIMEOUT_S = 600.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def server_command(model_dir: str, port: int, window: str, windows: list[int],
                   max_len: int) -> list[str]:
  """The `python -m mars_jax.serve` command line of one server kind (windows: the W
  that window "auto" picks among)."""
  choice = ["--windows", ",".join(map(str, windows))] if window == "auto" else []
  return [sys.executable, "-m", "mars_jax.serve", "--model", model_dir, "--host", "127.0.0.1",
          "--port", str(port), "--window", window, *choice, "--max-len", str(max_len),
          *SERVER_FLAGS]


def _tail(log, chars: int = 4000) -> str:
  log.flush()
  log.seek(0)
  return log.read()[-chars:]


def start_server(command: list[str], url: str, log) -> subprocess.Popen:
  """Starts the server (output to `log`, a text file open for reading and writing) and
  returns once GET /health answers 200; RuntimeError (the log's tail) otherwise."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
  proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
  deadline = time.monotonic() + HEALTH_TIMEOUT_S
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"the server exited ({proc.returncode}) before /health answered:"
                         f"\n{_tail(log)}")
    try:
      if httpx.get(f"{url}/health", timeout=2).status_code == 200:
        return proc
    except httpx.TransportError:
      pass
    time.sleep(0.5)
  proc.kill()
  raise RuntimeError(f"/health did not answer within {HEALTH_TIMEOUT_S:.0f} s:\n{_tail(log)}")


def stop_server(proc: subprocess.Popen) -> int | None:
  """SIGTERM, then waits for the exit -> its status (None: killed after STOP_TIMEOUT_S)."""
  proc.send_signal(signal.SIGTERM)
  try:
    return proc.wait(STOP_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    return None


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int],
                            max_tokens: int) -> dict:
  """One streamed greedy completion -> {"text", "chunk_s": seconds from sending to each
  chunk with text, "completion_tokens", "forwards"} (from the usage chunk)."""
  body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
          "stream": True, "stream_options": {"include_usage": True}}
  parts, chunk_s, usage = [], [], None
  sent = time.perf_counter()
  async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
    if response.status_code != 200:
      raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
    async for line in response.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[len("data: "):])
      if "error" in chunk:
        raise RuntimeError(f"the stream failed: {chunk['error']}")
      usage = chunk.get("usage") or usage
      if chunk["choices"] and chunk["choices"][0]["text"]:
        chunk_s.append(time.perf_counter() - sent)
        parts.append(chunk["choices"][0]["text"])
  if usage is None or not chunk_s:
    raise RuntimeError(f"the stream of {prompt} ended without text or usage.")
  return {"text": "".join(parts), "chunk_s": chunk_s,
          "completion_tokens": usage["completion_tokens"], "forwards": usage["forwards"]}


async def _load(url: str, prompts: list[list[list[int]]], max_tokens: int,
                duration_s: float) -> tuple[list[dict], float]:
  limits = httpx.Limits(max_connections=len(prompts))
  async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
    start = time.perf_counter()

    async def one_client(i: int, own: list[list[int]]) -> list[dict]:
      records = []
      for j, prompt in enumerate(own):
        if j and time.perf_counter() - start > duration_s:
          break
        records.append({"key": (i, j),
                        **await stream_completion(client, url, prompt, max_tokens)})
      return records

    done = await asyncio.gather(*(one_client(i, own) for i, own in enumerate(prompts)))
    return [r for records in done for r in records], time.perf_counter() - start


def run_load(url: str, prompts: list[list[list[int]]], max_tokens: int,
             duration_s: float = float("inf")) -> tuple[list[dict], float]:
  """len(prompts) concurrent clients, client i streaming prompts[i] back to back (none
  started past duration_s but its first) -> (request records keyed (i, j), wall seconds)."""
  return asyncio.run(_load(url, prompts, max_tokens, duration_s))


def _percentile_ms(values_s: list[float], q: float) -> float | None:
  return float(np.percentile(values_s, q) * 1e3) if values_s else None


def summarize(records: list[dict], wall_s: float) -> dict:
  """The figures of one load (see the module doc)."""
  tokens = sum(r["completion_tokens"] for r in records)
  gaps_s = [b - a for r in records for a, b in zip(r["chunk_s"], r["chunk_s"][1:])]
  ttft_s = [r["chunk_s"][0] for r in records]
  tpot_s = [(r["chunk_s"][-1] - r["chunk_s"][0]) / (r["completion_tokens"] - 1)
            for r in records if len(r["chunk_s"]) > 1]
  return {"requests": len(records), "completion_tokens": tokens, "wall_s": wall_s,
          "requests_per_s": len(records) / wall_s, "tokens_per_s": tokens / wall_s,
          "ttft_p50_ms": _percentile_ms(ttft_s, 50), "ttft_p99_ms": _percentile_ms(ttft_s, 99),
          "itl_p50_ms": _percentile_ms(gaps_s, 50), "itl_p99_ms": _percentile_ms(gaps_s, 99),
          "tpot_p50_ms": _percentile_ms(tpot_s, 50),
          "tokens_per_forward": tokens / max(sum(r["forwards"] for r in records), 1)}


def bench_server(model_dir: str, window: str, windows: list[int],
                 prompts: dict[int, list[list[list[int]]]], args) -> tuple[dict, dict]:
  """One server kind, each client count warmed up then timed -> ({N: (records, wall
  seconds) of its fastest pass}, {"command", "exit_code"})."""
  largest = max(windows) if window == "auto" else int(window)
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  command = server_command(model_dir, port, window, windows,
                           toy.PROMPT_LEN + args.max_tokens + largest - 1)
  with tempfile.TemporaryFile("w+") as log:
    begin = time.perf_counter()
    proc = start_server(command, url, log)
    print(f"--window {window}: up in {time.perf_counter() - begin:.0f} s", flush=True)
    loads = {}
    try:
      for n, own in prompts.items():
        # warm-up, right before the timed passes: it compiles and calibrates the batch
        # buckets and the moves between them that this load goes through
        warm_s = run_load(url, own, args.max_tokens, args.duration_s)[1]
        passes = [run_load(url, own, args.max_tokens, args.duration_s)
                  for _ in range(args.repeats)]
        loads[n] = max(passes, key=lambda p: sum(r["completion_tokens"] for r in p[0]) / p[1])
        print(f"--window {window}: N={n} warm-up {warm_s:.1f} s, timed passes "
              + " ".join(f"{wall_s:.2f}" for _, wall_s in passes) + " s", flush=True)
    except BaseException:
      proc.kill()
      proc.wait()
      print(f"{' '.join(command)}: the load failed; the server's log:\n{_tail(log)}",
            file=sys.stderr, flush=True)
      raise
    code = stop_server(proc)
    if code != 0:
      print(f"the --window {window} server exited {code} after SIGTERM:\n{_tail(log)}",
            flush=True)
  return loads, {"command": command, "exit_code": code}


def load_peer(model_dir: str, threads: int):
  """transformers' model of the exported directory (float32, CUDA when torch has it,
  EOS off; threads: torch's CPU threads, 0: its default) -> (model, facts)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  if threads:
    torch.set_num_threads(threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()
  if torch.cuda.is_available():
    model = model.to("cuda")
  model.generation_config.eos_token_id = None  # as the servers' toy: exactly max_tokens
  return model, {"peer_device": str(model.device), "torch_threads": torch.get_num_threads(),
                 "torch": torch.__version__, "transformers": transformers.__version__}


def peer_figures(model, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
  """transformers' greedy generate at batch len(prompts): best of `repeats` timings."""
  call = sample.transformers_generate(model, prompts, max_new=max_tokens)
  seconds, outputs = sample.best_times({"peer": call}, repeats, isolated=("peer",))
  tokens = sum(map(len, outputs["peer"][0]))
  return {"batch": len(prompts), "seconds": seconds["peer"],
          "tokens_per_s": tokens / seconds["peer"]}


def same_texts(a: list[dict], b: list[dict]) -> tuple[bool, int]:
  """Whether the requests both loads sent (same (client, request) key: same prompt)
  got the same text -> (all equal and at least one, how many compared)."""
  texts = {r["key"]: r["text"] for r in b}
  common = [r for r in a if r["key"] in texts]
  return bool(common) and all(r["text"] == texts[r["key"]] for r in common), len(common)


def _ms(row: dict, name: str) -> str:
  """The auto and W=1 figures `name` of a row, "auto/W=1" ("-": none measured)."""
  values = [row[kind][name] for kind in KINDS]
  return "/".join("-" if v is None else f"{v:.1f}" if v < 10 else f"{v:.0f}" for v in values)


def print_table(rows: list[dict]) -> None:
  """One line per N; latency columns in ms, auto/W=1."""
  print(f"{'N':>4} {'auto tok/s':>10} {'W=1 tok/s':>10} {'HF tok/s':>10} {'auto/W=1':>8} "
        f"{'W=1/HF':>7} {'req/s':>11} {'TTFT p50':>11} {'TTFT p99':>11} {'ITL p50':>11} "
        f"{'ITL p99':>11} {'TPOT p50':>9} {'tok/fwd':>7} {'=AR':>4}   (auto/W=1, ms)")
  for r in rows:
    a, w, hf = r["auto"], r["w1"], r["transformers"]
    req = f"{a['requests_per_s']:.1f}/{w['requests_per_s']:.1f}"
    print(f"{r['clients']:>4} {a['tokens_per_s']:>10.0f} {w['tokens_per_s']:>10.0f} "
          f"{hf['tokens_per_s']:>10.0f} {r['auto_over_w1']:>7.2f}x "
          f"{r['w1_over_transformers']:>6.2f}x "
          f"{req:>11} {_ms(r, 'ttft_p50_ms'):>11} {_ms(r, 'ttft_p99_ms'):>11} "
          f"{_ms(r, 'itl_p50_ms'):>11} {_ms(r, 'itl_p99_ms'):>11} {_ms(r, 'tpot_p50_ms'):>9} "
          f"{a['tokens_per_forward']:>7.2f} {'yes' if r['same_text_as_w1'] else 'NO':>4}",
          flush=True)


def plot(rows: list[dict], path: str) -> None:
  """Output tokens/s against N (log x) for the two servers and the peer."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  clients = [r["clients"] for r in rows]
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, label in (("auto", 'server, window "auto"'), ("w1", "server, W = 1"),
                     ("transformers", "transformers generate (batch N)")):
    ax.plot(clients, [r[key]["tokens_per_s"] for r in rows], marker="o", label=label)
  ax.set_xscale("log")
  ax.set_xticks(clients, [str(n) for n in clients])
  ax.minorticks_off()
  ax.set_xlabel("concurrent streaming clients N")
  ax.set_ylabel("output tokens/s")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


def run(args) -> dict:
  clients = sample._ints(args.clients)  # pylint: disable=protected-access
  windows = sample._ints(args.windows)  # pylint: disable=protected-access
  begin = time.perf_counter()
  t = toy.train(length=toy.PROMPT_LEN + max(8, args.max_tokens), steps=args.train_steps,
                seed=args.seed)
  print(f"toy trained in {time.perf_counter() - begin:.0f} s", flush=True)
  prompts = {n: np.reshape(t.prompts(n * args.requests_per_client, args.seed + n),
                           (n, args.requests_per_client, toy.PROMPT_LEN)).tolist()
             for n in clients}
  facts = {"model": "toy", "train_steps": args.train_steps, "clients": clients,
           "windows": windows, "max_tokens": args.max_tokens, "prompt_len": toy.PROMPT_LEN,
           "requests_per_client": args.requests_per_client, "duration_s": args.duration_s,
           "server_flags": list(SERVER_FLAGS), "jax": jax.__version__,
           "jax_platforms": os.environ.get("JAX_PLATFORMS", ""), "cpu_count": os.cpu_count(),
           "load_average": os.getloadavg()}
  with tempfile.TemporaryDirectory(prefix="mars-serve-bench-") as tmp:
    model_dir = toy.export(t, os.path.join(tmp, "toy"))
    loads, servers = {}, {}
    for kind, window in KINDS.items():
      loads[kind], servers[kind] = bench_server(model_dir, window, windows, prompts, args)
    peer, peer_facts = load_peer(model_dir, args.torch_threads)
    facts.update(peer_facts)
    rows = []
    for n in clients:
      row = {"clients": n, **{kind: summarize(*loads[kind][n]) for kind in KINDS},
             "transformers": peer_figures(peer, [p[0] for p in prompts[n]], args.max_tokens,
                                          args.repeats)}
      row["same_text_as_w1"], row["compared"] = same_texts(loads["auto"][n][0],
                                                           loads["w1"][n][0])
      row["auto_over_w1"] = row["auto"]["tokens_per_s"] / row["w1"]["tokens_per_s"]
      row["w1_over_transformers"] = (row["w1"]["tokens_per_s"]
                                     / row["transformers"]["tokens_per_s"])
      rows.append(row)
  return {**facts, "servers": servers, "rows": rows}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--clients", default="1,4,16,64", help="comma list of concurrent clients N")
  p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
  p.add_argument("--requests-per-client", type=int, default=4)
  p.add_argument("--duration-s", type=float, default=60.0,
                 help="a client starts no request past this many seconds of a load")
  p.add_argument("--windows", default="1,2,3,5", help='the W that window "auto" picks among')
  p.add_argument("--repeats", type=int, default=3,
                 help="timed passes of each load, timings of the peer; the best counts")
  p.add_argument("--torch-threads", type=int, default=0,
                 help="torch CPU threads for the peer (0: torch's default); on a CPU shared "
                      "with other jobs, 1 avoids OpenMP barrier stalls")
  p.add_argument("--train-steps", type=int, default=150, help="the toy's training steps")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench_serve.json", help="JSON results file")
  p.add_argument("--plot", default="", help="PNG of output tokens/s against N")
  args = p.parse_args(argv)
  jax.config.update("jax_platforms", "cpu")  # before any JAX use: see the module doc
  print(f"clients={args.clients} max_tokens={args.max_tokens} requests_per_client="
        f"{args.requests_per_client} windows={args.windows} cpus={os.cpu_count()} "
        f"load={os.getloadavg()[0]:.1f}; peer: transformers generate at batch N; "
        "=AR: the auto server's texts equal the W=1 server's", flush=True)
  result = run(args)
  print_table(result["rows"])
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")
  if args.plot:
    plot(result["rows"], args.plot)
    print(f"wrote {args.plot}")
  if any(s["exit_code"] != 0 for s in result["servers"].values()):
    sys.exit("a server did not exit 0 after SIGTERM (see above).")


if __name__ == "__main__":
  main()
