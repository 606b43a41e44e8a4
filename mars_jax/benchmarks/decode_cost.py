"""`python -m mars_jax.bench decode`: where a decoding step's time goes.

For each batch and window, compiles the sampler's `run_steps` variant and reports,
next to its measured seconds per step (`decoding.timing.step_seconds`):
  - the two rooflines of `mars_jax.benchmarks.roofline`, at this machine's memory
    bandwidth and float32 matmul rate measured in the same run: the bytes a step
    must move (the params once plus the K/V cache blocks it reads) and the FLOPs it
    must do (2 per weight per slot fed: b * (2W - 1) slots, plus the attention);
  - XLA's cost analysis of one step: FLOPs and bytes accessed;
  - the layout copies left in the compiled step (HLO `copy`/`transpose` ops, their
    count and bytes per step): data movement that does no arithmetic.
With --sampling, the same step with every row sampled too, and its cost over the
greedy step's, both measured in the same run.

  python -m mars_jax.bench decode --model toy --batch-sizes 1,4,16,64 --windows 1,5
  python -m mars_jax.bench decode --model qwen2.5-0.5b --batch-sizes 8 --windows 5 \
      --mode lossless --sampling top_k=20,top_p=0.8,temperature=0.7
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import numpy as np

from mars_jax.core import choices
from mars_jax.decoding import loading
from mars_jax.benchmarks import toy
from mars_jax.benchmarks.roofline import (forward_bytes, forward_flops, matmul_rate,
                                          memory_bandwidth)
from mars_jax.decoding import batching, loop, timing
from mars_jax.benchmarks.sample import SHAPES
from mars_jax.core.choices import Mode
from mars_jax.models import attention, qwen2

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1, "u32": 4, "s8": 1, "u8": 1}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\][^=]*? (copy|transpose)\(")


def layout_copies(hlo: str) -> tuple[int, int]:
  """(count, bytes) of copy and transpose ops in the compiled while-loop body."""
  count = total = 0
  for line in hlo.splitlines():
    m = _COPY.search(line)
    if m and "while/body" in line:
      dims = [int(d) for d in m.group(2).split(",") if d]
      count += 1
      total += int(np.prod(dims or [1])) * _BYTES.get(m.group(1), 4)
  return count, total


_SAMPLE_TYPES = {"temperature": float, "top_k": int, "top_p": float}


def sampling_controls(text: str) -> dict:
  """"top_k=20,top_p=0.8,temperature=0.7" -> {"top_k": 20, "top_p": 0.8, "temperature": 0.7}."""
  pairs = dict(item.split("=", 1) for item in text.split(",") if item)
  if not set(pairs) <= set(_SAMPLE_TYPES):
    raise ValueError(f"--sampling {text!r}: expected name=value pairs of {sorted(_SAMPLE_TYPES)}.")
  controls = {name: _SAMPLE_TYPES[name](value) for name, value in pairs.items()}
  if controls.get("temperature", 1.0) <= 0:
    raise ValueError(f"--sampling {text!r}: a sampled step needs temperature > 0.")
  return {"temperature": 1.0} | controls


def step_cost(config, params, *, batch: int, cache_len: int, window: int, mode: Mode,
              mask_token_id: int) -> dict:
  """Cost analysis and layout copies of one `run_steps` step (loop of 1 step)."""
  ones = np.ones((batch,), np.int32)
  state = loop.start(config, ones[:, None], ones,
                         np.full((batch,), cache_len - window, np.int32),
                         loop.new_controls(batch), cache_len=cache_len)
  compiled = loop.run_steps.lower(
      config, params, state, batching.eos_array(()), np.int32(mask_token_id), np.int32(1),
      np.bool_(False), window=window, real_slots=window, mode=mode).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  copies, copy_bytes = layout_copies(compiled.as_text())
  return {"flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          "layout_copies": copies, "layout_copy_bytes": copy_bytes}


def load(name: str, seed: int):
  """-> (config, params, mask id): "toy" (trained at start), an HF dir / run, or a named
  random shape."""
  if name == "toy":
    t = toy.train(seed=seed)
    return t.config, t.params, t.mask_token_id
  if name in SHAPES or name.lower() in qwen2.PRESETS:
    config = qwen2.Qwen2Config(**SHAPES[name]) if name in SHAPES else qwen2.preset(name)
    return config, qwen2.init_params(config, jax.random.key(seed)), config.vocab_size - 1
  m = loading.load_model(name, runtime=qwen2.DEFAULT_RUNTIME)
  return m.config, m.params, m.mask_token_id


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench decode", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="tiny",
                 help="HF dir, RUN_DIR, toy, or tiny | small | preset")
  p.add_argument("--batch-sizes", default="1,4,16,64")
  p.add_argument("--windows", default="1,5")
  p.add_argument("--cache-len", type=int, default=256, help="cache bucket (slots)")
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--mode", default="gated", choices=choices.values(Mode))
  p.add_argument("--sampling", default=None, metavar="top_k=20,top_p=0.8,temperature=0.7",
                 help="also time the step with every row sampled so (temperature 1.0 "
                      "unless given)")
  args = p.parse_args(argv)
  sample = None if args.sampling is None else sampling_controls(args.sampling)
  config, params, mask_id = load(args.model, args.seed)
  bw, rate = memory_bandwidth(), matmul_rate()
  print(f"model={args.model} params={qwen2.num_params(params):,} cache_len={args.cache_len} "
        f"memory bandwidth (array copy) {bw / 1e9:.1f} GB/s, matmul (f32 1024^3) "
        f"{rate / 1e9:.0f} GFLOP/s, both measured in this run; mode={args.mode}"
        + ("" if sample is None else f"; sampled: {args.sampling} vs greedy"))
  print(f"{'batch':>5} {'W':>2} {'slots':>5} {'ms/step':>8} {'mem roof':>8} {'flop roof':>9} "
        f"{'x roof':>6} {'GFLOP':>7} {'MB accessed':>11} {'copies':>6} {'copy MB':>8}"
        + ("" if sample is None else f" {'sampled ms':>10} {'x greedy':>8}"))
  for b in (int(x) for x in args.batch_sizes.split(",")):
    for w in (int(x) for x in args.windows.split(",")):
      c = step_cost(config, params, batch=b, cache_len=args.cache_len, window=w,
                    mode=args.mode, mask_token_id=mask_id)
      timed = functools.partial(timing.step_seconds, config, params, batch=b,
                                cache_len=args.cache_len, window=w, mode=args.mode,
                                mask_token_id=mask_id, steps=args.steps, repeats=5)
      s = timed()
      sampled = None if sample is None else timed(sample=sample)
      # the timed steps accept one token each (tau 1): slots read up to steps + W,
      # in whole attention chunks
      chunk = attention.CACHE_CHUNK
      read = min(args.cache_len, -(-(args.steps + w) // chunk) * chunk)
      mem = sum(forward_bytes(config, qwen2.DEFAULT_RUNTIME, b, read)) / bw
      flop = forward_flops(config, b * (2 * w - 1), (args.steps + w) // 2) / rate
      print(f"{b:5d} {w:2d} {b * (2 * w - 1):5d} {s * 1e3:8.3f} {mem * 1e3:8.3f} "
            f"{flop * 1e3:9.3f} {s / max(mem, flop):6.1f} {c['flops'] / 1e9:7.3f} "
            f"{c['bytes_accessed'] / 1e6:11.1f} {c['layout_copies']:6d} "
            f"{c['layout_copy_bytes'] / 1e6:8.2f}"
            + ("" if sampled is None else f" {sampled * 1e3:10.3f} {sampled / s:8.2f}"),
            flush=True)


if __name__ == "__main__":
  main()
