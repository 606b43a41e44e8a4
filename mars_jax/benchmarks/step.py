"""`python -m mars_jax.bench step`: our MARS and AR-SFT train steps next to a PyTorch peer.

Two tables, both measured in the same run:

1. Step time (value, gradient and AdamW update) of our MARS step, our AR-SFT step
   and their PyTorch peers on the same weights and batches: transformers' Qwen2
   (sdpa attention, float32, the same thread count) running an AR-SFT step, and a
   MARS step written the plain way with it: the [clean | noisy] concatenation of
   2L positions, the two-stream boolean mask as a 4-D attention mask, full logits,
   cross-entropy at the targets. Batches are SFT-like (row lengths 80-100% of L,
   right-padded) with 70% ("prompt-heavy") or 30% ("response-heavy") of each row
   prompt, plus the embedded default's shape (configs/tiny.py: its model, batch
   and length, real examples of its task). Our MARS step runs the noisy stream of
   target blocks only (n positions; `objective.target_stream`) and, for
   reference, of every block (n = L). Temp MiB is XLA's compiled temporary memory
   of our step (`memory_analysis`).
2. Memory of the loss (unembedding + cross-entropy, value and gradient) over
   [b, 2L] hidden states: the naive full-logits loss against the chunked loss,
   from XLA's compiled memory analysis. Nothing is executed, so real vocabulary
   sizes and lengths cost only compile time.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.core import choices
from mars_jax.parallel import sharding
from mars_jax.training import masks, objective, optimizer, step as train_step
from mars_jax.core.choices import AttentionImpl, Kind, Remat
from mars_jax.models import qwen2

MIB = 2 ** 20


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench step", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  g = p.add_argument_group("model (random weights) and batch of the step-time table")
  g.add_argument("--preset", default=None,
                 help="a Qwen2.5 or Qwen3 shape, e.g. qwen2.5-0.5b, qwen3-0.6b (overrides the "
                 "sizes below)")
  g.add_argument("--hidden", type=int, default=256)
  g.add_argument("--layers", type=int, default=4)
  g.add_argument("--heads", type=int, default=8)
  g.add_argument("--kv-heads", type=int, default=2)
  g.add_argument("--intermediate", type=int, default=768)
  g.add_argument("--vocab", type=int, default=4096)
  g.add_argument("--batch", type=int, default=8)
  g.add_argument("--length", type=int, default=256)
  g.add_argument("--block-size", type=int, default=4)
  g.add_argument("--scenarios", default="prompt-heavy,response-heavy,default",
                 help="comma-separated: prompt-heavy (70%% prompt), response-heavy (30%%), "
                 "default (configs/tiny.py's model, batch, length and task)")
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="compute dtype (params stay float32)")
  g.add_argument("--remat", default="dots_with_no_batch_dims", choices=choices.values(Remat),
                 help="remat policy of each layer (default: configs/tiny.py's, the fastest "
                 "with a layer scan on CPU; none keeps every activation)")
  g.add_argument("--attention", default="xla", choices=choices.values(AttentionImpl),
                 help="attention implementation of our steps (Runtime.attention_impl)")
  g.add_argument("--no-scan", action="store_true",
                 help="unrolled layers (Runtime.scan_layers=False) instead of a layer scan")
  g.add_argument("--chunk-size", type=int, default=256,
                 help="sequence positions per cross-entropy chunk")
  g.add_argument("--steps", type=int, default=3, help="timed steps per round")
  g.add_argument("--rounds", type=int, default=2, help="rounds; the best is reported")
  g.add_argument("--no-peer", action="store_true", help="skip the PyTorch peer")
  g.add_argument("--threads", type=int, default=0,
                 help="torch threads (0: as many as the CPU cores JAX uses)")
  g = p.add_argument_group("loss-memory table")
  g.add_argument("--mem-vocabs", default="32768,151936")
  g.add_argument("--mem-lengths", default="512,2048", help="L; the loss sees 2L positions")
  g.add_argument("--mem-batch", type=int, default=8, help="rows per device")
  g.add_argument("--mem-hidden", type=int, default=896)
  return p.parse_args(argv)


def model_config(args) -> qwen2.Qwen2Config:
  if args.preset:
    return qwen2.preset(args.preset)
  return qwen2.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                           bos_token_id=0, eos_token_id=1)


def synthetic_batch(config: qwen2.Qwen2Config, batch: int, length: int) -> dict:
  """Random tokens; the first quarter of each row is prompt, the rest response."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size - 1, (batch, length)).astype(np.int32)
  loss_mask = np.zeros((batch, length), bool)
  loss_mask[:, length // 4:] = True
  return {"tokens": tokens, "loss_mask": loss_mask}


def train_flops(config: qwen2.Qwen2Config, batch: int, positions: int) -> tuple[float, float]:
  """Analytic FLOPs of one forward+backward (3x forward) over [batch, positions], with
  attention computed densely as the model does. -> (total, attention part)."""
  c = config
  qkvo = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
  per_token = c.num_hidden_layers * (qkvo + 3 * c.hidden_size * c.intermediate_size)
  matmul = 2 * batch * positions * (per_token + c.hidden_size * c.vocab_size)
  attention = (4 * batch * positions ** 2 * c.num_attention_heads * c.head_dim
               * c.num_hidden_layers)
  return 3 * (matmul + attention), 3 * attention


def time_step(config, runtime, obj, tx, mesh, params, batch, steps, rounds=1):
  """-> (seconds per step, best of `rounds` rounds of `steps` steps; compiled temp MiB)."""
  state = train_step.init_train_state(config, tx, mesh, params=qwen2.relayout(params, runtime),
                                      runtime=runtime)
  step = train_step.make_train_step(config, obj, tx, mesh, runtime=runtime)
  temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes / MIB
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    best = min(best, (time.perf_counter() - start) / steps)
  return best, temp


def sft_batch(config: qwen2.Qwen2Config, batch: int, length: int, prompt_fraction: float,
              seed: int = 0) -> dict:
  """SFT-like rows: lengths 80-100% of L, the first `prompt_fraction` of each prompt, the
  rest response (loss_mask), right-padded with token 0."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, config.vocab_size - 1, (batch, length)).astype(np.int32)
  loss_mask = np.zeros((batch, length), bool)
  for row, n in enumerate(rng.integers(int(0.8 * length), length + 1, batch)):
    loss_mask[row, int(round(prompt_fraction * n)):n] = True
    tokens[row, n:] = 0
  return {"tokens": tokens, "loss_mask": loss_mask}


def default_scenario():
  """configs/tiny.py's model config, batch size and a batch of its task's real examples."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from mars_jax.training import config as train_config  # pylint: disable=import-outside-toplevel
  from mars_jax.data import (build_tokenizer, load_data,  # pylint: disable=import-outside-toplevel
                             model_vocab_size)
  path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.py")
  spec = importlib.util.spec_from_file_location("tiny_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  tok = build_tokenizer(cfg.tokenizer)
  config = train_config.random_model_config(
      cfg, vocab_size=model_vocab_size(tok), bos_token_id=tok.pad_token_id,
      eos_token_id=tok.eos_token_id)
  data_cfg = cfg.data.to_dict()
  data_cfg["synthetic"].update(num_train=cfg.train.batch_size, num_test=0)
  data = load_data(data_cfg, tok)
  batch = next(data.train_iterator(batch_size=cfg.train.batch_size, shard_index=0,
                                   shard_count=1))
  return config, batch


def stream_length_of(batch: dict, block_size: int, length: int) -> int:
  """The trainer's derived target-stream length for this batch (multiple of 8 and B)."""
  count = objective.target_block_lengths(objective.prepare(batch), block_size)
  return objective.fitting_stream_length(int(np.max(count)), block_size, length)


def torch_step(model, batch: dict, *, kind: Kind, block_size: int, mask_token_id: int):
  """One PyTorch peer step (forward, backward, AdamW) as a closure, on `model`'s weights.

  AR-SFT: the causal pass with a padding mask. MARS: [clean | noisy] (2L positions),
  the two-stream mask (`masks.two_stream_segment_mask`, padding excluded) as a 4-D
  additive mask, full logits, mean CE over each row's targets in both streams."""
  import torch  # pylint: disable=import-outside-toplevel
  tokens = torch.from_numpy(np.asarray(batch["tokens"])).long()
  loss_mask = torch.from_numpy(np.asarray(batch["loss_mask"]))
  b, length = tokens.shape
  real = tokens != 0
  real[:, 0] = True
  labels = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
  target = torch.cat([loss_mask[:, 1:], torch.zeros(b, 1, dtype=torch.bool)], 1)
  weights = target.float() / target.float().sum(1, keepdim=True).clamp(min=1)
  positions = torch.arange(length).expand(b, length)
  if kind == "mars":
    noisy = torch.where(loss_mask, mask_token_id, tokens)
    seg = np.asarray(real, np.int32)
    allowed = torch.from_numpy(np.array(masks.two_stream_segment_mask(
        seg, np.asarray(positions, np.int32), block_size)))
    additive = torch.zeros(allowed.shape)
    additive[~allowed] = torch.finfo(torch.float32).min
    inputs = dict(input_ids=torch.cat([tokens, noisy], 1),
                  position_ids=torch.cat([positions, positions], 1),
                  attention_mask=additive[:, None])
    labels, weights = torch.cat([labels, labels], 1), torch.cat([weights, weights], 1)
  else:
    inputs = dict(input_ids=tokens, position_ids=positions, attention_mask=real.long())
  opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

  def run():
    logits = model(**inputs).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1), reduction="none")
    loss = (ce * weights.reshape(-1)).sum() / b
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
  return run


def time_torch(run, steps: int, rounds: int) -> float:
  run()
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(steps):
      run()
    best = min(best, (time.perf_counter() - start) / steps)
  return best


def scenario_rows(config, batch, args, runtime, mesh, peer_dir: str | None) -> list[tuple]:
  """-> rows (name, positions, seconds, temp MiB or None) of one scenario."""
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(total_steps=10 ** 6))
  params = jax.device_get(qwen2.init_params(config, jax.random.key(0)))
  b, length = batch["tokens"].shape
  block, mask_id = args.block_size, config.vocab_size - 1
  n = stream_length_of(batch, block, length)
  rows = []
  for name, kind, stream in (("ours ar_sft", "ar_sft", stream_length_of(batch, 1, length)),
                             (f"ours mars, n={n}", "mars", n),
                             (f"ours mars, n=L={length}", "mars", None)):
    obj = objective.ObjectiveConfig(kind=kind, block_size=block, mask_token_id=mask_id,
                                    chunk_size=args.chunk_size, stream_length=stream)
    seconds, temp = time_step(config, runtime, obj, tx, mesh, params, batch, args.steps,
                              args.rounds)
    positions = b * (length + (stream or length) if kind == "mars" else length)
    rows.append((name, positions, seconds, temp))
  if peer_dir is not None:
    from mars_jax.benchmarks.sample import load_transformers  # pylint: disable=import-outside-toplevel
    for kind in ("ar_sft", "mars"):
      model, _ = load_transformers(config, params, os.path.join(peer_dir, kind), args.threads)
      model.config._attn_implementation = "sdpa"  # pylint: disable=protected-access
      model.train()
      run = torch_step(model, batch, kind=kind, block_size=block, mask_token_id=mask_id)
      rows.append((f"torch {kind}", b * length * (2 if kind == "mars" else 1),
                   time_torch(run, args.steps, args.rounds), None))
  return rows


def step_table(args) -> str:
  import tempfile  # pylint: disable=import-outside-toplevel
  runtime = qwen2.Runtime(dtype=args.dtype, remat=args.remat, scan_layers=not args.no_scan,
                          attention_impl=args.attention)
  mesh = sharding.make_mesh(sharding.MeshConfig(-1, 1, 1))
  if not args.threads:
    args.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
  lines = [f"Train step (value, gradient, AdamW): dtype={runtime.dtype} remat={runtime.remat} "
           f"attention={runtime.attention_impl} "
           f"scan_layers={runtime.scan_layers} "
           f"B={args.block_size}, {jax.device_count()} x {jax.devices()[0].platform}; "
           f"best of {args.rounds} rounds of {args.steps} steps"
           + ("" if args.no_peer else f"; PyTorch peer: transformers sdpa, "
              f"{args.threads} threads")]
  for name in args.scenarios.split(","):
    if name == "default":
      config, batch = default_scenario()
    elif name in ("prompt-heavy", "response-heavy"):
      config = model_config(args)
      batch = sft_batch(config, args.batch, args.length,
                        0.7 if name == "prompt-heavy" else 0.3)
    else:
      raise SystemExit(f"--scenarios: unknown {name!r}")
    b, length = batch["tokens"].shape
    with tempfile.TemporaryDirectory() as peer_dir:
      rows = scenario_rows(config, batch, args, runtime, mesh,
                           None if args.no_peer else peer_dir)
    ar = rows[0][2]
    lines += ["", f"{name}: {qwen2.num_params(qwen2.abstract_params(config)) / 1e6:.1f}M "
              f"params (hidden={config.hidden_size} layers={config.num_hidden_layers} "
              f"heads={config.num_attention_heads}/{config.num_key_value_heads} "
              f"mlp={config.intermediate_size} vocab={config.vocab_size}), b={b} L={length}, "
              f"{np.mean(batch['loss_mask']) * 100:.0f}% of positions are response",
              f"{'step':<22} {'positions':>9} {'ms/step':>9} {'x our AR':>9} {'temp MiB':>9}"]
    for row, positions, seconds, temp in rows:
      lines.append(f"{row:<22} {positions:>9d} {seconds * 1e3:>9.1f} {seconds / ar:>9.2f} "
                   + (f"{temp:>9.1f}" if temp is not None else f"{'':>9}"))
    by = {r[0].split(",")[0]: r[2] for r in rows}
    if not args.no_peer:
      mars = rows[1][2]
      lines.append(f"ours/torch: ar_sft {by['ours ar_sft'] / by['torch ar_sft']:.2f}x, "
                   f"mars {mars / by['torch mars']:.2f}x (below 1: ours is faster)")
  return "\n".join(lines)


def loss_memory(vocab: int, length: int, batch: int, hidden: int,
                chunk_size: int | None) -> float:
  """Compiled temp MiB of value_and_grad of the loss head over [batch, 2L] positions."""
  config = qwen2.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                             num_hidden_layers=1, num_attention_heads=1,
                             num_key_value_heads=1, tie_word_embeddings=True)
  head = {"embedding": jax.ShapeDtypeStruct((vocab, hidden), jnp.float32)}
  h = jax.ShapeDtypeStruct((batch, 2 * length, hidden), jnp.float32)
  labels = jax.ShapeDtypeStruct((batch, 2 * length), jnp.int32)

  def loss(head, h, labels):
    ce, _ = objective.token_cross_entropy(config, head, h, labels, chunk_size=chunk_size)
    return jnp.mean(ce)

  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(head, h, labels).compile()
  return compiled.memory_analysis().temp_size_in_bytes / MIB


def memory_table(args) -> str:
  lines = [
      f"Loss memory (unembed + CE, value and grad; XLA temp buffers): b={args.mem_batch}, "
      f"hidden={args.mem_hidden}, chunk={args.chunk_size} positions",
      f"{'vocab':>7} {'L':>5} {'2L':>5} {'logits f32 MiB':>15} {'naive MiB':>10} "
      f"{'chunked MiB':>12} {'naive/chunked':>14}"]
  for vocab in (int(v) for v in args.mem_vocabs.split(",")):
    for length in (int(n) for n in args.mem_lengths.split(",")):
      logits = args.mem_batch * 2 * length * vocab * 4 / MIB
      naive = loss_memory(vocab, length, args.mem_batch, args.mem_hidden, None)
      chunked = loss_memory(vocab, length, args.mem_batch, args.mem_hidden, args.chunk_size)
      lines.append(f"{vocab:>7d} {length:>5d} {2 * length:>5d} {logits:>15.1f} {naive:>10.1f} "
                   f"{chunked:>12.1f} {naive / chunked:>14.1f}")
  return "\n".join(lines)


def main(argv=None) -> None:
  args = parse_args(argv)
  print(step_table(args), flush=True)
  print()
  print(memory_table(args))
