"""The shapes of the ragged engine's calls (`mars_jax.serve.server`), and what XLA
compiles the widest of them to (`step_bytes`, which sizes the KV pool: `sizing`).

A call's flat width is a power of two; its rows and tiles follow from the width, the
call's window and its kind (`call_shape`), so the variants that warmup compiles stay
few: "decode" calls (rows: the width over 2W - 1), prefill calls of "few" rows (one per
FEW_SLOTS slots) or "many" (one a slot).
"""

from __future__ import annotations

import jax
import numpy as np

from mars_jax.core.choices import Mode
from mars_jax.decoding import batching, ragged
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime

TILE = 8                  # query slots of a tile (`paged.Tiles`) in a call with W > 1
FEW_SLOTS = 16            # a "few rows" prefill call: a row per FEW_SLOTS slots at most


def default_batched_tokens(rows: int, window: int, prefill_chunk: int) -> int:
  """The default token budget of a step: every row decoding at the largest window, and
  at least 2048 (vLLM's default for online serving) and a prefill chunk; a power of two."""
  return batching.pow2(max(2048, prefill_chunk, rows * (2 * window - 1)))


def call_shape(max_rows: int, width: int, window: int, kind: str) -> tuple[int, int, int]:
  """(rows, tiles, tile width) of a call `width` slots wide. kind: "decode", a decoding
  call (rows: the width over a row's 2W - 1 slots); "few", a prefill call of at most one
  row a FEW_SLOTS slots; "many", a prefill call of up to a row a slot. At most max_rows
  rows. A decoding call at W = 1 takes one slot a tile, the others TILE (a prompt
  chunk's queries share their row's pages)."""
  rows = {"decode": width if window == 1 else batching.pow2(-(-width // (2 * window - 1))),
          "few": max(width // FEW_SLOTS, 1), "many": width}[kind]
  rows = min(max_rows, rows)
  tq = 1 if window == 1 and kind == "decode" else TILE
  return rows, min(width, rows + width // tq), tq


def step_bytes(config: Qwen2Config, params, *, rows: int, max_len: int, page_size: int,
               width: int, window: int, mode: Mode, runtime: Runtime = DEFAULT_RUNTIME
               ) -> tuple[int, int, int]:
  """What XLA compiles the widest step to (a prefill call `width` slots wide at W =
  window, over a two-page pool) -> (its temporaries, the state's bytes besides the pool,
  a page's bytes). Lowered and compiled, never run."""
  state = jax.eval_shape(lambda: ragged.new_state(config, rows, max_len, 2, page_size,
                                                  runtime=runtime))
  layout = ragged.layout(rows, [], width, *call_shape(rows, width, window, "many"))
  compiled = ragged.run_steps.lower(
      config, params, state, layout, np.zeros((8,), np.int32), np.int32(0), np.int32(1),
      np.int32(1), np.bool_(False), window=window, mode=mode, runtime=runtime).compile()
  pool = sum(int(np.prod(state.cache[k].shape)) * state.cache[k].dtype.itemsize
             for k in ("k", "v"))
  held = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
  return compiled.memory_analysis().temp_size_in_bytes, held - pool, pool // 2
