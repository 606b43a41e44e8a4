"""`python -m mars_jax.evaluate`: exact-match accuracy and tokens per forward.

Greedy decoding through `mars_jax.sampling` on GSM8K-format problems (the
synthetic test split, or a local JSONL of {"question", "answer"} with `#### N`),
for every (gate, window, tau) asked; prints a table and writes JSON and a Pareto
plot (accuracy vs tokens per forward).

  python -m mars_jax.evaluate --model RUN_DIR_OR_HF_DIR --task synthetic \
      --taus 1.0,0.95,0.9 --windows 1,4,5 --metrics probability,margin --out eval/
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

from tqdm.auto import tqdm

from mars_jax import sampling
from mars_jax.data import synthetic
from mars_jax.loading import LoadedModel, chat_prompt_ids, load_model


def load_problems(task: str, num: int | None = None, *, seed: int = 0) -> list[dict]:
  """"synthetic" (its test split, `num` problems) or a JSONL path of {question, answer}."""
  if task == "synthetic":
    return synthetic.generate(num or 500, seed=seed, split="test")
  if not os.path.isfile(task):
    raise FileNotFoundError(f"{task}: no such task file (use 'synthetic' or a JSONL of "
                            "{\"question\", \"answer\"} records).")
  problems = []
  with open(task) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
        problems.append({"question": rec["question"], "answer": rec["answer"]})
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{task}:{n}: expected a JSON object with 'question' and "
                         f"'answer' ({e}).") from e
      if synthetic.extract_answer(rec["answer"]) is None:
        raise ValueError(f"{task}:{n}: the answer has no '#### N' final answer.")
  if not problems:
    raise ValueError(f"{task}: no problems.")
  return problems[:num] if num else problems


def score(model: LoadedModel, problems: Sequence[dict], *, tau: float = 1.0, window: int = 1,
          metric: str = "probability", batch_size: int = 64, max_new_tokens: int = 64,
          progress: Any = None) -> dict:
  """Decodes every problem; -> {accuracy, tokens_per_forward, tokens, forwards, n,
  outputs}. tokens_per_forward = generated tokens / per-sample forwards (prefill
  included), so AR decoding gives exactly 1.0."""
  prompts = [chat_prompt_ids(model.tokenizer, [{"role": "user", "content": p["question"]}])
             for p in problems]
  correct = tokens = forwards = 0
  outputs = []
  for i in range(0, len(prompts), batch_size):
    res = sampling.generate(model.config, model.params, prompts[i:i + batch_size],
                            max_new_tokens=max_new_tokens, mask_token_id=model.mask_token_id,
                            eos_token_ids=model.eos_token_ids, tau=tau, window=window,
                            metric=metric)
    for j, toks in enumerate(res.tokens):
      text = model.tokenizer.decode(toks, skip_special_tokens=True)
      ok = synthetic.is_correct(text, problems[i + j]["answer"])
      correct += ok
      outputs.append({"output": text, "correct": bool(ok)})
    tokens += sum(len(t) for t in res.tokens)
    forwards += sum(res.num_forwards)
    if progress is not None:
      progress.update(len(res.tokens))
  return {"accuracy": correct / len(problems), "tokens_per_forward": tokens / max(forwards, 1),
          "tokens": tokens, "forwards": forwards, "n": len(problems), "outputs": outputs}


def sweep(model: LoadedModel, problems: Sequence[dict], *, taus: Sequence[float],
          windows: Sequence[int], metrics: Sequence[str], batch_size: int = 64,
          max_new_tokens: int = 64, show_progress: bool = True) -> list[dict]:
  """`score` for every (metric, window, tau); window 1 is run once (it ignores tau)."""
  settings = []
  for metric in metrics:
    for w in windows:
      for tau in ([1.0] if w == 1 else taus):
        if w == 1 and metric != metrics[0]:
          continue
        settings.append((metric, w, tau))
  rows = []
  with tqdm(total=len(settings) * len(problems), desc="evaluate", unit="problem",
            disable=not show_progress) as bar:
    for metric, w, tau in settings:
      r = score(model, problems, tau=tau, window=w, metric=metric, batch_size=batch_size,
                max_new_tokens=max_new_tokens, progress=bar)
      rows.append({"metric": metric, "window": w, "tau": tau,
                   **{k: v for k, v in r.items() if k != "outputs"}})
  return rows


def format_table(rows: Sequence[dict]) -> str:
  head = f"{'gate':<12}{'W':>3}{'tau':>7}{'accuracy':>10}{'tok/fwd':>9}{'n':>6}"
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['metric']:<12}{r['window']:>3}{r['tau']:>7.2f}"
                 f"{100 * r['accuracy']:>9.1f}%{r['tokens_per_forward']:>9.2f}{r['n']:>6}")
  return "\n".join(lines)


def pareto_plot(series: dict[str, Sequence[dict]], path: str, title: str = "") -> None:
  """Accuracy vs tokens per forward, one marker series per label."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for label, rows in series.items():
    pts = sorted((r["tokens_per_forward"], 100 * r["accuracy"]) for r in rows)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label, ms=4)
  ax.set_xlabel("tokens per forward")
  ax.set_ylabel("exact-match accuracy (%)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _floats(s: str) -> list[float]:
  return [float(x) for x in s.split(",") if x]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.evaluate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="HF directory, RUN_DIR or RUN_DIR/STEP")
  p.add_argument("--task", default="synthetic", help="'synthetic' or a GSM8K-format JSONL")
  p.add_argument("--num-problems", type=int, default=500)
  p.add_argument("--taus", default="1.0,0.95,0.9,0.8,0.7")
  p.add_argument("--windows", default="1,4,5", help="proposals per forward (1 = AR)")
  p.add_argument("--metrics", default="probability,margin",
                 help="gates: probability, margin, entropy")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--out", default=None, help="directory for results.json and pareto.png")
  args = p.parse_args(argv)
  model = load_model(args.model)
  problems = load_problems(args.task, args.num_problems)
  rows = sweep(model, problems, taus=_floats(args.taus),
               windows=[int(w) for w in args.windows.split(",")],
               metrics=args.metrics.split(","), batch_size=args.batch_size,
               max_new_tokens=args.max_new_tokens)
  print(format_table(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"model": args.model, "task": args.task, "rows": rows}, f, indent=2)
    series: dict[str, list] = {}
    for r in rows:
      series.setdefault(f"{r['metric']} W={r['window']}", []).append(r)
    pareto_plot(series, os.path.join(args.out, "pareto.png"), title=args.model)
    print(f"wrote {args.out}/results.json and pareto.png")


if __name__ == "__main__":
  main()
