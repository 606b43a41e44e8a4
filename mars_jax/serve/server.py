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
            the device (admit_steps while a row is free), ending early when a row
            finishes and requests wait;
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
from mars_jax.decoding import batching, loop, pages as pages_lib, programs as programs_lib, ragged
from mars_jax.decoding.window_policy import FixedWindow, WindowPolicy
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime
from mars_jax.serve.dense import DenseServer
from mars_jax.serve.requests import Request, Round, Stream, Update

TILE = 8                  # query slots of a tile (`paged.Tiles`) in a call with W > 1
MIN_WIDTH = 16            # the narrowest flat batch
DEFAULT_PAGE_SIZE = 16


@dataclasses.dataclass
class Row:
  """A running request's row: its pages (in order), prompt tokens whose K/V are written
  (the host's count while it prefills), its request."""
  request: Request
  pages: list[int]
  prefilled: int


class Server(DenseServer):
  """Continuous batching on the ragged, paged engine (module doc); a drafter or a mesh
  is served by `DenseServer` (this class hands it over).

  Arguments as `DenseServer`'s, and: max_num_batched_tokens: the flat batch's tokens at
  most (default: max(2048, prefill_chunk, batch_size x (2 max_window - 1)) rounded up to a
  power of two); page_size; num_pages: the pool (default: batch_size rows of max_len,
  plus the trash page); prefix_caching. min_batch_size and admit_steps keep their
  meaning where they have one (admit_steps); min_batch_size is accepted and unused."""

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
    need = batch_size * (2 * self.max_window - 1)
    self.max_tokens = max_num_batched_tokens or batching.pow2(max(2048, prefill_chunk, need))
    if self.max_tokens < 2 * self.max_window - 1:
      raise ValueError(f"max_num_batched_tokens={self.max_tokens} is below one decoding "
                       f"row's {2 * self.max_window - 1} slots at the largest window "
                       f"({self.max_window}); raise it.")
    if self.num_pages < 2 + math.ceil((2 * self.max_window - 1) / page_size):
      raise ValueError(f"num_pages={self.num_pages} cannot hold one row; raise it.")
    self.widths = [w for w in (MIN_WIDTH << i for i in range(32)) if w < self.max_tokens]
    self.widths.append(self.max_tokens)
    # each round's steps commit at most W tokens a row; its one prefill step a chunk
    self.harvest_width = min(max_len, (self.policy.round_steps + 1) * self.max_window)
    self.measure = self._measure
    self.forward_tokens = 0   # flat tokens run (padding excluded), for the metrics

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
    self.scan = self._stop_scan(self.max_batch)
    self._cancelled: set[int] = set()
    self._table: list[tuple[int, int, int]] = []   # page-table entries to send
    self._resumed: dict[int, Stream] = {}          # preempted requests' streams
    return dropped

  def _stop_scan(self, rows: int):
    from mars_jax.decoding import stops
    return stops.StopScan(self.tokenizer, [()] * rows)

  @property
  def pool_use(self) -> float:
    """The share of the pool's pages that requests hold."""
    return self.pool.in_use / max(self.pool.num_pages - self.pool.reserved, 1)

  # ---- pages ----------------------------------------------------------------------

  def _ensure(self, row: int, upto: int) -> None:
    """Gives `row` the pages for positions [0, upto) (OutOfPages when the pool cannot)."""
    r = self.rows[row]
    want = math.ceil(min(upto, self.max_len) / self.page_size)
    if want > len(r.pages):
      new = self.pool.allocate(want - len(r.pages))
      self._table += [(row, len(r.pages) + i, p) for i, p in enumerate(new)]
      r.pages += new

  def _release(self, row: int) -> None:
    r = self.rows.pop(row)
    self._table += [(row, i, 0) for i in range(len(r.pages))]
    self.pool.release(r.pages)

  def _send_table(self) -> None:
    while self._table:
      chunk, self._table = self._table[:ragged.TABLE_CHUNK], self._table[ragged.TABLE_CHUNK:]
      rows = np.full((ragged.TABLE_CHUNK,), self.max_batch, np.int32)
      cols = np.zeros((ragged.TABLE_CHUNK,), np.int32)
      pages = np.zeros((ragged.TABLE_CHUNK,), np.int32)
      rows[:len(chunk)], cols[:len(chunk)], pages[:len(chunk)] = zip(*chunk)
      self.state = self.call(ragged.set_pages, self.state, rows, cols, pages)

  def _register(self, row: int) -> None:
    """Registers the row's full pages whose K/V are final: below its prefill count, or
    below its length less a window (the pending tokens' K/V are written next step)."""
    r = self.rows[row]
    stream = self._streams[r.request.request_id]
    tokens = list(r.request.prompt) + stream.tokens
    final = (r.prefilled if r.prefilled < len(r.request.prompt)
             else len(tokens) - self.max_window)
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
            math.ceil(min(len(prompt) + 2 * self.max_window, self.max_len) / self.page_size)
            - len(hit))
      except pages_lib.OutOfPages:
        self.pool.release(hit)
        break
      self.queue.popleft()
      row = free.pop(0)
      self.rows[row] = Row(request, hit + rest, len(hit) * self.page_size)
      self._table += [(row, i, p) for i, p in enumerate(hit + rest)]
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
    for k, (row, request, hit) in enumerate(started):
      rows[k], start[k] = row, hit
      self.slots[row] = request.request_id
      self.scan.reset(row, request.stop)
      self._streams[request.request_id] = self._resumed.pop(request.request_id, Stream())
    self.state = self.call(loop.insert, self.state, rows, new.prompt, new.prompt_len,
                           new.max_new_tokens, new.controls, start)
    return [row for row, _, _ in started]

  def _preempt(self, row: int) -> None:
    """Frees a row and puts its request back at the front of the queue, its committed
    tokens appended to its prompt (module doc)."""
    r = self.rows[row]
    rid = r.request.request_id
    stream = self._streams.pop(rid)
    self._release(row)
    self.slots[row] = None
    request = dataclasses.replace(
        r.request, prompt=r.request.prompt + tuple(stream.tokens),
        max_new_tokens=r.request.max_new_tokens - len(stream.tokens))
    self._requests[rid] = request
    self._resumed[rid] = stream
    self.queue.appendleft(request)

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
      width = self._width(fixed + len(auto) * (2 * w - 1))
      if width is None:
        continue
      call_w = self._call_window(max([w] + [self.rows[r].request.controls["window"]
                                            for r in decoding]))
      seconds = self._cost(width, call_w)
      rate = len(auto) * self.policy.stats.tokens_per_forward(w) / seconds
      if best_rate is None or rate > best_rate:
        best, best_rate = w, rate
    self.policy.choices.append((len(decoding), len(auto), best))
    return best

  def _cost(self, width: int, window: int) -> float:
    if self.policy.costs.get(width, self.max_len, window) is None:
      self.policy.calibrate(width, self.max_len, self._measure)
    return self.policy.costs.get(width, self.max_len, window)

  def _width(self, tokens: int) -> int | None:
    return next((w for w in self.widths if w >= tokens), None)

  def _call_window(self, largest: int) -> int:
    return min(w for w in self.windows if w >= largest)

  def _tiles(self, width: int, window: int) -> tuple[int, int]:
    """(tiles, tile width) of a call: W = 1 calls one slot a tile, else TILE."""
    tq = 1 if window == 1 else TILE
    return min(width, self.max_batch + width // tq), tq

  def _layout(self, spans: list[tuple[int, int, int]], window: int) -> ragged.Layout:
    width = self._width(sum(rs + w - 1 for _, rs, w in spans))
    tiles, tq = self._tiles(width, window)
    return ragged.layout(self.max_batch, spans, width, tiles, tq)

  def _run(self, layout: ragged.Layout, window: int, auto: int, steps: int, mode: Mode,
           stop_on_finish: bool) -> None:
    self.state = self.call(ragged.run_steps, self.config, self.params, self.state, layout,
                           self.eos_ids, np.int32(self.mask_token_id), np.int32(auto),
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
    in_flight = steps * self.max_window if self._last is not None else 0
    for row in sorted(self.rows, key=lambda x: self.rows[x].request.request_id):
      r = self.rows[row]
      w = self._row_window(r.request, auto)
      if row in decoding:
        known = len(r.request.prompt) + len(self._streams[r.request.request_id].tokens)
        upto = min(known + in_flight + steps * w + 2 * w,
                   len(r.request.prompt) + r.request.max_new_tokens + 2 * w)
      else:
        upto = len(r.request.prompt) + (steps + 2) * w
      try:
        self._ensure(row, upto)
      except pages_lib.OutOfPages:
        if self._last is not None:
          return [], [], auto     # read the round in flight, then preempt with what it says
        self._preempt(max(self.rows, key=lambda x: self.rows[x].request.request_id))
        return self._plan()
    budget = self.max_tokens
    spans_a, spans_b = [], []
    for row in decoding:
      w = self._row_window(self.rows[row].request, auto)
      if budget >= 2 * w - 1:
        spans_a.append((row, w, w))
        spans_b.append((row, w, w))
        budget -= 2 * w - 1
    if not prefilling:
      return [], spans_b, auto
    for row in prefilling:
      r = self.rows[row]
      w = self._row_window(r.request, auto)
      chunk = min(len(r.request.prompt) - r.prefilled, budget - (w - 1))
      if chunk < 1:
        continue
      spans_a.append((row, chunk, w))
      budget -= chunk + w - 1
      r.prefilled += chunk
      if r.prefilled >= len(r.request.prompt):
        spans_b.append((row, w, w))
    return spans_a, spans_b, auto

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
    steps = self.admit_steps if self.active < self.max_batch else self.policy.round_steps
    self.window = auto
    if spans_a:
      self._run(self._layout(spans_a, self.max_window), self.max_window, auto, 1, mode, False)
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

  def _measure(self, width: int, cache_len: int, window: int) -> float:
    """Seconds of one decoding step at flat width `width` and W = window: as many rows
    as the width holds at 2W - 1 slots, each at a context of min(max_len / 2, 256)."""
    rows = min(self.max_batch, max(width // (2 * window - 1), 1))
    context = min(self.max_len // 2, 256)
    state = self._new_state(self.max_batch)
    pages = min(math.ceil((context + 2 * window) / self.page_size), self.num_pages - 1)
    entries = [(r, c, 1 + c) for r in range(rows) for c in range(pages)]
    new = batching.bucket([[0] * context] * rows, self.max_batch, max_new_tokens=1 << 20,
                          width=self._insert_width(context), stop_width=self.max_stop_ids)
    state = self.call(loop.insert, state, np.arange(self.max_batch, dtype=np.int32),
                      new.prompt, new.prompt_len, new.max_new_tokens, new.controls,
                      np.full((self.max_batch,), context - 1, np.int32))
    saved, self.state, self._table = self.state, state, entries
    try:
      self._send_table()
      layout = self._layout([(r, window, window) for r in range(rows)], window)
      best = float("inf")
      for _ in range(3):
        begin = time.perf_counter()
        self._run(layout, window, window, 1, "lossless" if self.mode == "lossless"
                  else "gated", False)
        jax.block_until_ready(self.state.length)
        best = min(best, time.perf_counter() - begin)
    finally:
      self.state, self._table = saved, []
    return best

  def warmup(self, prompt_len: int | None = None) -> None:
    """Compiles every variant `step` can meet with prompts of up to `prompt_len` tokens
    (default: max_len - 1): the inserts of every prompt width, the step at every flat
    width, window and kernel mode, the harvest, stop and page-table calls; a
    `WindowPolicy` also times the decoding step at each width and window. The server's
    state and requests are left as they were."""
    prompt_len = min(prompt_len or self.max_len - 1, self.max_len - 1)
    saved = self.state
    self.state = self._new_state(self.max_batch)
    b = self.max_batch
    for p in [w for w in self.prompt_widths
              if w < prompt_len or w == min(v for v in self.prompt_widths if v >= prompt_len)]:
      new = batching.bucket([[0] * p], b, max_new_tokens=1, width=p,
                            stop_width=self.max_stop_ids)
      self.state = self.call(loop.insert, self.state, np.full((b,), b, np.int32), new.prompt,
                             new.prompt_len, new.max_new_tokens, new.controls,
                             np.zeros((b,), np.int32))
    self._table = [(b, 0, 0)]
    self._send_table()
    modes = ["lossless"] if self.mode == "lossless" else ["gated", "lossless"]
    for mode in modes:
      for width in self.widths:
        for window in self.windows:
          tiles, tq = self._tiles(width, window)
          layout = ragged.layout(b, [], width, tiles, tq)
          self._run(layout, window, window, 1, mode, False)
    got = self.call(loop.harvest, self.state, self.call(loop.copy_lengths, self.state.length),
                    width=self.harvest_width)
    self.state = self.call(loop.stop, self.state, np.zeros((b,), bool), np.zeros((b,), np.int32))
    jax.block_until_ready((got, self.state))
    self.state = saved
    if isinstance(self.policy, WindowPolicy):   # the widths decoding rounds meet
      for width in sorted({self._width(min(self.max_tokens, n * (2 * w - 1)))
                           for w in self.windows for n in range(1, self.max_batch + 1)}):
        self.policy.calibrate(width, self.max_len, self._measure)
