"""Sampling: the warps equal a NumPy reference and the sort of the vocabulary, AR
sampling equals a naive recompute-everything sampler, lossless sampling is AR sampling
token for token at every W (and in distribution, by a test that rejects the
always-accept rule), a prompt's tokens depend on its seed only, and stops end decoding
inside the loop.

The model is test_sampling's: a random tiny Qwen2 (vocabulary 128) with its output head
scaled up, so its distributions are peaked but not one-hot.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import MASK_ID, full_logits, model  # noqa: F401  (the fixture)

from mars_jax import serve
from mars_jax.decoding import sampler as sampling
from mars_jax.decoding import draws, gates, stops
from mars_jax.decoding.window_policy import FixedWindow

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

PROMPTS = [[11, 52, 3], [7, 90, 33, 64, 25, 18, 41, 9, 100], [60, 61], [5, 77, 12, 98, 43]]
SEEDS = [3, 141, 59, 26]
KW = dict(max_new_tokens=12, mask_token_id=MASK_ID, eos_token_ids=[2])


def cut_np(scaled, top_k, top_p):
  """One distribution's top-k then top-p cut, token by token in float64: -inf outside."""
  vocab = len(scaled)
  order = np.argsort(-scaled, kind="stable")
  kth = scaled[order[min(top_k, vocab) - 1]] if 0 < top_k < vocab else -np.inf
  keep = scaled >= kth
  if top_p < 1.0:
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    p /= p.sum()
    mass, last = 0.0, None
    for i in order:
      if not keep[i] or mass >= top_p:
        break
      mass, last = mass + p[i], scaled[i]
    keep &= scaled >= last
  return np.where(keep, scaled, -np.inf)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9),
                                         (7, 0.6), (200, 0.3), (3, 0.999)])
def test_cut_equals_numpy_reference(top_k, top_p):
  rng = np.random.default_rng(top_k + int(100 * top_p))
  logits = rng.normal(size=(3, 4, 50)).astype(np.float32) * 2
  logits[0, 0, :6] = logits[0, 0, 0]               # ties at the top
  logits[1, 2, 10:20] = np.sort(logits[1, 2])[-4]  # ties around the k-th largest
  got = np.asarray(draws.cut(jnp.asarray(logits), jnp.full((3,), top_k, jnp.int32),
                             jnp.full((3,), top_p, jnp.float32)))
  want = np.stack([[cut_np(l.astype(np.float64), top_k, top_p) for l in row] for row in logits])
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6)


def sort_cut(scaled, top_k, top_p):
  """The cut by the sort of the whole vocabulary (as `draws.cut` was)."""
  return jnp.where(scaled >= draws.sorted_threshold(scaled, top_k, top_p), scaled, -jnp.inf)


def cut_cases(vocab=1000):
  """Every (top_k, top_p) pair, one row each, over 8 slots of logits: 2 spread, 1 flat
  (nuclei the candidates do not close), 1 whose first CANDIDATES - 1 tokens hold
  0.795 of the mass (at top_p 0.8, the nucleus ends past the candidates),
  2 bf16-quantised (many ties), 2 on a coarse grid (more than CANDIDATES tokens tied
  with the k-th)."""
  k = draws.CANDIDATES
  pairs = [(top_k, top_p) for top_k in (0, 1, 5, 20, k, k + 1, vocab)
           for top_p in (0.05, 0.5, 0.8, 0.95, 1.0)]
  rng = np.random.default_rng(0)
  normal = rng.normal(size=(len(pairs), 8, vocab)).astype(np.float32)
  scale = np.asarray([4, 6, 0.1, 0, 2, 3, 1, 1], np.float32)[:, None]
  logits = normal * scale
  logits[:, 0, :5] = logits[:, 0, :1]                              # ties at the top
  head = rng.uniform(0.9, 1.1, size=k - 1)
  tail = np.linspace(1.0, 0.5, vocab - k + 1)
  probs = np.concatenate([0.795 * head / head.sum(), 0.205 * tail / tail.sum()])
  logits[:, 3] = np.log(probs)[rng.permutation(vocab)]
  logits[:, 4:6] = np.asarray(jnp.asarray(logits[:, 4:6], jnp.bfloat16), np.float32)
  logits[:, 6:] = np.round(logits[:, 6:] * 2) / 2
  top_k, top_p = (np.asarray(x) for x in zip(*pairs))
  return (jnp.asarray(logits), jnp.asarray(top_k, jnp.int32),
          jnp.asarray(top_p, jnp.float32))


@pytest.mark.e2e   # 35 s of compiling; the draws' exactness stays in the default suite
def test_candidates_cut_as_the_sort_does():
  """Where the CANDIDATES largest logits decide the threshold, it keeps the sort's set;
  where they cannot (top_k > CANDIDATES; a nucleus open at the last candidate when
  every candidate passed top-k), `cut` takes the sort; batches of either kind, and a
  mixed one, cut and draw as the sort does."""
  scaled, top_k, top_p = cut_cases()
  threshold, decided = draws.candidate_threshold(scaled, top_k, top_p)
  decided = np.asarray(decided)[..., 0]
  want = np.asarray(sort_cut(scaled, top_k, top_p))
  got = np.asarray(jnp.where(scaled >= threshold, scaled, -jnp.inf))
  np.testing.assert_array_equal(got[decided], want[decided])
  vocab, k = scaled.shape[-1], draws.CANDIDATES
  top_k, top_p = np.asarray(top_k), np.asarray(top_p)
  assert not decided[top_k == k + 1].any()
  assert decided[(top_k > 0) & (top_k <= 20) | (top_p == 1.0) & (top_k != k + 1)].all()
  assert decided[top_k != k + 1][:, :2].all()                      # spread: closed
  open_p = (top_p >= 0.5) & (top_p < 1.0)
  assert not decided[(top_k == 0) & open_p][:, 2].any()             # flat: open
  assert not decided[(top_k == 0) & (top_p == np.float32(0.8))][:, 3].any()
  assert not decided[(top_k == k) & open_p & (top_p > 0.5)][:, 6:].any()  # tied past K
  rows = decided.all(axis=1)
  assert 0 < rows.sum() < len(rows)
  positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), scaled.shape[:2])
  temperature = jnp.ones(top_k.shape, jnp.float32)
  seed = jnp.arange(len(top_k), dtype=jnp.uint32)
  for batch in (rows, ~rows, np.ones_like(rows)):
    args = (scaled[batch], jnp.asarray(top_k[batch]), jnp.asarray(top_p[batch]))
    np.testing.assert_array_equal(np.asarray(draws.cut(*args)), want[batch])
    tokens = draws.choose(args[0], positions[batch], temperature[batch], *args[1:],
                          seed[batch])
    drawn = gates.greedy(jnp.asarray(want[batch])
                         + draws.noise(seed[batch], positions[batch], vocab))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(drawn))


def _near_a_boundary(scaled: np.ndarray, top_k: int, top_p: float, eps: float = 1e-5) -> bool:
  """Whether the float64 nucleus of one slot ends within `eps` of top_p: there float32
  sums may end it one token (or one tie group) apart, as draws' docstring says."""
  if top_p >= 1.0:
    return False
  kept = cut_np(scaled, top_k, 1.0)
  p = np.exp(kept - kept.max())
  p = np.sort(p[np.isfinite(kept)] / p[np.isfinite(kept)].sum())[::-1]
  return bool(np.any(np.abs(np.cumsum(p) - top_p) < eps))


def test_sort_fallback_equals_float64_reference():
  """The sort of the whole vocabulary, which a slot takes when its CANDIDATES largest
  logits cannot decide the cut (a wide nucleus on a flat distribution, top_k past the
  candidates), keeps the set a float64 reference keeps, token by token: at Qwen2.5's
  vocabulary (151,936) and on the 1000-token cases of `cut_cases`."""
  rng = np.random.default_rng(7)
  vocab = 151_936
  pairs = [(0, 0.5), (0, 0.9), (0, 0.95), (draws.CANDIDATES + 37, 1.0), (500, 0.8)]
  logits = (rng.normal(size=(len(pairs), 2, vocab)) * [[0.5], [2.0]]).astype(np.float32)
  top_k = jnp.asarray([k for k, _ in pairs], jnp.int32)
  top_p = jnp.asarray([p for _, p in pairs], jnp.float32)
  small = cut_cases()
  compared = 0
  for scaled, ks, ps in ((jnp.asarray(logits), top_k, top_p), small):
    decided = np.asarray(draws.candidate_threshold(scaled, ks, ps)[1])[..., 0]
    rows = ~decided.all(axis=1)
    assert rows.any()                          # the fallback runs for these rows' batch
    got = np.asarray(draws.cut(scaled[rows], ks[rows], ps[rows]))
    values = np.asarray(scaled[rows], np.float64)
    for (r, s), slot_decided in np.ndenumerate(decided[rows]):
      k, p = int(np.asarray(ks)[rows][r]), float(np.asarray(ps)[rows][r])
      if slot_decided or _near_a_boundary(values[r, s], k, np.float32(p)):
        continue
      want = cut_np(values[r, s], k, float(np.float32(p)))
      np.testing.assert_array_equal(np.isinf(got[r, s]), np.isinf(want), err_msg=f"{k} {p}")
      compared += 1
  assert compared >= 40


def chi2_threshold(df: int, z: float = 3.719) -> float:
  """The chi-square quantile for a one-sided normal z (3.719: p = 1e-4), Wilson-Hilferty."""
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_goodness(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
  """Pearson's statistic of counts against probabilities, cells expected below
  `min_expected` pooled into one -> (statistic, threshold at p = 1e-4)."""
  expected = probs * counts.sum()
  small = expected < min_expected
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  stat = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
  return stat, chi2_threshold(len(obs) - 1)


def test_draws_follow_the_warped_distribution():
  """20,000 seeds at one position: the tokens drawn are distributed as softmax of the cut."""
  n, vocab = 20000, 12
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(vocab,)) * 1.5, jnp.float32)
  temperature, top_k, top_p = 0.7, 8, 0.95
  tokens = draws.choose(jnp.broadcast_to(logits, (n, 1, vocab)), jnp.full((n, 1), 7, jnp.int32),
                        jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32),
                        jnp.full((n,), top_p), jnp.arange(n, dtype=jnp.uint32))
  kept = cut_np(np.asarray(logits, np.float64) / temperature, top_k, top_p)
  probs = np.exp(kept - kept.max())
  probs /= probs.sum()
  counts = np.bincount(np.asarray(tokens)[:, 0], minlength=vocab)
  assert counts[probs == 0].sum() == 0
  stat, threshold = chi2_goodness(counts, probs)
  assert stat < threshold, (stat, threshold)


def naive_sample(config, params, prompt, max_new, eos, seed, temperature, top_k, top_p):
  """AR sampling recomputed from scratch every token: the uncached forward, the NumPy cut,
  and the noise the sampler defines (`draws.noise`, keyed by seed and position)."""
  out = []
  while len(out) < max_new and not (out and out[-1] in eos):
    position = len(prompt) + len(out)
    logits = full_logits(config, params, prompt + out)[-1].astype(np.float64)
    g = np.asarray(draws.noise(jnp.asarray([seed], jnp.uint32),
                               jnp.asarray([[position]], jnp.int32), len(logits)))[0, 0]
    out.append(int(np.argmax(cut_np(logits / temperature, top_k, top_p) + g)))
  return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 6, 0.9)])
def test_ar_sampling_equals_naive_sampler(model, temperature, top_k, top_p):
  config, params = model
  out = sampling.generate(config, params, PROMPTS, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=SEEDS, **KW)
  for prompt, seed, tokens in zip(PROMPTS, SEEDS, out.tokens):
    assert tokens == naive_sample(config, params, prompt, KW["max_new_tokens"], [2], seed,
                                  temperature, top_k, top_p)
  assert out.tokens != sampling.generate(config, params, PROMPTS, **KW).tokens


class CyclingWindow(FixedWindow):
  """A window policy that changes W every round of 2 steps, as a loaded server may."""

  def __init__(self, windows):
    super().__init__(max(windows), round_steps=2)
    self.windows, self.cycle = tuple(windows), list(windows)

  def choose(self, batch, cache_len, active, measure=None):
    self.cycle.append(self.cycle.pop(0))
    return self.cycle[-1]


@pytest.mark.parametrize("top_k,top_p", [pytest.param(0, 1.0, marks=pytest.mark.e2e), (5, 0.8)])
def test_lossless_and_tau_one_are_ar_sampling(model, top_k, top_p):
  """Lossless at W = 2, 4, 5 (fixed, in rounds of 3 steps, and W changed every round) and
  gated at tau 1: the tokens of AR sampling with the same seeds."""
  config, params = model
  kw = dict(KW, temperature=0.8, top_k=top_k, top_p=top_p, seed=SEEDS)
  ar = sampling.generate(config, params, PROMPTS, **kw).tokens
  for window in (2, 4, 5):
    out = sampling.generate(config, params, PROMPTS, window=window, mode="lossless", **kw)
    assert out.tokens == ar, window
    assert out.tokens_per_forward > 1.0
  rounds = sampling.generate(config, params, PROMPTS, mode="lossless",
                             policy=FixedWindow(4, round_steps=3), **kw)
  assert rounds.tokens == ar
  cycling = sampling.generate(config, params, PROMPTS, mode="lossless",
                              policy=CyclingWindow((5, 2, 4)), **kw)
  assert cycling.tokens == ar and set(cycling.windows) == {2, 4, 5}
  assert sampling.generate(config, params, PROMPTS, window=5, tau=1.0, **kw).tokens == ar


def test_a_prompt_samples_by_its_seed_alone(model):
  """Alone, in another order, in another batch bucket, next to greedy rows: same tokens."""
  config, params = model
  kw = dict(KW, temperature=0.9, top_p=0.95)
  batch = sampling.generate(config, params, PROMPTS, seed=SEEDS, **kw).tokens
  alone = [sampling.generate(config, params, [p], seed=s, **kw).tokens[0]
           for p, s in zip(PROMPTS, SEEDS)]
  assert alone == batch
  order = [2, 0, 3, 1]
  flipped = sampling.generate(config, params, [PROMPTS[i] for i in order],
                              seed=[SEEDS[i] for i in order], **kw).tokens
  assert flipped == [batch[i] for i in order]
  wide = sampling.generate(config, params, PROMPTS * 3, seed=SEEDS + [7] * 8, **kw).tokens
  assert wide[:4] == batch
  greedy = sampling.generate(config, params, PROMPTS, **KW).tokens
  mixed = sampling.generate(config, params, PROMPTS, seed=SEEDS,
                            **{**kw, "temperature": [0.9, 0.0, 0.9, 0.0]}).tokens
  assert mixed == [batch[0], greedy[1], batch[2], greedy[3]]
  assert sampling.generate(config, params, PROMPTS, seed=[s + 1 for s in SEEDS],
                           **kw).tokens != batch


SAMPLES = 1 << 15


def first_tokens(config, params, *, seeds, count=3, **kw):
  """The first `count` tokens of len(seeds) samples of one prompt (temperature 1, top-p
  0.9; kw: `sampling.generate`'s window, mode, tau, drafter, ...) -> int array
  [len(seeds)] (one cell id per joint outcome)."""
  out = sampling.generate(config, params, [[60, 61]] * len(seeds), max_new_tokens=count,
                          mask_token_id=MASK_ID, eos_token_ids=[], temperature=1.0,
                          top_p=0.9, seed=seeds, **kw)
  tokens = np.asarray(out.tokens)
  return (tokens[:, 0] * config.vocab_size + tokens[:, 1]) * config.vocab_size + tokens[:, 2]


def two_sample_chi2(a: np.ndarray, b: np.ndarray, min_count: int = 10):
  """Equal-size samples of cell ids: sum (A - B)^2 / (A + B) over cells, those with
  A + B < min_count pooled -> (statistic, threshold at p = 1e-4, cells)."""
  cells, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
  ca = np.bincount(inverse[:len(a)], minlength=len(cells))
  cb = np.bincount(inverse[len(a):], minlength=len(cells))
  small = ca + cb < min_count
  ca = np.append(ca[~small], ca[small].sum())
  cb = np.append(cb[~small], cb[small].sum())
  stat = float(np.sum((ca - cb) ** 2 / np.maximum(ca + cb, 1)))
  return stat, chi2_threshold(len(ca) - 1), len(ca)


@pytest.mark.e2e  # a law drawn from 32,768 samples a side
def test_lossless_sampling_keeps_the_ar_distribution(model):
  """The joint law of the first 3 tokens (temperature 1, top-p 0.9): AR sampling on seeds
  [0, N) against lossless sampling at W = 2, 4, 5 on seeds [N, 2N), N = 32,768, by a
  two-sample chi-square at p = 1e-4; the same test rejects accepting every MASK proposal
  (gated, tau 0)."""
  config, params = model
  ar = first_tokens(config, params, window=1, mode="gated", tau=1.0,
                    seeds=list(range(SAMPLES)))
  others = list(range(SAMPLES, 2 * SAMPLES))
  for window in (2, 4, 5):
    lossless = first_tokens(config, params, window=window, mode="lossless", tau=1.0,
                            seeds=others)
    stat, threshold, cells = two_sample_chi2(ar, lossless)
    print(f"lossless W={window}: chi2 {stat:.1f} < {threshold:.1f} ({cells} cells)")
    assert stat < threshold
  wrong = first_tokens(config, params, window=4, mode="gated", tau=0.0, seeds=others)
  stat, threshold, cells = two_sample_chi2(ar, wrong)
  print(f"always accept W=4: chi2 {stat:.1f} > {threshold:.1f} ({cells} cells)")
  assert stat > threshold


def test_stop_ids_end_decoding_and_are_not_counted(model):
  config, params = model
  kw = dict(KW, temperature=0.8, seed=SEEDS, max_new_tokens=16)
  full = sampling.generate(config, params, PROMPTS, **kw)
  stop_id = full.tokens[0][5]
  k = full.tokens[0].index(stop_id) + 1
  for window, mode in ((1, "gated"), (4, "lossless")):
    out = sampling.generate(config, params, PROMPTS, stop_token_ids=[stop_id], window=window,
                            mode=mode, **kw)
    assert out.tokens[0] == full.tokens[0][:k]
    assert out.finish_reasons[0] == "stop"
    for tokens, whole, reason in zip(out.tokens, full.tokens, out.finish_reasons):
      assert tokens == whole[:len(tokens)]
      assert reason == ("stop" if stop_id in whole else "length")
  assert full.finish_reasons == ["length"] * 4


def test_greedy_finish_reasons(model):
  config, params = model
  greedy = sampling.generate(config, params, PROMPTS, **{**KW, "max_new_tokens": 30})
  eos = greedy.tokens[1][3]
  out = sampling.generate(config, params, PROMPTS,
                          **{**KW, "max_new_tokens": 30, "eos_token_ids": [eos]})
  assert out.finish_reasons[1] == "eos" and out.tokens[1] == greedy.tokens[1][:4]


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
  """A tiny random Qwen2 with the real Qwen2.5 vocabulary and tokenizer."""
  from qwen_tokenizers import make_qwen_checkpoint

  from mars_jax.decoding import loading
  path = make_qwen_checkpoint(tmp_path_factory.mktemp("qwen") / "hf", "qwen2.5")
  return loading.load_model(path)


def spanning_stop(tokenizer, tokens):
  """A 4-character stop string made of the end of one token's text and the start of the
  next one's -> (stop, tokens whose text first holds it)."""
  for i in range(1, len(tokens) - 1):
    head = stops.decode(tokenizer, tokens[:i])
    whole = stops.decode(tokenizer, tokens[:i + 1])
    if (len(head) >= 2 and len(whole) >= len(head) + 2 and whole.startswith(head)
        and "\ufffd" not in whole and head[-2:].strip() and whole[len(head):][:2].strip()):
      stop = head[-2:] + whole[len(head):][:2]
      if stop not in head:
        return stop, stops.first_stop(tokenizer, tokens, [stop])
  raise AssertionError("no two tokens with printable text")


@pytest.mark.e2e   # time: the default suite's 12 minutes
def test_stop_strings_split_across_tokens(qwen_model):
  m = qwen_model
  prompt = m.tokenizer("Tell me a story.").input_ids
  kw = dict(max_new_tokens=24, mask_token_id=m.mask_token_id, eos_token_ids=m.eos_token_ids,
            temperature=1.0, seed=5, tokenizer=m.tokenizer)
  full = sampling.generate(m.config, m.params, [prompt], **kw)
  stop, k = spanning_stop(m.tokenizer, full.tokens[0])
  text = stops.decode(m.tokenizer, full.tokens[0])
  for window, mode in ((1, "gated"), (3, "lossless")):
    out = sampling.generate(m.config, m.params, [prompt], stop=[stop], window=window,
                            mode=mode, **kw)
    assert out.tokens[0] == full.tokens[0][:k]
    assert out.texts[0] == text[:text.index(stop)]
    assert out.finish_reasons == ["stop"]
    if window == 1:
      assert out.num_forwards == [k]
  with pytest.raises(ValueError, match="need a tokenizer"):
    sampling.generate(m.config, m.params, [prompt], stop=[stop],
                      **{**kw, "tokenizer": None})


@pytest.mark.e2e  # the continuous-batching server, end to end
def test_server_samples_as_generate_does(model, qwen_model):
  """Continuous batching (2 rows, 4 requests, lossless W=4): each request's tokens are its
  `generate` tokens, stop ids and stop strings included, with its finish reason."""
  config, params = model
  kw = dict(temperature=0.8, top_p=0.9)
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=[2],
                        batch_size=2, max_len=64, window=4, mode="lossless", round_steps=3)
  want = sampling.generate(config, params, PROMPTS, seed=SEEDS, **KW, **kw)
  stop_id = want.tokens[2][4]
  ids = [server.submit(p, max_new_tokens=KW["max_new_tokens"], seed=s,
                       stop_token_ids=[stop_id] if i == 2 else (), **kw)
         for i, (p, s) in enumerate(zip(PROMPTS, SEEDS))]
  done = server.run()
  for i, rid in enumerate(ids):
    k = want.tokens[i].index(stop_id) + 1 if i == 2 else len(want.tokens[i])
    assert done[rid].tokens == want.tokens[i][:k]
    assert done[rid].finish_reason == ("stop" if i == 2 else want.finish_reasons[i])

  m = qwen_model
  prompt = m.tokenizer("Tell me a story.").input_ids
  full = sampling.generate(m.config, m.params, [prompt], max_new_tokens=24,
                           mask_token_id=m.mask_token_id, eos_token_ids=m.eos_token_ids,
                           temperature=1.0, seed=5, tokenizer=m.tokenizer)
  stop, k = spanning_stop(m.tokenizer, full.tokens[0])
  server = serve.Server.from_model(m, batch_size=2, max_len=64, window=3, mode="lossless")
  rid = server.submit(prompt, max_new_tokens=24, temperature=1.0, seed=5, stop=[stop])
  other = server.submit(prompt, max_new_tokens=24, temperature=1.0, seed=5)
  done = server.run()
  assert done[rid].tokens == full.tokens[0][:k] and done[rid].finish_reason == "stop"
  assert done[rid].text == full.texts[0][:full.texts[0].index(stop)]
  assert done[other].tokens == full.tokens[0]
  with pytest.raises(ValueError, match="tokenizer"):
    serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=[2]).submit(
        [1, 2], max_new_tokens=4, stop=["x"])


def test_bad_sampling_controls_are_refused(model):
  config, params = model
  for bad, match in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"),
                     (dict(temperature=[0.5, 0.5]), "temperature: 2 values for 4"),
                     (dict(stop=[["a"], ["b"]]), "stop: 2 lists for 4")):
    with pytest.raises(ValueError, match=match):
      sampling.generate(config, params, PROMPTS, **KW, **bad)


def min_p_np(scaled, min_p):
  """The min-p cut in float64: tokens less than min_p times as likely as the likeliest go."""
  return np.where(scaled >= scaled.max() + np.log(min_p), scaled, -np.inf) if min_p else scaled


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.2), (6, 0.9, 0.05), (0, 0.7, 0.5)])
def test_min_p_cut_equals_numpy_reference(top_k, top_p, min_p):
  """`draws.warp` with min_p: the top-k/top-p cut, then min-p (transformers' order)."""
  rng = np.random.default_rng(7)
  logits = rng.normal(size=(2, 3, 50)).astype(np.float32) * 2
  temperature = np.asarray([0.7, 1.3], np.float32)
  got = np.asarray(draws.warp(jnp.asarray(logits), jnp.asarray(temperature),
                              jnp.full((2,), top_k, jnp.int32), jnp.full((2,), top_p),
                              jnp.full((2,), min_p, jnp.float32)))
  want = np.stack([[min_p_np(cut_np(l.astype(np.float64) / t, top_k, top_p), min_p)
                    for l in row] for row, t in zip(logits, temperature)])
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6)


def test_the_server_draws_min_p_and_ignores_eos_as_asked(model):
  """The ragged server (2 rows, lossless W = 3): sampled requests with min_p get the
  naive sampler's tokens (uncached forward, NumPy cut, the sampler's noise); a greedy
  request whose EOS comes early runs past it to its budget with ignore_eos, and stops
  there without."""
  config, params = model
  greedy = sampling.generate(config, params, [PROMPTS[1]], max_new_tokens=16,
                             mask_token_id=MASK_ID, eos_token_ids=[-1]).tokens[0]
  eos = greedy[5]
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=[eos],
                        batch_size=2, max_len=64, window=3, mode="lossless", round_steps=3)
  sampled = [server.submit(p, max_new_tokens=10, temperature=1.0, top_p=0.9, min_p=0.3,
                           seed=s, ignore_eos=True) for p, s in zip(PROMPTS[:3], SEEDS)]
  past, stopped = (server.submit(PROMPTS[1], max_new_tokens=16, ignore_eos=flag)
                   for flag in (True, False))
  done = server.run()
  for p, s, rid in zip(PROMPTS, SEEDS, sampled):
    out = []
    while len(out) < 10:
      logits = full_logits(config, params, p + out)[-1].astype(np.float64)
      g = np.asarray(draws.noise(jnp.asarray([s], jnp.uint32),
                                 jnp.asarray([[len(p) + len(out)]], jnp.int32), len(logits)))
      out.append(int(np.argmax(min_p_np(cut_np(logits, 0, 0.9), 0.3) + g[0, 0])))
    assert done[rid].tokens == out
  assert done[past].tokens == greedy and done[past].finish_reason == "length"
  k = greedy.index(eos) + 1
  assert done[stopped].tokens == greedy[:k] and done[stopped].finish_reason == "eos"
