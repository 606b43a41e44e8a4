"""The old module paths of the moved training modules are the new modules themselves (kept
for one release), and the names outside users rely on resolve through both paths."""

import importlib

import pytest

MOVED = {
    "mars_jax.objective": "mars_jax.training.objective",
    "mars_jax.masks": "mars_jax.training.masks",
    "mars_jax.train_step": "mars_jax.training.step",
    "mars_jax.trainer": "mars_jax.training.loop",
    "mars_jax.train_config": "mars_jax.training.config",
    "mars_jax.checkpoint": "mars_jax.training.checkpoint",
    "mars_jax.optimizer": "mars_jax.training.optimizer",
    "mars_jax.lora": "mars_jax.training.lora",
    "mars_jax.peft_adapter": "mars_jax.training.peft_adapter",
    "mars_jax.experiment": "mars_jax.training.experiment",
}


@pytest.mark.parametrize("old,new", MOVED.items())
def test_old_path_is_the_moved_module(old, new):
  assert importlib.import_module(old) is importlib.import_module(new)


def test_contract_names_resolve():
  # pylint: disable=import-outside-toplevel
  import mars_jax.objective
  from mars_jax.masks import two_stream_mask
  from mars_jax.objective import ar_sft_loss, mars_loss
  from mars_jax.training import masks, objective
  assert two_stream_mask is masks.two_stream_mask
  assert (mars_loss, ar_sft_loss) == (objective.mars_loss, objective.ar_sft_loss)
  assert mars_jax.objective.mars_loss is objective.mars_loss


def test_cli_modules_reexport_the_evaluation_names():
  # pylint: disable=import-outside-toplevel
  from mars_jax import evaluate, lm_eval
  from mars_jax.evaluation import evaluate as ev, lm_eval as le
  assert all(getattr(evaluate, n) is getattr(ev, n) for n in evaluate.__all__ if n != "main")
  assert all(getattr(lm_eval, n) is getattr(le, n) for n in lm_eval.__all__
             if n not in ("main", "synthetic_tasks_main"))
