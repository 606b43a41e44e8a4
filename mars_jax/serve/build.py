"""What the engine process serves, built from `python -m mars_jax.serve`'s parsed
arguments: the model (an HF directory or a run, on one device or a mesh), its drafter,
the windows and their policy, the context per row, the batch (--batch-size, or rows
from the free memory: `sizing`), the executables kept beside the compilation cache and
the step costs measured there, and the `Server` over them; and the sampling defaults of
the model's generation_config.json, which the HTTP process applies.
"""

from __future__ import annotations

import hashlib
import logging
import os

from mars_jax.checkpoints import hf, runs
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.decoding.loading import (load_drafter, load_model, trained_block_size,
                                       trained_window, warn_untrained_windows)
from mars_jax.decoding.programs import Programs
from mars_jax.decoding.window_policy import WindowPolicy
from mars_jax.models.qwen2 import Runtime
from mars_jax.serve import sizing
from mars_jax.serve.server import Server
from mars_jax.serve.shapes import default_batched_tokens, step_bytes

DEFAULT_MAX_CONTEXT = 4096  # tokens per request unless --max-len says otherwise
DEFAULT_WINDOWS = (1, 2, 3, 5)
DENSE_PREFILL_CHUNK = 64   # the dense server's (a drafter or a mesh) prefill step width

log = logging.getLogger("mars_jax.serve")



def default_windows(path: str) -> list[int]:
  """1, 2, 3, 5, cut to B + 1 (and B + 1 added) for a MARS run of block size B."""
  block = trained_block_size(path)
  if block is None:
    return list(DEFAULT_WINDOWS)
  return sorted({w for w in DEFAULT_WINDOWS if w <= block + 1} | {block + 1})


def generation_defaults(path: str) -> dict:
  """temperature, top_p, top_k and min_p of the model's generation_config.json (an HF
  directory's, or a run's tokenizer directory's); temperature 0 when it says
  do_sample false; {} when it has none."""
  where = path if os.path.isfile(os.path.join(path, "config.json")) else (
      runs.tokenizer_dir(runs.resolve_checkpoint(path)[0]))
  record = hf.read_generation_config(where) or {}
  if record.get("do_sample") is False:
    return {"temperature": 0.0}
  return {k: record[k] for k in ("temperature", "top_p", "top_k", "min_p")
          if record.get(k) is not None}


def cost_table_path(cache: str, programs: Programs, model, mode: str) -> str:
  """Where the step costs of this model's shape, runtime and kernel mode on this device
  are kept beside the compilation cache (they depend on the shapes, not the weights)."""
  digest = hashlib.sha256(repr((programs.salt(), model.config, model.runtime, mode))
                          .encode()).hexdigest()[:40]
  return os.path.join(cache, "step_costs", f"{digest}.json")


def build_server(args, cache: str | None = None):
  """-> (Server, LoadedModel, the cost table's path or None) for parsed arguments: what
  the engine process serves. cache: the compilation cache directory (None: off); the
  executables go to its executables/, the step costs to its step_costs/ unless
  --cost-table names a file."""
  windows = (sorted({int(w) for w in args.windows.split(",")}) if args.windows
             else default_windows(args.model))
  fixed = None if args.window == "auto" else int(args.window)
  runtime = args.dtype and Runtime(param_dtype=args.dtype, dtype=args.dtype)
  model = load_model(args.model, runtime=runtime, mesh=decode_mesh.mesh_from_flag(args.mesh))
  drafter = None
  if args.drafter is not None:
    fixed = fixed or trained_window(args.model, args.draft_window + 1)
    drafter = load_drafter(args.drafter, model, args.model, draft_window=args.draft_window,
                           window=args.drafter_window, runtime=runtime)
  largest = max([fixed] if fixed else windows)
  max_window = largest if drafter else args.max_window or largest
  extra = (args.draft_window + max(largest, drafter.window) if drafter
           else max(largest, max_window)) - 1   # cache slots past prompt + completion
  warn_untrained_windows(args.model, [max(largest, max_window)])
  context = min(model.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
  max_len = args.max_len or context + extra
  batch_size = args.max_num_seqs
  ragged = drafter is None and model.mesh is None
  pages = args.num_kv_pages
  chunk = args.prefill_chunk or DENSE_PREFILL_CHUNK
  if ragged:
    batch_size = batch_size or sizing.MAX_ROWS
    tokens = args.max_num_batched_tokens or default_batched_tokens(
        batch_size, max(largest, max_window), args.prefill_chunk or 1)
    chunk = args.prefill_chunk or tokens - max(largest, max_window) + 1
    if pages is None:
      pages, reason = sizing.pool_pages(
          *step_bytes(model.config, model.params, rows=batch_size, max_len=max_len,
                      page_size=args.block_size, width=tokens,
                      window=max(largest, max_window), mode=args.mode, runtime=model.runtime),
          rows=batch_size, pages_per_row=-(-max_len // args.block_size),
          utilization=args.memory_utilization)
      log.info("KV pool: %s (--num-kv-pages to choose)", reason)
  elif batch_size is None:
    batch_size, reason = sizing.default_rows(
        model.config, model.runtime, max_len=max_len, window=max(largest, max_window),
        prefill_chunk=chunk, utilization=args.memory_utilization,
        devices=model.mesh and list(model.mesh.devices.flat))
    log.info("batch: %s (--batch-size to choose)", reason)
  programs = cost_path = None
  if cache and model.mesh is None and drafter is None:
    programs = Programs(os.path.join(cache, "executables"),
                        max_bytes=int(args.cache_max_gib * (1 << 30)))
  if args.cost_table:
    cost_path = args.cost_table
  elif programs is not None and not fixed:
    cost_path = cost_table_path(cache, programs, model, args.mode)
  policy = fixed or WindowPolicy(
      windows, costs=cost_path if cost_path and os.path.exists(cost_path) else None,
      round_steps=args.round_steps)
  paged = (dict(max_num_batched_tokens=tokens, page_size=args.block_size, num_pages=pages,
                prefix_caching=args.enable_prefix_caching) if ragged
           else dict(min_batch_size=args.min_batch_size))
  server = Server.from_model(
      model, batch_size=batch_size, max_len=max_len, window=policy,
      mode=args.mode, tau=args.tau, metric=args.gate, prefill_chunk=chunk,
      round_steps=args.round_steps, admit_steps=args.admit_steps, max_window=max_window,
      drafter=drafter, draft_window=args.draft_window, programs=programs, **paged)
  return server, model, cost_path
