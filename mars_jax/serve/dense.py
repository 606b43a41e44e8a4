"""Continuous batching over the resumable sampler: a small Python serving loop.

  server = Server(config, params, mask_token_id=m, eos_token_ids=eos, batch_size=8,
                  max_len=512, window=WindowPolicy(), mode="lossless")
  rid = server.submit(prompt_ids, max_new_tokens=64, tau=0.9, temperature=0.7, seed=1,
                      stop=["\n\n"])   # stop strings need Server(..., tokenizer=tok)
  rid2 = server.submit(prompt_ids, max_new_tokens=64, window=3, mode="gated", tau=0.9)
  for update in server.stream():          # until every submitted request is done
    print(update.request_id, update.tokens, update.done)
  server.completed[rid].tokens_per_forward, server.completed[rid].finish_reason

Each `step` is one round of the decoding loop (`mars_jax.decoding.rounds.run_round`):

  1. batch bucket: the smallest of min_batch_size x 4^k (and batch_size) that holds
     the active and queued requests; a change moves the active rows to a state of
     that bucket (`loop.regroup`, one bucket at a time), so the load decides the
     compiled batch, and with it the cost table row the window policy reads;
  2. refill: every free row (its request finished) takes the next queued request
     (`loop.insert`), without touching the other rows; the new prompts are
     prefilled by the round's first steps, `prefill_chunk` tokens wide, while
     the other rows keep decoding in the same forwards (every row runs the step's
     width, so it is the new prompts' power of two, at most prefill_chunk). The prompts
     are inserted `prompt_widths` wide (prefill_chunk x 8^k, and max_len): few
     variants to compile;
  3. decode: the policy picks W, at least the largest window a live request fixed
     (rounded up to one of the policy's windows or max_window, which bounds the
     compiled variants); the loop runs `round_steps` steps (`admit_steps` while the
     batch has a free row: a request that arrives meanwhile starts sooner), ending
     early when a row
     finishes and requests are waiting. The prefill steps run at max_window (its
     rows' own caps still hold; a lossless row's output is the same at every W),
     so their compiled variants do not multiply with the windows. Requests with window
     "auto" take the round's W; one with a fixed window commits at most that many
     tokens per forward. A lossless server runs the lossless kernel always (it gates
     its gated rows on the same forward); a gated one runs it when some live request
     is lossless (`loop.Controls`);
  4. harvest: one device-to-host copy of each row's new tokens and counters
     (`loop.harvest`: O(new tokens), whatever the cache length); no other sync. With
     `overlap` (the default) and no request waiting for a row, the round's harvest is
     read at the next step, after the next round is dispatched: the device runs round
     r + 1 while the host reads and streams round r (and takes new requests). When
     requests wait, a step reads what is in flight first and its own round at once,
     so a row that finished is refilled at the next round;
  5. stop: rows whose new text holds one of their stop strings are cut after the
     token that completed it (`mars_jax.decoding.stops`: the new text only);
  6. stream: the tokens each request committed since the last step come back as
     `Update`s; a finished request becomes a `Completion` and frees its row.

`warmup` compiles (and, for a `WindowPolicy`, times) every variant the steps can
meet, so a server that has run it compiles nothing while serving. `reset` drops the
running requests and starts from a fresh state: what a failed round leaves behind
(its buffers may have been donated) is never used again.

`cancel` drops a queued request, or ends a running one at the start of the next
step (its row is free for the refill of that step).

With a drafter (`drafter=`, a `speculative.Drafter`) a round is `round_steps` rounds of
two-model decoding (`mars_jax.decoding.speculative`) at the server's fixed window: every
request gets the AR tokens (greedy, or sampled with its seed) of the served model, its
tau and gate deciding how the drafter and the target's MASK slots draft. New prompts
are prefilled whole by the round's first forward.

On a mesh (`mesh=`, from `sharding.make_mesh`) the weights are placed once with the
decode shardings and the state lives split over it (`mars_jax.decoding.mesh`); the
buckets are then multiples of data x fsdp as well.

Every row is decoded as if it were alone (per-sample cursors, gates, budgets, windows
and position-keyed sampling noise), so a request gets the tokens it gets from
`sampling.generate` alone at the same W (a gated request with window "auto" takes
the W the load picks, so fix its window for reproducible output); in lossless mode,
the AR tokens (greedy, or sampled with its seed) whatever W the policy picks.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from mars_jax.core import choices
from mars_jax.core.choices import Metric, Mode
from mars_jax.decoding import (batching, gates, loop, programs as programs_lib, rounds,
                               speculative, stops, timing)
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.decoding.window_policy import FixedWindow, WindowPolicy
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.serve.requests import Completion, Request, Round, SpecCounts, Stream, Update


BUCKET_GROWTH = 4   # a batch bucket is min_batch_size x 4^k rows (or batch_size)
PROMPT_GROWTH = 8   # an insert is prefill_chunk x 8^k (or max_len) tokens wide


class DenseServer:
  """Continuous batching of requests over one fixed-shape KV cache.

  batch_size: rows at full load; min_batch_size: rows at the lightest load
  (default batch_size: a fixed bucket); max_len: cache slots, >= prompt +
  max_new_tokens + W - 1 of every request; window: a fixed W, or a
  `WindowPolicy` (it measures step costs when it first meets a bucket);
  mode: "gated" or "lossless" (see `sampling`); tau, metric: the gate of requests
  that do not give their own; prefill_chunk: width of the prefill steps (longer
  prompts take several); round_steps: steps between two host round trips;
  admit_steps: the steps of a round while the batch has a free row
  (a fixed window; a policy brings its own); mesh: the mesh to decode on (None: one
  device); tokenizer: decodes the text stop strings are found in (and
  `Completion.text`); max_stop_ids: stop ids a request may give; max_window: the
  largest window a request may fix (default: the policy's largest); drafter: decode
  with it (a fixed window, one device), drafting up to draft_window tokens a round;
  programs: call the kernels through these saved executables (`decoding.programs`; one
  device, no drafter; None: through jit); overlap: dispatch each round before reading
  the last one's harvest (step 4 of the module doc).
  """

  def __init__(self, config: Qwen2Config, params, *, mask_token_id: int,
               eos_token_ids: int | Sequence[int], batch_size: int = 8,
               min_batch_size: int | None = None, max_len: int = 512,
               window: int | WindowPolicy | FixedWindow = 1, mode: Mode = "gated", tau: float = 1.0,
               metric: Metric = "probability", prefill_chunk: int = 64,
               round_steps: int = 8, admit_steps: int = 2,
               runtime: Runtime = DEFAULT_RUNTIME,
               mesh: Mesh | None = None, tokenizer=None,
               max_stop_ids: int = loop.STOP_BUCKET, max_window: int | None = None,
               drafter: speculative.Drafter | None = None, draft_window: int = 4,
               programs: programs_lib.Programs | None = None, overlap: bool = True):
    self.policy = (window if isinstance(window, (WindowPolicy, FixedWindow))
                   else FixedWindow(window, round_steps=round_steps))
    self.max_window = max_window or max(self.policy.windows)
    batching.check_args(config, window=self.max_window, mode=mode,
                        mask_token_id=mask_token_id)
    gates.metric_ids(metric, 1)
    self.max_batch = decode_mesh.batch_rows(batch_size, mesh)
    self.min_batch = min(decode_mesh.batch_rows(min_batch_size or batch_size, mesh),
                         self.max_batch)
    if prefill_chunk < self.max_window:
      raise ValueError(f"prefill_chunk={prefill_chunk} is below the largest window.")
    self.drafter, self.draft_window = drafter, draft_window
    if drafter is not None:
      if not isinstance(self.policy, FixedWindow) or len(self.policy.windows) != 1 or mesh:
        raise ValueError("a server with a drafter runs one fixed window on one device: "
                         "pass an int window and no mesh.")
      speculative.check_args(config, drafter, [[0]], 1, draft_window=draft_window,
                             window=self.max_window, mask_token_id=mask_token_id)
    if mesh is not None:
      params = decode_mesh.place_params(config, params, mesh, runtime)
    self.config, self.runtime, self.params, self.mode = config, runtime, params, mode
    self.mesh = mesh
    self.mask_token_id, self.tau, self.metric = mask_token_id, tau, metric
    self.eos_ids = batching.eos_array(eos_token_ids)
    self.max_len, self.prefill_chunk = max_len, prefill_chunk
    self.tokenizer, self.max_stop_ids = tokenizer, max_stop_ids
    self._streams: dict[int, Stream] = {}
    self.call = (programs if programs is not None and mesh is None and drafter is None
                 else programs_lib.direct)
    self.measure = timing.measure_fn(config, params, mode=mode,
                                     mask_token_id=mask_token_id, runtime=runtime, mesh=mesh,
                                     call=self.call)
    if drafter is not None:
      self.models = (speculative.Model(config, runtime),
                     speculative.Model(drafter.config, drafter.runtime))
    self.buckets = [b for b in (self.min_batch * BUCKET_GROWTH ** i
                                for i in range(self.max_batch.bit_length()))
                    if b < self.max_batch] + [self.max_batch]
    widths = [w for w in (prefill_chunk * PROMPT_GROWTH ** i for i in range(max_len.bit_length()))
              if 2 * w <= max_len]
    self.prompt_widths = widths + [max_len]
    # a round's steps (its prefill steps for the longest prompt, then round_steps) each
    # commit at most extra_slots + 1 tokens a row
    self.harvest_width = min(max_len, (self.policy.round_steps + math.ceil(
        max_len / prefill_chunk)) * (self.extra_slots + 1))
    self.admit_steps = max(1, min(admit_steps, self.policy.round_steps))
    self.queue: collections.deque[Request] = collections.deque()
    self.completed: dict[int, Completion] = {}
    self._requests: dict[int, Request] = {}
    self._next_id = 0
    self.window = 0          # the W of the last round (0: none ran yet)
    self.overlap = overlap
    self.steps = 0           # forwards run for the batch
    self.spec = SpecCounts()  # the rows' steps at W > 1 and what they committed
    self.reset()

  def _new_state(self, rows: int):
    if self.drafter is not None:
      return speculative.new_state(*self.models, rows, self.max_len,
                                   stop_ids=self.max_stop_ids)
    if self.mesh is None:
      return loop.new_state(self.config, rows, self.max_len, runtime=self.runtime,
                            stop_ids=self.max_stop_ids)
    return decode_mesh.new_state(self.config, self.mesh, rows, self.max_len,
                                 runtime=self.runtime, stop_ids=self.max_stop_ids)

  def reset(self) -> list[int]:
    """A fresh state of min_batch_size rows: the running requests are dropped (no
    `Completion`) and the queue kept; -> the ids dropped. What a failed step left
    behind (its buffers may have been donated) is never read again."""
    dropped = [r for r in getattr(self, "slots", ()) if r is not None]
    for rid in dropped:
      self._forget(rid)
    self.state = self._new_state(self.min_batch)
    self._last: Round | None = None   # a round dispatched, its harvest not read yet
    self.slots: list[int | None] = [None] * self.min_batch
    self.scan = stops.StopScan(self.tokenizer, [()] * self.min_batch)
    self._cancelled: set[int] = set()
    return dropped

  @classmethod
  def from_model(cls, model, **kwargs) -> "DenseServer":
    """A server over a `mars_jax.decoding.loading.LoadedModel` (its mask and EOS ids, tokenizer)."""
    return cls(model.config, model.params, mask_token_id=model.mask_token_id,
               eos_token_ids=model.eos_token_ids, runtime=model.runtime,
               **{"mesh": model.mesh, "tokenizer": model.tokenizer, **kwargs})

  @property
  def decoded(self) -> loop.DecodeState:
    """The state of the served model's rows (its tokens, cursors and forwards)."""
    return self.state if self.drafter is None else self.state.target

  @property
  def extra_slots(self) -> int:
    """Cache slots a request takes past its prompt and completion: W - 1, or with a
    drafter K + max(W, the drafter's window) - 1."""
    if self.drafter is None:
      return self.max_window - 1
    return self.draft_window + max(self.max_window, self.drafter.window) - 1

  @property
  def active(self) -> int:
    return sum(r is not None for r in self.slots)

  @property
  def idle(self) -> bool:
    return not self.queue and not self.active and self._last is None

  def submit(self, prompt: Sequence[int], *, max_new_tokens: int, tau: float | None = None,
             metric: Metric | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop: str | Sequence[str] | None = None,
             stop_token_ids: Sequence[int] = (), window: int | str = "auto",
             mode: Mode | None = None, min_p: float = 0.0, ignore_eos: bool = False) -> int:
    """Queues a request; -> its id. tau, metric, mode default to the server's; window:
    "auto" (the round's W) or a fixed W in [1, max_window]; the sampling controls, stop
    strings and stop ids are as `sampling.generate`'s; min_p: the min-p cut (0: off);
    ignore_eos: only the budget, stop strings and stop ids end it. Raises ValueError on a request
    the server cannot serve, before queueing it."""
    if not prompt or max_new_tokens < 1:
      raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1.")
    batching.check_prompt_ids(self.config, [prompt])
    if self.drafter is not None:
      if mode == "gated" or window not in ("auto", self.max_window):
        raise ValueError("this server decodes with a drafter: every request gets the "
                         "model's AR tokens (mode 'lossless') at the server's window "
                         f"({self.max_window}); leave mode and window unset.")
      batching.check_prompt_ids(self.drafter.config, [prompt])
    extra = self.extra_slots
    need = len(prompt) + max_new_tokens + extra
    if need > self.max_len:
      raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + "
                       f"{extra} (the window's or drafts' slots) = {need} exceeds the "
                       f"server's max_len={self.max_len}.")
    if window != "auto" and not (isinstance(window, (int, np.integer))
                                 and 1 <= window <= self.max_window):
      raise ValueError(f"window={window!r}; expected 'auto' or an int in [1, "
                       f"{self.max_window}] (the server's max_window).")
    mode = self.mode if mode is None else mode
    choices.check(Mode, mode, "mode")
    vocab = self.config.vocab_size
    if not 0 <= top_k <= vocab:
      raise ValueError(f"top_k={top_k}; expected an int in [0, {vocab}] (the vocabulary; "
                       "0: off).")
    outside = [t for t in stop_token_ids if not 0 <= t < vocab]
    if outside:
      raise ValueError(f"stop_token_ids {outside[:4]} are outside the vocabulary [0, "
                       f"{vocab}).")
    controls = dict(tau=float(self.tau if tau is None else tau),
                    metric=self.metric if metric is None else metric,
                    temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                    seed=int(seed), stop_token_ids=[int(t) for t in stop_token_ids],
                    window=0 if window == "auto" else int(window),
                    lossless=mode == "lossless", min_p=float(min_p),
                    ignore_eos=bool(ignore_eos))
    batching.controls(1, 1, stop_width=self.max_stop_ids, **controls)  # raises on bad ones
    stop_strings = stops.check_stops(stop, 1)[0]
    if stop_strings and self.tokenizer is None:
      raise ValueError("stop strings need a server with a tokenizer (Server(..., "
                       "tokenizer=...)).")
    request = Request(self._next_id, tuple(int(t) for t in prompt), int(max_new_tokens),
                      controls, stop_strings)
    self.queue.append(request)
    self._requests[request.request_id] = request
    self._next_id += 1
    return request.request_id

  def cancel(self, request_id: int) -> bool:
    """Drops a queued request, or ends a running one at the next `step` (no `Completion`
    either way); -> whether the request was queued or running."""
    if request_id not in self._requests:
      return False
    queued = [r for r in self.queue if r.request_id == request_id]
    if queued:
      self.queue.remove(queued[0])
      self._forget(request_id)
    else:
      self._cancelled.add(request_id)
    return True

  def _forget(self, request_id: int) -> None:
    del self._requests[request_id]
    self._streams.pop(request_id, None)

  def _drop_cancelled(self) -> None:
    """Ends the running requests `cancel` was called on and frees their rows."""
    rows = np.asarray([r in self._cancelled for r in self.slots])
    self._cancelled.clear()
    if not rows.any():
      return
    self._stop(rows, np.zeros(rows.shape, np.int32))
    for row in np.flatnonzero(rows):
      self._forget(self.slots[row])
      self.slots[row] = None

  def _resize(self) -> None:
    """Moves the active rows to the bucket the load asks for (see the module doc), one
    bucket at a time: the first move packs the active rows at the front."""
    want = min(max(decode_mesh.batch_rows(self.active + len(self.queue), self.mesh),
                   self.min_batch), self.max_batch)
    want = min(b for b in self.buckets if b >= want)
    if want == len(self.slots):
      return
    keep = [i for i, r in enumerate(self.slots) if r is not None]
    at = self.buckets.index(len(self.slots))
    for b in (self.buckets[at + 1:self.buckets.index(want) + 1] if want > len(self.slots)
              else self.buckets[self.buckets.index(want):at][::-1]):
      rows = np.full((b,), len(self.slots), np.int32)
      rows[:len(keep)] = keep
      self.state = self._regroup(self.state, rows)
      self.slots = [self.slots[i] for i in keep] + [None] * (b - len(keep))
      self.scan = self.scan.take(keep + [None] * (b - len(keep)))
      keep = list(range(len(keep)))

  def _regroup(self, state, rows: np.ndarray):
    return (speculative.regroup(state, rows) if self.drafter is not None
            else self.call(loop.regroup, state, rows, mesh=self.mesh))

  def _insert(self, state, rows: np.ndarray, new: batching.Bucket):
    if self.drafter is not None:
      return speculative.insert(state, rows, new.prompt, new.prompt_len, new.max_new_tokens,
                                new.controls)
    return self.call(loop.insert, state, rows, new.prompt, new.prompt_len, new.max_new_tokens,
                       new.controls, mesh=self.mesh)

  def _refill(self) -> tuple[int, int]:
    """Starts queued requests in free rows; -> (prefill width, prefill steps), (0, 0)
    when none started."""
    free = [i for i, r in enumerate(self.slots) if r is None][:len(self.queue)]
    if not free:
      return 0, 0
    started = [self.queue.popleft() for _ in free]
    b = len(self.slots)
    controls = {k: [r.controls[k] for r in started] for k in started[0].controls}
    longest = max(len(r.prompt) for r in started)
    new = batching.bucket([r.prompt for r in started], b,
                          width=None if self.drafter is not None else self._insert_width(longest),
                          max_new_tokens=[r.max_new_tokens for r in started],
                          stop_width=self.max_stop_ids, **controls)
    rows = np.full((b,), b, np.int32)  # entry k: the row request k starts in (b: none)
    rows[:len(free)] = free
    for row, r in zip(free, started):
      self.slots[row] = r.request_id
      self.scan.reset(row, r.stop)
      self._streams[r.request_id] = Stream()
    self.state = self._insert(self.state, rows, new)
    if self.drafter is not None:
      return new.prompt.shape[1], 1
    width = self._prefill_width(longest)
    return width, math.ceil(longest / width)

  def _insert_width(self, longest: int) -> int:
    return min(w for w in self.prompt_widths if w >= longest)

  def _prefill_width(self, longest: int) -> int:
    """The prefill step's width for new prompts of up to `longest` tokens: every row
    runs it, so no wider than they need (a power of two), at most prefill_chunk."""
    return min(batching.pow2(longest, batching.MIN_PROMPT_BUCKET), self.prefill_chunk,
               self._insert_width(longest))

  def _kernel_mode(self, live: Sequence[dict]) -> Mode:
    """The kernel of a round: lossless on a lossless server (it gates gated rows too),
    else lossless only when some live request is."""
    return ("lossless" if self.mode == "lossless" or any(c["lossless"] for c in live)
            else "gated")

  def step(self) -> list[Update]:
    """One round: cancel, resize, refill, decode, harvest, stop, stream (module doc);
    with `overlap`, the round it dispatched may be read at the next step (module doc)."""
    self._drop_cancelled()
    early = []
    if self._last is not None and self.queue:   # requests wait: free its rows first
      early, self._last = self._harvest(self._last), None
    self._resize()
    width, prefill_steps = self._refill()
    if self.drafter is not None:
      if not self.active:
        return []
      before = self._lengths()
      self._spec_step(width)
      got = self.call(loop.harvest, self.decoded, before, width=self.harvest_width)
      return self._harvest(Round(got, before, tuple(self.slots), self.window))
    last, self._last = self._last, None
    new = self._dispatch(width, prefill_steps) if self.active else None
    updates = [] if last is None else self._harvest(last)
    if new is not None and self.overlap and not self.queue:
      self._last = new    # read at the next step, while the device runs the next round
    elif new is not None:
      updates += self._harvest(new)
    return early + updates

  def _dispatch(self, width: int, prefill_steps: int) -> "Round":
    """Dispatches a round and its harvest, waiting for neither."""
    since = self.call(loop.copy_lengths, self.state.length)
    live = [self._requests[r].controls for r in self.slots if r is not None]
    fixed = max(c["window"] for c in live)  # the largest window a live request fixed
    floor = min(w for w in (*self.policy.windows, self.max_window) if w >= fixed)
    self.state, self.window = rounds.dispatch(
        self.config, self.params, self.state, self.policy, active=self.active,
        eos_ids=self.eos_ids, mask_token_id=self.mask_token_id, mode=self._kernel_mode(live),
        measure=self.measure, real_slots=width, wide_steps=prefill_steps,
        wide_window=self.max_window, stop_on_finish=bool(self.queue), min_window=floor,
        runtime=self.runtime, steps=self.admit_steps if self.active < len(self.slots) else None,
        mesh=self.mesh, call=self.call)
    got = self.call(loop.harvest, self.state, since, width=self.harvest_width)
    return Round(got, since, tuple(self.slots), self.window)

  def _lengths(self) -> np.ndarray:
    """Each row's committed length as the host knows it (int32[b]; 0 on free rows)."""
    out = np.zeros((len(self.slots),), np.int32)
    for row, rid in enumerate(self.slots):
      if rid is not None:
        out[row] = len(self._requests[rid].prompt) + len(self._streams[rid].tokens)
    return out

  def _stop(self, rows: np.ndarray, keep: np.ndarray) -> None:
    self.state = (speculative.stop(self.state, rows, keep) if self.drafter is not None
                  else self.call(loop.stop, self.state, rows, keep, mesh=self.mesh))

  def _spec_step(self, wide: int) -> None:
    """A round of two-model decoding: `round_steps` rounds (the first one `wide` when new
    prompts wait for their prefill)."""
    self.state = speculative.run_rounds(
        *self.models, self.params, self.drafter.params, self.state, self.eos_ids,
        np.int32(self.mask_token_id), np.int32(self.drafter.mask_token_id),
        np.int32(self.policy.round_steps), np.bool_(bool(self.queue)),
        shape=speculative.Shape(self.draft_window, self.max_window, self.drafter.window),
        wide=wide)
    self.window = self.max_window

  def _row_window(self, request: Request, auto: int) -> int:
    """The W a row of `request` ran at in a round at W = auto (its own window caps it)."""
    return min(request.controls["window"] or auto, auto)

  def _harvest(self, last: "Round") -> list[Update]:
    """Reads a round's new tokens (one copy), cuts rows at their stop strings, tells the
    policy what the round accepted, and streams -> the updates. The round's rows are
    those of its dispatch: a request that ended since (finished, cut, cancelled) is
    skipped, and the others are found where they are now."""
    if self.drafter is not None:
      got, since, drafted = jax.device_get((last.got, last.since, self.state.drafter.forwards))
    else:
      (got, since), drafted = jax.device_get((last.got, last.since)), None
    self.steps = int(got.steps)
    live = np.asarray([r is not None for r in last.slots])
    if np.any(live & (got.length - since > self.harvest_width)):
      raise RuntimeError(f"a row committed more than {self.harvest_width} tokens in one round; "
                         "the harvest would drop some.")
    now = {rid: row for row, rid in enumerate(self.slots) if rid is not None}
    cut = np.zeros((len(self.slots),), bool)
    keep = np.zeros((len(self.slots),), np.int32)
    updates, tokens_seen, forwards_seen = [], 0, 0
    for row, rid in enumerate(last.slots):
      if rid not in now:
        continue
      here, stream = now[rid], self._streams[rid]
      new = got.tokens[row, :got.length[row] - since[row]].tolist()
      if self.drafter is None:   # tokens a step committed share its forward count
        window = self._row_window(self._requests[rid], last.window)
        for committed in np.unique(got.born[row, :len(new)], return_counts=True)[1]:
          self.spec.count(window, int(committed))
      forwards, done = int(got.forwards[row]), bool(got.done[row])
      k = self.scan.push(here, new)
      if k is not None:  # a stop string: keep k tokens, count forwards up to the k-th
        new = new[:k - len(stream.tokens)]
        forwards, done, cut[here] = int(got.born[row, len(new) - 1]), True, True
        keep[here] = k - self._requests[rid].resumed   # the device's tokens of this row
      tokens_seen += len(new)
      forwards_seen += forwards - stream.forwards
      stream.tokens += new
      stream.forwards = forwards
      controls = self._requests[rid].controls
      reason = (batching.finish_reason(stream.tokens,
                                       [-1] if controls["ignore_eos"] else self.eos_ids,
                                       controls["stop_token_ids"] or [-1],
                                       stopped=self.scan.stopped[here]) if done else None)
      updates.append(Update(rid, new, len(stream.tokens), forwards, done, reason))
      if done:
        self._finish(here, rid, reason, 0 if drafted is None else int(drafted[row]))
    if cut.any():
      self._stop(cut, keep)
    self.policy.observe(last.window, tokens_seen, forwards_seen)
    return updates

  def _finish(self, row: int, rid: int, reason: str, drafted: int) -> None:
    request, stream = self._requests[rid], self._streams[rid]
    text = None if self.tokenizer is None else stops.text(
        self.tokenizer, stream.tokens, request.stop, reason=reason,
        stopped=self.scan.stopped[row])
    self.completed[rid] = Completion(rid, stream.tokens, stream.forwards, reason, text,
                                     drafted)
    self._forget(rid)
    self._cancelled.discard(rid)
    self.slots[row] = None

  def warmup(self, prompt_len: int | None = None) -> None:
    """Compiles every variant `step` can meet with prompts of up to `prompt_len` tokens
    (default: max_len - 1): each batch bucket's insert of every prompt bucket, its
    prefill and decoding steps at every window, harvest, stop and the moves to the next
    bucket up and down; a `WindowPolicy` also times each bucket's windows. The server's
    state and requests are left as they were."""
    if self.drafter is not None or self.mesh is not None:
      raise ValueError("warmup covers one-device serving without a drafter.")
    prompt_len = min(prompt_len or self.max_len - 1, self.max_len - 1)
    widths = [w for w in self.prompt_widths
              if w < prompt_len or w == min(v for v in self.prompt_widths if v >= prompt_len)]
    windows = sorted({*self.policy.windows, self.max_window})
    modes = ["lossless"] if self.mode == "lossless" else ["gated", "lossless"]
    for b in self.buckets:
      if isinstance(self.policy, WindowPolicy):
        self.policy.calibrate(b, self.max_len, self.measure)
      state = self._new_state(b)
      for p in widths:
        new = batching.bucket([[0] * p], b, max_new_tokens=1, width=p,
                              stop_width=self.max_stop_ids)
        state = self._insert(state, np.full((b,), b, np.int32), new)
      for mode in modes:
        run = functools.partial(self.call, loop.run_steps, self.config, self.params,
                                eos_ids=self.eos_ids, mask_token_id=np.int32(self.mask_token_id),
                                mode=mode, runtime=self.runtime, mesh=self.mesh)
        for w in windows:
          state = run(state=state, max_steps=np.int32(1), stop_on_finish=np.bool_(False),
                      real_slots=w, window=w)
        prefill = {self._prefill_width(p) for p in range(1, prompt_len + 1)}
        for width in prefill - {self.max_window}:
          state = run(state=state, max_steps=np.int32(1), stop_on_finish=np.bool_(False),
                      real_slots=width, window=self.max_window)
      got = self.call(loop.harvest, state, self.call(loop.copy_lengths, state.length),
                      width=self.harvest_width)
      state = self.call(loop.stop, state, np.zeros((b,), bool), np.zeros((b,), np.int32),
                        mesh=self.mesh)
      at = self.buckets.index(b)
      for other in self.buckets[max(at - 1, 0):at] + self.buckets[at + 1:at + 2]:
        jax.block_until_ready(self._regroup(state, np.arange(other, dtype=np.int32)))
      jax.block_until_ready((got, state))

  def stream(self) -> Iterator[Update]:
    """Steps until every submitted request is done, yielding the updates."""
    while not self.idle:
      yield from self.step()

  def run(self) -> dict[int, Completion]:
    """Serves everything submitted; -> the completions by request id."""
    for _ in self.stream():
      pass
    return self.completed
