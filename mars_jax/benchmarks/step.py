"""`python -m mars_jax.bench step`: the MARS train step against its AR-SFT peer.

Two tables, both measured in the same run:

1. Step time of the MARS step (one pass over 2L positions) and the AR-SFT step
   (L positions) on the same random model, batch (b, L) and mesh, next to each
   step's analytic training FLOPs and their attention share: two streams double
   the matmul tokens, and the dense 2L x 2L attention quadruples the score work,
   so a MARS step does 2x to 4x the model work of an AR step, by attention share.
2. Memory of the loss (unembedding + cross-entropy, value and gradient) over
   [b, 2L] hidden states: the naive full-logits loss against the chunked loss,
   from XLA's compiled memory analysis (temporary buffers). Nothing is executed,
   so real vocabulary sizes and lengths cost only compile time.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax import objective, optimizer, sharding, train_step
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
  g.add_argument("--vocab", type=int, default=8192)
  g.add_argument("--batch", type=int, default=8)
  g.add_argument("--length", type=int, default=256)
  g.add_argument("--block-size", type=int, default=4)
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="compute dtype (params stay float32)")
  g.add_argument("--remat", default="none", choices=["none", "full", "dots",
                                                     "dots_with_no_batch_dims"])
  g.add_argument("--chunk-size", type=int, default=256,
                 help="sequence positions per cross-entropy chunk")
  g.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
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
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)


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


def time_step(config, runtime, obj, tx, mesh, params, batch, steps):
  """-> (seconds per step, compiled temp MiB)."""
  state = train_step.init_train_state(config, tx, mesh, params=params, runtime=runtime)
  step = train_step.make_train_step(config, obj, tx, mesh, runtime=runtime)
  temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes / MIB
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return (time.perf_counter() - start) / steps, temp


def step_table(args) -> str:
  config = model_config(args)
  runtime = qwen2.Runtime(dtype=args.dtype, remat=args.remat)
  mesh = sharding.make_mesh(sharding.MeshConfig(-1, 1, 1))
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(total_steps=args.steps + 1))
  params = jax.device_get(qwen2.init_params(config, jax.random.key(0)))
  batch = synthetic_batch(config, args.batch, args.length)
  rows = []
  for kind in ("ar_sft", "mars"):
    obj = objective.ObjectiveConfig(kind=kind, block_size=args.block_size,
                                    mask_token_id=config.vocab_size - 1,
                                    chunk_size=args.chunk_size)
    seconds, temp = time_step(config, runtime, obj, tx, mesh, params, batch, args.steps)
    length = args.length * (2 if kind == "mars" else 1)
    flops, attention = train_flops(config, args.batch, length)
    rows.append((kind, args.batch * length, seconds, flops / 1e9, attention / flops, temp))
  ar = rows[0]
  lines = [
      f"MARS step vs AR-SFT step: {qwen2.num_params(params) / 1e6:.1f}M params "
      f"(hidden={config.hidden_size} layers={config.num_hidden_layers} "
      f"heads={config.num_attention_heads}/{config.num_key_value_heads} "
      f"mlp={config.intermediate_size} vocab={config.vocab_size}), b={args.batch} "
      f"L={args.length} B={args.block_size}, dtype={runtime.dtype}, remat={runtime.remat}, "
      f"{jax.device_count()} x {jax.devices()[0].platform}, {args.steps} timed steps",
      f"{'objective':<10} {'positions':>9} {'ms/step':>9} {'x AR':>6} {'GFLOP':>9} "
      f"{'x AR':>6} {'attn %':>7} {'temp MiB':>9}"]
  for kind, positions, seconds, gflop, attn, temp in rows:
    lines.append(f"{kind:<10} {positions:>9d} {seconds * 1e3:>9.1f} {seconds / ar[2]:>6.2f} "
                 f"{gflop:>9.1f} {gflop / ar[3]:>6.2f} {attn * 100:>7.1f} {temp:>9.1f}")
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
