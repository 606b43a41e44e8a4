"""`python -m mars_jax.bench sample`: MARS decoding vs our jitted AR loop vs transformers.

On the same weights, in the same run, for each batch size: tokens per second and
tokens per forward of `sampling.generate` at windows 1 (our AR loop), 2, 4 and
B+1, and of transformers' greedy `generate` with its KV cache on the weights
exported by `hf.save_pretrained` (the outside peer). Prompts are random ids of one
length; EOS is ignored, so every sample generates exactly --max-new-tokens and all
rows time the same amount of output. Compilation and warm-up are not timed; the calls
are timed round-robin, --repeats rounds, and each row keeps its best round.

--model: an HF directory, or a random-init shape: "tiny" (configs/tiny.py's
model), "small" (8 layers, 512 wide, 32k vocab) or a Qwen2.5 preset name. On
random weights the gate sees near-uniform distributions: tau 0 accepts every
proposal (the upper bound of MARS: W tokens per forward), tau >= max top
probability accepts none (the cost of the W-1 extra slots). A trained MARS
checkpoint lies between.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np

from mars_jax import gates, hf, sampling
from mars_jax.models import qwen2
from mars_jax.models.config import PRESETS, Qwen2Config

SHAPES = {
    "tiny": dict(vocab_size=320, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                 rope_theta=10000.0),
    "small": dict(vocab_size=32768, hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  tie_word_embeddings=True, rope_theta=10000.0),
}


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def load_model(name: str, seed: int) -> tuple[Qwen2Config, Any, int]:
  """HF directory or random-init shape -> (config, params, mask_token_id)."""
  if os.path.isdir(name):
    config, params = hf.load_pretrained(name)
    try:
      mask_id = hf.load_tokenizer(name, config.vocab_size)[1]
    except (OSError, ValueError):
      mask_id = config.vocab_size - 1
    return config, params, mask_id
  if name in SHAPES:
    config = Qwen2Config(**SHAPES[name])
  elif name.lower() in PRESETS:
    config = qwen2.preset(name)
  else:
    raise ValueError(f"--model {name!r}: not a directory, nor one of "
                     f"{sorted(SHAPES) + sorted(PRESETS)}.")
  return config, qwen2.init_params(config, jax.random.key(seed)), config.vocab_size - 1


def ours(config, params, prompts, *, max_new, mask_id, window, tau, metric):
  """A call of our sampler -> (tokens list[list[int]], tokens per forward, forwards)."""
  def call():
    out = sampling.generate(config, params, prompts, max_new_tokens=max_new,
                            mask_token_id=mask_id, eos_token_ids=(), tau=tau, window=window,
                            metric=metric)
    return out.tokens, out.tokens_per_forward, out.forwards
  return call


def transformers_generate(model, prompts, *, max_new):
  """A call of transformers' greedy generate with its KV cache -> (tokens, 1.0, forwards)."""
  import torch  # pylint: disable=import-outside-toplevel
  ids = torch.tensor(prompts, dtype=torch.long, device=model.device)

  def call():
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=max_new, use_cache=True, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist(), 1.0, max_new
  return call


def best_times(calls: dict[str, Any], repeats: int) -> tuple[dict[str, float], dict[str, Any]]:
  """Warms every call up (compiles), then times them round-robin, `repeats` rounds;
  -> (best seconds per call, each call's output). Round-robin spreads the load of
  other jobs on a shared machine over all rows, and the best round drops it."""
  outputs = {name: call() for name, call in calls.items()}
  best = {name: float("inf") for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      call()
      best[name] = min(best[name], time.perf_counter() - start)
  return best, outputs


def load_transformers(config, params, directory: str, threads: int):
  """Exports `params` with hf.save_pretrained and loads them in transformers (float32),
  on CUDA when torch has it. -> (model, facts for the JSON)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  if threads:
    torch.set_num_threads(threads)
  hf.save_pretrained(config, params, directory, dtype="float32")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32).eval()
  if torch.cuda.is_available():
    model = model.to("cuda")
  model.generation_config.eos_token_id = None  # as ours: no EOS, exactly max_new tokens
  return model, {"peer_device": str(model.device), "torch_threads": torch.get_num_threads(),
                 "transformers": transformers.__version__, "torch": torch.__version__}


def bench_batch(config, params, peer, prompts, windows, taus, args, mask_id) -> list[dict]:
  """All rows of one batch size; speedups are against our AR loop on the same prompts."""
  kw = dict(max_new=args.max_new_tokens, mask_id=mask_id, metric=args.metric)
  calls = {("ours AR", 1, 1.0): ours(config, params, prompts, window=1, tau=1.0, **kw)}
  if peer is not None:
    calls[("transformers", 1, 1.0)] = transformers_generate(peer, prompts,
                                                            max_new=args.max_new_tokens)
  for window in (w for w in windows if w > 1):
    for tau in taus:
      calls[("ours MARS", window, tau)] = ours(config, params, prompts, window=window,
                                               tau=tau, **kw)
  seconds, outputs = best_times(calls, args.repeats)
  ar_tokens = outputs[("ours AR", 1, 1.0)][0]
  ar_rate = sum(map(len, ar_tokens)) / seconds[("ours AR", 1, 1.0)]
  rows = []
  for key, (tokens, per_forward, forwards) in outputs.items():
    rate = sum(map(len, tokens)) / seconds[key]
    row = {"batch": len(prompts), "impl": key[0], "window": key[1], "tau": key[2],
           "tokens_per_s": rate, "tokens_per_forward": per_forward, "forwards": forwards,
           "seconds": seconds[key], "speedup_vs_ours_ar": rate / ar_rate}
    if key[0] == "transformers":
      row["same_tokens_as_ours_ar"] = float(np.mean([a == b for a, b in zip(ar_tokens, tokens)]))
    rows.append(row)
  return rows


def run(args) -> dict:
  config, params, mask_id = load_model(args.model, args.seed)
  windows = _ints(args.windows) if args.windows else sorted({1, 2, 4, args.block_size + 1})
  rng = np.random.default_rng(args.seed)
  facts = {"model": args.model, "config": config.to_hf_dict(), "metric": args.metric,
           "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "backend": jax.default_backend(),
           "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count()}
  with tempfile.TemporaryDirectory(prefix="mars-bench-") as tmp:
    peer = None
    if not args.no_transformers:
      peer, peer_facts = load_transformers(config, params, os.path.join(tmp, "hf"),
                                           args.torch_threads)
      facts.update(peer_facts)
    rows = []
    for i, bs in enumerate(_ints(args.batch_sizes)):
      prompts = rng.integers(0, mask_id, (bs, args.prompt_len)).tolist()
      batch_rows = bench_batch(config, params, peer, prompts, windows, _floats(args.taus),
                               args, mask_id)
      print_rows(batch_rows, header=i == 0)
      rows += batch_rows
  return {**facts, "rows": rows}


def print_rows(rows, *, header: bool) -> None:
  if header:
    print(f"{'batch':>5} {'impl':<13} {'W':>2} {'tau':>5} {'tokens/s':>10} {'tok/fwd':>8} "
          f"{'vs our AR':>9}  note")
  for r in rows:
    note = (f"same tokens as ours AR: {r['same_tokens_as_ours_ar']:.0%}"
            if "same_tokens_as_ours_ar" in r else "")
    print(f"{r['batch']:>5} {r['impl']:<13} {r['window']:>2} {r['tau']:>5.2f} "
          f"{r['tokens_per_s']:>10.1f} {r['tokens_per_forward']:>8.2f} "
          f"{r['speedup_vs_ours_ar']:>8.2f}x  {note}", flush=True)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench sample", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="tiny",
                 help="HF directory, or tiny | small | a Qwen2.5 preset (random init)")
  p.add_argument("--batch-sizes", default="1,4,8,16,32,64")
  p.add_argument("--block-size", type=int, default=4, help="B: windows default to 1,2,4,B+1")
  p.add_argument("--windows", default="", help="comma list overriding the default windows")
  p.add_argument("--taus", default="0.9", help="comma list of gate thresholds for W > 1")
  p.add_argument("--metric", choices=gates.METRICS, default="probability")
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
  p.add_argument("--torch-threads", type=int, default=0,
                 help="torch CPU threads for the peer (0: torch's default); on a CPU shared "
                      "with other jobs, 1 avoids OpenMP barrier stalls")
  p.add_argument("--out", default="bench_sample.json", help="JSON results file")
  args = p.parse_args(argv)
  print(f"model={args.model} backend={jax.default_backend()} cpus={os.cpu_count()} "
        f"prompt_len={args.prompt_len} max_new_tokens={args.max_new_tokens} "
        f"metric={args.metric}; peer: transformers greedy generate (KV cache) on the "
        "exported weights")
  result = run(args)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
