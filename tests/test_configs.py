"""Every shipped config validates; the paper configs (Qwen2.5 and Qwen3, both stages)
carry the paper's recipe."""

import glob
import importlib.util
import os

import pytest

from mars_jax.training import config as train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_validates(path):
  cfg = load(path)
  train_config.validate(cfg)
  assert cfg.objective.kind in ("mars", "ar_sft")


PAPER = ("qwen2_5_0_5b", "qwen2_5_7b", "qwen2_5_72b", "qwen3_0_6b", "qwen3_8b")


@pytest.mark.parametrize("model", PAPER)
@pytest.mark.parametrize("stage,kind", [("ar_sft", "ar_sft"), ("mars", "mars")])
def test_paper_settings(model, stage, kind):
  c = load(os.path.join(ROOT, "configs", f"{model}_{stage}.py"))
  assert (c.optimizer.learning_rate, c.optimizer.warmup_ratio, c.train.batch_size,
          c.data.max_length, c.data.num_epochs, c.objective.block_size,
          c.objective.ar_weight, c.objective.kind) == (5e-6, 0.03, 384, 512, 5, 4, 1.0, kind)


@pytest.mark.parametrize("qwen3,qwen2_5", [("qwen3_0_6b", "qwen2_5_0_5b"),
                                           ("qwen3_8b", "qwen2_5_7b")])
@pytest.mark.parametrize("stage", ["ar_sft", "mars"])
def test_qwen3_configs_mirror_the_qwen2_5_ones(qwen3, qwen2_5, stage):
  """Same recipe, mesh, memory settings as the Qwen2.5 config of that size; stage 1
  starts from the Qwen3 checkpoint."""
  q3, q25 = (load(os.path.join(ROOT, "configs", f"{m}_{stage}.py")) for m in (qwen3, qwen2_5))
  assert q3.model.init != q25.model.init
  assert stage == "mars" or "Qwen3" in q3.model.init
  assert q3.model.preset.startswith("qwen3-") and q25.model.preset.startswith("qwen2.5-")
  q3.model.init, q3.model.preset = q25.model.init, q25.model.preset
  assert q3.to_dict() == q25.to_dict()


def test_the_study_report_goes_under_its_workdir_unless_asked():
  """configs/study.py leaves study.report unset: `python -m mars_jax.study` then writes
  WORKDIR/results.md, and a tracked report (docs/results_300.md) only with
  --config.study.report."""
  assert load(os.path.join(ROOT, "configs", "study.py")).study.report is None
