"""Evaluator: answer extraction and scoring, problem files, and the study on a miniature."""

import json
import os
import subprocess
import sys

import pytest

from mars_jax import evaluate as evaluate_cli
from mars_jax.evaluation import evaluate
from mars_jax.data import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text,expected", [
    ("Bags: 7*7=49\nAll: 49+3=52\n#### 52", "52"),
    ("... #### 1,234", "1234"),
    ("#### -5", "-5"),
    ("the answer is 12", None),
    ("#### 3\n#### 4", "4"),
])
def test_extract_answer(text, expected):
  assert synthetic.extract_answer(text) == expected


def test_is_correct():
  assert synthetic.is_correct("x=3+4=7\n#### 7", "3+4=7\n#### 7")
  assert not synthetic.is_correct("#### 8", "#### 7")
  assert not synthetic.is_correct("no final answer", "#### 7")


def test_load_problems_from_jsonl(tmp_path):
  f = tmp_path / "gsm.jsonl"
  f.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n\n" +
               json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
  assert [p["question"] for p in evaluate.load_problems(str(f))] == ["1+1?", "2+2?"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: .*####"):
    evaluate.load_problems(str(bad))
  with pytest.raises(FileNotFoundError):
    evaluate.load_problems(str(tmp_path / "missing.jsonl"))


def test_score_counts_exact_matches():
  """A stub-free check of `score`: a model that cannot answer scores 0 with 1 token/forward;
  sampled (temperature 1), the same outputs for the same seed, others for another."""
  import jax
  from mars_jax.data import build_char_tokenizer, model_vocab_size
  from mars_jax.decoding.loading import LoadedModel
  from mars_jax.models import qwen2
  tok = build_char_tokenizer()
  config = qwen2.preset("qwen2.5-0.5b", vocab_size=model_vocab_size(tok), hidden_size=32,
                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, eos_token_id=2)
  params = qwen2.init_params(config, jax.random.key(0))
  model = LoadedModel(config, qwen2.Runtime(), params, tok, 3, (2,))
  problems = synthetic.generate(3, split="test")
  r = evaluate.score(model, problems, max_new_tokens=8, batch_size=2)
  assert r["n"] == 3 and r["accuracy"] == 0.0 and r["tokens_per_forward"] == 1.0
  assert r["tokens"] == r["forwards"] and len(r["outputs"]) == 3

  def outputs(**sample):
    return [o["output"] for o in evaluate.score(model, problems, max_new_tokens=8,
                                                batch_size=2, **sample)["outputs"]]
  sampled = outputs(temperature=1.0, seed=3)
  assert sampled == outputs(temperature=1.0, seed=3)
  assert sampled != outputs(temperature=1.0, seed=4)
  assert sampled != [o["output"] for o in r["outputs"]]


def test_cli_passes_the_sampling_flags(tmp_path, monkeypatch, capsys):
  """--temperature/--top-k/--top-p/--sample-seed reach every `score` of the sweep and
  are recorded in results.json; the defaults are greedy; a bad value is one line."""
  task = tmp_path / "gsm.jsonl"
  task.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
  seen = []
  monkeypatch.setattr(evaluate, "load_model", lambda path, mesh=None: path)

  def score(model, problems, **kw):
    seen.append(kw)
    return {"accuracy": 0.0, "tokens_per_forward": 1.0, "tokens": 1, "forwards": 1, "n": 1}
  monkeypatch.setattr(evaluate, "score", score)
  base = ["--model", str(tmp_path), "--task", str(task), "--taus", "0.9", "--windows", "1,4",
          "--metrics", "probability"]
  evaluate_cli.main(base)
  assert [(kw["temperature"], kw["top_k"], kw["top_p"], kw["seed"]) for kw in seen] == [
      (0.0, 0, 1.0, 0)] * 2
  seen.clear()
  evaluate_cli.main(base + ["--temperature", "0.7", "--top-k", "20", "--top-p", "0.9",
                            "--sample-seed", "5", "--out", str(tmp_path / "out")])
  want = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5}
  assert [{k: kw[k] for k in want} for kw in seen] == [want] * 2
  with open(tmp_path / "out" / "results.json") as f:
    assert json.load(f)["sampling"] == want
  with pytest.raises(SystemExit) as e:
    evaluate_cli.main(base + ["--top-p", "0"])
  assert e.value.code == 2 and "top_p=[0.0]; it must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.e2e   # the study's CLI: two seeds of a miniature, trained and scored
def test_study_miniature(tmp_path):
  """Two seeds, each with its own parent and variants, the seed-0 parent again unrolled,
  and the report's claim, interval and per-seed tables."""
  report = tmp_path / "results.md"
  r = subprocess.run(
      [sys.executable, "-m", "mars_jax.study", "--config", os.path.join(ROOT, "configs/study.py"),
       f"--workdir={tmp_path}/study", "--config.study.parent_steps=2",
       "--config.study.child_steps=2", "--config.study.variants=('control','mars_b4')",
       "--config.study.seeds=0,1",
       "--config.study.taus=(1.0,0.9)", "--config.study.gates=('probability',)",
       "--config.study.num_problems=4", f"--config.study.report={report}",
       "--config.model.overrides.hidden_size=32", "--config.model.overrides.intermediate_size=64",
       "--config.model.overrides.num_hidden_layers=1", "--config.model.overrides.num_attention_heads=2",
       "--config.model.overrides.num_key_value_heads=1", "--config.train.batch_size=8",
       "--config.data.synthetic.num_train=200", "--config.data.synthetic.num_test=8",
       "--config.final_eval.max_new_tokens=8"],
      cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  text = report.read_text()
  for seed in (0, 1):
    for name in ("parent", "control", "mars_b4"):
      assert f"| {seed} | {name} |" in text
      assert os.path.isdir(tmp_path / "study" / f"seed_{seed}" / name)
  assert "| 0 | parent_unrolled |" in text and "seed 0's parent, trained twice" in text
  assert "| mars_b4 | probability | 5 | 0.90 |" in text
  assert "| mars_b4 AR mode - control AR mode |" in text
  assert (tmp_path / "results_pareto.png").stat().st_size > 0
