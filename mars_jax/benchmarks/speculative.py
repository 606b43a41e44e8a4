"""`python -m mars_jax.bench speculative`: two-model decoding against its target alone.

A drafter and a target several times its size, both trained on the embedded task, each
as an AR-SFT parent (stage 1) and its MARS child (stage 2):

  python -m mars_jax.train --config configs/tiny.py --workdir runs/tiny                # drafters
  python -m mars_jax.train --config configs/tiny_target.py --workdir runs/tiny_target  # targets

Rows, for each batch size b, on the same --prompts held-out questions of the task
(chat-formatted), decoded b at a time:

  target alone      the AR target at W = 1 (the peer: our jitted AR loop), the MARS
                    target at W = 1 and lossless at W = B + 1 (its own drafts);
  drafter + target  AR or MARS drafter x AR or MARS target, K = --draft-window drafts a
                    round; a MARS drafter drafts min(B + 1, K) a forward while --tau
                    holds, a MARS target adds min(B, K) MASK slots to its forward.

Every row is exact: its tokens equal its target's greedy AR tokens (checked: "=AR").
tokens/s counts generated tokens (up to EOS) per second; the calls are timed round-robin,
--repeats rounds, best round kept (`sample.best_times`), compilation not timed.
"tok/fwd" is tokens per target forward, "dft/tok" drafter forwards per committed token.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import numpy as np

from mars_jax.decoding import loading, sampler as sampling
from mars_jax.evaluation import evaluate
from mars_jax.benchmarks.sample import best_times
from mars_jax.decoding import speculative
from mars_jax.decoding.batching import GenerateResult

ROLES = {"ar_drafter": "runs/tiny/stage1", "mars_drafter": "runs/tiny/hf",
         "ar_target": "runs/tiny_target/stage1", "mars_target": "runs/tiny_target/hf"}


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench speculative", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  for role, default in ROLES.items():
    p.add_argument(f"--{role.replace('_', '-')}", default=default,
                   help=f"HF directory or run (default {default})")
  p.add_argument("--batch-sizes", default="1,4,16")
  p.add_argument("--prompts", type=int, default=16, help="questions per batch size")
  p.add_argument("--draft-window", type=int, default=4, help="drafts per round, K")
  p.add_argument("--tau", type=float, default=0.9,
                 help="the gate of MARS drafting (drafter and target MASK slots)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=None, help="write the rows as JSON here")
  return p.parse_args(argv)


def merged(results: list) -> GenerateResult:
  """The results of consecutive batches as one (forwards summed)."""
  return GenerateResult(
      tokens=[t for r in results for t in r.tokens],
      num_forwards=[f for r in results for f in r.num_forwards],
      forwards=sum(r.forwards for r in results),
      drafter_forwards=[f for r in results for f in r.drafter_forwards])


def rows_of(models: dict, paths: dict, k: int) -> dict[str, dict]:
  """name -> generate kwargs of each row (its target's model included)."""
  def window(role):  # a drafter's tokens per forward; a target's W (K drafts at most)
    return loading.trained_window(paths[role], k if role.endswith("drafter") else k + 1)

  def drafter(role):
    m = models[role]
    return speculative.Drafter(m.config, m.params, m.mask_token_id, m.runtime, window(role))

  lossless = loading.trained_window(paths["mars_target"], np.iinfo(np.int32).max)
  out = {"AR target alone": dict(target="ar_target", window=1),
         "MARS target alone, W=1": dict(target="mars_target", window=1),
         f"MARS target alone, lossless W={lossless}": dict(target="mars_target",
                                                          window=lossless, mode="lossless")}
  for d in ("ar_drafter", "mars_drafter"):
    for t in ("ar_target", "mars_target"):
      name = f"{d.split('_')[0].upper()} drafter + {t.split('_')[0].upper()} target"
      out[name] = dict(target=t, window=window(t), drafter=drafter(d), draft_window=k)
  return out


def main(argv=None) -> None:
  args = parse(argv)
  paths = {role: getattr(args, role) for role in ROLES}
  models = {role: loading.load_model(path) for role, path in paths.items()}
  for role in ("ar_drafter", "mars_drafter", "mars_target"):
    loading.check_same_tokenizer(models["ar_target"].tokenizer, models[role].tokenizer,
                                 paths["ar_target"], paths[role])
  settings, _, _ = evaluate.synthetic_settings(paths["ar_target"])
  problems = evaluate.load_problems("synthetic", 512, seed=settings["seed"],
                                    test_fraction=settings["test_fraction"],
                                    difficulty=settings["difficulty"])
  tokenizer = models["ar_target"].tokenizer
  rows = rows_of(models, paths, args.draft_window)
  print(f"drafters {paths['ar_drafter']} (AR), {paths['mars_drafter']} (MARS); targets "
        f"{paths['ar_target']} (AR), {paths['mars_target']} (MARS); K={args.draft_window} "
        f"tau={args.tau}, {args.max_new_tokens} new tokens at most, EOS ends a row; "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}")
  params = {role: sum(x.size for x in jax.tree.leaves(m.params)) for role, m in models.items()}
  print("params: " + ", ".join(f"{role} {n:,}" for role, n in params.items()))
  results = []
  prompts = [loading.chat_prompt_ids(tokenizer, [{"role": "user", "content": p["question"]}])
             for p in problems[:args.prompts]]
  for batch in [int(b) for b in args.batch_sizes.split(",")]:
    calls = {}
    for name, row in rows.items():
      target = models[row["target"]]
      kw = {key: value for key, value in row.items() if key != "target"}

      def call(target=target, kw=kw, batch=batch):
        return merged([sampling.generate(target.config, target.params, prompts[i:i + batch],
                                         max_new_tokens=args.max_new_tokens,
                                         mask_token_id=target.mask_token_id,
                                         eos_token_ids=target.eos_token_ids, tau=args.tau, **kw)
                       for i in range(0, len(prompts), batch)])
      calls[name] = call
    seconds, outputs = best_times(calls, args.repeats)
    base = seconds["AR target alone"]
    print(f"\nbatch {batch} ({len(prompts)} questions)\n| row | tokens/s | vs AR target | tok/fwd | dft/tok | target "
          "fwd | =AR |\n|---|---|---|---|---|---|---|")
    for name, row in rows.items():
      out = outputs[name]
      ar = outputs["AR target alone" if row["target"] == "ar_target"
                   else "MARS target alone, W=1"]
      tokens = sum(out.num_tokens)
      r = dict(batch=batch, row=name, tokens_per_s=tokens / seconds[name],
               speedup=(tokens / seconds[name]) / (sum(outputs["AR target alone"].num_tokens)
                                                   / base),
               tokens_per_forward=out.tokens_per_forward,
               drafter_forwards_per_token=out.drafter_forwards_per_token,
               target_forwards=out.forwards, equal_to_ar=out.tokens == ar.tokens,
               tokens=tokens, seconds=seconds[name])
      results.append(r)
      print(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['tokens_per_forward']:.2f} | {r['drafter_forwards_per_token']:.2f} | "
            f"{r['target_forwards']} | {'yes' if r['equal_to_ar'] else 'NO'} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "params": params, "rows": results}, f, indent=1)
  if not all(r["equal_to_ar"] for r in results):
    raise SystemExit("a row differs from its target's greedy AR output")
