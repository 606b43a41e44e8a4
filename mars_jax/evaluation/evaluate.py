"""Exact-match accuracy and tokens per forward of a model on GSM8K-format problems: the
problems (the synthetic test split drawn with a run's recorded settings, or a JSONL),
scoring one (gate, window, tau) setting, sweeps, the table and the Pareto plot, and the
evaluate command behind `python -m mars_jax.evaluate` (the CLI, mars_jax/evaluate.py).

Not lm-evaluation-harness tasks: those are mars_jax.evaluation.lm_eval.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from tqdm.auto import tqdm

from mars_jax.decoding import sampler as sampling
from mars_jax.core.choices import Metric
from mars_jax.data import synthetic
from mars_jax.decoding import gates, mesh as decode_mesh
from mars_jax.decoding.prompts import budgets, check_sampling_flags, prompt_seeds
from mars_jax.decoding.loading import (LoadedModel, chat_prompt_ids, load_model, model_path,
                                       warn_untrained_windows)


def load_problems(task: str, num: int | None = None, *, seed: int = 0,
                  test_fraction: float = 0.1, difficulty: str = "standard") -> list[dict]:
  """"synthetic" (its test split, `num` problems, drawn with the given generator
  settings: pass a run's, see `synthetic_settings`) or a JSONL path of {question, answer}."""
  if task == "synthetic":
    return synthetic.generate(num or 500, seed=seed, split="test",
                              test_fraction=test_fraction, difficulty=difficulty)
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


def task_record_dir(model_path: str) -> str:
  """The directory whose task.json describes `model_path`: the path itself (an HF
  directory or RUN_DIR), or RUN_DIR for RUN_DIR/STEP and RUN_DIR/checkpoints/STEP."""
  path = os.path.abspath(model_path.rstrip("/") or "/")
  if os.path.basename(path).isdigit() and not os.path.isfile(
      os.path.join(path, synthetic.TASK_FILE)):
    path = os.path.dirname(path)
    if os.path.basename(path) == "checkpoints":
      path = os.path.dirname(path)
  return path


def synthetic_settings(model_path: str | None, **overrides) -> tuple[dict, dict, list[str]]:
  """The synthetic test-split settings to evaluate `model_path` on.

  Per setting (seed, test_fraction, difficulty, num_test), first of: an override that
  is not None (a CLI flag), the model's task.json (see `task_record_dir`), the
  generator default (num_test: None). -> (settings, origin of each, notices).
  """
  unknown = set(overrides) - set(synthetic.SPLIT_DEFAULTS) - {"num_test"}
  if unknown:
    raise TypeError(f"unknown synthetic settings {sorted(unknown)}.")
  record, where = None, None
  if model_path is not None:
    where = os.path.join(task_record_dir(model_path), synthetic.TASK_FILE)
    record = synthetic.load_task_settings(os.path.dirname(where))
  notices = []
  recorded = record["synthetic"] if record else {}
  if record is None:
    notices.append(
        f"notice: {model_path or 'no model'} has no {synthetic.TASK_FILE} (no record of the "
        "data it trained on): using the generator defaults for what no flag sets. Pass "
        "--difficulty/--seed/--test-fraction to match its training data.")
  elif record["source"] != "synthetic":
    notices.append(f"notice: {where}: the model trained on {record['source']!r}, not the "
                   "synthetic task; its data.synthetic settings (unused in training) apply.")
  settings, origins = {}, {}
  for key, default in {**synthetic.SPLIT_DEFAULTS, "num_test": None}.items():
    if overrides.get(key) is not None:
      settings[key], origins[key] = overrides[key], "flag --" + key.replace("_", "-")
      if key in ("seed", "test_fraction") and key in recorded and recorded[key] != (
          overrides[key]):
        notices.append(f"notice: --{key.replace('_', '-')} {overrides[key]} differs from the "
                       f"run's {recorded[key]}: this test split may hold problems the model "
                       "trained on.")
    elif key in recorded:
      settings[key], origins[key] = recorded[key], where
    else:
      settings[key], origins[key] = default, "generator default"
  synthetic.check_split_settings(settings, "evaluate")
  return settings, origins, notices


def describe_settings(settings: dict, origins: dict) -> str:
  """One line per origin: "difficulty=easy seed=0 test_fraction=0.1  (from X)"."""
  groups: dict[str, list[str]] = {}
  for key in synthetic.SPLIT_DEFAULTS:
    groups.setdefault(origins[key], []).append(f"{key}={settings[key]}")
  return "\n".join(f"  {' '.join(kv)}  (from {origin})" for origin, kv in groups.items())


def score(model: LoadedModel, problems: Sequence[dict], *, tau: float = 1.0, window: int = 1,
          metric: Metric = "probability", batch_size: int = 64,
          max_new_tokens: int | None = 64,
          temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
          progress: Any = None) -> dict:
  """Decodes every problem; -> {accuracy, tokens_per_forward, tokens, forwards, n,
  outputs}. tokens_per_forward = generated tokens / per-sample forwards (prefill
  included), so AR decoding gives exactly 1.0. temperature (0: greedy), top_k, top_p:
  sampling as `sampling.generate`; problem i samples with the seed seed + i.
  max_new_tokens None: as many as fit the model's context."""
  prompts = [chat_prompt_ids(model.tokenizer, [{"role": "user", "content": p["question"]}])
             for p in problems]
  budget = budgets(model.config.max_position_embeddings, prompts, max_new_tokens)
  seeds = prompt_seeds(seed, len(prompts))
  correct = tokens = forwards = 0
  outputs = []
  for i in range(0, len(prompts), batch_size):
    res = sampling.generate(model.config, model.params, prompts[i:i + batch_size],
                            max_new_tokens=budget[i:i + batch_size],
                            mask_token_id=model.mask_token_id,
                            eos_token_ids=model.eos_token_ids, tau=tau, window=window,
                            metric=metric, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seeds[i:i + batch_size], runtime=model.runtime,
                            mesh=model.mesh)
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
          max_new_tokens: int | None = 64, show_progress: bool = True, **sample
          ) -> list[dict]:
  """`score` for every (metric, window, tau); window 1 is run once (it ignores tau).
  sample: `score`'s temperature, top_k, top_p and seed, the same for every setting."""
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
                max_new_tokens=max_new_tokens, progress=bar, **sample)
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


def run(args) -> None:
  """The evaluate command on parsed arguments (`python -m mars_jax.evaluate`'s `main`
  parses them)."""
  check_sampling_flags(args.temperature, args.top_k, args.top_p, args.sample_seed)
  for metric in args.metrics.split(","):
    gates.check_tau(_floats(args.taus), metric, "--taus")
  args.model = model_path(args.model)
  flags = {"seed": args.seed, "test_fraction": args.test_fraction,
           "difficulty": args.difficulty}
  task_info = None
  if args.task == "synthetic":
    settings, origins, notices = synthetic_settings(args.model, **flags)
    num, num_from = args.num_problems, "flag --num-problems"
    if num is None:
      num, num_from = ((settings["num_test"], f"data.synthetic.num_test in "
                        f"{origins['num_test']}") if settings["num_test"] else (500, "default"))
    for line in notices:
      print(line)
    print(f"synthetic test split, {num} problems (from {num_from}):\n"
          + describe_settings(settings, origins), flush=True)
    problems = load_problems("synthetic", num, **{k: settings[k]
                                                   for k in synthetic.SPLIT_DEFAULTS})
    task_info = {"settings": {k: settings[k] for k in synthetic.SPLIT_DEFAULTS},
                 "origins": {k: origins[k] for k in synthetic.SPLIT_DEFAULTS},
                 "num_problems": num}
  else:
    given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
    if given:
      raise ValueError(f"{', '.join(given)} apply to --task synthetic only.")
    problems = load_problems(args.task, args.num_problems or 500)
  model = load_model(args.model, mesh=decode_mesh.mesh_from_flag(args.mesh))
  windows = [int(w) for w in args.windows.split(",")]
  warn_untrained_windows(args.model, windows)
  sample = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "seed": args.sample_seed}
  rows = sweep(model, problems, taus=_floats(args.taus),
               windows=windows,
               metrics=args.metrics.split(","), batch_size=args.batch_size,
               max_new_tokens=args.max_new_tokens, **sample)
  print(format_table(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"model": args.model, "task": args.task, "synthetic": task_info,
                 "sampling": sample, "rows": rows}, f, indent=2)
    series: dict[str, list] = {}
    for r in rows:
      series.setdefault(f"{r['metric']} W={r['window']}", []).append(r)
    pareto_plot(series, os.path.join(args.out, "pareto.png"), title=args.model)
    print(f"wrote {args.out}/results.json and pareto.png")
