"""The OpenAI-compatible HTTP API over an `Engine` (FastAPI; run by uvicorn in
`python -m mars_jax.serve`).

  GET  /health               200 {"status": "ok"} while the engine thread runs
  GET  /v1/models            the one model served
  POST /v1/completions       a text prompt (or token ids) -> text
  POST /v1/chat/completions  messages, in the model's own chat template -> a reply
  GET  /metrics              Prometheus text: requests, tokens, forwards, tokens per
                             forward, running and queued requests, the window in use

Both POST endpoints stream (server-sent events of OpenAI chunks, then `data: [DONE]`)
when "stream" is true. A bad request is answered 400 with an OpenAI error body naming
the field (`mars_jax.serve.protocol`) and never reaches the engine. A streaming client
that goes away cancels its request, which frees its row at the next round; a
non-streamed one is checked for a disconnect every `DISCONNECT_POLL_S` while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from mars_jax.loading import chat_prompt_ids
from mars_jax.serve import protocol
from mars_jax.serve.engine import Done, Engine, Error, Handle, Tokens
from mars_jax.serve.protocol import RequestError, Spec
from mars_jax.serve.text_stream import TextStream

DISCONNECT_POLL_S = 0.5


def context_room(engine: Engine) -> int:
  """The most prompt + generated tokens one request may hold."""
  server = engine.server
  return min(server.max_len - server.extra_slots, server.config.max_position_embeddings)


def encode(tokenizer, spec: Spec) -> list[int]:
  """The prompt's token ids: the chat template with the assistant header, a text
  prompt as is (no special tokens added), or the ids given."""
  if spec.chat:
    try:
      return chat_prompt_ids(tokenizer, spec.messages)
    except Exception as e:  # the template refused the turns (roles, order)
      raise RequestError(f"the chat template refused 'messages': {e}", "messages") from e
  ids = (tokenizer.encode(spec.prompt, add_special_tokens=False)
         if isinstance(spec.prompt, str) else list(spec.prompt))
  if not ids:
    raise RequestError("'prompt' encodes to no tokens with this model's tokenizer.",
                       "prompt")
  return ids


def submit_kwargs(engine: Engine, spec: Spec, prompt: list[int]) -> dict:
  """`Server.submit`'s arguments for a checked request; RequestError on a prompt or
  budget that does not fit, or a window above the server's."""
  field = "messages" if spec.chat else "prompt"
  room = context_room(engine) - len(prompt)
  if room < 1:
    raise RequestError(f"the prompt has {len(prompt)} tokens; this server holds at most "
                       f"{context_room(engine)} tokens per request, prompt and completion "
                       "together. Shorten the prompt.", field)
  if spec.max_tokens is not None and spec.max_tokens > room:
    raise RequestError(f"max_tokens={spec.max_tokens}, but the prompt's {len(prompt)} "
                       f"tokens leave room for {room} (this server holds "
                       f"{context_room(engine)} per request).", "max_tokens")
  if spec.window != "auto" and not 1 <= spec.window <= engine.server.max_window:
    raise RequestError(f"'window'={spec.window} is out of range; it must be 'auto' or in "
                       f"[1, {engine.server.max_window}] (the server's --max-window).",
                       "window")
  return dict(max_new_tokens=spec.max_tokens or room, tau=spec.tau, metric=spec.gate,
              temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
              seed=spec.seed, stop=list(spec.stop) or None,
              stop_token_ids=spec.stop_token_ids, window=spec.window, mode=spec.mode)


def sse(data: dict | str) -> str:
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def metrics_text(engine: Engine, model_name: str) -> str:
  """The engine's counters in the Prometheus text format."""
  m = engine.metrics
  label = f'model="{model_name}"'
  lines = []

  def metric(name, kind, help_, samples):
    lines.extend([f"# HELP mars_{name} {help_}", f"# TYPE mars_{name} {kind}"])
    lines.extend(f"mars_{name}{{{labels}}} {value}" for labels, value in samples)

  metric("requests_total", "counter", "Requests finished, by finish reason.",
         [(f'{label},finish_reason="{r}"', n) for r, n in sorted(m.requests.items())]
         or [(f'{label},finish_reason="stop"', 0)])
  metric("requests_cancelled_total", "counter", "Requests cancelled (client gone, shutdown).",
         [(label, m.cancelled)])
  metric("requests_failed_total", "counter", "Requests a failed round ended.",
         [(label, m.failed)])
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
  if engine.server.drafter is not None:
    metric("drafter_forwards_total", "counter",
           "Drafter forwards the finished requests drafted in (summed over requests).",
           [(label, m.drafter_forwards)])
  metric("rounds_total", "counter", "Rounds of decoding steps.", [(label, m.rounds)])
  metric("requests_running", "gauge", "Requests decoding now.", [(label, m.running)])
  metric("requests_queued", "gauge", "Requests waiting for a row.", [(label, m.queued)])
  metric("window", "gauge", "Proposals per forward W of the last round.", [(label, m.window)])
  metric("batch_rows", "gauge", "Rows of the compiled batch of the last round.",
         [(label, m.batch)])
  return "\n".join(lines) + "\n"


def create_app(engine: Engine, *, model_name: str, tokenizer, eos_token_ids) -> FastAPI:
  """The API over `engine` (started and stopped with the app's lifespan)."""
  created = int(time.time())

  @contextlib.asynccontextmanager
  async def lifespan(app):
    engine.start()
    try:
      yield
    finally:
      await asyncio.get_running_loop().run_in_executor(None, engine.stop)

  app = FastAPI(title="mars_jax", lifespan=lifespan)

  @app.exception_handler(RequestError)
  async def request_error(request, e: RequestError):
    return JSONResponse(protocol.error_body(str(e), e.param, e.kind), status_code=e.status)

  @app.get("/health")
  async def health():
    if not engine.alive:
      return JSONResponse({"status": "stopped"}, status_code=503)
    return {"status": "ok"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": created, "owned_by": "mars_jax",
                                        "max_model_len": context_room(engine)}]}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(metrics_text(engine, model_name),
                             media_type="text/plain; version=0.0.4")

  async def body_of(request: Request):
    raw = await request.body()
    try:
      return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RequestError(f"the request body is not valid JSON: {e}.") from e

  async def start(spec: Spec) -> Handle:
    prompt = encode(tokenizer, spec)
    kwargs = submit_kwargs(engine, spec, prompt)
    try:
      return await engine.submit(prompt, **kwargs)
    except ValueError as e:
      raise RequestError(str(e)) from e
    except RuntimeError as e:
      raise RequestError(str(e), status=503, kind="server_error") from e

  async def answer(request: Request, spec: Spec):
    handle = await start(spec)
    if spec.stream:
      return StreamingResponse(stream(spec, handle), media_type="text/event-stream")
    try:
      while True:
        try:
          event = await asyncio.wait_for(handle.__anext__(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            return JSONResponse({}, status_code=499)
          continue
        if isinstance(event, Error):
          return JSONResponse(protocol.error_body(event.message, kind="server_error"),
                              status_code=500)
        if isinstance(event, Done):
          c = event.completion
          return protocol.completion_response(
              spec, c.text, c.finish_reason,
              usage(handle.prompt_len, c))
    finally:
      engine.cancel(handle)

  def usage(prompt_len: int, c) -> dict:
    return protocol.usage(prompt_len, len(c.tokens), c.forwards,
                          c.drafter_forwards if engine.server.drafter is not None else None)

  async def stream(spec: Spec, handle: Handle) -> AsyncIterator[str]:
    text = TextStream(tokenizer, spec.stop, (*eos_token_ids, *spec.stop_token_ids))
    try:
      if spec.chat:
        yield sse(protocol.chunk(spec, None, first=True))
      async for event in handle:
        if isinstance(event, Tokens):
          delta = text.push(event.tokens)
          if delta:
            yield sse(protocol.chunk(spec, delta))
        elif isinstance(event, Done):
          c = event.completion
          rest = text.finish(c.text)
          if rest:
            yield sse(protocol.chunk(spec, rest))
          yield sse(protocol.chunk(spec, None, c.finish_reason))
          if spec.include_usage:
            yield sse(protocol.chunk(spec, None, use=usage(handle.prompt_len, c)))
        else:
          yield sse(protocol.error_body(event.message, kind="server_error"))
      yield sse("[DONE]")
    finally:
      engine.cancel(handle)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await answer(request, protocol.parse_completion(await body_of(request),
                                                           model_name=model_name))

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await answer(request, protocol.parse_chat(await body_of(request),
                                                     model_name=model_name))

  return app
