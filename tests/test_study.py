"""The study's seeds and report: a parent per seed, the seed in every run's config, the
t-intervals (against scipy), the paired claims and their verdicts, the float-rounding
line, the per-seed wall-clock and the Pareto plot with error bars. No training here: the
miniature study through the CLI is tests/test_evaluate.py's."""

import json
import os

import pytest
from scipy import stats

from mars_jax.data import task_settings
from mars_jax.experiments import study, study_report
from test_configs import ROOT, load


@pytest.fixture(scope="module")
def cfg():
  return load(os.path.join(ROOT, "configs", "study.py"))


def _with(cfg, **study_fields):
  c = cfg.copy_and_resolve_references()
  c.unlock()
  c.study.update(study_fields)
  return c


def test_a_run_has_at_least_three_seeds_and_lora_r32(cfg):
  assert len(study.seeds_of(cfg)) >= 3 and "lora_r32" in cfg.study.variants
  assert cfg.study.rounding_check


@pytest.mark.parametrize("values", [[95.0, 96.4, 93.8], [1.0, 2.0], [0.2, -1.4, 3.0, 0.0, 2.2]])
def test_t_interval_is_scipys(values):
  iv = study_report.t_interval(values)
  lo, hi = stats.t.interval(0.95, len(values) - 1, loc=iv.mean, scale=stats.sem(values))
  assert iv.mean == pytest.approx(sum(values) / len(values))
  assert (iv.low, iv.high) == (pytest.approx(lo, abs=1e-3), pytest.approx(hi, abs=1e-3))
  assert study_report.t_interval([3.0]).half is None


def test_every_seed_trains_its_own_parent_and_the_split_stays(cfg, tmp_path):
  c = _with(cfg, seeds=(0, 1, 2))
  assert study.parent_dirs(c, "w") == {s: os.path.join("w", f"seed_{s}", "parent")
                                       for s in (0, 1, 2)}
  for name in ("parent", "mars_b8", "lora_r32"):
    v = study.variant_config(c, name, "p", seed=7)
    assert (v.train.seed, v.data.seed) == (7, 7)
    assert v.data.synthetic.seed == cfg.data.synthetic.seed
    assert task_settings(v.data)["synthetic"] == task_settings(cfg.data)["synthetic"]
  assert study.variant_config(c, "parent", None, 1).model.scan_layers
  unrolled = study.variant_config(c, study.UNROLLED_PARENT, None, 1)
  assert not unrolled.model.scan_layers and unrolled.train.steps == cfg.study.parent_steps


def test_a_reused_parent_serves_one_seed(cfg):
  assert study.parent_dirs(_with(cfg, seeds=(0, 1), parent_dir="p/s{seed}"), "w") == {
      0: "p/s0", 1: "p/s1"}
  assert study.parent_dirs(_with(cfg, seeds=(3, 1), parent_dir="a, b"), "w") == {3: "a", 1: "b"}
  assert study.parent_dirs(_with(cfg, seeds=(0,), parent_dir="runs/tiny/stage1"), "w") == {
      0: "runs/tiny/stage1"}
  with pytest.raises(ValueError, match=r"1 parent\(s\) for 3 seeds .*each seed needs its own"):
    study.parent_dirs(_with(cfg, parent_dir="runs/tiny/stage1"), "w")
  for bad in ((0, 0), (), ("0",)):
    with pytest.raises(ValueError, match="give distinct integer seeds"):
      study.seeds_of(_with(cfg, seeds=bad))


def _result(rows, train_s=10.0):
  return {"train_s": train_s, "eval_s": 2.0, "final_loss": 0.1, "final_eval_loss": 0.2,
          "trainable_params": 5, "params": 5,
          "rows": [{"metric": "probability", "window": w, "tau": t, "accuracy": a / 100,
                    "tokens_per_forward": f, "n": 500} for w, t, a, f in rows]}


def test_report_pairs_seeds_and_judges_each_claim(cfg, tmp_path):
  """mars_b4 AR - control: +3, +4, +5 (holds); tau 0.95 - AR: -5, -6, -4 (does not hold);
  no-AR - MARS: about -90 (holds: it falls); LoRA - MARS: -1, +1, 0 (cannot tell)."""
  results = {}
  for seed, d in enumerate((3.0, 4.0, 5.0)):
    mars = 90.0 + seed
    results[seed] = {
        "parent": _result([(1, 1.0, 95.0, 1.0)]),
        "control": _result([(1, 1.0, mars - d, 1.0)]),
        "mars_b4": _result([(1, 1.0, mars, 1.0), (4, 0.95, mars - (5, 6, 4)[seed], 2.5 + seed / 10)]),
        "noar_b4": _result([(1, 1.0, mars - 90 + seed / 2, 1.0)]),
        "lora_r32": _result([(1, 1.0, mars + (-1, 1, 0)[seed], 1.0),
                             (4, 0.95, mars, 2.0)]),
    }
  results[0][study.UNROLLED_PARENT] = _result([(1, 1.0, 88.4, 1.0)])
  path = tmp_path / "results.md"
  study_report.write_report(cfg, results, str(path), "cmd")
  text = path.read_text()
  rows = {l.split(" | ")[2].replace(" (2.60 ± 0.25 tokens/forward)", "").replace(
      " (2.00 ± 0.00 tokens/forward)", ""): l
          for l in text.splitlines() if l.startswith("| ") and " - " in l}
  assert rows["mars_b4 AR mode - control AR mode"].endswith(
      "| +4.0 ± 2.5 | +3.0, +4.0, +5.0 | **holds** |")
  assert rows["mars_b4 tau 0.95 W=4 - mars_b4 AR mode"].endswith(
      "| -5.0 ± 2.5 | -5.0, -6.0, -4.0 | **does not hold** |")
  assert rows["noar_b4 AR mode - mars_b4 AR mode"].endswith("| **holds** |")
  assert rows["lora_r32 AR mode - mars_b4 AR mode"].endswith(
      "| +0.0 ± 2.5 | -1.0, +1.0, +0.0 | **cannot tell** |")
  assert "mars_b8 AR mode" not in text   # claims whose runs the study lacks are left out
  assert "| mars_b4 | probability | 4 | 0.95 | 86.0% ± 4.3 | 85.0, 85.0, 88.0 | " \
         "2.60 ± 0.25 | 2.50, 2.60, 2.70 |" in text
  assert "seed 0's parent" in text and "scored 95.0% and 88.4% in AR mode" in text
  assert "6.6 points apart, where the parents of the 3 seeds span 95.0% to 95.0%" in text
  assert "| mars_b4 tau 0.95 W=4 (2.60 ± 0.25 tokens/forward) - mars_b4 AR mode |" in text
  assert "| 2 | lora_r32 | 10 | 2 |" in text and "sum to 3 min" in text
  assert text.index("## What holds") < text.index("## Accuracy and tokens per forward")
  assert (tmp_path / "results_pareto.png").stat().st_size > 0


def test_one_seed_cannot_tell(cfg, tmp_path):
  results = {0: {"control": _result([(1, 1.0, 90.0, 1.0)]),
                 "mars_b4": _result([(1, 1.0, 95.0, 1.0)])}}
  study_report.write_report(cfg, results, str(tmp_path / "r.md"), "cmd")
  text = (tmp_path / "r.md").read_text()
  assert "| +5.0 (one seed) | +5.0 | **cannot tell** |" in text


def test_a_schedule_sets_the_childs_steps_and_learning_rate(cfg):
  """"<variant>@<schedule>": study.schedules' steps and learning rate; mars_b4_fixed: the
  paper's fixed partition; an undefined schedule fails before any training."""
  c = load(os.path.join(ROOT, "configs", "study_stage2.py"))
  paper = study.variant_config(c, "mars_b4@paper", "p", seed=2)
  assert (paper.train.steps, paper.optimizer.learning_rate) == (
      c.stage1.steps, c.stage1.learning_rate) == (c.study.parent_steps, 2e-3)
  assert paper.objective.random_block_offset and paper.objective.ar_weight == 1.0
  fixed = study.variant_config(c, "mars_b4_fixed@paper", "p", seed=2)
  assert not fixed.objective.random_block_offset and fixed.objective.block_size == 4
  short = study.variant_config(c, "control", "p", seed=2)
  assert (short.train.steps, short.optimizer.learning_rate) == (300, cfg.optimizer.learning_rate)
  assert study.eval_settings("control@paper", c) == [("probability", 1, 1.0)]
  with pytest.raises(ValueError, match=r"names schedule 'long', which study.schedules does "
                                       r"not define \(it has \['paper'\]\)"):
    study.run_study(_with(c, variants=("mars_b4@long",)), "unused")


def test_processes_sharing_a_seed_keep_each_others_results(tmp_path):
  path = str(tmp_path / "results.json")
  assert study._record(path) == {}
  study._record(path, "control", {"train_s": 1.0})
  study._record(path, "mars_b4@paper", {"train_s": 2.0})   # another process, same seed
  assert study._record(path) == {"control": {"train_s": 1.0}, "mars_b4@paper": {"train_s": 2.0}}


@pytest.mark.parametrize("mean, values, kind, want", [
    (-0.5, [-0.6, -0.5, -0.4], "not_worse", "holds"),
    (-3.0, [-3.2, -3.0, -2.8], "not_worse", "does not hold"),
    (-1.0, [-2.0, -1.0, 0.0], "not_worse", "cannot tell"),
    (-90.0, [-91.0, -90.0, -89.0], "worse", "holds"),
    (-0.2, [-0.3, -0.2, -0.1], "worse", "does not hold"),
])
def test_verdicts_weigh_the_interval_against_the_margin(mean, values, kind, want):
  d = study_report.t_interval(values)
  assert d.mean == pytest.approx(mean)
  assert study_report.verdict(kind, d, margin=1.0) == want


def test_a_study_of_two_arms_judges_each_and_draws_the_loss_curves(cfg, tmp_path):
  """Runs "<variant>" and "<variant>@paper": every claim in each arm (MARS - control and
  MARS - parent), the offset ablation, the arms compared, and the clean-stream loss of
  every run from its metrics.jsonl (a child's step 0 is its parent's last value)."""
  c = load(os.path.join(ROOT, "configs", "study_stage2.py"))
  results = {}
  for seed in range(3):
    runs = {}
    for name, acc, curve in (("parent", 90.0, {50: 1.0, 1200: 0.02}),
                             ("control", 90.5, {50: 0.03, 300: 0.02}),
                             ("mars_b4", 86.0, {50: 0.16, 300: 0.04}),
                             ("control@paper", 91.0, {50: 0.03, 1200: 0.015}),
                             ("mars_b4@paper", 90.0 + seed / 10, {50: 0.16, 1200: 0.02}),
                             ("mars_b4_fixed@paper", 89.5, {50: 0.2, 1200: 0.03})):
      run_dir = tmp_path / f"s{seed}" / name
      run_dir.mkdir(parents=True)
      with open(run_dir / "metrics.jsonl", "w") as f:
        for step, v in curve.items():
          f.write(json.dumps({"step": step, "loss": 1.0, "eval_ce_ar": v}) + "\n")
      rows = [(1, 1.0, acc, 1.0)] + ([(4, 0.95, acc - 0.2, 2.5)] if "mars" in name else [])
      runs[name] = {**_result(rows), "run_dir": str(run_dir)}
    results[seed] = runs
  path = tmp_path / "results.md"
  study_report.write_report(c, results, str(path), "cmd")
  text = path.read_text()
  verdicts = {l.split(" | ")[2].split(" (")[0]: l.rsplit("**", 2)[1]
              for l in text.splitlines() if l.startswith("| ") and " AR mode - " in l}
  assert verdicts["mars_b4 AR mode - control AR mode"] == "does not hold"      # -4.5
  assert verdicts["mars_b4@paper AR mode - control@paper AR mode"] == "cannot tell"  # -0.9 ± 0.2
  assert verdicts["mars_b4@paper AR mode - parent AR mode"] == "holds"        # +0.1
  assert verdicts["mars_b4@paper AR mode - mars_b4_fixed@paper AR mode"] == "holds"
  assert "| mars_b4@paper AR mode - mars_b4 AR mode | +4.1 ± 0.2 |" in text
  assert "a margin of 1 point(s)" in text and "at learning rate 0.002 instead" in text
  assert "| mars_b4@paper | 0.0200 | 0.1600 |  |  | 0.0200 (step 1200) |" in text
  assert "| control | 0.0200 | 0.0300 |  | 0.0200 | 0.0200 (step 300) |" in text
  assert (tmp_path / "results_curves.png").stat().st_size > 0


def test_a_run_with_fewer_seeds_is_named(cfg, tmp_path):
  results = {s: {"control": _result([(1, 1.0, 90.0, 1.0)])} for s in range(3)}
  results[2]["mars_b4"] = _result([(1, 1.0, 91.0, 1.0)])
  study_report.write_report(cfg, results, str(tmp_path / "r.md"), "cmd")
  assert "Note: `mars_b4` has seeds 2 only (of 0, 1, 2)" in (tmp_path / "r.md").read_text()
