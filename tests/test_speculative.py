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
from test_sampled_decoding import SAMPLES, first_tokens, two_sample_chi2
from test_sampling import MASK_ID, PROMPTS, model  # noqa: F401  (the fixture)
from test_sampling_ext import toy_prompts, trained  # noqa: F401  (the fixture)

from mars_jax import serve
from mars_jax.checkpoints import hf
from mars_jax.decoding import sampler as sampling
from mars_jax.decoding import speculative

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

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
@pytest.mark.parametrize("k,target_window,drafter_window,tau", [   # half of them e2e (time)
    (1, 1, 1, 1.0), pytest.param(4, 1, 1, 1.0, marks=pytest.mark.e2e), (4, 3, 1, 0.3),
    pytest.param(3, 1, 4, 0.3, marks=pytest.mark.e2e),
    pytest.param(4, 5, 4, 0.0, marks=pytest.mark.e2e), (2, 4, 3, 0.5)])
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


@pytest.mark.parametrize("k,target_window,drafter_window,tau", [
    (4, 1, 1, 1.0), pytest.param(3, 3, 4, 0.3, marks=pytest.mark.e2e)])
def test_sampled_equals_the_targets_ar_sampling(model, drafters, k, target_window,
                                                drafter_window, tau):
  """Temperature 0.9, top-p 0.95, a seed per prompt: the tokens of the target's own AR
  sampling with the same seeds (the drafts share the verifying draws' noise)."""
  kw = dict(temperature=0.9, top_p=0.95, seed=SEEDS)
  want = reference(model, **kw)
  config, params = model
  for name in ("noisy", "other"):
    d_config, d_params = drafters[name]
    out = sampling.generate(config, params, PROMPTS, max_new_tokens=BUDGETS,
                            mask_token_id=MASK_ID, eos_token_ids=EOS, window=target_window,
                            tau=tau, draft_window=k, **kw,
                            drafter=speculative.Drafter(d_config, d_params, MASK_ID,
                                                        window=drafter_window))
    assert out.tokens == want.tokens, name


@pytest.mark.e2e  # a law drawn from 32,768 samples a side
def test_two_model_sampling_keeps_the_ar_distribution(model, drafters):
  """The sampling issue's test with two models: the joint law of the first 3 tokens
  (temperature 1, top-p 0.9) of AR sampling on seeds [0, N) against the noisy drafter
  (MARS drafting, W_d = 3) and a MARS-windowed target (W_t = 3) at K = 3 on seeds
  [N, 2N), N = 32,768, by a two-sample chi-square at p = 1e-4."""
  config, params = model
  ar = first_tokens(config, params, window=1, mode="gated", tau=1.0,
                    seeds=list(range(SAMPLES)))
  d_config, d_params = drafters["noisy"]
  spec = first_tokens(config, params, window=3, mode="lossless", tau=0.3,
                      seeds=list(range(SAMPLES, 2 * SAMPLES)), draft_window=3,
                      drafter=speculative.Drafter(d_config, d_params, MASK_ID, window=3))
  stat, threshold, cells = two_sample_chi2(ar, spec)
  print(f"two models K=3: chi2 {stat:.1f} < {threshold:.1f} ({cells} cells)")
  assert stat < threshold


@pytest.mark.e2e  # the continuous-batching server, end to end
def test_server_with_a_drafter_equals_generate(model, drafters):
  """Continuous batching with a drafter (1 to 2 rows, 8 requests, 3 rounds a step, so rows
  are refilled and regrouped): each request's tokens are the target's AR tokens, greedy
  and sampled, with a stop id; a gated request or another window is refused."""
  config, params = model
  d_config, d_params = drafters["noisy"]
  drafter = speculative.Drafter(d_config, d_params, MASK_ID, window=3)
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=EOS,
                        batch_size=2, min_batch_size=1, max_len=64, window=3,
                        round_steps=3, tau=0.3,
                        drafter=drafter, draft_window=3)
  sampled = dict(temperature=0.8, top_p=0.9)
  greedy = reference(model)
  want = reference(model, seed=SEEDS, **sampled)
  stop_id = want.tokens[2][4]
  ids = [server.submit(p, max_new_tokens=b, seed=s,
                       stop_token_ids=[stop_id] if i == 2 else (), **sampled)
         for i, (p, b, s) in enumerate(zip(PROMPTS, BUDGETS, SEEDS))]
  ids += [server.submit(p, max_new_tokens=b) for p, b in zip(PROMPTS, BUDGETS)]
  done = server.run()
  for i, rid in enumerate(ids[:4]):
    k = want.tokens[i].index(stop_id) + 1 if i == 2 else len(want.tokens[i])
    assert done[rid].tokens == want.tokens[i][:k]
    assert done[rid].drafter_forwards > 0
  assert [done[rid].tokens for rid in ids[4:]] == greedy.tokens
  for bad in (dict(mode="gated"), dict(window=2)):
    with pytest.raises(ValueError, match="drafter"):
      server.submit(PROMPTS[0], max_new_tokens=4, **bad)


@pytest.mark.e2e   # trains the toy: about a minute
def test_a_target_whose_drafts_fill_k_skips_the_drafter(trained):
  """The trained toy (its MASK proposals are right) as the target at W_t = 4, K = 3: its
  own drafts fill K in most rounds, so the drafter (the toy, AR) skips them and catches
  up later in wide steps; the output is still the toy's AR output, with fewer drafter
  forwards than at W_t = 1."""
  m = trained
  prompts = toy_prompts(m)
  kw = dict(max_new_tokens=21, mask_token_id=m.mask_token_id, eos_token_ids=(),
            draft_window=3, drafter=speculative.Drafter(m.config, m.params, m.mask_token_id))
  ar = sampling.generate(m.config, m.params, prompts, window=1, max_new_tokens=21,
                         mask_token_id=m.mask_token_id, eos_token_ids=())
  alone = sampling.generate(m.config, m.params, prompts, window=1, **kw)
  both = sampling.generate(m.config, m.params, prompts, window=4, tau=0.5, **kw)
  assert alone.tokens == both.tokens == ar.tokens
  assert sum(both.drafter_forwards) < sum(alone.drafter_forwards) / 2


def test_bad_two_model_arguments_are_refused(model, drafters):
  config, params = model
  d_config, d_params = drafters["other"]
  kw = dict(max_new_tokens=4, mask_token_id=MASK_ID, eos_token_ids=EOS)
  for bad, match in ((dict(draft_window=0), "draft_window=0"),
                     (dict(window="auto"), "target's window must be an int"),
                     (dict(drafter_window=0), "drafter window=0"),
                     (dict(mesh=object()), "one device"),
                     (dict(prompts=[[130]]), "outside the vocabulary")):
    args = {"prompts": PROMPTS, "drafter_window": 1, **bad}
    drafter = speculative.Drafter(d_config, d_params, MASK_ID, window=args.pop("drafter_window"))
    with pytest.raises(ValueError, match=match):
      sampling.generate(config, params, args.pop("prompts"), drafter=drafter, **kw, **args)
