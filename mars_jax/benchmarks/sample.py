"""`python -m mars_jax.bench sample`: MARS decoding vs our jitted AR loop vs transformers.

On the same weights, in the same run, for each batch size: tokens per second and
tokens per forward of `sampling.generate` at window 1 (our AR loop), of gated
MARS (each W > 1 and tau), of lossless MARS (each W > 1: output equal to greedy
AR, checked), of the load-aware window policy (`window="auto"`, gated at the
first tau and lossless), and of transformers' greedy `generate` with its KV
cache on the weights exported by `hf.save_pretrained` (the outside peer). EOS is
ignored, so every sample generates exactly --max-new-tokens and all rows time
the same amount of output. Compilation, warm-up and the policy's cost
calibration are not timed; our calls are timed round-robin, --repeats rounds,
and each row keeps its best round; the peer is timed apart, then left idle for a
second (torch's worker threads keep spinning after a call and slowed whichever of
our calls ran next on a 2-core CPU by up to 2x). Each row also gives the tokens per second that
the memory-bandwidth roofline allows at its tokens per forward (params plus the
K/V cache read once per forward, at the bandwidth of an array copy measured in the
same run).

--model: an HF directory or a training run (RUN_DIR[/STEP]); "toy": the toy of
`mars_jax.benchmarks.toy`, trained at start (seconds) so that its MASK proposals
are right (an upper bound of acceptance: the regime of a trained checkpoint);
or a random-init shape: "tiny" (configs/tiny.py's model), "small" (8 layers,
512 wide, 32k vocab) or a Qwen2.5 preset name. On random weights the gate sees
near-uniform distributions: tau 0 accepts every proposal (W tokens per forward),
tau >= max top probability accepts none (the cost of the W-1 extra slots).
--prompts: "random" ids of --prompt-len tokens, "synthetic" (the synthetic
task's test questions, chat-formatted: needs a model with a tokenizer), or
"toy" (the toy's cycle; the default with --model toy).
--costs PREFIX: the policy's cost tables, PREFIX.gated.json and
PREFIX.lossless.json, loaded when present, else measured and written there.

--temperature T > 0 (with --top-k, --top-p): every row samples instead, prompt i with
seed i: our AR loop is AR sampling, gated MARS draws its proposals and gates them
(`mars_jax.decoding.gates`), lossless MARS is AR sampling token for token (=AR shows
it), and the peer is transformers' sampling generate. "acc" is the share of the W-1
extra slots a forward filled, (tokens per forward - 1) / (W - 1). After the table, the
drafts' acceptance under our shared-noise coupling against the speculative-sampling
rule, slot by slot, on the same contexts (`mars_jax.benchmarks.acceptance`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Callable

import jax
import numpy as np

from mars_jax.core import choices
from mars_jax.checkpoints import hf
from mars_jax.decoding import loading, sampler as sampling
from mars_jax.evaluation import evaluate
from mars_jax.benchmarks import acceptance, roofline, toy
from mars_jax.decoding import gates
from mars_jax.core.choices import Mode
from mars_jax.models import qwen2
from mars_jax.models.config import PRESETS, Qwen2Config
from mars_jax.decoding.window_policy import CostTable, WindowPolicy

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


@dataclasses.dataclass
class BenchModel:
  """Weights and how to draw prompts: prompts(n, rng) -> n token lists."""
  config: Qwen2Config
  params: Any
  mask_id: int
  prompts: Callable[[int, np.random.Generator], list[list[int]]]


def _random_prompts(length: int, high: int):
  return lambda n, rng: rng.integers(0, high, (n, length)).tolist()


def _synthetic_prompts(tokenizer):
  problems = evaluate.load_problems("synthetic", 512)

  def draw(n, rng):
    return [loading.chat_prompt_ids(tokenizer,
                                    [{"role": "user", "content": problems[i]["question"]}])
            for i in rng.choice(len(problems), n, replace=False)]
  return draw


def load_model(args) -> BenchModel:
  """--model and --prompts -> a `BenchModel`."""
  name, kind = args.model, args.prompts
  tokenizer = None
  if name == "toy":
    t = toy.train(length=max(toy.PROMPT_LEN + 8, args.prompt_len + args.max_new_tokens),
                  steps=150, seed=args.seed)
    config, params, mask_id = t.config, t.params, t.mask_token_id
    if kind in ("toy", "auto"):
      return BenchModel(config, params, mask_id,
                        lambda n, rng: t.prompts(n, int(rng.integers(1 << 30)), args.prompt_len))
  elif os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
    m = loading.load_model(name, runtime=qwen2.DEFAULT_RUNTIME)  # float32, as the peer
    config, params, mask_id, tokenizer = m.config, m.params, m.mask_token_id, m.tokenizer
  elif os.path.isdir(name):
    config, params = hf.load_pretrained(name)
    try:
      tokenizer, mask_id = hf.load_tokenizer(name, config.vocab_size)
    except (OSError, ValueError):
      mask_id = config.vocab_size - 1
  elif name in SHAPES or name.lower() in PRESETS:
    config = Qwen2Config(**SHAPES[name]) if name in SHAPES else qwen2.preset(name)
    params, mask_id = qwen2.init_params(config, jax.random.key(args.seed)), config.vocab_size - 1
  else:
    raise ValueError(f"--model {name!r}: not a directory, nor toy, nor one of "
                     f"{sorted(SHAPES) + sorted(PRESETS)}.")
  if kind == "synthetic":
    if tokenizer is None:
      raise ValueError("--prompts synthetic needs a model directory with a tokenizer.")
    return BenchModel(config, params, mask_id, _synthetic_prompts(tokenizer))
  if kind not in ("random", "auto"):
    raise ValueError(f"--prompts {kind} needs --model toy." if kind == "toy"
                     else f"--prompts {kind!r}: expected random, synthetic or toy.")
  return BenchModel(config, params, mask_id, _random_prompts(args.prompt_len, mask_id))


def ours(m: BenchModel, prompts, *, max_new, window, tau, metric, mode="gated", policy=None,
         runtime: qwen2.Runtime = qwen2.DEFAULT_RUNTIME, sample: dict | None = None):
  """A call of our sampler (params computed in `runtime`; sample: temperature, top_k,
  top_p, prompt i seeded i) -> (tokens, tokens per forward, forwards, windows used)."""
  seeds = list(range(len(prompts)))

  def call():
    out = sampling.generate(m.config, m.params, prompts, max_new_tokens=max_new,
                            mask_token_id=m.mask_id, eos_token_ids=(), tau=tau, window=window,
                            metric=metric, mode=mode, policy=policy, runtime=runtime,
                            seed=seeds, **(sample or {}))
    return out.tokens, out.tokens_per_forward, out.forwards, out.windows
  return call


def transformers_generate(model, prompts, *, max_new, sample: dict | None = None):
  """A call of transformers' generate with its KV cache (prompts left-padded), greedy or
  sampling with `sample`'s temperature, top_k, top_p -> (tokens, 1.0, forwards,
  {1: forwards})."""
  warp = {} if not sample or not sample["temperature"] else dict(
      do_sample=True, temperature=sample["temperature"], top_k=sample["top_k"] or None,
      top_p=sample["top_p"])
  import torch  # pylint: disable=import-outside-toplevel
  width = max(map(len, prompts))
  ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long,
                     device=model.device)
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                      dtype=torch.long, device=model.device)

  def call():
    with torch.no_grad():
      out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, use_cache=True,
                           pad_token_id=0, **({"do_sample": False} | warp))
    return out[:, width:].tolist(), 1.0, max_new, {1: max_new}
  return call


MIN_TIMED_S = 0.2  # one measurement repeats a call until it lasts this long
PEER_PAUSE_S = 1.0  # idle time after the peer, so its spinning worker threads go to sleep


def _seconds_per_call(call) -> float:
  """Mean seconds of `call` over as many back-to-back runs as fill MIN_TIMED_S."""
  runs, start = 0, time.perf_counter()
  while True:
    call()
    runs += 1
    elapsed = time.perf_counter() - start
    if elapsed >= MIN_TIMED_S:
      return elapsed / runs


def best_times(calls: dict[Any, Any], repeats: int, isolated: tuple = ()
               ) -> tuple[dict[Any, float], dict[Any, Any]]:
  """Warms every call up (compiles, calibrates), then times them: the `isolated` ones
  (the peer: another runtime whose thread pool keeps spinning after a call and slows
  whatever runs next on a small CPU) each on its own followed by a pause, the others
  round-robin, `repeats` rounds (spreading the load of other jobs over all rows).
  A measurement is the mean of back-to-back calls over at least MIN_TIMED_S.
  -> (best seconds per call, each call's output)."""
  outputs = {name: call() for name, call in calls.items()}
  best = {name: float("inf") for name in calls}
  for name in isolated:
    for _ in range(repeats):
      best[name] = min(best[name], _seconds_per_call(calls[name]))
    time.sleep(PEER_PAUSE_S)
  for _ in range(repeats):
    for name, call in calls.items():
      if name not in isolated:
        best[name] = min(best[name], _seconds_per_call(call))
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


def make_policies(args, windows: list[int]) -> dict[str, WindowPolicy]:
  """One policy per mode; cost tables from --costs files when present."""
  policies = {}
  for mode in choices.values(Mode):
    path = f"{args.costs}.{mode}.json" if args.costs else ""
    costs = CostTable.load(path) if path and os.path.isfile(path) else CostTable(
        meta={"model": args.model, "mode": mode, "backend": jax.default_backend()})
    policies[mode] = WindowPolicy(windows, costs, round_steps=args.round_steps)
  return policies


def roofline_forwards_per_s(m: BenchModel, batch: int, args, bandwidth: float) -> float:
  """Forwards per second at the memory-bandwidth roofline: each reads the params once and
  the K/V of the mean live length (prompt + half the new tokens)."""
  live = args.prompt_len + args.max_new_tokens // 2
  return bandwidth / sum(roofline.forward_bytes(m.config, qwen2.DEFAULT_RUNTIME, batch, live))


def bench_batch(m: BenchModel, peer, prompts, windows, taus, args,
                policies: dict[str, WindowPolicy], bandwidth: float) -> list[dict]:
  """All rows of one batch size; speedups are against our AR loop on the same prompts;
  `roofline_tokens_per_s`: the row's tokens per forward at the memory roofline."""
  sample = sample_controls(args)
  kw = dict(max_new=args.max_new_tokens, metric=args.metric, sample=sample)
  calls = {("ours AR", 1, 1.0): ours(m, prompts, window=1, tau=1.0, **kw)}
  if peer is not None:
    calls[("transformers", 1, 1.0)] = transformers_generate(peer, prompts,
                                                            max_new=args.max_new_tokens,
                                                            sample=sample)
  for window in (w for w in windows if w > 1):
    for tau in taus:
      calls[("ours MARS", window, tau)] = ours(m, prompts, window=window, tau=tau, **kw)
    calls[("ours lossless", window, 1.0)] = ours(m, prompts, window=window, tau=1.0,
                                                 mode="lossless", **kw)
  calls[("auto MARS", "auto", taus[0])] = ours(m, prompts, window="auto", tau=taus[0],
                                               policy=policies["gated"], **kw)
  calls[("auto lossless", "auto", 1.0)] = ours(m, prompts, window="auto", tau=1.0,
                                               mode="lossless", policy=policies["lossless"],
                                               **kw)
  seconds, outputs = best_times(calls, args.repeats,
                                isolated=tuple(k for k in calls if k[0] == "transformers"))
  ar_tokens = outputs[("ours AR", 1, 1.0)][0]
  ar_rate = sum(map(len, ar_tokens)) / seconds[("ours AR", 1, 1.0)]
  roof = roofline_forwards_per_s(m, len(prompts), args, bandwidth) * len(prompts)
  rows = []
  for key, (tokens, per_forward, forwards, used) in outputs.items():
    rate = sum(map(len, tokens)) / seconds[key]
    rows.append({"batch": len(prompts), "impl": key[0], "window": key[1], "tau": key[2],
                 "tokens_per_s": rate, "tokens_per_forward": per_forward,
                 "forwards": forwards, "seconds": seconds[key],
                 "acceptance": ((per_forward - 1) / (key[1] - 1)
                                if isinstance(key[1], int) and key[1] > 1 else None),
                 "speedup_vs_ours_ar": rate / ar_rate,
                 "roofline_tokens_per_s": roof * per_forward,
                 "same_tokens_as_ours_ar": float(np.mean([a == b for a, b in
                                                          zip(ar_tokens, tokens)])),
                 "windows_used": {str(w): n for w, n in sorted(used.items())}})
  return rows


def sample_controls(args) -> dict | None:
  """--temperature, --top-k, --top-p as `sampling.generate` keywords (None: greedy)."""
  if not args.temperature:
    return None
  return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}


def acceptance_rows(m: BenchModel, windows, args, rng) -> list[dict]:
  """Coupling vs the speculative-sampling rule, per draft slot, at each W > 1."""
  prompts = m.prompts(max(_ints(args.batch_sizes)), rng)
  rows = []
  for window in (w for w in windows if w > 1):
    r = acceptance.draft_acceptance(m.config, m.params, prompts, window=window,
                                    mask_token_id=m.mask_id, max_new_tokens=args.max_new_tokens,
                                    **sample_controls(args))
    rows.append({"window": window, **r})
    print(f"W={window}: drafts kept per slot, coupling "
          + " ".join(f"{a:.3f}" for a in r["coupling"]) + " | rule "
          + " ".join(f"{a:.3f}" for a in r["rule"]) + f"  ({r['drafts']} contexts)", flush=True)
  return rows


def run(args) -> dict:
  m = load_model(args)
  windows = _ints(args.windows) if args.windows else sorted({1, 2, 4, args.block_size + 1})
  rng = np.random.default_rng(args.seed)
  facts = {"model": args.model, "prompts": args.prompts, "config": m.config.to_hf_dict(),
           "metric": args.metric, "prompt_len": args.prompt_len,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "sampling": sample_controls(args),
           "round_steps": args.round_steps, "backend": jax.default_backend(),
           "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
           "load_average": os.getloadavg()}
  policies = make_policies(args, windows)
  facts["memory_bandwidth"] = bandwidth = roofline.memory_bandwidth()
  with tempfile.TemporaryDirectory(prefix="mars-bench-") as tmp:
    peer = None
    if not args.no_transformers:
      peer, peer_facts = load_transformers(m.config, m.params, os.path.join(tmp, "hf"),
                                           args.torch_threads)
      facts.update(peer_facts)
    rows = []
    for i, bs in enumerate(_ints(args.batch_sizes)):
      batch_rows = bench_batch(m, peer, m.prompts(bs, rng), windows, _floats(args.taus), args,
                               policies, bandwidth)
      print_rows(batch_rows, header=i == 0)
      rows += batch_rows
  if args.costs:
    for mode, policy in policies.items():
      policy.costs.save(f"{args.costs}.{mode}.json")
  facts["costs"] = {mode: p.costs.to_json() for mode, p in policies.items()}
  if args.temperature:
    facts["draft_acceptance"] = acceptance_rows(m, windows, args, rng)
  return {**facts, "rows": rows}


def print_rows(rows, *, header: bool) -> None:
  if header:
    print(f"{'batch':>5} {'impl':<13} {'W':>4} {'tau':>5} {'tokens/s':>10} {'tok/fwd':>8} "
          f"{'acc':>5} {'vs our AR':>9} {'=AR':>5} {'roof tok/s':>10} {'%roof':>5}  "
          "W used (batch forwards)")
  for r in rows:
    used = " ".join(f"{w}:{n}" for w, n in r["windows_used"].items())
    acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
    print(f"{r['batch']:>5} {r['impl']:<13} {r['window']:>4} {r['tau']:>5.2f} "
          f"{r['tokens_per_s']:>10.1f} {r['tokens_per_forward']:>8.2f} {acc:>5} "
          f"{r['speedup_vs_ours_ar']:>8.2f}x {r['same_tokens_as_ours_ar']:>5.0%} "
          f"{r['roofline_tokens_per_s']:>10.0f} "
          f"{r['tokens_per_s'] / r['roofline_tokens_per_s']:>5.0%}  {used}",
          flush=True)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench sample", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="tiny",
                 help="HF dir, RUN_DIR[/STEP], toy, or tiny | small | a Qwen2.5 preset")
  p.add_argument("--prompts", default="auto",
                 help="random | synthetic | toy (auto: toy for --model toy, else random)")
  p.add_argument("--batch-sizes", default="1,4,8,16,32,64")
  p.add_argument("--block-size", type=int, default=4, help="B: windows default to 1,2,4,B+1")
  p.add_argument("--windows", default="", help="comma list overriding the default windows")
  p.add_argument("--taus", default="0.9", help="comma list of gate thresholds for W > 1; "
                                               "the policy's gated rows use the first")
  p.add_argument("--metric", choices=gates.METRICS, default="probability")
  p.add_argument("--prompt-len", type=int, default=32, help="random and toy prompts")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--round-steps", type=int, default=8,
                 help="decoding steps between two choices of the window policy")
  p.add_argument("--costs", default="", help="cost-table prefix (see above)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sample at this temperature (0: greedy, as before)")
  p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
  p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
  p.add_argument("--torch-threads", type=int, default=0,
                 help="torch CPU threads for the peer (0: torch's default); on a CPU shared "
                      "with other jobs, 1 avoids OpenMP barrier stalls")
  p.add_argument("--out", default="bench_sample.json", help="JSON results file")
  args = p.parse_args(argv)
  print(f"model={args.model} backend={jax.default_backend()} cpus={os.cpu_count()} "
        f"load={os.getloadavg()[0]:.1f} prompt_len={args.prompt_len} "
        f"max_new_tokens={args.max_new_tokens} metric={args.metric} "
        f"temperature={args.temperature} top_k={args.top_k} top_p={args.top_p}; peer: "
        "transformers generate (KV cache) on the exported weights; =AR: share of samples "
        "whose tokens equal our AR loop's")
  result = run(args)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
