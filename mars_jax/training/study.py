"""The toy-scale study (`python -m mars_jax.study`, the CLI in mars_jax/study.py): its
variants, the train config of each, training and evaluating them on the held-out
synthetic problems, and the report (tables, Pareto plot, wall-clock).

An AR-SFT parent is trained on the synthetic task; from it, each variant trains the
same number of steps (`VARIANTS`, `LORA_VARIANTS`; docs/results_lora.md). Finished runs
are reused, so an interrupted study resumes. Each run is scored on the synthetic test
split drawn with its recorded data settings (its task.json; the study config's
data.synthetic for a run with no record); a reused parent whose record differs from the
study's is named.
"""

from __future__ import annotations

import json
import logging
import os
import time

from mars_jax.evaluation import evaluate
from mars_jax.training import checkpoint, experiment, lora
from mars_jax.data import synthetic, task_settings
from mars_jax.loading import load_model

_LOG = logging.getLogger(__name__)

# name -> (objective.kind, block_size, ar_weight, intra_block); the parent is "parent".
VARIANTS = {
    "control": ("ar_sft", 4, 1.0, "causal"),
    "mars_b4": ("mars", 4, 1.0, "causal"),
    "mars_b8": ("mars", 8, 1.0, "causal"),
    "mars_b16": ("mars", 16, 1.0, "causal"),
    "noar_b4": ("mars", 4, 0.0, "causal"),
    "noar_b8": ("mars", 8, 0.0, "causal"),
    "noar_b16": ("mars", 16, 0.0, "causal"),
    "bd_b4": ("mars", 4, 0.0, "bidirectional"),
}
# MARS at B = 4 (as mars_b4) through LoRA adapters over the frozen parent:
# name -> (lora.rank, lora.train_mask_row); alpha is twice the rank (the authors' 32 / 64).
LORA_VARIANTS = {
    "lora_r8": (8, True),
    "lora_r32": (32, True),
    "lora_r32_frozen_mask": (32, False),
}


def variant_config(cfg, name: str, parent_dir: str | None):
  """The train config of one run of the study."""
  c = cfg.copy_and_resolve_references()
  c.unlock()
  c.stage1.enabled = False
  c.final_eval.num_problems = 0
  c.train.export_hf = False
  if name == "parent":
    c.objective.kind = "ar_sft"
    c.train.steps = cfg.study.parent_steps
    c.optimizer.learning_rate = cfg.study.parent_learning_rate
  else:
    kind, block, ar_weight, intra = _objective_of(name)
    if name in LORA_VARIANTS:
      rank, train_mask_row = LORA_VARIANTS[name]
      c.lora.update(rank=rank, alpha=2.0 * rank, train_mask_row=train_mask_row)
    c.model.init = parent_dir
    c.objective.update(kind=kind, block_size=block, ar_weight=ar_weight, intra_block=intra)
    c.train.steps = cfg.study.child_steps
  c.lock()
  return c


def _objective_of(name: str) -> tuple[str, int, float, str]:
  """(objective.kind, block_size, ar_weight, intra_block) of a variant; a LoRA variant
  trains mars_b4's objective."""
  if name in LORA_VARIANTS:
    return VARIANTS["mars_b4"]
  if name not in VARIANTS:
    raise ValueError(f"study.variants: unknown variant {name!r}; expected one of "
                     f"{[*VARIANTS, *LORA_VARIANTS]}.")
  return VARIANTS[name]


def eval_settings(name: str, cfg) -> list[tuple[str, int, float]]:
  """(gate, window, tau) to evaluate: AR only for AR models; else window B (and B+1 at
  B=4) at every tau and gate, plus AR mode."""
  if name in ("parent", "control"):
    return [("probability", 1, 1.0)]
  block = _objective_of(name)[1]
  windows = [block, block + 1] if block == 4 else [block]
  out = [("probability", 1, 1.0)]
  for gate in cfg.study.gates:
    out += [(gate, w, tau) for w in windows for tau in cfg.study.taus]
  return out


def run_study(cfg, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  results_path = os.path.join(workdir, "results.json")
  results = json.load(open(results_path)) if os.path.exists(results_path) else {}
  parent_dir = cfg.study.parent_dir or os.path.join(workdir, "parent")
  study_split = split_settings(task_settings(cfg.data))
  problem_sets: dict[tuple, list[dict]] = {}
  for name in ["parent", *cfg.study.variants]:
    if name in results:
      if "trainable_params" not in results[name]:   # a result from before the count
        results[name]["trainable_params"], results[name]["params"] = _param_counts(
            results[name]["run_dir"])
      continue
    run_dir = parent_dir if name == "parent" else os.path.join(workdir, name)
    t0 = time.time()
    summary = experiment.run(variant_config(cfg, name, parent_dir), run_dir)
    train_s = time.time() - t0
    final = summary["stages"]["main"]["final"] or {}
    model = load_model(run_dir)
    record = synthetic.load_task_settings(run_dir)
    split = split_settings(record) if record else study_split
    if split != study_split:
      _LOG.info("[%s] note: %s trained on synthetic %s, not the study's %s; evaluated on "
                "its own.", name, run_dir, split, study_split)
    key = tuple(sorted(split.items()))
    if key not in problem_sets:
      problem_sets[key] = evaluate.load_problems("synthetic", cfg.study.num_problems, **split)
    problems = problem_sets[key]
    rows = []
    t1 = time.time()
    for gate, w, tau in eval_settings(name, cfg):
      r = evaluate.score(model, problems, tau=tau, window=w, metric=gate,
                         batch_size=cfg.final_eval.batch_size,
                         max_new_tokens=cfg.final_eval.max_new_tokens)
      rows.append({"metric": gate, "window": w, "tau": tau,
                   **{k: v for k, v in r.items() if k != "outputs"}})
    trainable, total = _param_counts(run_dir)
    results[name] = {"train_s": train_s, "eval_s": time.time() - t1, "rows": rows,
                     "trainable_params": trainable, "params": total,
                     "final_loss": final.get("loss"), "final_eval_loss": final.get("eval_loss"),
                     "run_dir": run_dir, "synthetic": split}
    print(f"\n[{name}] train {train_s:.0f}s, eval {results[name]['eval_s']:.0f}s\n"
          + evaluate.format_table(rows), flush=True)
    with open(results_path + ".tmp", "w") as f:
      json.dump(results, f, indent=2)
    os.replace(results_path + ".tmp", results_path)
  return results


def _param_counts(run_dir: str) -> tuple[int, int]:
  """(trained, total) parameters of a run: its adapters and mask row under LoRA, else all."""
  return lora.count(checkpoint.load_params(run_dir, merge_adapters=False)[2])


def split_settings(record: dict) -> dict:
  """The generator settings of a task record that decide the test problems."""
  return {k: record["synthetic"][k] for k in synthetic.SPLIT_DEFAULTS}


def write_report(cfg, results: dict, path: str, command: str) -> None:
  """docs/results.md: tables, the Pareto plot, wall-clock per run, the command."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  plot = os.path.splitext(path)[0] + "_pareto.png"
  series = {}
  for name, res in results.items():
    for r in res["rows"]:
      if r["window"] > 1:
        series.setdefault(f"{name} {r['metric']} W={r['window']}", []).append(r)
  evaluate.pareto_plot(series, plot, title="accuracy vs tokens per forward (held-out)")
  s = cfg.study
  lines = [
      "# Toy-scale study: MARS on the synthetic arithmetic task", "",
      f"Command: `{command}`", "",
      f"Parent: AR-SFT from random init, {s.parent_steps} steps; every variant then trains "
      f"{s.child_steps} steps from it. Model: "
      f"{cfg.model.overrides.num_hidden_layers} layers, hidden "
      f"{cfg.model.overrides.hidden_size}; batch {cfg.train.batch_size}, length "
      f"{cfg.data.max_length}. Greedy decoding on {s.num_problems} held-out problems of "
      f"the synthetic test split (difficulty {cfg.data.synthetic.difficulty}, split seed "
      f"{cfg.data.synthetic.seed}, test fraction {cfg.data.synthetic.test_fraction}: the "
      "training data's); tokens per forward = generated tokens / forwards (AR = 1.00).", "",
      *[f"Note: `{name}` trained on, and is evaluated on, synthetic {res['synthetic']} "
        "(its task.json), not the study's settings.\n"
        for name, res in results.items()
        if res.get("synthetic") not in (None, split_settings(task_settings(cfg.data)))],
      "## Wall-clock and final losses", "",
      "A run trained before the study (a reused parent) shows only its loading time and no "
      "final loss here.", "",
      "| run | train s | eval s | final train loss | final eval loss | trained params |",
      "|---|---:|---:|---:|---:|---:|"]
  for name, res in results.items():
    fl = res.get("final_loss")
    fe = res.get("final_eval_loss")
    n = res.get("trainable_params")
    trained = "" if n is None else f"{n:,} of {res['params']:,}"
    lines.append(f"| {name} | {res['train_s']:.0f} | {res['eval_s']:.0f} | "
                 f"{'' if fl is None else f'{fl:.4f}'} | {'' if fe is None else f'{fe:.4f}'} | "
                 f"{trained} |")
  lines += ["", "## Accuracy and tokens per forward", "",
            "| run | gate | W | tau | accuracy | tokens/forward |", "|---|---|---:|---:|---:|---:|"]
  for name, res in results.items():
    for r in res["rows"]:
      lines.append(f"| {name} | {r['metric']} | {r['window']} | {r['tau']:.2f} | "
                   f"{100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} |")
  lines += ["", f"![Pareto plot]({os.path.basename(plot)})", ""]
  with open(path, "w") as f:
    f.write("\n".join(lines))
