"""The study's report (docs/results.md, docs/results_300.md): every figure as a mean over seeds with its 95%
t-interval and the per-seed values, the paper's claims as paired differences per seed
with a verdict, the float-rounding spread, the Pareto plot with error bars, and the
wall-clock of every run. The runs themselves are mars_jax/training/study.py's.

A claim is judged on the 95% interval of its paired difference (the same seed's two
runs, in accuracy points) against the margin `study.margin` (m points): a claim that one
run is no worse than another holds when the interval lies at or above -m, does not hold
when it lies below -m, and cannot be told otherwise; a claim that one run is worse holds
when the interval lies below -m and does not hold when it lies at or above -m. One seed
gives no interval, and every verdict is then "cannot tell". A study with schedules
(`study.schedules`, runs named "<variant>@<schedule>") judges every claim in each arm.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Sequence

from mars_jax.data import task_settings
from mars_jax.experiments.study import UNROLLED_PARENT, objective_of, split_settings

# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); beyond, 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

AR = ("probability", 1, 1.0)   # (gate, window, tau) of AR mode


class Interval(NamedTuple):
  mean: float
  half: float | None   # None: fewer than two values
  values: tuple[float, ...]

  @property
  def low(self) -> float | None:
    return None if self.half is None else self.mean - self.half

  @property
  def high(self) -> float | None:
    return None if self.half is None else self.mean + self.half


def t_interval(values: Sequence[float]) -> Interval:
  """The mean of `values` and the half-width of its two-sided 95% t-interval."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return Interval(mean, None, tuple(values))
  sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
  t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
  return Interval(mean, t * sd / math.sqrt(n), tuple(values))


def _row(res: dict, setting: tuple[str, int, float]) -> dict | None:
  for r in res["rows"]:
    if (r["metric"], r["window"], r["tau"]) == setting:
      return r
  return None


class Claim(NamedTuple):
  text: str
  paper: str
  kind: str   # "not_worse": a - b >= 0 claimed; "worse": a - b < 0 claimed
  pairs: tuple[tuple[str, tuple, str, tuple], ...]   # (run a, setting a, run b, setting b)


def _tau95(b: int) -> tuple[str, int, float]:
  return ("probability", b, 0.95)


CLAIMS = (
    Claim("MARS in AR mode keeps the AR-SFT model's accuracy (MARS - control)",
          "matches or exceeds AR-SFT: 0.5B 30.4 vs 28.7, 7B 58.1 vs 56.6 (+1.7, +1.5)",
          "not_worse", tuple((f"mars_b{b}", AR, "control", AR) for b in (4, 8, 16))),
    Claim("MARS in AR mode keeps the stage-1 parent's accuracy (MARS - parent: the "
          "paper's AR-SFT baseline is the stage-1 checkpoint)",
          "0.5B 30.4 vs 28.7, 7B 58.1 vs 56.6 (+1.7, +1.5)",
          "not_worse", tuple((f"mars_b{b}", AR, "parent", AR) for b in (4, 8, 16))),
    Claim("MARS at tau 0.95 (W = B) keeps its own AR-mode accuracy (tau 0.95 - AR mode)",
          "baseline-level accuracy at 1.5-1.7x throughput (authors' note, GSM8K at tau "
          "0.95: 70.7 vs AR-SFT's 68.4, 1.785 tokens/forward)",
          "not_worse", tuple((f"mars_b{b}", _tau95(b), f"mars_b{b}", AR) for b in (4, 8, 16))),
    Claim("Our random block offset keeps the accuracy of the paper's fixed partition "
          "(offset - fixed, MARS B=4)", "the paper's blocks start at position 0 (no figure)",
          "not_worse", (("mars_b4", AR, "mars_b4_fixed", AR),
                        ("mars_b4", _tau95(4), "mars_b4_fixed", _tau95(4)))),
    Claim("Without the AR loss, AR-mode accuracy falls (no-AR - MARS)",
          "the AR loss is what keeps quality at larger B (no single figure)",
          "worse", tuple((f"noar_b{b}", AR, f"mars_b{b}", AR) for b in (4, 8, 16))),
    Claim("LoRA rank 32 keeps full MARS fine-tuning's accuracy (LoRA r32 - MARS B=4)",
          "no figure in the paper", "not_worse",
          (("lora_r32", AR, "mars_b4", AR), ("lora_r32", _tau95(4), "mars_b4", _tau95(4)))),
)

# Runs that belong to no arm: the parent is every arm's.
_SHARED = ("parent", UNROLLED_PARENT)


def arms(results: dict[int, dict]) -> list[str]:
  """The schedule suffixes of the study's runs, "" (study.child_steps) first: "@paper"."""
  names = {n for res in results.values() for n in res}
  return sorted({n[n.index("@"):] if "@" in n else "" for n in names if n not in _SHARED},
                key=lambda a: (a != "", a))


def _in_arm(name: str, arm: str) -> str:
  return name if name in _SHARED else name + arm


def paired(results: dict[int, dict], a: str, sa: tuple, b: str, sb: tuple) -> Interval | None:
  """The per-seed difference (points) of run a at setting sa minus run b at sb, over the
  seeds that have both; None if none has."""
  diffs = []
  for res in results.values():
    ra = _row(res[a], sa) if a in res else None
    rb = _row(res[b], sb) if b in res else None
    if ra is not None and rb is not None:
      diffs.append(100 * (ra["accuracy"] - rb["accuracy"]))
  return t_interval(diffs) if diffs else None


def verdict(kind: str, d: Interval, margin: float = 0.0) -> str:
  """'holds', 'does not hold' or 'cannot tell' for a claim of `kind` on the interval `d`,
  against `margin` points (the module docstring)."""
  if d.half is None:
    return "cannot tell"
  if kind == "not_worse":
    good, bad = d.low >= -margin, d.high < -margin
  else:
    good, bad = d.high < -margin, d.low >= -margin
  return "holds" if good else "does not hold" if bad else "cannot tell"


def _pm(iv: Interval, fmt: str, unit: str = "") -> str:
  if iv.half is None:
    return f"{iv.mean:{fmt}}{unit} (one seed)"
  return f"{iv.mean:{fmt}}{unit} ± {iv.half:{fmt.lstrip('+')}}"


def _values(iv: Interval, fmt: str) -> str:
  return ", ".join(f"{v:{fmt}}" for v in iv.values)


def _setting_name(run: str, s: tuple, results: dict[int, dict]) -> str:
  """'run AR mode', or 'run tau T W=W (tokens per forward ± interval)'."""
  if s == AR:
    return f"{run} AR mode"
  tpf = t_interval([_row(r[run], s)["tokens_per_forward"] for r in results.values()
                    if run in r and _row(r[run], s) is not None])
  return f"{run} tau {s[2]:.2f} W={s[1]} ({_pm(tpf, '.2f')} tokens/forward)"


def claim_lines(results: dict[int, dict], margin: float = 0.0) -> list[str]:
  """The claim table: one row per comparison whose runs the study has, in every arm, the
  claim and the paper's figure on its first."""
  lines = ["| claim | paper | comparison | ours: mean difference ± 95% interval (points) "
           "| per seed | verdict |", "|---|---|---|---:|---|---|"]
  for c in CLAIMS:
    first = True
    for arm in arms(results):
      for a, sa, b, sb in c.pairs:
        a, b = _in_arm(a, arm), _in_arm(b, arm)
        d = paired(results, a, sa, b, sb)
        if d is None:
          continue
        text, paper, first = (c.text, c.paper, False) if first else ("", "", False)
        lines.append(f"| {text} | {paper} | {_setting_name(a, sa, results)} - "
                     f"{_setting_name(b, sb, results)} | {_pm(d, '+.1f')} | "
                     f"{_values(d, '+.1f')} | **{verdict(c.kind, d, margin)}** |")
  return lines


def schedule_lines(results: dict[int, dict], margin: float = 0.0) -> list[str]:
  """Each arm against the first ("" : study.child_steps): the same variant's AR mode (and
  tau 0.95 for MARS), paired per seed; [] for a study of one arm."""
  others = arms(results)[1:]
  if not others or "" not in arms(results):
    return []
  lines = ["| comparison | mean difference ± 95% interval (points) | per seed | verdict "
           "(no worse) |", "|---|---:|---|---|"]
  for arm in others:
    for name in dict.fromkeys(n.split("@")[0] for res in results.values() for n in res
                              if n.endswith(arm)):
      variant = objective_of(name)
      for s in (AR,) if variant.kind == "ar_sft" else (AR, _tau95(variant.block)):
        d = paired(results, name + arm, s, name, s)
        if d is not None:
          lines.append(f"| {_setting_name(name + arm, s, results)} - "
                       f"{_setting_name(name, s, results)} | {_pm(d, '+.1f')} | "
                       f"{_values(d, '+.1f')} | **{verdict('not_worse', d, margin)}** |")
  return lines if len(lines) > 2 else []


def settings_table(results: dict[int, dict], names: list[str]) -> dict[tuple, dict]:
  """(run, gate, window, tau) -> {"accuracy": Interval (%), "tokens_per_forward": Interval},
  over the seeds that have the run, in the order of `names` and their rows."""
  out: dict[tuple, dict] = {}
  for name in names:
    for res in results.values():
      for r in res.get(name, {}).get("rows", []):
        out.setdefault((name, r["metric"], r["window"], r["tau"]), [])
  for key in out:
    rows = [_row(res[key[0]], key[1:]) for res in results.values() if key[0] in res]
    rows = [r for r in rows if r is not None]
    out[key] = {"accuracy": t_interval([100 * r["accuracy"] for r in rows]),
                "tokens_per_forward": t_interval([r["tokens_per_forward"] for r in rows])}
  return out


def rounding_lines(results: dict[int, dict]) -> list[str]:
  """The float-rounding spread: one seed's parent on the scanned and unrolled runtimes,
  beside the parents' spread over seeds."""
  for seed, res in results.items():
    if UNROLLED_PARENT in res and "parent" in res:
      a, b = (100 * _row(res[n], AR)["accuracy"] for n in ("parent", UNROLLED_PARENT))
      la, lb = (res[n].get("final_eval_loss") for n in ("parent", UNROLLED_PARENT))
      loss = (f" (final eval loss {la:.4f} and {lb:.4f})"
              if la is not None and lb is not None else "")
      parents = [100 * _row(r["parent"], AR)["accuracy"] for r in results.values()
                 if "parent" in r]
      return [f"Float rounding alone: seed {seed}'s parent, trained twice with the same seed "
              f"and data, once on the scanned runtime (`model.scan_layers=True`, every other "
              f"run here) and once unrolled, scored {a:.1f}% and {b:.1f}% in AR mode{loss}: "
              f"{abs(a - b):.1f} points apart, where the parents of the {len(parents)} seeds "
              f"span {min(parents):.1f}% to {max(parents):.1f}%. So float rounding moves one "
              "run about as far as a new seed does: it is part of the run-to-run noise that "
              "the intervals over seeds measure, and a single run of each method (as this "
              "study was before seeds) cannot separate effects of a few points. The paired "
              "differences above compare runs that share their seed's parent, which is why "
              "their intervals are narrower than those of the accuracies below.", ""]
  return []


def pareto(table: dict[tuple, dict], path: str) -> None:
  """Accuracy against tokens per forward, means over seeds with 95% error bars on both."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  series: dict[str, list] = {}
  for (name, gate, w, _), iv in table.items():
    if w > 1:
      series.setdefault(f"{name} {gate} W={w}", []).append(iv)
  fig, ax = plt.subplots(figsize=(7, 5))
  control = table.get(("control", *AR))
  if control is not None:   # the AR-SFT control's accuracy, its interval shaded
    acc = control["accuracy"]
    ax.axhline(acc.mean, color="black", ls="--", lw=1, label="control (AR-SFT), AR mode")
    if acc.half is not None:
      ax.axhspan(acc.low, acc.high, color="black", alpha=0.08)
  colors = plt.cm.tab10.colors   # past ten series: the colors again, dashed and square
  for k, (label, ivs) in enumerate(series.items()):
    ivs = sorted(ivs, key=lambda i: i["tokens_per_forward"].mean)
    err = lambda key: [0.0 if i[key].half is None else i[key].half for i in ivs]
    ax.errorbar([i["tokens_per_forward"].mean for i in ivs], [i["accuracy"].mean for i in ivs],
                xerr=err("tokens_per_forward"), yerr=err("accuracy"),
                fmt="o-" if k < 10 else "s--", ms=4, capsize=2, label=label,
                color=colors[k % 10])
  ax.set_xlabel("tokens per forward")
  ax.set_ylabel("exact-match accuracy (%)")
  ax.set_title("accuracy vs tokens per forward (held-out; mean, 95% interval over seeds)",
               fontsize=9)
  ax.grid(alpha=0.3)
  if series or control is not None:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


CURVE_METRIC = "eval_ce_ar"   # the held-out clean-stream (AR) loss, logged every eval step


def loss_curve(run_dir: str) -> dict[int, float]:
  """step -> the held-out clean-stream loss of a run (its metrics.jsonl; the last record
  of a step a resumed run logged twice); {} without one."""
  path = os.path.join(run_dir, "metrics.jsonl")
  out: dict[int, float] = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        rec = json.loads(line)
        if CURVE_METRIC in rec:
          out[int(rec["step"])] = float(rec[CURVE_METRIC])
  return out


def curves(results: dict[int, dict]) -> dict[str, dict[int, Interval]]:
  """run -> step -> the clean-stream loss over the seeds that logged it; a child's step 0
  is its parent's last logged value (the weights it starts from)."""
  out: dict[str, dict[int, list]] = {}
  for res in results.values():
    parent = loss_curve(res["parent"]["run_dir"]) if "run_dir" in res.get("parent", {}) else {}
    for name, r in res.items():
      if name == UNROLLED_PARENT or "run_dir" not in r:
        continue
      curve = loss_curve(r["run_dir"])
      if name != "parent" and curve and parent:
        curve = {0: parent[max(parent)], **curve}
      for step, v in curve.items():
        out.setdefault(name, {}).setdefault(step, []).append(v)
  return {n: {st: t_interval(v) for st, v in sorted(c.items())} for n, c in out.items()}


def curve_lines(table: dict[str, dict[int, Interval]]) -> list[str]:
  """The clean-stream loss of every child at a few steps: 0, 50, 100, 300 and its last."""
  lines = ["| run | " + " | ".join(f"step {s}" for s in ("0", "50", "100", "300", "last"))
           + " |", "|---|" + "---:|" * 5]
  for name, c in table.items():
    if name == "parent":
      continue
    last = max(c)
    cells = [c.get(s) for s in (0, 50, 100, 300)] + [c[last]]
    lines.append(f"| {name} | " + " | ".join(
        "" if iv is None else f"{iv.mean:.4f}" for iv in cells[:4])
        + f" | {cells[4].mean:.4f} (step {last}) |")
  return lines


def plot_curves(table: dict[str, dict[int, Interval]], parent_steps: int, path: str) -> None:
  """The clean-stream loss over steps, mean over seeds with its 95% band: the parent from
  0, each child from the parent's end."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(8, 5))
  for k, (name, c) in enumerate(table.items()):
    offset = 0 if name == "parent" else parent_steps
    steps = [offset + s for s in c]
    mean = [iv.mean for iv in c.values()]
    color = "black" if name == "parent" else plt.cm.tab10.colors[k % 10]
    ax.plot(steps, mean, lw=1.2, color=color, label=name,
            ls="--" if "@" not in name and name != "parent" else "-")
    if all(iv.half is not None for iv in c.values()):
      ax.fill_between(steps, [iv.low for iv in c.values()], [iv.high for iv in c.values()],
                      color=color, alpha=0.12)
  ax.set_yscale("log")
  ax.set_xlabel("step (children start at the parent's last)")
  ax.set_ylabel("held-out clean-stream loss (nats)")
  ax.set_title("clean-stream (AR) loss over steps (mean, 95% band over seeds)", fontsize=9)
  ax.grid(alpha=0.3, which="both")
  if table:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_report(cfg, results: dict[int, dict], path: str, command: str) -> None:
  """docs/results.md from {seed: {run: result}} (study.run_study's)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  plot = os.path.splitext(path)[0] + "_pareto.png"
  seeds = list(results)
  names = list(dict.fromkeys(n for res in results.values() for n in res))
  table = settings_table(results, [n for n in names if n != UNROLLED_PARENT])
  pareto(table, plot)
  loss_table = curves(results)
  curve_plot = os.path.splitext(path)[0] + "_curves.png"
  if loss_table:
    plot_curves(loss_table, cfg.study.parent_steps, curve_plot)
  s = cfg.study
  margin = float(s.get("margin", 0.0))
  schedules = s.get("schedules") or {}
  arm_text = "".join(
      f"; runs named `<variant>@{k}` train {v['steps']} steps at learning rate "
      f"{v['learning_rate']:g} instead" for k, v in schedules.items()
      if any(n.endswith("@" + k) for n in names))
  own = split_settings(task_settings(cfg.data))
  spent = sum(r["train_s"] + r["eval_s"] for res in results.values() for r in res.values())
  lines = [
      "# Toy-scale study: MARS on the synthetic arithmetic task", "",
      f"Command: `{command}`", "",
      f"Seeds {', '.join(map(str, seeds))}: each seed trains its own AR-SFT parent from "
      f"random init ({s.parent_steps} steps; the seed sets the init, the masking and the "
      f"data order, at learning rate {s.parent_learning_rate:g}), then every variant trains "
      f"{s.child_steps} steps from its own seed's parent at learning rate "
      f"{cfg.optimizer.learning_rate:g}{arm_text}. Model: {cfg.model.overrides.num_hidden_layers} layers, hidden "
      f"{cfg.model.overrides.hidden_size}; batch {cfg.train.batch_size}, length "
      f"{cfg.data.max_length}. Every seed is scored on the same {s.num_problems} held-out "
      f"problems, greedy, from the synthetic test split (difficulty "
      f"{cfg.data.synthetic.difficulty}, split seed {cfg.data.synthetic.seed}, test fraction "
      f"{cfg.data.synthetic.test_fraction}: the training data's); tokens per forward = "
      "generated tokens / forwards (AR = 1.00). Figures are means over the seeds with the "
      "half-width of their 95% t-interval (mean ± half-width), then the per-seed values in "
      "seed order.", "",
      *[f"Note: `{name}` has seeds {', '.join(str(x) for x in seeds if name in results[x])} "
        f"only (of {', '.join(map(str, seeds))}); its intervals and paired differences are "
        "over those.\n" for name in names
        if sum(name in results[x] for x in seeds) < len(seeds)],
      *[f"Note: seed {seed}'s `{name}` trained on, and is evaluated on, synthetic "
        f"{res['synthetic']} (its task.json), not the study's settings.\n"
        for seed, rs in results.items() for name, res in rs.items()
        if res.get("synthetic") not in (None, own)],
      "## What holds", "",
      "Each claim as a paired difference per seed (the same seed's two runs), in accuracy "
      f"points, judged against a margin of {margin:g} point(s): a claim that one run is no "
      f"worse holds when the whole interval lies at or above -{margin:g}, does not hold "
      f"when it lies below -{margin:g}, and cannot be told otherwise; the no-AR claim (that "
      f"accuracy falls) holds when the interval lies below -{margin:g}.", "",
      *claim_lines(results, margin), "",
      *(["## The schedules compared", "",
         "Each run of an arm minus the same variant in the first arm, paired per seed "
         f"(no worse: the interval at or above -{margin:g}).", "",
         *schedule_lines(results, margin), ""] if schedule_lines(results, margin) else []),
      *(["## Held-out clean-stream loss over steps", "",
         f"`{CURVE_METRIC}` (the AR stream's cross-entropy on the held-out batches, nats), "
         "mean over seeds; a child's step 0 is its parent's last value.", "",
         *curve_lines(loss_table), "",
         f"![clean-stream loss]({os.path.basename(curve_plot)})", ""] if loss_table else []),
      *rounding_lines(results),
      "## Accuracy and tokens per forward", "",
      "| run | gate | W | tau | accuracy | per seed | tokens/forward | per seed |",
      "|---|---|---:|---:|---:|---|---:|---|"]
  for (name, gate, w, tau), iv in table.items():
    acc, tpf = iv["accuracy"], iv["tokens_per_forward"]
    lines.append(f"| {name} | {gate} | {w} | {tau:.2f} | {_pm(acc, '.1f', '%')} | "
                 f"{_values(acc, '.1f')} | {_pm(tpf, '.2f')} | {_values(tpf, '.2f')} |")
  lines += ["", f"![Pareto plot]({os.path.basename(plot)})", "",
            "## Wall-clock and final losses", "",
            f"Training and evaluation of every run sum to {spent / 60:.0f} min. A run "
            "trained before the study (a reused parent) shows only its loading time and no "
            "final loss.", "",
            "| seed | run | train s | eval s | final train loss | final eval loss | "
            "trained params |", "|---:|---|---:|---:|---:|---:|---:|"]
  for seed, rs in results.items():
    for name, res in rs.items():
      fl, fe, n = res.get("final_loss"), res.get("final_eval_loss"), res.get("trainable_params")
      trained = "" if n is None else f"{n:,} of {res['params']:,}"
      lines.append(f"| {seed} | {name} | {res['train_s']:.0f} | {res['eval_s']:.0f} | "
                   f"{'' if fl is None else f'{fl:.4f}'} | "
                   f"{'' if fe is None else f'{fe:.4f}'} | {trained} |")
  lines.append("")
  with open(path, "w") as f:
    f.write("\n".join(lines))
