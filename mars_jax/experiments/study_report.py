"""The study's report (docs/results.md): every figure as a mean over seeds with its 95%
t-interval and the per-seed values, the paper's claims as paired differences per seed
with a verdict, the float-rounding spread, the Pareto plot with error bars, and the
wall-clock of every run. The runs themselves are mars_jax/training/study.py's.

A claim is judged on the 95% interval of its paired difference (the same seed's two
runs, in accuracy points): a claim that one run is no worse than another holds when the
interval lies at or above 0, does not hold when it lies below 0, and cannot be told
otherwise; a claim that one run is worse is judged the other way round. One seed gives
no interval, and every verdict is then "cannot tell".
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Sequence

from mars_jax.data import task_settings
from mars_jax.experiments.study import UNROLLED_PARENT, split_settings

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
    Claim("MARS at tau 0.95 (W = B) keeps its own AR-mode accuracy (tau 0.95 - AR mode)",
          "baseline-level accuracy at 1.5-1.7x throughput (authors' note, GSM8K at tau "
          "0.95: 70.7 vs AR-SFT's 68.4, 1.785 tokens/forward)",
          "not_worse", tuple((f"mars_b{b}", _tau95(b), f"mars_b{b}", AR) for b in (4, 8, 16))),
    Claim("Without the AR loss, AR-mode accuracy falls (no-AR - MARS)",
          "the AR loss is what keeps quality at larger B (no single figure)",
          "worse", tuple((f"noar_b{b}", AR, f"mars_b{b}", AR) for b in (4, 8, 16))),
    Claim("LoRA rank 32 keeps full MARS fine-tuning's accuracy (LoRA r32 - MARS B=4)",
          "no figure in the paper", "not_worse",
          (("lora_r32", AR, "mars_b4", AR), ("lora_r32", _tau95(4), "mars_b4", _tau95(4)))),
)


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


def verdict(kind: str, d: Interval) -> str:
  if d.half is None:
    return "cannot tell"
  good, bad = (d.low >= 0, d.high < 0) if kind == "not_worse" else (d.high < 0, d.low >= 0)
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


def claim_lines(results: dict[int, dict]) -> list[str]:
  """The claim table: one row per comparison whose runs the study has, the claim and the
  paper's figure on its first."""
  lines = ["| claim | paper | comparison | ours: mean difference ± 95% interval (points) "
           "| per seed | verdict |", "|---|---|---|---:|---|---|"]
  for c in CLAIMS:
    first = True
    for a, sa, b, sb in c.pairs:
      d = paired(results, a, sa, b, sb)
      if d is None:
        continue
      text, paper, first = (c.text, c.paper, False) if first else ("", "", False)
      lines.append(f"| {text} | {paper} | {_setting_name(a, sa, results)} - "
                   f"{_setting_name(b, sb, results)} | {_pm(d, '+.1f')} | {_values(d, '+.1f')} | "
                   f"**{verdict(c.kind, d)}** |")
  return lines


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


def write_report(cfg, results: dict[int, dict], path: str, command: str) -> None:
  """docs/results.md from {seed: {run: result}} (study.run_study's)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  plot = os.path.splitext(path)[0] + "_pareto.png"
  seeds = list(results)
  names = list(dict.fromkeys(n for res in results.values() for n in res))
  table = settings_table(results, [n for n in names if n != UNROLLED_PARENT])
  pareto(table, plot)
  s = cfg.study
  own = split_settings(task_settings(cfg.data))
  spent = sum(r["train_s"] + r["eval_s"] for res in results.values() for r in res.values())
  lines = [
      "# Toy-scale study: MARS on the synthetic arithmetic task", "",
      f"Command: `{command}`", "",
      f"Seeds {', '.join(map(str, seeds))}: each seed trains its own AR-SFT parent from "
      f"random init ({s.parent_steps} steps; the seed sets the init, the masking and the "
      f"data order), then every variant trains {s.child_steps} steps from its own seed's "
      f"parent. Model: {cfg.model.overrides.num_hidden_layers} layers, hidden "
      f"{cfg.model.overrides.hidden_size}; batch {cfg.train.batch_size}, length "
      f"{cfg.data.max_length}. Every seed is scored on the same {s.num_problems} held-out "
      f"problems, greedy, from the synthetic test split (difficulty "
      f"{cfg.data.synthetic.difficulty}, split seed {cfg.data.synthetic.seed}, test fraction "
      f"{cfg.data.synthetic.test_fraction}: the training data's); tokens per forward = "
      "generated tokens / forwards (AR = 1.00). Figures are means over the seeds with the "
      "half-width of their 95% t-interval (mean ± half-width), then the per-seed values in "
      "seed order.", "",
      *[f"Note: seed {seed}'s `{name}` trained on, and is evaluated on, synthetic "
        f"{res['synthetic']} (its task.json), not the study's settings.\n"
        for seed, rs in results.items() for name, res in rs.items()
        if res.get("synthetic") not in (None, own)],
      "## What holds", "",
      "Each claim as a paired difference per seed (the same seed's two runs), in accuracy "
      "points. A claim that one run is no worse holds when the whole interval is at or "
      "above 0, does not hold when it is below 0, and cannot be told otherwise; the "
      "no-AR claim (that accuracy falls) the other way round.", "",
      *claim_lines(results), "",
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
