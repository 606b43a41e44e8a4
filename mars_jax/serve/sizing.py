"""The server's KV memory, sized from the device's free memory as vLLM sizes its KV cache
by --gpu-memory-utilization.

The ragged engine's pool (`pool_pages`): pages = (the budget - the widest step's
temporaries as XLA compiled them - the state besides the pool) / a page's bytes, at most
what max_num_seqs rows of max_len need:

  pages, reason = pool_pages(temporaries, state_bytes, page_bytes, rows=256,
                             pages_per_row=256, utilization=0.9)

The dense server (a drafter or a mesh: `default_rows`) sizes rows of max_len instead:

A row costs its share of the decoding state at max_len slots (the KV cache, the token
and forward-number buffers, its controls: `loop.new_state`'s shapes) plus the work of
a step (its logits at 2W - 1 slots with the sampling copies, and the activations of a
prefill step); the budget is `utilization` of the device's memory less what is in use
once the weights are loaded (an accelerator: `memory_stats`), or `utilization` of the
host's available memory (the CPU backend). The rows are the budget over a row's bytes,
at most MAX_ROWS: what a default server allocates at full load (the batch grows in
buckets with the load, so a light load holds less).
"""

from __future__ import annotations

import jax
import numpy as np

from mars_jax.decoding import loop
from mars_jax.models.qwen2 import Qwen2Config, Runtime

MAX_ROWS = 256       # vLLM's default --max-num-seqs
LOGIT_COPIES = 4     # logits, probabilities, the sorted copy top-k / top-p take, the draw
ACTIVATION_COPIES = 4


def row_bytes(config: Qwen2Config, runtime: Runtime, *, max_len: int, window: int,
              prefill_chunk: int) -> int:
  """Bytes one row of the batch holds at max_len cache slots (see the module doc)."""
  state = jax.eval_shape(lambda: loop.new_state(config, 1, max_len, runtime=runtime))
  held = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
  logits = (2 * window - 1) * config.vocab_size * 4 * LOGIT_COPIES
  width = config.hidden_size + 2 * config.intermediate_size
  activations = ((prefill_chunk + window) * width * np.dtype(runtime.jnp_dtype).itemsize
                 * ACTIVATION_COPIES)
  return held + logits + activations


def _host_available() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  raise OSError("/proc/meminfo has no MemAvailable line")


def budget(utilization: float, devices=None) -> tuple[int, str]:
  """-> (bytes the batch may take, where they come from)."""
  devices = devices or jax.local_devices()
  stats = [d.memory_stats() for d in devices]
  if all(s and "bytes_limit" in s for s in stats):
    limit = sum(s["bytes_limit"] for s in stats)
    used = sum(s.get("bytes_in_use", 0) for s in stats)
    return (max(int(limit * utilization) - used, 0),
            f"{utilization:g} x {limit / 2**30:.2f} GiB of {len(devices)} "
            f"{devices[0].device_kind} less {used / 2**30:.2f} GiB in use")
  free = _host_available()
  return int(free * utilization), f"{utilization:g} x {free / 2**30:.2f} GiB available on the host"


def default_rows(config: Qwen2Config, runtime: Runtime, *, max_len: int, window: int,
                 prefill_chunk: int, utilization: float, devices=None) -> tuple[int, str]:
  """-> (rows of the batch at full load, the reason, for the log). Raises ValueError
  when not one row fits."""
  per_row = row_bytes(config, runtime, max_len=max_len, window=window,
                      prefill_chunk=prefill_chunk)
  room, source = budget(utilization, devices)
  fits = room // per_row
  if fits < 1:
    raise ValueError(f"not one row of {max_len} cache slots ({per_row / 2**20:.1f} MiB) "
                     f"fits in {source}; lower --max-len or raise --memory-utilization.")
  rows = min(fits, MAX_ROWS)
  return rows, (f"{rows} rows: {per_row / 2**20:.2f} MiB a row at --max-len {max_len}, "
                f"{room / 2**30:.2f} GiB for the batch ({source}) holds {fits}"
                + (f", capped at {MAX_ROWS}" if fits > MAX_ROWS else ""))


CPU_POOL_BYTES = 4 << 30   # the CPU backend's pool at most (vLLM CPU's default KV space)


def pool_pages(temporaries: int, state_bytes: int, page_bytes: int, *, rows: int,
               pages_per_row: int, utilization: float, devices=None) -> tuple[int, str]:
  """-> (pages of the pool, the reason, for the log): what the budget holds once the
  widest step's temporaries and the state besides the pool are counted, at most rows x
  pages_per_row (+ the trash page); on the CPU backend (host memory, shared with
  everything else) at most CPU_POOL_BYTES. Raises ValueError when one row of pages does
  not fit."""
  room, source = budget(utilization, devices)
  if "on the host" in source and room - temporaries - state_bytes > CPU_POOL_BYTES:
    room = CPU_POOL_BYTES + temporaries + state_bytes
    source += f", at most {CPU_POOL_BYTES / 2**30:.0f} GiB of pool on the CPU backend"
  left = room - temporaries - state_bytes
  fits = left // page_bytes
  cap = rows * pages_per_row + 1
  if fits < pages_per_row + 1:
    raise ValueError(f"the KV pool cannot hold one row ({pages_per_row} pages of "
                     f"{page_bytes / 2**10:.0f} KiB) in {source} less the step's "
                     f"{temporaries / 2**20:.0f} MiB of temporaries and the state's "
                     f"{state_bytes / 2**20:.0f} MiB; lower --max-len or raise "
                     "--memory-utilization.")
  pages = min(fits, cap)
  return pages, (f"{pages} pages of {page_bytes / 2**10:.0f} KiB ({pages * page_bytes / 2**30:.2f}"
                 f" GiB): {source}, less the widest step's {temporaries / 2**20:.0f} MiB of "
                 f"temporaries (XLA's memory analysis) and the state's {state_bytes / 2**20:.0f}"
                 f" MiB besides the pool, holds {fits}"
                 + (f", capped at {cap} ({rows} rows of {pages_per_row})" if fits > cap else ""))
