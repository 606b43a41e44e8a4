"""The ragged engine's kernels: decoding steps over one flat batch of tokens and a page
pool (`mars_jax.models.paged`), each row at its own width and window.

The state is `loop.DecodeState` with a paged cache: {"k", "v"}: the pool [layers, pages,
page_size, kv_heads, head_dim], and "table": int32[rows, max_pages], each row's page
list (page 0, the trash page, where none is set). The accepting, verifying and sampling
of a step are `loop.advance`'s, unchanged; only its forward differs (`feed`): instead
of [rows, real_slots + W - 1] slots, row r takes `real_slots[r] + windows[r] - 1` slots
of the flat batch (`Layout`), from `start[r]` on:

  flat slot      0  1  2 | 3  4  5  6  7  8  9 | 10 ... 73 | 74 75 ... (padding)
  row            0  0  0 | 1  1  1  1  1  1  1 | 2  ...  2 |
  what           x  M  M | x  d  d  -  M  M  M | prompt chunk (64)
                 W = 3     lossless W = 4         a new row's prefill

Within a row the slots are laid out exactly as `loop.feed` lays them out (the real slots,
then the MASK slots after the last real token), so a row's tokens, acceptance and
cursor are what they are alone at its window (`loop`'s module doc). A call's layout is
fixed for its steps; the host (`mars_jax.serve.server`) builds one per call: the rows
that prefill take one step at their chunk's width, the decoding rounds `round_steps`
steps at 2W - 1 slots a row.

A call takes its rows out of the state (`Layout.rows`, R of them), steps them, and puts
them back: the proposals, gates and draws of a step cost the call's rows, never the
state's max_num_seqs.

Compilation: one per (flat width T, rows R, tiles, tile width, W, mode) and the state's
shapes, which the host ties together (`mars_jax.serve.server`); the rows' lengths, page
lists and windows are traced, so a longer context or another mix of windows compiles
nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mars_jax.core.choices import Mode
from mars_jax.decoding import loop
from mars_jax.decoding.loop import DecodeState
from mars_jax.models import cached, paged
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime

Array = jax.Array
TABLE_CHUNK = 256   # page-table entries `set_pages` writes per call


@struct.dataclass
class Layout:
  """Which rows a call runs and where their slots sit in its flat batch (R: the call's
  rows, T flat slots).

  rows: int32[R], the state rows the call runs, in flat order (b: padding); the other
  fields index them (the call's row k is the state's rows[k]): runs: bool[R];
  real_slots: int32[R]; start: int32[R], the row's first flat slot; row: int32[T] (R:
  padding), slot: int32[T] (the slot's index in its row's span); tiles: `paged.Tiles`
  (tile rows are call rows).
  """
  rows: Array
  runs: Array
  real_slots: Array
  start: Array
  row: Array
  slot: Array
  tiles: paged.Tiles


def layout(state_rows: int, spans: list[tuple[int, int, int]], width: int, rows: int,
           tiles: int, tile_width: int) -> Layout:
  """The `Layout` (numpy) of a call: spans lists (state row, real slots, window) of the
  rows it runs, in flat order; width: T; rows: R (a bound); tiles: the number of tiles
  (a bound); tile_width: tq. Raises ValueError when the spans exceed T, R or the tiles."""
  if len(spans) > rows:
    raise ValueError(f"{len(spans)} rows in a call of {rows}.")
  which = np.full((rows,), state_rows, np.int32)
  runs = np.zeros((rows,), bool)
  real = np.zeros((rows,), np.int32)
  start = np.zeros((rows,), np.int32)
  row = np.full((width,), rows, np.int32)
  slot = np.zeros((width,), np.int32)
  tile_token = np.full((tiles, tile_width), width, np.int32)
  tile_row = np.zeros((tiles,), np.int32)
  at = np.full((width,), tiles * tile_width - 1, np.int32)
  flat = n = 0
  for k, (r, rs, w) in enumerate(spans):
    count = rs + w - 1
    if flat + count > width:
      raise ValueError(f"the call's spans need more than its {width} slots.")
    which[k], runs[k], real[k], start[k] = r, True, rs, flat
    row[flat:flat + count] = k
    slot[flat:flat + count] = np.arange(count)
    tiles_k = -(-count // tile_width)
    if n + tiles_k > tiles:
      raise ValueError(f"the call's spans need more than its {tiles} tiles.")
    firsts = np.arange(tiles_k) * tile_width
    for i, first in enumerate(firsts):
      k_slots = min(tile_width, count - first)
      tile_token[n + i, :k_slots] = flat + first + np.arange(k_slots)
    tile_row[n:n + tiles_k] = k
    at[flat:flat + count] = n * tile_width + np.arange(count)
    n += tiles_k
    flat += count
  return Layout(which, runs, real, start, row, slot, paged.Tiles(tile_token, tile_row, at))


def new_state(config: Qwen2Config, rows: int, max_len: int, pages: int, page_size: int, *,
              runtime: Runtime = DEFAULT_RUNTIME, stop_ids: int = loop.STOP_BUCKET
              ) -> DecodeState:
  """An empty state: `rows` padding rows of `max_len` token slots, a zeroed pool of
  `pages` pages, every page list empty (the trash page)."""
  state = loop.new_state(config, rows, 1, runtime=runtime, stop_ids=stop_ids)
  pool = paged.init_pool(config, pages, page_size, runtime.jnp_dtype)
  max_pages = -(-max_len // page_size)
  return state.replace(seq=jnp.zeros((rows, max_len), jnp.int32),
                       born=jnp.zeros((rows, max_len), jnp.int32),
                       cache={**pool, "table": jnp.zeros((rows, max_pages), jnp.int32)})


@functools.partial(jax.jit, donate_argnums=0)
def set_pages(state: DecodeState, rows: Array, cols: Array, pages: Array) -> DecodeState:
  """Sets page-table entries: table[rows[i], cols[i]] = pages[i] (int32[TABLE_CHUNK]
  each; rows[i] >= b drops the entry)."""
  table = state.cache["table"].at[rows, cols].set(pages, mode="drop")
  return state.replace(cache={**state.cache, "table": table})


def feed(config: Qwen2Config, runtime: Runtime, params, seq: Array, cache, cursor: Array,
         real_count: Array, mask_start: Array, active: Array, proposing: Array,
         mask_token_id: Array, out_slots: Array, *, real_slots: Array, window: int,
         layout: Layout) -> tuple[Array, dict]:
  """`loop.feed` over the flat batch and the page pool (arguments as `loop.feed`;
  real_slots: int32[b], the layout's) -> (hidden at out_slots [b, o, embed], the cache)."""
  b, slots = seq.shape
  width = layout.row.shape[0]
  r = jnp.minimum(layout.row, b - 1)
  j = layout.slot
  rs = real_slots[r]
  is_real = j < rs
  pos = jnp.where(is_real, cursor[r] + j, mask_start[r] + j - rs)
  pos = jnp.where(layout.row < b, pos, 0)
  tokens = jnp.where(is_real, seq[r, jnp.minimum(pos, slots - 1)], mask_token_id)
  written = (layout.row < b) & active[r] & jnp.where(is_real, j < real_count[r], proposing[r])
  table = cache["table"]
  page_size = cache["k"].shape[2]
  page = jnp.where(written, table[r, jnp.minimum(pos // page_size, table.shape[1] - 1)], 0)
  hidden, pg = cached.forward_paged(
      config, runtime, params, tokens.astype(jnp.int32),
      paged.Paged(cache["k"], cache["v"], table, page, pos % page_size, pos, layout.tiles))
  at = jnp.minimum(layout.start[:, None] + out_slots, width - 1)
  return hidden[at], {**cache, "k": pg.k, "v": pg.v}


PER_ROW = ("seq", "cursor", "length", "draft", "prompt_len", "limit", "controls", "done",
           "forwards", "born")


def _take(state: DecodeState, rows: Array) -> DecodeState:
  """The call's rows of the state (padding rows: done); the pool is shared, not copied."""
  b = state.seq.shape[0]
  idx = jnp.minimum(rows, b - 1)
  sub = state.replace(**{f: jax.tree.map(lambda a: a[idx], getattr(state, f))
                         for f in PER_ROW},
                      cache={**state.cache, "table": state.cache["table"][idx]})
  return sub.replace(done=sub.done | (rows >= b))


def _put(state: DecodeState, rows: Array, sub: DecodeState) -> DecodeState:
  """`state` with the call's rows set from `sub` (padding rows dropped) and its pool."""
  return state.replace(
      **{f: jax.tree.map(lambda whole, part: whole.at[rows].set(part, mode="drop"),
                         getattr(state, f), getattr(sub, f)) for f in PER_ROW},
      steps=sub.steps, cache={**state.cache, "k": sub.cache["k"], "v": sub.cache["v"]})


@functools.partial(jax.jit, static_argnames=("config", "runtime", "window", "mode"),
                   donate_argnames=("state",))
def run_steps(config: Qwen2Config, params, state: DecodeState, layout: Layout, eos_ids: Array,
              mask_token_id: Array, auto_window: Array, max_steps: Array,
              stop_on_finish: Array, *, window: int, mode: Mode,
              runtime: Runtime = DEFAULT_RUNTIME) -> DecodeState:
  """Steps of the rows the layout runs, until they are all done, `max_steps` forwards
  ran, or (stop_on_finish) one of them finished. window: the largest W of the call (a
  row's own is its fixed window, else auto_window: int32[]); arguments else as
  `loop.run_steps`. The call's rows are taken out of the state once, stepped, and put
  back, so the per-row work of a step (its logits, gates, draws) is the call's rows',
  not the whole state's. -> the new state (the old one is donated)."""
  sub = _take(state, layout.rows)
  done0, steps0 = sub.done, sub.steps
  runs = layout.runs

  def cond(st):
    finished = jnp.any(st.done & ~done0)
    return (jnp.any(~st.done & runs) & (st.steps - steps0 < max_steps)
            & ~(stop_on_finish & finished))

  step = functools.partial(
      loop.advance, config, runtime, params, eos_ids=eos_ids, mask_token_id=mask_token_id,
      real_slots=layout.real_slots, window=window, mode=mode,
      forward=functools.partial(feed, layout=layout), runs=runs, auto_window=auto_window)
  return _put(state, layout.rows, jax.lax.while_loop(cond, step, sub))
