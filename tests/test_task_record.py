"""Evaluation follows the run: the synthetic settings a run trained on (task.json in its
run directory and HF export) decide the problems of the final eval and the evaluate CLI."""

import importlib.util
import json
import logging
import os
import shlex

import pytest

from mars_jax import evaluate as evaluate_cli
from mars_jax.evaluation import evaluate
from mars_jax.data import synthetic, task_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs",
                                                                            f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def _record(difficulty="easy", seed=3, test_fraction=0.2, num_test=16, source="synthetic"):
  return {"source": source, "synthetic": {"seed": seed, "test_fraction": test_fraction,
                                          "difficulty": difficulty, "num_train": 64,
                                          "num_test": num_test}}


def _test_split(num, difficulty="easy", seed=3, test_fraction=0.2):
  return synthetic.generate(num, seed=seed, split="test", test_fraction=test_fraction,
                            difficulty=difficulty)


class _Captured:
  """Stands in for load_model and sweep in evaluate.main: records the problems asked for."""

  def __init__(self, monkeypatch):
    self.problems = None
    monkeypatch.setattr(evaluate, "load_model", lambda path, mesh=None: path)

    def sweep(model, problems, **kw):
      self.problems = list(problems)
      return []
    monkeypatch.setattr(evaluate, "sweep", sweep)


def test_record_round_trip_and_errors(tmp_path, caplog):
  assert synthetic.load_task_settings(str(tmp_path)) is None
  synthetic.save_task_settings(str(tmp_path), _record())
  assert synthetic.load_task_settings(str(tmp_path)) == _record()
  # the trainer's write keeps a resumed run's record and warns what differs
  with caplog.at_level(logging.WARNING, logger="mars_jax.data.synthetic"):
    kept = synthetic.record_task_settings(str(tmp_path), _record(difficulty="standard"))
  assert kept == _record() and synthetic.load_task_settings(str(tmp_path)) == _record()
  [record] = caplog.records
  assert record.levelno == logging.WARNING
  assert "difficulty: recorded 'easy', config 'standard'" in record.getMessage()
  (tmp_path / "task.json").write_text(json.dumps(_record(difficulty="hard")))
  with pytest.raises(ValueError, match=r"task.json: invalid synthetic settings: difficulty"):
    synthetic.load_task_settings(str(tmp_path))
  (tmp_path / "task.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"task.json: not a task record"):
    synthetic.load_task_settings(str(tmp_path))


def test_task_settings_of_configs():
  assert task_settings({})["synthetic"] == {"seed": 0, "test_fraction": 0.1,
                                            "difficulty": "standard", "num_train": 20000,
                                            "num_test": 500}
  tiny = task_settings(_config("tiny").data)
  assert tiny["source"] == "synthetic" and tiny["synthetic"]["difficulty"] == "easy"
  assert task_settings(_config("study").data) == tiny


def test_record_dir_of_a_step_path(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "5").mkdir(parents=True)
  synthetic.save_task_settings(str(run), _record())
  for path in (run, run / "5", run / "checkpoints" / "5"):
    assert evaluate.task_record_dir(str(path)) == str(run)
    assert evaluate.synthetic_settings(str(path))[0]["difficulty"] == "easy"


def test_flags_override_the_record(tmp_path, monkeypatch, capsys):
  synthetic.save_task_settings(str(tmp_path), _record())
  settings, origins, notices = evaluate.synthetic_settings(str(tmp_path), difficulty="standard")
  assert settings == {"seed": 3, "test_fraction": 0.2, "difficulty": "standard",
                      "num_test": 16} and not notices
  assert origins["difficulty"] == "flag --difficulty"
  assert origins["seed"] == str(tmp_path / "task.json")
  cap = _Captured(monkeypatch)
  evaluate_cli.main(["--model", str(tmp_path), "--difficulty", "standard", "--seed", "4",
                     "--num-problems", "5"])
  assert cap.problems == _test_split(5, difficulty="standard", seed=4)
  out = capsys.readouterr().out
  assert "seed=4  (from flag --seed)" in out   # one line per origin
  assert "difficulty=standard  (from flag --difficulty)" in out
  assert f"test_fraction=0.2  (from {tmp_path / 'task.json'})" in out
  assert "5 problems (from flag --num-problems)" in out
  assert "--seed 4 differs from the run's 3: this test split may hold problems" in out
  with pytest.raises(SystemExit):
    evaluate_cli.main(["--model", str(tmp_path), "--task", str(tmp_path / "x.jsonl"),
                       "--difficulty", "easy"])
  assert "apply to --task synthetic only" in capsys.readouterr().err


def test_no_record_uses_the_generator_defaults_with_a_notice(tmp_path, monkeypatch, capsys):
  cap = _Captured(monkeypatch)
  evaluate_cli.main(["--model", str(tmp_path), "--num-problems", "3"])
  assert cap.problems == synthetic.generate(3, split="test")
  out = capsys.readouterr().out
  assert "notice:" in out and "has no task.json" in out
  assert "seed=0 test_fraction=0.1 difficulty=standard  (from generator default)" in out


def test_readme_evaluate_command_uses_the_default_runs_settings(tmp_path, monkeypatch, capsys):
  """The README's evaluate command on the default run's export (runs/tiny/hf, whose
  task.json experiment.run writes from configs/tiny.py's data) scores easy problems."""
  readme = open(os.path.join(ROOT, "README.md")).read()
  line = next(l for l in readme.splitlines()
              if l.startswith("python -m mars_jax.evaluate --model runs/tiny/hf"))
  argv = shlex.split(line.split("#")[0])[3:]
  hf_dir = tmp_path / "runs" / "tiny" / "hf"
  synthetic.save_task_settings(str(hf_dir), task_settings(_config("tiny").data))
  monkeypatch.chdir(tmp_path)
  cap = _Captured(monkeypatch)
  evaluate_cli.main(argv)
  tiny = _config("tiny").data.synthetic
  assert cap.problems == synthetic.generate(tiny.num_test, seed=tiny.seed, split="test",
                                            test_fraction=tiny.test_fraction,
                                            difficulty="easy")
  out = capsys.readouterr().out
  assert "difficulty=easy" in out and "notice" not in out
  assert f"{tiny.num_test} problems (from data.synthetic.num_test in " in out


@pytest.mark.slow  # end to end: a training run and its final evaluation
def test_a_run_records_its_task_and_is_evaluated_on_it(tmp_path, monkeypatch, capsys):
  """The real path: experiment.run (1 step of a tiny model, easy problems, split seed 3,
  test fraction 0.2) writes task.json into its run dir and HF export; the final eval,
  `export` and the evaluate CLI on the export all draw the same test problems."""
  from mars_jax import export
  from mars_jax.experiments import stages as experiment
  cfg = _config("tiny")
  cfg.model.overrides.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1))
  cfg.data.synthetic.update(dict(num_train=64, num_test=16, seed=3, test_fraction=0.2,
                                 difficulty="easy"))
  cfg.train.update(dict(batch_size=8, steps=1, log_every=1, eval_every=1000, eval_batches=1,
                        checkpoint_every=1, export_hf=True))
  cfg.stage1.enabled = False
  cfg.final_eval.update(dict(num_problems=2, taus=(1.0,), max_new_tokens=4))
  scored = []
  real_score = evaluate.score

  def score(model, problems, **kw):
    scored.append(list(problems))
    return real_score(model, problems, **kw)
  monkeypatch.setattr(evaluate, "score", score)
  workdir = str(tmp_path / "run")
  summary = experiment.run(cfg, workdir)
  expected = _record()
  assert synthetic.load_task_settings(workdir) == expected
  assert synthetic.load_task_settings(os.path.join(workdir, "hf")) == expected
  assert scored and all(p == _test_split(2) for p in scored)
  assert summary["final_eval"]["main"][0]["n"] == 2
  assert "synthetic problems (seed 3, test_fraction 0.2, difficulty easy)" in (
      capsys.readouterr().out)
  # `python -m mars_jax.export` carries the run's record next to the weights
  out = str(tmp_path / "exported")
  export.export(workdir, out, progress=False)
  assert synthetic.load_task_settings(out) == expected
  # the evaluate CLI finds the export's record: the run's own held-out problems
  scored.clear()
  evaluate_cli.main(["--model", os.path.join(workdir, "hf"), "--taus", "1.0", "--windows", "1",
                     "--metrics", "probability", "--max-new-tokens", "4", "--num-problems", "2",
                     "--out", str(tmp_path / "eval")])
  assert scored == [_test_split(2)]
  res = json.load(open(tmp_path / "eval" / "results.json"))
  assert res["synthetic"]["settings"] == {"seed": 3, "test_fraction": 0.2,
                                          "difficulty": "easy"}
  assert res["synthetic"]["origins"]["difficulty"].endswith(os.path.join("hf", "task.json"))
  assert "notice" not in capsys.readouterr().out


def test_study_report_names_the_settings(tmp_path):
  """The study report states the held-out split's settings and names a run evaluated on
  other ones (a reused parent whose task.json differs from the study's data)."""
  from mars_jax.experiments import study, study_report
  cfg = _config("study")
  own = study.split_settings(task_settings(cfg.data))
  row = {"metric": "probability", "window": 4, "tau": 1.0, "accuracy": 0.5,
         "tokens_per_forward": 1.0, "n": 2}
  results = {"parent": {"train_s": 1, "eval_s": 1, "rows": [row], "synthetic":
                        {**own, "difficulty": "standard"}},
             "control": {"train_s": 1, "eval_s": 1, "rows": [row], "synthetic": own}}
  path = tmp_path / "results.md"
  study_report.write_report(cfg, {0: results}, str(path), "cmd")
  text = path.read_text()
  assert "synthetic test split (difficulty easy, split seed 0, test fraction 0.1" in text
  assert "Note: seed 0's `parent` trained on" in text and "`control` trained" not in text
