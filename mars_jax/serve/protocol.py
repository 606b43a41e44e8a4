"""The OpenAI wire format: request bodies checked field by field, responses and stream
chunks built (pure functions; no HTTP here, see `mars_jax.serve.app`).

  spec = parse_completion(body, model_name="tiny")      # RequestError: HTTP 400
  spec = parse_chat(body, model_name="tiny")
  spec = with_defaults(spec, {"temperature": 0.7, "top_p": 0.8})  # what the body left out
  completion_response(spec, rid, text, reason, usage)   # -> dict (JSON)
  chunk(spec, rid, delta, reason)                       # -> one stream chunk (dict)

A body is checked the way the OpenAI API checks it: every field known, of its type and
in its range, else a `RequestError` naming the field (`param`) that `error_body` turns
into {"error": {"message", "type", "param", "code"}}. Fields the engine cannot honour
(penalties other than their neutral values, n > 1, best_of, tools, JSON response
formats) are refused with a message saying so rather than ignored. vLLM's extra fields
are honoured: top_k, min_p, stop_token_ids, ignore_eos, chat_template_kwargs (passed to
the chat template), stream_options.continuous_usage_stats; so are logprobs /
top_logprobs (chat) and logprobs / echo (completions), which a forward of the AR model
over the prompt and the completion gives (`mars_jax.decoding.scoring`). MARS's own knobs
are extra fields: tau, window ("auto" or an int), gate (the gate metric), mode ("gated"
or "lossless").
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
import uuid
from typing import Any

from mars_jax.core import choices
from mars_jax.core.choices import Metric, Mode

COMPLETION_DEFAULT_MAX_TOKENS = 16  # what the OpenAI completions API defaults to
SEED_RANGE = 1 << 32
INT32_RANGE = 1 << 31   # token ids, top_k and budgets: the engine keeps them as int32
FLOAT32_MAX = 3.4028234663852886e38
MAX_STOPS = 4           # stop strings a request may give, as the OpenAI API allows
MAX_STOP_CHARS = 256    # characters a stop string may have (our bound: each is scanned
                        # for after every token of its row)
MAX_STOP_IDS = 64       # stop token ids a request may give
MAX_REQUEST_BYTES = 32 << 20   # the largest request body, by default (--max-request-bytes)
MAX_LOGPROBS = 20       # alternatives a token's logprobs may list (OpenAI's bound)


class RequestError(ValueError):
  """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.param, self.status, self.kind = param, status, kind


def error_body(message: str, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclasses.dataclass(frozen=True)
class Spec:
  """One checked request. chat: messages (role/content) else prompt (text or ids);
  max_tokens None: as many as fit; window: "auto" or an int; temperature, top_p,
  top_k, min_p, tau, gate, mode None: the server's defaults; seed: always set (drawn at
  random when the body has none); logprobs: how many alternatives each token's logprobs
  list (None: no logprobs); echo: the completion starts with the prompt (and its
  logprobs); continuous_usage: with include_usage, every stream chunk carries the usage
  so far;
  chat_template_kwargs: extra variables for the chat template."""
  chat: bool
  model: str
  prompt: str | list[int] | None
  messages: list[dict] | None
  max_tokens: int | None
  temperature: float | None
  top_p: float | None
  top_k: int | None
  stop: tuple[str, ...]
  stop_token_ids: tuple[int, ...]
  seed: int
  stream: bool
  include_usage: bool
  tau: float | None
  window: int | str
  gate: str | None
  mode: str | None
  created: int
  id: str
  min_p: float | None = None
  ignore_eos: bool = False
  logprobs: int | None = None
  echo: bool = False
  continuous_usage: bool = False
  chat_template_kwargs: dict | None = None


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  """An int or float of JSON that is finite (JSON's NaN and Infinity, and 1e400, are
  not)."""
  return (isinstance(v, (int, float)) and not isinstance(v, bool)
          and (isinstance(v, int) or math.isfinite(v)))


def _typed(body: dict, name: str, check, expected: str, default=None):
  """body[name] when present and not null (default otherwise), else RequestError."""
  value = body.get(name)
  if value is None:
    return default
  if not check(value):
    raise RequestError(f"'{name}' must be {expected}; got {type(value).__name__} "
                       f"{value!r}.", name)
  return value


def _ranged(name: str, value, ok: bool, expected: str):
  if not ok:
    raise RequestError(f"'{name}'={value!r} is out of range; it must be {expected}.", name)
  return value


# Fields accepted and honoured, besides the endpoint's own (prompt / messages).
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                 "stop_token_ids", "seed", "n", "stream", "stream_options", "tau", "window",
                 "gate", "mode", "user", "ignore_eos", "logprobs"}
# Fields accepted only at their no-op value (the engine has no such feature).
NO_OP = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
         "repetition_penalty": (None, 1, 1.0),
         "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
         "tools": (None, []), "tool_choice": (None, "none"),
         "response_format": (None, {"type": "text"}),
         "parallel_tool_calls": (None, False), "service_tier": (None, "auto", "default")}


def _common(body: dict, *, chat: bool, model_name: str, extra: set[str]) -> dict:
  unknown = sorted(set(body) - COMMON_FIELDS - set(NO_OP) - extra)
  if unknown:
    raise RequestError(f"unrecognized request argument supplied: '{unknown[0]}'.", unknown[0])
  for name, allowed in NO_OP.items():
    if name in body and body[name] not in allowed:
      neutral = " or ".join(repr(v) for v in allowed if v is not None)
      raise RequestError(f"'{name}'={body[name]!r} is not supported by this server; send "
                         f"{neutral or 'null'} or omit it.", name)
  model = _typed(body, "model", lambda v: isinstance(v, str), "a string")
  if model is None:
    raise RequestError("'model' is required (GET /v1/models lists it).", "model")
  if model != model_name:
    raise RequestError(f"model '{model}' does not exist; this server serves "
                       f"'{model_name}'.", "model")
  n = _typed(body, "n", _is_int, "an integer", 1)
  _ranged("n", n, n == 1, "1 (one choice per request; send n requests with seeds for more)")
  max_tokens = _typed(body, "max_tokens", _is_int, "an integer")
  if chat and body.get("max_completion_tokens") is not None:
    max_tokens = _typed(body, "max_completion_tokens", _is_int, "an integer")
  if max_tokens is not None:
    scoring = not chat and body.get("echo") is True   # max_tokens 0: the prompt scored
    _ranged("max_tokens", max_tokens, (0 if scoring else 1) <= max_tokens < INT32_RANGE,
            ">= 1 (and < 2**31); 0 only with 'echo': true")
  elif not chat:
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
  temperature = _typed(body, "temperature", _is_number, "a number")
  if temperature is not None:
    temperature = _ranged("temperature", temperature, 0 <= temperature <= FLOAT32_MAX,
                          ">= 0 and finite (0: greedy)")
    temperature = float(temperature)
  top_p = _typed(body, "top_p", _is_number, "a number")
  if top_p is not None:
    top_p = _ranged("top_p", float(top_p), 0 < top_p <= 1, "in (0, 1]")
  min_p = _typed(body, "min_p", _is_number, "a number")
  if min_p is not None:
    min_p = float(_ranged("min_p", min_p, 0 <= min_p <= 1, "in [0, 1] (0: off)"))
  ignore_eos = _typed(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
  top_k = _typed(body, "top_k", _is_int, "an integer")
  if top_k is not None:
    top_k = 0 if top_k == -1 else top_k           # vLLM's "off"
    _ranged("top_k", top_k, 0 <= top_k < INT32_RANGE, ">= 0 (0 or -1: off) and at most "
            "the vocabulary")
  stop = _typed(body, "stop", lambda v: isinstance(v, str) or (
      isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or a list of "
      "strings", [])
  stop = [stop] if isinstance(stop, str) else stop
  _ranged("stop", stop, all(stop) and len(stop) <= MAX_STOPS and all(
      len(s) <= MAX_STOP_CHARS for s in stop),
      f"at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
  stop_ids = _typed(body, "stop_token_ids", lambda v: isinstance(v, list) and all(
      _is_int(t) for t in v), "a list of integers", [])
  _ranged("stop_token_ids", stop_ids, len(stop_ids) <= MAX_STOP_IDS and all(
      0 <= t < INT32_RANGE for t in stop_ids),
      f"at most {MAX_STOP_IDS} token ids of the vocabulary")
  seed = _typed(body, "seed", _is_int, "an integer")
  if seed is not None:
    _ranged("seed", seed, 0 <= seed < SEED_RANGE, "in [0, 2**32)")
  stream = _typed(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
  options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
  bad = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
  if bad:
    raise RequestError(f"unrecognized stream_options field '{bad[0]}'.", "stream_options")
  include_usage = options.get("include_usage", False)
  continuous = options.get("continuous_usage_stats", False)
  if not isinstance(include_usage, bool) or not isinstance(continuous, bool):
    raise RequestError("'stream_options.include_usage' and "
                       "'stream_options.continuous_usage_stats' must be booleans.",
                       "stream_options")
  if options and not stream:
    raise RequestError("'stream_options' is only allowed with 'stream': true.",
                       "stream_options")
  tau = _typed(body, "tau", _is_number, "a number")
  if tau is not None:
    _ranged("tau", tau, 0 <= tau <= 1, "in [0, 1] (1: exact AR under the gate)")
  window = _typed(body, "window", lambda v: v == "auto" or _is_int(v),
                  "'auto' or an integer", "auto")
  gate = _typed(body, "gate", lambda v: isinstance(v, str), "a string")
  if gate is not None:
    _ranged("gate", gate, gate in choices.values(Metric), f"one of {choices.values(Metric)}")
  mode = _typed(body, "mode", lambda v: isinstance(v, str), "a string")
  if mode is not None:
    _ranged("mode", mode, mode in choices.values(Mode), f"one of {choices.values(Mode)}")
  _typed(body, "user", lambda v: isinstance(v, str), "a string")
  prefix = "chatcmpl" if chat else "cmpl"
  return dict(chat=chat, model=model, max_tokens=max_tokens, temperature=temperature,
              top_p=top_p, top_k=top_k, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
              seed=secrets.randbelow(SEED_RANGE) if seed is None else seed, stream=stream,
              include_usage=include_usage, tau=None if tau is None else float(tau),
              window=window, gate=gate, mode=mode, created=int(time.time()),
              id=f"{prefix}-{uuid.uuid4().hex}", min_p=min_p, ignore_eos=ignore_eos,
              continuous_usage=continuous)


def _no_stream_logprobs(common: dict, param: str) -> None:
  if common["stream"]:
    raise RequestError(f"'{param}' is given on non-streamed requests only (the logprobs "
                       "come from a forward over the whole completion); send 'stream': "
                       "false.", param)


# apply_chat_template's own arguments: not template variables
TEMPLATE_ARGUMENTS = {"conversation", "tools", "documents", "chat_template",
                      "add_generation_prompt", "continue_final_message", "tokenize",
                      "padding", "truncation", "max_length", "return_tensors", "return_dict",
                      "return_assistant_tokens_mask", "tokenizer_kwargs"}
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}  # defaults


def with_defaults(spec: Spec, defaults: dict) -> Spec:
  """`spec` with each sampling field the body left out (None) from `defaults` (the
  model's generation config), else from the OpenAI API's defaults."""
  return dataclasses.replace(spec, **{
      name: (defaults.get(name, value) if getattr(spec, name) is None else getattr(spec, name))
      for name, value in OPENAI_SAMPLING.items()})


def _body(body: Any) -> dict:
  if not isinstance(body, dict):
    raise RequestError(f"the request body must be a JSON object; got "
                       f"{type(body).__name__}.")
  return body


def parse_completion(body: Any, *, model_name: str) -> Spec:
  """POST /v1/completions: prompt is a string, a list of token ids, or a one-element
  list of either (one prompt per request)."""
  body = _body(body)
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]
  if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
    _ranged("prompt", "[...]", all(0 <= t < INT32_RANGE for t in prompt),
            "token ids of the vocabulary")
  elif not (isinstance(prompt, str) and prompt):
    raise RequestError("'prompt' must be a non-empty string or a non-empty list of token "
                       "ids (one prompt per request).", "prompt")
  common = _common(body, chat=False, model_name=model_name, extra={"prompt", "echo"})
  logprobs = _typed(body, "logprobs", _is_int, "an integer (the alternatives per token)")
  if logprobs is not None:
    _ranged("logprobs", logprobs, 0 <= logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
    _no_stream_logprobs(common, "logprobs")
  echo = _typed(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
  if echo:
    _no_stream_logprobs(common, "echo")
  return Spec(prompt=prompt, messages=None, logprobs=logprobs, echo=echo, **common)


def _content(message: dict, i: int) -> str:
  content = message.get("content")
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise RequestError(f"'messages[{i}].content' must be a string or a list of text parts.",
                     f"messages[{i}].content")


def parse_chat(body: Any, *, model_name: str) -> Spec:
  """POST /v1/chat/completions: messages, a non-empty list of {role, content} turns
  (content a string, or a list of {"type": "text", "text"} parts)."""
  body = _body(body)
  messages = body.get("messages")
  if not (isinstance(messages, list) and messages):
    raise RequestError("'messages' must be a non-empty list of {role, content} objects.",
                       "messages")
  turns = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise RequestError(f"'messages[{i}]' must be an object with a string 'role'.",
                         f"messages[{i}]")
    turns.append({"role": m["role"], "content": _content(m, i)})
  common = _common(body, chat=True, model_name=model_name,
                   extra={"messages", "max_completion_tokens", "top_logprobs",
                          "chat_template_kwargs"})
  wants = _typed(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
  top = _typed(body, "top_logprobs", _is_int, "an integer")
  if top is not None:
    _ranged("top_logprobs", top, 0 <= top <= MAX_LOGPROBS and (wants or top == 0),
            f"in [0, {MAX_LOGPROBS}], with 'logprobs': true")
  if wants:
    _no_stream_logprobs(common, "logprobs")
  template_kwargs = _typed(body, "chat_template_kwargs", lambda v: isinstance(v, dict),
                           "an object")
  taken = sorted(set(template_kwargs or ()) & TEMPLATE_ARGUMENTS)
  if taken:
    raise RequestError(f"'chat_template_kwargs' may not set '{taken[0]}' (the server sets "
                       "it); pass only the template's own variables.", "chat_template_kwargs")
  return Spec(prompt=None, messages=turns, logprobs=(top or 0) if wants else None,
              chat_template_kwargs=template_kwargs, **common)


@dataclasses.dataclass(frozen=True)
class Tokenize:
  """A checked /tokenize request: a prompt (text) or chat messages."""
  prompt: str | None
  messages: list[dict] | None
  add_special_tokens: bool
  add_generation_prompt: bool
  chat_template_kwargs: dict | None
  return_token_strs: bool = False


def _optional_model(body: dict, model_name: str) -> None:
  model = _typed(body, "model", lambda v: isinstance(v, str), "a string")
  if model is not None and model != model_name:
    raise RequestError(f"model '{model}' does not exist; this server serves "
                       f"'{model_name}'.", "model")


def parse_tokenize(body: Any, *, model_name: str) -> Tokenize:
  """POST /tokenize (vLLM's): {"prompt", "add_special_tokens" (default true)} or
  {"messages", "add_generation_prompt" (default true), "chat_template_kwargs"}; "model"
  and "return_token_strs" optional. The chat template decides a chat's special
  tokens."""
  body = _body(body)
  chat = "messages" in body
  known = {"model", "add_special_tokens", "return_token_strs"} | (
      {"messages", "add_generation_prompt", "chat_template_kwargs"} if chat else {"prompt"})
  unknown = sorted(set(body) - known)
  if unknown:
    raise RequestError(f"unrecognized request argument supplied: '{unknown[0]}'.", unknown[0])
  _optional_model(body, model_name)
  flag = lambda name, default: _typed(body, name, lambda v: isinstance(v, bool),
                                      "a boolean", default)
  if chat:
    turns = parse_chat({"model": model_name, "messages": body["messages"]},
                       model_name=model_name).messages
    kwargs = _typed(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    taken = sorted(set(kwargs or ()) & TEMPLATE_ARGUMENTS)
    if taken:
      raise RequestError(f"'chat_template_kwargs' may not set '{taken[0]}'.",
                         "chat_template_kwargs")
    return Tokenize(None, turns, flag("add_special_tokens", False),
                    flag("add_generation_prompt", True), kwargs,
                    flag("return_token_strs", False))
  prompt = body.get("prompt")
  if not isinstance(prompt, str):
    raise RequestError("'prompt' must be a string (or send 'messages').", "prompt")
  return Tokenize(prompt, None, flag("add_special_tokens", True), False, None,
                  flag("return_token_strs", False))


def parse_detokenize(body: Any, *, model_name: str) -> list[int]:
  """POST /detokenize (vLLM's): {"tokens": [ids]}, "model" optional -> the ids."""
  body = _body(body)
  unknown = sorted(set(body) - {"model", "tokens"})
  if unknown:
    raise RequestError(f"unrecognized request argument supplied: '{unknown[0]}'.", unknown[0])
  _optional_model(body, model_name)
  tokens = body.get("tokens")
  if not (isinstance(tokens, list) and all(_is_int(t) and 0 <= t < INT32_RANGE
                                           for t in tokens)):
    raise RequestError("'tokens' must be a list of token ids.", "tokens")
  return tokens


def finish_reason(reason: str) -> str:
  """The engine's "eos" / "stop" / "length" as OpenAI names them ("stop", "length")."""
  return "length" if reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, forwards: int | None = None,
          drafter_forwards: int | None = None) -> dict:
  """OpenAI's usage, plus the request's forwards and tokens per forward (and, from a
  server with a drafter, its drafter forwards and drafter forwards per token); forwards
  None: OpenAI's three counts alone (a stream's usage so far)."""
  use = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
  if forwards is None:
    return use
  use.update(forwards=forwards,
             tokens_per_forward=round(completion_tokens / max(forwards, 1), 4))
  if drafter_forwards is not None:
    use.update(drafter_forwards=drafter_forwards, drafter_forwards_per_token=round(
        drafter_forwards / max(completion_tokens, 1), 4))
  return use


def completion_response(spec: Spec, text: str, reason: str, use: dict,
                        logprobs: dict | None = None) -> dict:
  """The non-streamed answer (a text or a chat completion object); logprobs: the
  choice's (`logprobs_of`)."""
  if spec.chat:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": finish_reason(reason)}
  else:
    choice = {"index": 0, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason(reason)}
  return {"id": spec.id, "object": "chat.completion" if spec.chat else "text_completion",
          "created": spec.created, "model": spec.model, "choices": [choice], "usage": use}


def chunk(spec: Spec, delta: str | None, reason: str | None = None, *,
          first: bool = False, use: dict | None = None, so_far: dict | None = None) -> dict:
  """One stream chunk: a text delta (first: the chat chunk that carries the role), the
  last one with its finish reason, or (use) the usage chunk, which has no choices;
  so_far: the usage until this chunk (vLLM's continuous_usage_stats)."""
  obj = "chat.completion.chunk" if spec.chat else "text_completion"
  out = {"id": spec.id, "object": obj, "created": spec.created, "model": spec.model}
  if use is not None:
    return {**out, "choices": [], "usage": use}
  finish = None if reason is None else finish_reason(reason)
  if spec.chat:
    message = {"role": "assistant", "content": ""} if first else (
        {} if delta is None else {"content": delta})
    choice = {"index": 0, "delta": message, "logprobs": None, "finish_reason": finish}
  else:
    choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
  out["choices"] = [choice]
  if so_far is not None:
    out["usage"] = so_far
  return out


def _finite(logprob) -> float:
  """A logprob JSON can carry: -inf (a token the model rules out) as vLLM sends it."""
  value = float(logprob)
  return value if value > -9999.0 else -9999.0   # NaN too


def logprobs_of(tokenizer, spec: Spec, prompt: list[int], completion, scores
                ) -> tuple[str, dict | None]:
  """The choice's text and logprobs for a request that asked for logprobs or echo.

  prompt: its ids; completion: a `Completion` (tokens, text); scores: the AR model's
  `scoring.Scores` over prompt + completion tokens (None: no logprobs asked). The
  completion's text starts with the prompt's under echo (a text prompt as given, ids
  decoded), whose first token has no logprob (null). Chat: {"content": [{"token",
  "logprob", "bytes", "top_logprobs"}]}; completions: {"tokens", "token_logprobs",
  "top_logprobs", "text_offset"} (offsets into the returned text)."""
  text = completion.text
  first = len(prompt)   # the first token reported, in prompt + completion
  if spec.echo:
    shown = spec.prompt if isinstance(spec.prompt, str) else tokenizer.decode(prompt)
    text, first = shown + text, 0
  if spec.logprobs is None:
    return text, None
  ids = list(prompt) + list(completion.tokens)
  piece = tokenizer.decode
  rows = []   # (token string, logprob or None, [(alternative, logprob)] or None)
  for i in range(first, len(ids)):
    if i == 0:   # the prompt's first token: no logprob (nor scores when it is alone)
      rows.append((piece([ids[0]]), None, None))
      continue
    alternatives = [(piece([int(t)]), _finite(lp)) for t, lp in
                    zip(scores.top_ids[i - 1], scores.top_logprobs[i - 1])]
    rows.append((piece([ids[i]]), _finite(scores.logprob[i - 1]), alternatives))
  if spec.chat:
    def entry(token, lp):
      return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}
    return text, {"content": [{**entry(tok, lp), "top_logprobs": [entry(*a) for a in alts]}
                              for tok, lp, alts in rows]}
  offsets, at = [], 0
  for token, _, _ in rows:
    offsets.append(at)
    at += len(token)
  return text, {"tokens": [t for t, _, _ in rows],
                "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [None if alts is None else {**dict(alts), tok: lp}
                                 for tok, lp, alts in rows],
                "text_offset": offsets}
