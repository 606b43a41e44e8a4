"""The OpenAI-compatible HTTP API over the engine process (FastAPI; run by uvicorn in
`python -m mars_jax.serve`).

  GET  /health               200 {"status": "ok", "startup_s": ...} once the engine is
                             warm; 503 {"status": "starting"} before, {"status":
                             "restarting", "reason"} while a dead engine starts again,
                             and with the reason when the server gave up
  GET  /v1/models            the one model served, with its context and the sampling
                             defaults requests get (the model's generation config);
                             503 like every endpoint until the engine is ready
  POST /v1/completions       a text prompt (or token ids) -> text (logprobs, echo)
  POST /v1/chat/completions  messages, in the model's own chat template -> a reply
  POST /tokenize             vLLM's: a prompt or messages -> their token ids
  POST /detokenize           vLLM's: token ids -> text
  GET  /version              {"version": mars_jax's}
  GET  /metrics              Prometheus text (`mars_jax.serve.metrics`): ours and vLLM's
                             names

Both POST endpoints stream (server-sent events of OpenAI chunks, then `data: [DONE]`)
when "stream" is true. A bad request is answered 400 with an OpenAI error body naming
the field (`mars_jax.serve.protocol`); the engine's own refusals come back as 400 too.
Past `max_queued` requests waiting for a row, a request is answered 503 with
Retry-After at once. A client that goes away (queued, prefilling or streaming) cancels
its request, which frees its row at the next round: streamed responses cancel when they
end however they end; a non-streamed one is checked every `DISCONNECT_POLL_S`. A
round that fails answers its requests 500; after shutdown begins, new requests get 503
and the ones still open are answered 503 before the connections close.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

import mars_jax
from mars_jax.decoding.loading import chat_prompt_ids
from mars_jax.serve import protocol
from mars_jax.serve.metrics import metrics_text
from mars_jax.serve.engine import Engine, Handle
from mars_jax.serve.messages import Accepted, Done, Error, Loaded, Scored, Tokens
from mars_jax.serve.requests import Completion
from mars_jax.serve.protocol import MAX_REQUEST_BYTES, RequestError, Spec
from mars_jax.serve.text_stream import TextStream

DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = 1
INLINE_PARSE_BYTES = 64 << 10   # bodies up to this are parsed on the event loop


def encode(tokenizer, spec: Spec) -> list[int]:
  """The prompt's token ids: the chat template with the assistant header (and the
  request's chat_template_kwargs), a text prompt as is (no special tokens added), or the
  ids given."""
  if spec.chat:
    try:
      return chat_prompt_ids(tokenizer, spec.messages, **(spec.chat_template_kwargs or {}))
    except Exception as e:  # the template refused the turns (roles, order)
      raise RequestError(f"the chat template refused 'messages': {e}", "messages") from e
  ids = (tokenizer.encode(spec.prompt, add_special_tokens=False)
         if isinstance(spec.prompt, str) else list(spec.prompt))
  if not ids:
    raise RequestError("'prompt' encodes to no tokens with this model's tokenizer.",
                       "prompt")
  return ids


def tokenize_ids(tokenizer, spec: protocol.Tokenize) -> list[int]:
  """A /tokenize request's ids: the messages in the chat template, or the prompt."""
  if spec.messages is None:
    return tokenizer.encode(spec.prompt, add_special_tokens=spec.add_special_tokens)
  try:
    return chat_prompt_ids(tokenizer, spec.messages, spec.add_generation_prompt,
                           **(spec.chat_template_kwargs or {}))
  except Exception as e:  # the template refused the turns (roles, order)
    raise RequestError(f"the chat template refused 'messages': {e}", "messages") from e


def submit_kwargs(facts: Loaded, spec: Spec, prompt: list[int]) -> dict:
  """`Server.submit`'s arguments for a checked request (sampling defaults applied);
  RequestError on a prompt or budget that does not fit, or a window above the
  server's."""
  field = "messages" if spec.chat else "prompt"
  room = facts.context_room - len(prompt)
  if room < 1:
    raise RequestError(f"the prompt has {len(prompt)} tokens; this server holds at most "
                       f"{facts.context_room} tokens per request, prompt and completion "
                       "together. Shorten the prompt.", field)
  if spec.max_tokens is not None and spec.max_tokens > room:
    raise RequestError(f"max_tokens={spec.max_tokens}, but the prompt's {len(prompt)} "
                       f"tokens leave room for {room} (this server holds "
                       f"{facts.context_room} per request).", "max_tokens")
  if spec.window != "auto" and not 1 <= spec.window <= facts.max_window:
    raise RequestError(f"'window'={spec.window} is out of range; it must be 'auto' or in "
                       f"[1, {facts.max_window}] (the server's --max-window).", "window")
  return dict(max_new_tokens=spec.max_tokens or room, tau=spec.tau, metric=spec.gate,
              temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
              seed=spec.seed, stop=list(spec.stop) or None,
              stop_token_ids=spec.stop_token_ids, window=spec.window, mode=spec.mode,
              min_p=spec.min_p, ignore_eos=spec.ignore_eos)


def sse(data: dict | str) -> str:
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Streamed(StreamingResponse):
  """A streamed response that watches for the client leaving (uvicorn only says so
  through `receive`) and runs `on_end` however it ends: done, client gone, error."""

  def __init__(self, content, on_end: Callable[[], None]):
    super().__init__(content, media_type="text/event-stream")
    self.on_end = on_end

  async def __call__(self, scope, receive, send):
    async def gone():
      while (await receive())["type"] != "http.disconnect":
        pass
    watcher = asyncio.ensure_future(gone())
    streamer = asyncio.ensure_future(self.stream_response(send))
    try:
      await asyncio.wait({watcher, streamer}, return_when=asyncio.FIRST_COMPLETED)
      if streamer.done() and not isinstance(streamer.exception(), (OSError, type(None))):
        raise streamer.exception()
    finally:
      for task in (watcher, streamer):
        task.cancel()
      self.on_end()


def create_app(engine: Engine, *, model_name: str, max_queued: int,
               sampling_defaults: dict, api_key: str | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES,
               request_timeout: float | None = None,
               body_timeout: float = 60.0) -> FastAPI:
  """The API over `engine` (started and stopped with the app's lifespan).
  max_queued: requests that may wait for a row beyond the batch's rows;
  sampling_defaults: temperature, top_p, top_k for requests that leave them out;
  api_key: what the /v1 endpoints require as `Authorization: Bearer <key>` (None: no
  key); max_request_bytes: the largest request body (413 past it); request_timeout:
  seconds after which a request is cancelled and answered 504 (None: never);
  body_timeout: seconds a request's body may take to arrive (408 past them)."""
  created = int(time.time())
  tokenizing = 0   # requests between their checks and their submit (templating, tokenizing)

  def timed_out(handle: Handle) -> str | None:
    """Why the request must end now (it ran past request_timeout), or None."""
    if request_timeout is None or time.monotonic() - handle.submitted <= request_timeout:
      return None
    return f"the request ran past the server's --request-timeout ({request_timeout:g} s)."

  def authorize(request: Request) -> None:
    if api_key is None:
      return
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
      raise RequestError("Incorrect API key provided: send the server's --api-key as "
                         "'Authorization: Bearer <key>'.", status=401,
                         kind="invalid_request_error")

  @contextlib.asynccontextmanager
  async def lifespan(app):
    engine.start()
    yield
    await engine.stop()

  app = FastAPI(title="mars_jax", lifespan=lifespan)

  @app.exception_handler(RequestError)
  async def request_error(request, e: RequestError):
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    if e.status in (401, 408, 413):   # answered before its body was read: close after it
      headers = {"Connection": "close"}
    return JSONResponse(protocol.error_body(str(e), e.param, e.kind), status_code=e.status,
                        headers=headers)

  def facts() -> Loaded:
    if engine.failure is not None:
      raise RequestError(f"the engine stopped: {engine.failure}", status=500,
                         kind="server_error")
    if engine.restarting is not None:
      raise RequestError(f"the engine is restarting ({engine.restarting}); retry shortly.",
                         status=503, kind="server_error")
    if engine.ready is None or not engine.loaded.done():
      raise RequestError("the server is starting (compiling); retry shortly.", status=503,
                         kind="server_error")
    return engine.loaded.result()

  @app.get("/health")
  async def health():
    if engine.failure is not None:
      return JSONResponse({"status": "stopped", "reason": engine.failure}, status_code=503)
    if engine.restarting is not None:
      return JSONResponse({"status": "restarting", "reason": engine.restarting},
                          status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    if engine.ready is None:
      return JSONResponse({"status": "starting"}, status_code=503)
    if not engine.admitting:
      return JSONResponse({"status": "shutting down"}, status_code=503)
    return {"status": "ok", "startup_s": round(engine.ready.startup_s, 2),
            "warmup_s": round(engine.ready.warmup_s, 2),
            "programs_loaded": engine.ready.programs_loaded,
            "programs_compiled": engine.ready.programs_compiled,
            "failed_rounds": engine.metrics.failed_rounds,
            "last_failure": engine.metrics.last_failure or None}

  @app.get("/v1/models")
  async def models(request: Request):
    authorize(request)
    room = facts().context_room   # 503 until ready: a client waiting on it starts in time
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": created, "owned_by": "mars_jax",
                                        "max_model_len": room,
                                        "sampling_defaults": sampling_defaults}]}

  @app.get("/metrics")
  async def metrics():
    drafter = engine.loaded.done() and engine.loaded.result().drafter
    return PlainTextResponse(metrics_text(engine, model_name, drafter),
                             media_type="text/plain; version=0.0.4")

  async def body_of(request: Request) -> bytes:
    """The request's body, read at most `max_request_bytes` far (413 past it) and within
    `body_timeout` seconds (408 past it: a client trickling it in holds a connection)."""
    authorize(request)
    too_big = RequestError(f"the request body exceeds {max_request_bytes} bytes "
                           "(--max-request-bytes).", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_request_bytes:
      raise too_big
    chunks = []

    async def read() -> None:
      size = 0
      async for chunk in request.stream():
        size += len(chunk)
        if size > max_request_bytes:
          raise too_big
        chunks.append(chunk)
    try:
      await asyncio.wait_for(read(), body_timeout)
    except asyncio.TimeoutError as e:
      raise RequestError(f"the request body did not arrive within {body_timeout:g} s "
                         "(--body-timeout).", status=408) from e
    return b"".join(chunks)

  async def parsed(request: Request, parse: Callable[..., Any]) -> Any:
    """The checked request (`parse` over the body's JSON); a large body is parsed in a
    worker thread, so that a 16 MiB list of token ids stalls no stream."""
    raw = await body_of(request)

    def run() -> Spec:
      try:
        body = json.loads(raw)
      except (ValueError, RecursionError) as e:   # bad JSON, bad UTF-8, nested too deep
        raise RequestError(f"the request body is not valid JSON: {e}.") from e
      return parse(body, model_name=model_name)
    return run() if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(run)

  async def encoded(spec: Spec) -> tuple[list[int], Loaded]:
    """The request's prompt ids, templated and tokenized in a worker thread (a long
    prompt stalls no stream), and the facts: 503 past --max-queued, counting requests
    queued in the engine and those still being tokenized here."""
    nonlocal tokenizing
    known = facts()
    # counted with nothing awaited before, so concurrent requests see each other
    waiting = len(engine.handles) + tokenizing - known.max_batch
    if waiting >= max_queued:
      engine.rejected += 1
      raise RequestError(f"{waiting} requests are waiting for a row (--max-queued "
                         f"{max_queued}); retry later.", status=503, kind="server_error")
    tokenizing += 1
    try:
      prompt = await asyncio.to_thread(encode, known.tokenizer, spec)
    finally:
      tokenizing -= 1
    return prompt, facts()   # the engine may have gone meanwhile

  def submitted(make: Callable[[], Handle]) -> Handle:
    try:
      return make()
    except RuntimeError as e:
      raise RequestError(str(e), status=503, kind="server_error") from e

  async def start(spec: Spec, prompt: list[int], known: Loaded) -> Handle:
    """Submits the request and waits for the engine to take it (a round at most) ->
    its handle; RequestError when it is refused."""
    handle = submitted(lambda: engine.submit(prompt, **submit_kwargs(known, spec, prompt)))
    try:
      event = await handle.__anext__()
    except BaseException:
      engine.cancel(handle)
      raise
    if isinstance(event, Error):
      raise RequestError(event.message, status=event.status,
                         kind="invalid_request_error" if event.status == 400
                         else "server_error")
    assert isinstance(event, Accepted), event
    return handle

  async def outcome(request: Request, handle: Handle):
    """The request's last event (`Done` or `Scored`), or the response that ends it
    otherwise: 499 (the client left), 504 (past --request-timeout), the engine's error.
    The request is cancelled however this ends (nothing, once it is done)."""
    try:
      return await last_event(request, handle)
    finally:
      engine.cancel(handle)

  async def last_event(request: Request, handle: Handle):
    while True:
      try:
        event = await asyncio.wait_for(handle.__anext__(), DISCONNECT_POLL_S)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          return JSONResponse({}, status_code=499)
        late = timed_out(handle)
        if late:
          return JSONResponse(protocol.error_body(late, kind="server_error"),
                              status_code=504)
        continue
      if isinstance(event, Error):   # 503 (a restart, a shutdown): retry shortly
        retry = {"Retry-After": str(RETRY_AFTER_S)} if event.status == 503 else None
        return JSONResponse(protocol.error_body(event.message, kind="server_error"),
                            status_code=event.status, headers=retry)
      if isinstance(event, (Done, Scored)):
        return event

  async def answer(request: Request, spec: Spec):
    spec = protocol.with_defaults(spec, sampling_defaults)
    prompt, known = await encoded(spec)
    if spec.max_tokens == 0:   # echo: the prompt scored, nothing generated
      if len(prompt) > known.context_room:
        raise RequestError(f"the prompt has {len(prompt)} tokens; this server holds at most "
                           f"{known.context_room} per request. Shorten the prompt.", "prompt")
      if known.vocab_size and any(not 0 <= t < known.vocab_size for t in prompt):
        raise RequestError(f"'prompt' has token ids outside the vocabulary [0, "
                           f"{known.vocab_size}).", "prompt")
      c = Completion(-1, [], 0, "length", "")
    else:
      handle = await start(spec, prompt, known)
      if spec.stream:
        return _Streamed(stream(spec, handle, known), lambda: engine.cancel(handle))
      done = await outcome(request, handle)
      if not isinstance(done, Done):
        return done
      c = done.completion
    use = usage(len(prompt), c, known)
    if spec.logprobs is None and not spec.echo:
      return protocol.completion_response(spec, c.text, c.finish_reason, use)
    scores = None
    ids = prompt + list(c.tokens)
    if spec.logprobs is not None and len(ids) > 1:   # one token alone: none to score
      scored = await outcome(request, submitted(lambda: engine.score(ids, spec.logprobs)))
      if not isinstance(scored, Scored):
        return scored
      scores = scored.scores
    text, logprobs = await asyncio.to_thread(
        protocol.logprobs_of, known.tokenizer, spec, prompt, c, scores)
    return protocol.completion_response(spec, text, c.finish_reason, use, logprobs)

  def usage(prompt_len: int, c, known: Loaded) -> dict:
    return protocol.usage(prompt_len, len(c.tokens), c.forwards,
                          c.drafter_forwards if known.drafter else None)

  async def stream(spec: Spec, handle: Handle, known: Loaded) -> AsyncIterator[str]:
    ends = () if spec.ignore_eos else known.eos_token_ids
    text = TextStream(known.tokenizer, spec.stop, (*ends, *spec.stop_token_ids))
    generated = 0

    def so_far() -> dict | None:   # continuous_usage_stats (with include_usage): every chunk
      return (protocol.usage(handle.prompt_len, generated)
              if spec.continuous_usage and spec.include_usage else None)
    if spec.chat:
      yield sse(protocol.chunk(spec, None, first=True, so_far=so_far()))
    poll = None if request_timeout is None else DISCONNECT_POLL_S   # None: a plain await
    while not handle.finished:
      try:
        event = await asyncio.wait_for(handle.__anext__(), poll)
      except asyncio.TimeoutError:
        late = timed_out(handle)
        if late:   # the stream ends with the error; `_Streamed` cancels the request
          yield sse(protocol.error_body(late, kind="server_error"))
          break
        continue
      if isinstance(event, Tokens):
        generated += len(event.tokens)
        delta = text.push(event.tokens)
        if delta:
          yield sse(protocol.chunk(spec, delta, so_far=so_far()))
      elif isinstance(event, Done):
        c = event.completion
        generated = len(c.tokens)
        rest = text.finish(c.text)
        if rest:
          yield sse(protocol.chunk(spec, rest, so_far=so_far()))
        yield sse(protocol.chunk(spec, None, c.finish_reason, so_far=so_far()))
        if spec.include_usage:
          yield sse(protocol.chunk(spec, None, use=usage(handle.prompt_len, c, known)))
      else:
        yield sse(protocol.error_body(event.message, kind="server_error"))
    yield sse("[DONE]")

  @app.get("/version")
  async def version():
    return {"version": mars_jax.__version__}

  @app.post("/tokenize")
  async def tokenize(request: Request):
    """vLLM's: {"prompt"} or {"messages"} (with the chat template, or
    "add_generation_prompt" false) -> {"count", "max_model_len", "tokens"}."""
    spec = await parsed(request, protocol.parse_tokenize)
    known = facts()
    ids = await asyncio.to_thread(tokenize_ids, known.tokenizer, spec)
    return {"count": len(ids), "max_model_len": known.context_room, "tokens": ids,
            "token_strs": (known.tokenizer.convert_ids_to_tokens(ids)
                           if spec.return_token_strs else None)}

  @app.post("/detokenize")
  async def detokenize(request: Request):
    """vLLM's: {"tokens": [ids]} -> {"prompt": text}."""
    ids = await parsed(request, protocol.parse_detokenize)
    known = facts()
    return {"prompt": await asyncio.to_thread(known.tokenizer.decode, ids)}

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await answer(request, await parsed(request, protocol.parse_completion))

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await answer(request, await parsed(request, protocol.parse_chat))

  return app
