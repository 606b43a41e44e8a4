"""Continuous batching over the ragged, paged engine (`mars_jax.decoding.ragged`).

  server = Server(config, params, mask_token_id=m, eos_token_ids=eos, batch_size=64,
                  max_len=4096, window=WindowPolicy(), mode="lossless")
  rid = server.submit(prompt_ids, max_new_tokens=64, tau=0.9, window=3)
  for update in server.stream():
    print(update.request_id, update.tokens, update.done)

The requests, their checks, updates and completions are `DenseServer`'s (`submit`,
`cancel`, `stream`, `run`); what differs is the shape of a step, as in vLLM V1:

  rows      up to batch_size (vLLM's --max-num-seqs) requests run at once, each in a row
            of the state; no batch buckets and no regrouping;
  KV        pages of a pool (`page_size` slots), `num_pages` in all; a row holds the
            pages it has written and those its round may write, allocated as it grows
            (`mars_jax.decoding.pages.PagePool`), freed when it ends however it ends;
  prefix    full pages of committed tokens are keyed by the hash of everything before
            them and reused by a later request with the same prefix (a system prompt,
            the next turn of a chat): its prefill starts after them;
  steps     one flat batch of at most max_num_batched_tokens tokens a forward: a
            decoding row adds its 2W - 1 slots (W its own: a fixed window, or the
            policy's for "auto"), and new prompts add chunks in the same forward, which
            runs one step; a round with no prompt to prefill runs round_steps steps on
            the device, ending early when a row finishes and requests wait (a request
            that arrives meanwhile starts at the next round);
  window    "auto" rows run at the W with the best expected rate: the policy's
            acceptance over the measured cost of the real step (its flat width at each W,
            `WindowPolicy` keyed by that width), W = 1 always a candidate;
  harvest   as `DenseServer`'s: one copy of each row's new tokens a round, overlapped
            with the next round when no request waits.

A row that cannot get the pages its round needs is preempted, vLLM's way: its pages are
freed and its request goes back to the front of the queue with the tokens it has
committed appended to its prompt (its stream is kept), so it resumes where it was.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import jax
import numpy as np

from mars_jax.core.choices import Metric, Mode
from mars_jax.decoding import (batching, loop, pages as pages_lib, programs as programs_lib,
                               ragged, stops)
from mars_jax.decoding.window_policy import FixedWindow, WindowPolicy
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.serve.dense import DenseServer
from mars_jax.serve.shapes import call_shape, default_batched_tokens
from mars_jax.serve.requests import Request, Round, Stream, Update

MIN_WIDTH = 1             # the narrowest flat batch
DEFAULT_PAGE_SIZE = 16


@dataclasses.dataclass
class Row:
  """A running request's row: its pages (in order), its prompt tokens whose K/V are
  written by the calls dispatched so far (advanced when a chunk is planned), its
  request."""
  request: Request
  pages: list[int]
  prefilled: int


class Server(DenseServer):
  """Continuous batching on the ragged, paged engine (module doc); a drafter or a mesh
  is served by `DenseServer` (this class hands it over).

  Arguments as `DenseServer`'s (batch_size: vLLM's max_num_seqs), and:
  max_num_batched_tokens: the flat batch's tokens at most (`default_batched_tokens`);
  prefill_chunk: the prompt tokens a row prefills in one step at most (a longer prompt,
  or one the budget has no room for, takes several); page_size; num_pages: the pool (default: batch_size rows of max_len,
  plus the trash page); prefix_caching. min_batch_size and admit_steps are the dense
  server's (batch buckets, short rounds while a row is free): accepted and unused."""

  def __new__(cls, config: Qwen2Config, params, **kwargs):
    if kwargs.get("drafter") is not None or kwargs.get("mesh") is not None:
      return DenseServer(config, params, **kwargs)
    return super().__new__(cls)

  def __init__(self, config: Qwen2Config, params, *, mask_token_id: int,
               eos_token_ids: int | Sequence[int], batch_size: int = 8,
               min_batch_size: int | None = None, max_len: int = 512,
               window: int | WindowPolicy | FixedWindow = 1, mode: Mode = "gated",
               tau: float = 1.0, metric: Metric = "probability", prefill_chunk: int = 64,
               round_steps: int = 8, admit_steps: int = 2,
               runtime: Runtime = DEFAULT_RUNTIME, mesh=None, tokenizer=None,
               max_stop_ids: int = loop.STOP_BUCKET, max_window: int | None = None,
               drafter=None, draft_window: int = 4,
               programs: programs_lib.Programs | None = None, overlap: bool = True,
               max_num_batched_tokens: int | None = None,
               page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
               prefix_caching: bool = True):
    self.page_size = page_size
    self.num_pages = num_pages or batch_size * math.ceil(max_len / page_size) + 1
    self.prefix_caching = prefix_caching
    super().__init__(config, params, mask_token_id=mask_token_id,
                     eos_token_ids=eos_token_ids, batch_size=batch_size,
                     min_batch_size=batch_size, max_len=max_len, window=window, mode=mode,
                     tau=tau, metric=metric, prefill_chunk=prefill_chunk,
                     round_steps=round_steps, admit_steps=admit_steps, runtime=runtime,
                     tokenizer=tokenizer, max_stop_ids=max_stop_ids, max_window=max_window,
                     programs=programs, overlap=overlap)
    self.windows = sorted({*self.policy.windows, self.max_window})
    self.largest = self.windows[-1]   # the largest W a row runs at (auto or fixed)
    self.max_tokens = max_num_batched_tokens or default_batched_tokens(
        batch_size, self.largest, prefill_chunk)
    if self.max_tokens < prefill_chunk + self.largest - 1:
      raise ValueError(f"max_num_batched_tokens={self.max_tokens} cannot hold one prompt "
                       f"chunk: prefill_chunk {prefill_chunk} + the {self.largest - 1} "
                       f"MASK slots of the largest window ({self.largest}); raise it or "
                       "lower prefill_chunk.")
    if self.num_pages < 2 + math.ceil((2 * self.largest - 1) / page_size):
      raise ValueError(f"num_pages={self.num_pages} cannot hold one row; raise it.")
    self.widths = [w for w in (MIN_WIDTH << i for i in range(32)) if w < self.max_tokens]
    self.widths.append(self.max_tokens)
    # each round's steps commit at most W tokens a row; its one prefill step a chunk
    self.harvest_width = min(max_len, (self.policy.round_steps + 1) * self.largest)
    self.preemptions = 0      # rows preempted (their requests resumed later)
    self.forward_tokens = 0   # flat tokens dispatched (padding excluded; a call that ends
                              # early counts its steps all the same), for the metrics

  # ---- state ----------------------------------------------------------------------

  def _new_state(self, rows: int):
    return ragged.new_state(self.config, rows, self.max_len, self.num_pages, self.page_size,
                            runtime=self.runtime, stop_ids=self.max_stop_ids)

  def reset(self) -> list[int]:
    """A fresh state and an empty pool (every page free, the prefix cache emptied: what a
    failed round left on the device is never read again); the running requests are
    dropped (no `Completion`), the queue kept; -> the ids dropped."""
    rows = getattr(self, "rows", None) or {}
    dropped = [r.request.request_id for r in rows.values()]
    for rid in dropped:
      self._forget(rid)
    if not hasattr(self, "pool"):
      self.pool = pages_lib.PagePool(self.num_pages, self.page_size,
                                     prefix_caching=self.prefix_caching)
    self.pool.reset()
    self.state = self._new_state(self.max_batch)
    self._last: Round | None = None
    self.slots: list[int | None] = [None] * self.max_batch
    self.rows: dict[int, Row] = {}
    self.scan = stops.StopScan(self.tokenizer, [()] * self.max_batch)
    self._cancelled: set[int] = set()
    self._table: dict[tuple[int, int], int] = {}   # page-table entries to send
    queued = {r.request_id for r in self.queue}
    # preempted requests waiting in the queue: their streams and stop scans
    self._resumed: dict[int, tuple[Stream, tuple]] = {
        rid: v for rid, v in getattr(self, "_resumed", {}).items() if rid in queued}
    return dropped

  # ---- pages ----------------------------------------------------------------------

  def _ensure(self, row: int, upto: int) -> None:
    """Gives `row` the pages for positions [0, upto) (OutOfPages when the pool cannot)."""
    r = self.rows[row]
    want = math.ceil(min(upto, self.max_len) / self.page_size)
    if want > len(r.pages):
      new = self.pool.allocate(want - len(r.pages))
      self._table.update(((row, len(r.pages) + i), p) for i, p in enumerate(new))
      r.pages += new

  def _release(self, row: int) -> None:
    r = self.rows.pop(row)
    self._table.update(((row, i), 0) for i in range(len(r.pages)))
    self.pool.release(r.pages)

  def _send_table(self) -> None:
    """Writes the page-table entries set since the last call, each (row, column) once
    (its latest page: a row freed and taken again in one round), TABLE_CHUNK a call."""
    entries, self._table = list(self._table.items()), {}
    for at in range(0, len(entries), ragged.TABLE_CHUNK):
      chunk = entries[at:at + ragged.TABLE_CHUNK]
      rows = np.full((ragged.TABLE_CHUNK,), self.max_batch, np.int32)
      cols = np.zeros((ragged.TABLE_CHUNK,), np.int32)
      pages = np.zeros((ragged.TABLE_CHUNK,), np.int32)
      rows[:len(chunk)] = [r for (r, _), _ in chunk]
      cols[:len(chunk)] = [c for (_, c), _ in chunk]
      pages[:len(chunk)] = [p for _, p in chunk]
      self.state = self.call(ragged.set_pages, self.state, rows, cols, pages)

  def _register(self, row: int) -> None:
    """Registers the row's full pages whose K/V are final: below its prefill count, or
    below its length less a window (the pending tokens' K/V are written next step)."""
    r = self.rows[row]
    stream = self._streams[r.request.request_id]
    tokens = list(r.request.prompt) + stream.tokens[r.request.resumed:]
    final = (r.prefilled if r.prefilled < len(r.request.prompt)
             else len(tokens) - self.largest)
    if final >= self.page_size:
      self.pool.register(r.pages, tokens[:final])

  # ---- requests ---------------------------------------------------------------------

  def _row_window(self, request: Request, auto: int) -> int:
    return request.controls["window"] or auto

  def _admit(self) -> list[int]:
    """Starts queued requests in free rows while the pool can hold their prompts; ->
    the rows started."""
    free = [i for i, r in enumerate(self.slots) if r is None]
    started: list[tuple[int, Request, int]] = []
    while free and self.queue:
      request = self.queue[0]
      prompt = request.prompt
      hit = self.pool.match(prompt, len(prompt) - 1)
      try:
        rest = self.pool.allocate(
            math.ceil(self._prefill_need(request) / self.page_size) - len(hit))
      except pages_lib.OutOfPages:
        self.pool.release(hit)
        break
      self.queue.popleft()
      row = free.pop(0)
      self.rows[row] = Row(request, hit + rest, len(hit) * self.page_size)
      self._table.update(((row, i), p) for i, p in enumerate(hit + rest))
      started.append((row, request, len(hit) * self.page_size))
    if not started:
      return []
    b = self.max_batch
    controls = {k: [r.controls[k] for _, r, _ in started] for k in started[0][1].controls}
    new = batching.bucket([r.prompt for _, r, _ in started], b,
                          width=self._insert_width(max(len(r.prompt) for _, r, _ in started)),
                          max_new_tokens=[r.max_new_tokens for _, r, _ in started],
                          stop_width=self.max_stop_ids, **controls)
    rows = np.full((b,), b, np.int32)
    start = np.zeros((b,), np.int32)
    forwards = np.zeros((b,), np.int32)
    for k, (row, request, hit) in enumerate(started):
      rows[k], start[k] = row, hit
      self.slots[row] = request.request_id
      self.scan.reset(row, request.stop)
      stream = Stream()
      if request.request_id in self._resumed:   # a preempted request goes on
        stream, scan = self._resumed.pop(request.request_id)
        self.scan.restore(row, scan)
      self._streams[request.request_id] = stream
      forwards[k] = stream.forwards
    self.state = self.call(loop.insert, self.state, rows, new.prompt, new.prompt_len,
                           new.max_new_tokens, new.controls, start, forwards)
    return [row for row, _, _ in started]

  def submit(self, prompt: Sequence[int], *, max_new_tokens: int, **kwargs) -> int:
    """`DenseServer.submit`; also refuses a request that the whole pool cannot hold."""
    room = (self.pool.num_pages - self.pool.reserved) * self.page_size
    need = len(prompt) + max_new_tokens + 2 * self.largest
    if need > room:
      raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + "
                       f"{2 * self.largest} (the window's slots) = {need} tokens; the KV "
                       f"pool holds {room} ({self.pool.num_pages - self.pool.reserved} pages "
                       f"of {self.page_size}): lower max_tokens.")
    return super().submit(prompt, max_new_tokens=max_new_tokens, **kwargs)

  def _preempt(self, row: int) -> None:
    """Frees a row and puts its request back at the front of the queue, its committed
    tokens appended to its prompt (module doc)."""
    r = self.rows[row]
    rid, old = r.request.request_id, r.request
    stream = self._streams.pop(rid)
    self._release(row)
    self.slots[row] = None
    base = old.prompt[:len(old.prompt) - old.resumed]
    request = dataclasses.replace(
        old, prompt=base + tuple(stream.tokens),
        max_new_tokens=old.max_new_tokens + old.resumed - len(stream.tokens),
        resumed=len(stream.tokens))
    self._requests[rid] = request
    self._resumed[rid] = (stream, self.scan.snapshot(row))
    self.queue.appendleft(request)
    self.preemptions += 1

  def _finish(self, row: int, rid: int, reason: str, drafted: int) -> None:
    self._register(row)
    self._release(row)
    super()._finish(row, rid, reason, drafted)

  def _forget(self, request_id: int) -> None:
    super()._forget(request_id)
    self._resumed.pop(request_id, None)

  def _drop_cancelled(self) -> None:
    rows = [i for i, r in enumerate(self.slots) if r in self._cancelled]
    self._cancelled.clear()
    if not rows:
      return
    cut = np.zeros((self.max_batch,), bool)
    cut[rows] = True
    self._stop(cut, np.zeros((self.max_batch,), np.int32))
    for row in rows:
      self._forget(self.slots[row])
      self._release(row)
      self.slots[row] = None

  # ---- a round --------------------------------------------------------------------

  def _choose(self, decoding: list[int]) -> int:
    """The W of the "auto" rows: the best expected tokens per second over the measured
    cost of the step's flat width at each W (W = 1 always a candidate)."""
    if isinstance(self.policy, FixedWindow):
      return self.policy.windows[0]
    auto = [r for r in decoding if not self.rows[r].request.controls["window"]]
    fixed = sum(2 * self.rows[r].request.controls["window"] - 1 for r in decoding
                if self.rows[r].request.controls["window"])
    if not auto:
      return 1
    best, best_rate = 1, None
    for w in self.policy.windows:
      call_w = self._call_window(max([w] + [self.rows[r].request.controls["window"]
                                            for r in decoding]))
      fit = self._fit(fixed + len(auto) * (2 * w - 1), len(decoding), call_w, ("decode",))
      if fit is None:
        continue
      width = fit[0]
      seconds = self._cost(width, call_w)
      rate = len(auto) * self.policy.stats.tokens_per_forward(w) / seconds
      if best_rate is None or rate > best_rate:
        best, best_rate = w, rate
    self.policy.choices.append((len(decoding), len(auto), best))
    return best

  def _cost(self, width: int, window: int) -> float:
    seconds = self.policy.costs.seconds.get((width, self.max_len, window))
    if seconds is None:
      seconds = self._measure(width, window)
      self.policy.costs.put(width, self.max_len, window, seconds)
    return seconds

  def _call_window(self, largest: int) -> int:
    return min(w for w in self.windows if w >= largest)

  def _layout(self, spans: list[tuple[int, int, int]], window: int,
              prefill: bool = False) -> ragged.Layout:
    """The call's layout at the narrowest width (and fewest rows) that holds its spans."""
    tokens = sum(rs + w - 1 for _, rs, w in spans)
    fit = self._fit(tokens, len(spans), window, ("few", "many") if prefill else ("decode",))
    if fit is None:
      raise ValueError(f"{len(spans)} rows of {tokens} slots exceed the widest call.")
    width, kind = fit
    return ragged.layout(self.max_batch, spans, width,
                         *call_shape(self.max_batch, width, window, kind))

  def _fit(self, tokens: int, rows: int, window: int, kinds: tuple[str, ...]
           ) -> tuple[int, str] | None:
    """The narrowest (width, kind) of `kinds` whose call holds `tokens` slots of `rows`
    rows (None: none)."""
    return next(((w, k) for w in self.widths for k in kinds if w >= tokens
                 and call_shape(self.max_batch, w, window, k)[0] >= rows), None)

  def _run(self, layout: ragged.Layout, window: int, auto: int, steps: int, mode: Mode,
           stop_on_finish: bool, eos_ids: np.ndarray | None = None) -> None:
    self.state = self.call(ragged.run_steps, self.config, self.params, self.state, layout,
                           self.eos_ids if eos_ids is None else eos_ids,
                           np.int32(self.mask_token_id), np.int32(auto),
                           np.int32(steps), np.bool_(stop_on_finish), window=window,
                           mode=mode, runtime=self.runtime)

  def _plan(self) -> tuple[list, list, int]:
    """The round's spans: (prefill call spans, decoding spans, auto W); rows that cannot
    get their pages are preempted first."""
    decoding = [row for row, r in self.rows.items()
                if r.prefilled >= len(r.request.prompt)]
    prefilling = [row for row in self.rows if row not in decoding]
    auto = self._choose(decoding)
    steps = self.policy.round_steps
    in_flight = steps * self.largest if self._last is not None else 0
    for row in sorted(self.rows, key=lambda x: self.rows[x].request.request_id):
      r = self.rows[row]
      w = self._row_window(r.request, auto)
      if row in decoding:
        stream = self._streams[r.request.request_id]
        known = len(r.request.prompt) + len(stream.tokens) - r.request.resumed
        upto = min(known + in_flight + steps * w + 2 * w,
                   len(r.request.prompt) + r.request.max_new_tokens + 2 * w)
      else:
        upto = self._prefill_need(r.request)
      try:
        self._ensure(row, upto)
      except pages_lib.OutOfPages:
        if self._last is not None:
          return [], [], auto     # read the round in flight, then preempt with what it says
        self._preempt(max(self.rows, key=lambda x: self.rows[x].request.request_id))
        return self._plan()
    spans_b = []
    for row in decoding:   # as many as the widest decoding call holds
      w = self._row_window(self.rows[row].request, auto)
      if self._holds(spans_b + [(row, w, w)], False):
        spans_b.append((row, w, w))
    if not prefilling:
      return [], spans_b, auto
    spans_a, budget = list(spans_b), self.max_tokens - sum(2 * w - 1 for _, _, w in spans_b)
    for row in prefilling:
      r = self.rows[row]
      w = self._row_window(r.request, auto)
      chunk = min(len(r.request.prompt) - r.prefilled, budget - (w - 1), self.prefill_chunk)
      if chunk < 1:
        continue
      spans_a.append((row, chunk, w))
      budget -= chunk + w - 1
      r.prefilled += chunk
      if (r.prefilled >= len(r.request.prompt)
          and self._holds(spans_b + [(row, w, w)], False)):
        spans_b.append((row, w, w))
    return spans_a, spans_b, auto

  def _holds(self, spans: list[tuple[int, int, int]], prefill: bool) -> bool:
    """Whether one call holds these spans (its slots and rows)."""
    window = self._call_window(max(w for _, _, w in spans))
    return self._fit(sum(rs + w - 1 for _, rs, w in spans), len(spans), window,
                     ("few", "many") if prefill else ("decode",)) is not None

  def _prefill_need(self, request: Request) -> int:
    """The positions a prefilling row may write by the end of its round: its prompt,
    then a round of decoding steps at the largest W (at most its budget)."""
    steps = self.policy.round_steps
    return min(len(request.prompt) + (steps + 2) * self.largest,
               len(request.prompt) + request.max_new_tokens + 2 * self.largest, self.max_len)

  def step(self) -> list[Update]:
    """One round: cancel, admit, plan, dispatch, harvest (module doc); with `overlap`,
    the round it dispatched may be read at the next step."""
    self._drop_cancelled()
    early = []
    if self._last is not None and self.queue:   # requests wait: free its rows first
      early, self._last = self._harvest(self._last), None
    self._admit()
    spans_a, spans_b, auto = self._plan() if self.rows else ([], [], 1)
    last, self._last = self._last, None
    if not spans_a and not spans_b and last is not None:
      return early + self._harvest(last) + self.step()
    new = self._dispatch(spans_a, spans_b, auto) if spans_a or spans_b else None
    updates = [] if last is None else self._harvest(last)
    if new is not None and self.overlap and not self.queue:
      self._last = new
    elif new is not None:
      updates += self._harvest(new)
    return early + updates

  def _dispatch(self, spans_a: list, spans_b: list, auto: int) -> Round:
    self._send_table()
    since = self.call(loop.copy_lengths, self.state.length)
    live = [self.rows[row].request.controls for row, _, _ in spans_a + spans_b]
    mode = self._kernel_mode(live)
    steps = self.policy.round_steps
    self.window = auto
    if spans_a:
      self._run(self._layout(spans_a, self.largest, prefill=True), self.largest, auto,
                1, mode, False)
      self.forward_tokens += sum(rs + w - 1 for _, rs, w in spans_a)
      steps -= 1
    if spans_b and steps > 0:
      window = self._call_window(max(w for _, _, w in spans_b))
      self._run(self._layout(spans_b, window), window, auto, steps, mode, bool(self.queue))
      self.forward_tokens += steps * sum(rs + w - 1 for _, rs, w in spans_b)
    got = self.call(loop.harvest, self.state, since, width=self.harvest_width)
    return Round(got, since, tuple(self.slots), auto)

  def _harvest(self, last: Round) -> list[Update]:
    updates = super()._harvest(last)
    for row in self.rows:
      self._register(row)
    return updates

  # ---- warmup and costs -------------------------------------------------------------

  def _measure(self, width: int, window: int) -> float:
    """Seconds of a decoding step at flat width `width` and W = window, as a round runs
    it (a call of round_steps steps, best of 3, over its steps): as many rows as the call
    holds at 2W - 1 slots, each at a context of min(max_len / 2, 256), none ending (no
    end token), all reading the same pages. On the server's own state and pages taken
    from its pool while no request runs (stopped, cleared and given back after), else
    on a second state of the same shapes."""
    shape = call_shape(self.max_batch, width, window, "decode")
    each = window if 2 * window - 1 <= width else 1   # rows of a narrower window fit
    rows = min(shape[0], max(width // (2 * each - 1), 1))
    context = min(self.max_len // 2, 256)
    steps = self.policy.round_steps
    own = not self.rows
    pages = min(math.ceil((context + (steps + 2) * window) / self.page_size),
                self.pool.free if own else self.num_pages - 1)
    held = self.pool.allocate(pages) if own else list(range(1, pages + 1))
    new = batching.bucket([[0] * context] * rows, self.max_batch, max_new_tokens=1 << 20,
                          width=self._insert_width(context), stop_width=self.max_stop_ids,
                          lossless=self.mode == "lossless")
    no_end = np.full_like(self.eos_ids, -1)
    saved, table = self.state, self._table
    self.state = self.call(loop.insert, self.state if own else self._new_state(self.max_batch),
                           np.arange(self.max_batch, dtype=np.int32), new.prompt,
                           new.prompt_len, new.max_new_tokens, new.controls,
                           np.full((self.max_batch,), context - 1, np.int32),
                           np.zeros((self.max_batch,), np.int32))
    self._table = {(r, c): p for r in range(rows) for c, p in enumerate(held)}
    try:
      self._send_table()
      layout = ragged.layout(self.max_batch, [(r, each, each) for r in range(rows)],
                             width, *shape)
      best = float("inf")
      for _ in range(3):
        begin = time.perf_counter()
        self._run(layout, window, window, steps, self.mode, False, no_end)
        jax.block_until_ready(self.state.length)
        best = min(best, (time.perf_counter() - begin) / steps)
    finally:
      if own:
        b = self.max_batch
        self.state = self.call(loop.stop, self.state, np.ones((b,), bool),
                               np.zeros((b,), np.int32), mesh=None)
        self._table = {(r, c): 0 for r in range(rows) for c in range(len(held))}
        self._send_table()
        self.pool.release(held)
      else:
        self.state = saved
      self._table = table
    return best

  def variants(self) -> list[tuple[int, int, str]]:
    """(width, W, kind) of every call a round can make (`call_shape`): decoding calls at
    each W, from one row to max_num_seqs rows (or the token budget); prefill calls at
    max_window, few rows or many, from one short prompt beside one decoding row to the
    budget."""
    decoding = set()
    for w in self.windows:   # rows of any window <= w, so any width up to every row at w
      widest = self._fit(self.max_batch * (2 * w - 1), self.max_batch, w, ("decode",))
      limit = widest[0] if widest else self.widths[-1]
      decoding |= {(width, "decode", w) for width in self.widths if width <= limit}
    smallest = self._fit(self.largest, 1, self.largest, ("few", "many"))[0]  # a 1-token chunk
    prefill, shapes = set(), set()
    for width in self.widths:
      for kind in ("few", "many"):
        shape = call_shape(self.max_batch, width, self.largest, kind)
        if width >= smallest and (width, shape) not in shapes:
          shapes.add((width, shape))
          prefill.add((width, kind, self.largest))
    return sorted((width, w, kind) for width, kind, w in decoding | prefill)

  def warmup(self, prompt_len: int | None = None) -> None:
    """Compiles every variant `step` can meet with prompts of up to `prompt_len` tokens
    (default: max_len - 1): the inserts of every prompt width, the step at every flat
    width, window and kernel mode, the harvest, stop and page-table calls; a
    `WindowPolicy` also times the decoding step at each width and window. The server's
    state and requests are left as they were."""
    if self.rows or self.queue:
      raise ValueError("warmup runs on a server with no request.")
    prompt_len = min(prompt_len or self.max_len - 1, self.max_len - 1)
    b = self.max_batch
    for p in [w for w in self.prompt_widths
              if w < prompt_len or w == min(v for v in self.prompt_widths if v >= prompt_len)]:
      new = batching.bucket([[0] * p], b, max_new_tokens=1, width=p,
                            stop_width=self.max_stop_ids)
      self.state = self.call(loop.insert, self.state, np.full((b,), b, np.int32), new.prompt,
                             new.prompt_len, new.max_new_tokens, new.controls,
                             np.zeros((b,), np.int32), np.zeros((b,), np.int32))
    self._table.setdefault((b, 0), 0)   # an entry of no row: the call is compiled
    self._send_table()
    modes = ["lossless"] if self.mode == "lossless" else ["gated", "lossless"]
    for mode in modes:
      for width, window, kind in self.variants():
        layout = ragged.layout(b, [], width, *call_shape(b, width, window, kind))
        self._run(layout, window, window, 1, mode, False)
    got = self.call(loop.harvest, self.state, self.call(loop.copy_lengths, self.state.length),
                    width=self.harvest_width)
    self.state = self.call(loop.stop, self.state, np.ones((b,), bool), np.zeros((b,), np.int32),
                           mesh=None)   # as `_stop` calls it
    jax.block_until_ready((got, self.state))
    if isinstance(self.policy, WindowPolicy):   # the widths decoding rounds meet
      for width, window, kind in self.variants():
        if kind == "decode":
          self._cost(width, window)
