"""Two-model decoding (mars_jax.decoding.speculative) is exact: greedy output equals the
target's greedy AR, and sampled output the target's AR sampling with the same seed,
token for token, for AR and MARS drafters and targets at every K, whatever the drafter
proposes (a drafter that always agrees, one that mostly agrees, one that rarely does).

The target is test_sampling's random tiny Qwen2 (vocabulary 128, output head scaled up
so its distributions are peaked but not one-hot); the drafters are the target itself, the
target with noise on every weight, and another random model with more embedding rows.
"""

import jax
import numpy as np
import pytest
from test_sampling import MASK_ID, PROMPTS, model  # noqa: F401  (the fixture)

from mars_jax import hf, sampling
from mars_jax.decoding import speculative

EOS = [2, 9]
BUDGETS = [14, 9, 16, 12]
SEEDS = [3, 141, 59, 26]


@pytest.fixture(scope="module")
def drafters(model, hf_tiny):
  """name -> (config, params): the target itself, the target with noise, another model."""
  config, params = model
  keys = iter(jax.random.split(jax.random.key(0), 1000))
  noisy = jax.tree.map(lambda p: p + 0.3 * p.std() * jax.random.normal(next(keys), p.shape),
                       params)
  path, _ = hf_tiny(tie=True, seed=7, vocab=160, hidden=32, layers=1, num_heads=2,
                    num_kv_heads=1, intermediate=48)
  other_config, other = hf.load_pretrained(path)
  return {"self": (config, params), "noisy": (config, noisy),
          "other": (other_config, {**other, "embedding": other["embedding"] * 20.0})}


def reference(model, **kw):
  config, params = model
  return sampling.generate(config, params, PROMPTS, max_new_tokens=BUDGETS,
                           mask_token_id=MASK_ID, eos_token_ids=EOS, window=1, **kw)


@pytest.mark.parametrize("name", ["self", "noisy", "other"])
@pytest.mark.parametrize("k,target_window,drafter_window,tau", [
    (1, 1, 1, 1.0), (4, 1, 1, 1.0), (4, 3, 1, 0.3), (3, 1, 4, 0.3), (4, 5, 4, 0.0),
    (2, 4, 3, 0.5)])
def test_greedy_equals_the_targets_ar(model, drafters, name, k, target_window,
                                      drafter_window, tau):
  want = reference(model)
  config, params = model
  d_config, d_params = drafters[name]
  out = sampling.generate(config, params, PROMPTS, max_new_tokens=BUDGETS,
                          mask_token_id=MASK_ID, eos_token_ids=EOS, window=target_window,
                          tau=tau, draft_window=k,
                          drafter=speculative.Drafter(d_config, d_params, MASK_ID,
                                                      window=drafter_window))
  assert out.tokens == want.tokens
  assert out.finish_reasons == want.finish_reasons
  assert len(out.drafter_forwards) == len(PROMPTS)
  if name == "self" and drafter_window == 1 and target_window == 1:
    # the target drafting for itself: every draft is taken, K + 1 tokens a target forward
    assert all(f <= -(-n // (k + 1)) + 1 for f, n in zip(out.num_forwards, out.num_tokens))
  print(name, k, target_window, drafter_window, tau, out.tokens_per_forward,
        out.drafter_forwards_per_token)
