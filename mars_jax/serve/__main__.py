"""`python -m mars_jax.serve`: the OpenAI-compatible HTTP server (docs/serving.md).

  python -m mars_jax.serve --model HF_DIR_OR_RUN [--host 127.0.0.1] [--port 8000]
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "NAME", "messages": [{"role": "user", "content": "2+3?"}]}'

Two processes: this one serves HTTP (uvicorn with uvloop and httptools: parsing, chat
templates, tokenizing, streaming text), and an engine process owns the device and runs
the decoding loop (`mars_jax.serve.engine`); one batched message each way per round.
Requests join free rows of the running batch between rounds, each with its own tau,
window, gate and mode (body fields; their defaults here). --window auto (the default)
picks W every round from the live batch (`WindowPolicy` over --windows).

--warmup (the default, except with --drafter or --mesh) compiles every batch, prompt and window variant the server can
meet before it says it is ready, and times each batch's windows for --window auto
(or reads --cost-table); compiled programs go to JAX's persistent compilation cache
(--compilation-cache), so a second start loads them. GET /health answers 503 until
then, and 200 with the start-up seconds after.

Requests that leave out temperature, top_p or top_k get the model's
generation_config.json values (--generation-config auto; "none": the OpenAI API's
defaults, temperature 1); /v1/models and the start-up log say which. Past
--max-queued requests waiting for a row, new ones are answered 503 with Retry-After.
SIGTERM or Ctrl-C stops admitting (503), lets in-flight requests finish for up to
--shutdown-timeout seconds, answers the rest 503, and exits.

--drafter DRAFT serves the model's AR output with a second model drafting for it
(mars_jax.decoding.speculative): up to --draft-window K tokens a round, verified in one
forward. Every request is then lossless; its tau and gate decide how the drafter (a MARS
run drafts several tokens a forward) and the model's own MASK slots draft. --window
auto means the model's trained B + 1 (at most K + 1) for a MARS run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from mars_jax.core import choices, cli
from mars_jax.core.choices import Metric, Mode
from mars_jax.decoding import gates
from mars_jax.serve.build import DEFAULT_MAX_CONTEXT, generation_defaults
from mars_jax.decoding.programs import DEFAULT_MAX_BYTES
from mars_jax.serve.protocol import MAX_REQUEST_BYTES

HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 1024

API_KEY_ENV = "MARS_JAX_API_KEY"

log = logging.getLogger("mars_jax.serve")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m mars_jax.serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="HF directory, or RUN_DIR[/STEP]")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--served-model-name", default=None,
                 help="the name clients pass as 'model' (default: the model directory's name)")
  p.add_argument("--window", default="auto",
                 help="'auto' (load-aware W every round) or a fixed W for every round")
  p.add_argument("--windows", default=None,
                 help="the W that --window auto picks among (default: 1,2,3,5, cut to the "
                      "block size + 1 that a MARS run records, which it then includes)")
  p.add_argument("--max-window", type=int, default=None,
                 help="the largest window a request may fix (default: the largest W the "
                      "server runs)")
  p.add_argument("--mode", choices=choices.values(Mode), default="lossless",
                 help="default mode of a request: lossless (output equal to AR) or gated")
  p.add_argument("--tau", type=float, default=1.0, help="default gate threshold (gated mode)")
  p.add_argument("--gate", choices=choices.values(Metric), default="probability",
                 help="default gate metric (gated mode)")
  p.add_argument("--max-num-seqs", "--batch-size", dest="max_num_seqs", type=int,
                 default=None,
                 help="requests decoding at once, the rows of the state (default: 256, as "
                      "vLLM; with --drafter or --mesh: as many rows of --max-len as "
                      "--memory-utilization of the free memory holds, at most 256)")
  p.add_argument("--max-num-batched-tokens", type=int, default=None,
                 help="tokens a forward runs at most: every decoding row's 2W - 1 slots, "
                      "then chunks of new prompts (default: max(2048, rows x (2 x the "
                      "largest W - 1)), a power of two)")
  p.add_argument("--block-size", type=int, default=16,
                 help="token slots of a KV page (vLLM's name)")
  p.add_argument("--num-kv-pages", type=int, default=None,
                 help="pages of the KV pool (default: what --memory-utilization of the free "
                      "memory holds once XLA's figure for the widest step's temporaries is "
                      "counted, at most --max-num-seqs rows of --max-len; the start-up log "
                      "says why)")
  p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                 default=True,
                 help="reuse the KV pages of a prompt's prefix that an earlier request "
                      "computed (a shared system prompt, the next turn of a chat)")
  p.add_argument("--memory-utilization", type=float, default=0.9,
                 help="the share of the device's memory (the CPU backend: of the host's "
                      "available memory) the default batch may fill")
  p.add_argument("--min-batch-size", type=int, default=1,
                 help="with --drafter or --mesh (the dense engine): rows at the lightest "
                      "load (the batch grows in powers of two)")
  p.add_argument("--max-len", type=int, default=None,
                 help="KV-cache slots per row: prompt + completion + W - 1 of any request "
                      f"(default: the model's context, at most {DEFAULT_MAX_CONTEXT}, + W - 1)")
  p.add_argument("--round-steps", type=int, default=8,
                 help="decoding steps per round: between two admissions and two stream "
                      "updates")
  p.add_argument("--admit-steps", type=int, default=2,
                 help="with --drafter or --mesh (the dense engine): decoding steps per "
                      "round while the batch has a free row")
  p.add_argument("--prefill-chunk", type=int, default=None,
                 help="prompt tokens a request prefills per forward at most (default: the "
                      "token budget, --max-num-batched-tokens; with --drafter or --mesh: 64)")
  p.add_argument("--cost-table", default=None,
                 help="JSON of step costs: read at start when it exists, written at exit")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
  p.add_argument("--mesh", default=None, help="decode on a mesh, e.g. tensor=8 (see generate)")
  p.add_argument("--shutdown-timeout", type=float, default=30.0,
                 help="seconds in-flight requests get to finish after SIGTERM")
  p.add_argument("--max-restarts", type=int, default=3,
                 help="engine deaths (a crash, the OOM killer) within 10 minutes that are "
                      "restarted; one more and the server exits with status 2")
  p.add_argument("--watchdog-s", type=float, default=300.0,
                 help="an engine that owes a round this long (from the dispatch of work, or "
                      "its last round while requests are open) "
                      "is killed and restarted (0: never)")
  p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                 help="the key the /v1 endpoints require as 'Authorization: Bearer <key>' "
                      f"(default: ${API_KEY_ENV}; unset: none)")
  p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                 help="the largest request body; past it, 413")
  p.add_argument("--request-timeout", type=float, default=None,
                 help="seconds after which a request is cancelled and answered 504 (a "
                      "stream: an error chunk); default: never")
  p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                 help="seconds a connection has to send a request's headers; past them, 408 "
                      "and closed")
  p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                 help="seconds a request's body has to arrive; past them, 408")
  p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                 help="seconds an idle keep-alive connection stays open (uvicorn's)")
  p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                 help="open connections at most; one more is answered 503 and closed")
  p.add_argument("--max-queued", type=int, default=256,
                 help="requests that may wait for a row; past it, 503 with Retry-After")
  p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                 help="compile every variant before answering /health 200 (default: on, "
                      "except with --drafter or --mesh, which compile on first use)")
  p.add_argument("--warmup-prompt-len", type=int, default=None,
                 help="the longest prompt warmup compiles for (default: --max-len - 1)")
  p.add_argument("--compilation-cache", default=None,
                 help="JAX's persistent compilation cache directory ('none': off; default: "
                      "$MARS_JAX_COMPILATION_CACHE, else ~/.cache/mars_jax/jax)")
  p.add_argument("--cache-max-gib", type=float, default=DEFAULT_MAX_BYTES / (1 << 30),
                 help="the most the compilation cache and the saved executables each keep; "
                      "past it the least recently used go")
  p.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                 help="auto: requests that leave out temperature, top_p or top_k get the "
                      "model's generation_config.json values; none: the OpenAI defaults")
  p.add_argument("--drafter", default=None,
                 help="a drafter model (HF directory or run) with the model's tokenizer")
  p.add_argument("--draft-window", type=int, default=4,
                 help="with --drafter: tokens drafted per round, K")
  p.add_argument("--drafter-window", type=int, default=None,
                 help="with --drafter: its tokens per forward (1: AR drafting; default: a "
                      "MARS run's B + 1, at most K, else 1)")
  p.add_argument("--log-level", default="info",
                 choices=["critical", "error", "warning", "info", "debug"])
  return p


class _Uvicorn:
  """uvicorn's server, telling the engine when shutdown begins: it stops admitting, and
  answers what is still open (503) a second before --shutdown-timeout runs out."""

  def __init__(self, config, engine, timeout: float):
    import uvicorn

    class Server(uvicorn.Server):
      def handle_exit(self, sig, frame):
        engine.admitting = False
        loop = engine.loop
        if loop is not None:
          loop.call_soon_threadsafe(loop.call_later, max(timeout - 1.0, 0.0),
                                    engine.answer_all,
                                    "the server shut down before the request finished.", 503)
        super().handle_exit(sig, frame)
    self.server = Server(config)

  def run(self) -> None:
    self.server.run()


def main(argv=None) -> None:
  p = parser()
  args = p.parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(),
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
  if args.window != "auto" and not args.window.isdigit():
    p.error(f"--window={args.window!r}; expected 'auto' or an int >= 1.")
  with cli.one_line_errors():
    gates.check_tau(args.tau, args.gate, "--tau")
  if not os.path.exists(args.model):
    p.exit(2, f"{p.prog}: error: --model {args.model}: no such file or directory\n")
  if args.request_timeout is not None and args.request_timeout <= 0:
    p.error(f"--request-timeout={args.request_timeout}; it must be > 0 (leave it out for "
            "none).")
  if args.max_restarts < 0:
    p.error(f"--max-restarts={args.max_restarts}; it must be >= 0.")
  for flag in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_pages"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      p.error(f"--{flag.replace('_', '-')}={value}; it must be >= 1 (leave it out for the "
              "default).")
  if not 0 < args.memory_utilization <= 1:
    p.error(f"--memory-utilization={args.memory_utilization}; expected a share in (0, 1].")
  for flag in ("header_timeout", "body_timeout", "timeout_keep_alive", "max_connections"):
    if getattr(args, flag) <= 0:
      p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)}; it must be > 0.")
  if args.cache_max_gib <= 0:
    p.error(f"--cache-max-gib={args.cache_max_gib}; it must be > 0.")
  if args.max_queued < 0:
    p.error(f"--max-queued={args.max_queued}; it must be >= 0.")
  if args.warmup and (args.drafter or args.mesh):
    p.error("--warmup covers one-device serving without a drafter; drop it (or pass "
            "--no-warmup) with --drafter or --mesh.")
  if args.warmup is None:
    args.warmup = not (args.drafter or args.mesh)
  try:
    defaults = generation_defaults(args.model) if args.generation_config == "auto" else {}
  except (ValueError, FileNotFoundError) as e:
    p.exit(2, f"{p.prog}: error: {e}\n")
  import uvicorn
  from mars_jax.serve.app import create_app
  from mars_jax.serve.engine import Engine
  from mars_jax.serve.http_limits import limited_protocol

  log.info("requests that leave them out get %s", defaults or "the OpenAI API's sampling "
           "defaults (temperature 1)")
  engine = Engine(args)
  name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
  app = create_app(engine, model_name=name, max_queued=args.max_queued,
                   sampling_defaults=defaults, api_key=args.api_key or None,
                   max_request_bytes=args.max_request_bytes,
                   request_timeout=args.request_timeout, body_timeout=args.body_timeout)
  # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again for
  # the handler it found: a no-op here, so the process ends by returning (exit status 0)
  # after the engine has stopped.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          loop="uvloop", http=limited_protocol(
                              header_timeout=args.header_timeout,
                              max_connections=args.max_connections),
                          timeout_keep_alive=args.timeout_keep_alive,
                          timeout_graceful_shutdown=args.shutdown_timeout)
  server = _Uvicorn(config, engine, args.shutdown_timeout)
  engine.on_failure = lambda: setattr(server.server, "should_exit", True)
  try:
    server.run()
  finally:
    engine.close()
  if engine.failure is not None and engine.ready is None:   # never served, or gave up
    p.exit(2, f"{p.prog}: error: {engine.failure}\n")


if __name__ == "__main__":
  main()
