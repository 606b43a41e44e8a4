"""The sampler equals naive uncached references, batch or not, with one compile per bucket.

The model is a random tiny Qwen2 whose output head is scaled up, so its top
probabilities spread over roughly 0.3..0.7 and the gates accept some MASK
proposals and reject others.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.checkpoints import hf
from mars_jax.decoding import sampler as sampling
from mars_jax.decoding import loop
from mars_jax.models import cached, qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

MASK_ID = 127
BLOCK = 4
REF_LEN = 64
TAUS = {"probability": 0.45, "margin": 0.2, "entropy": 1.6}
PROMPTS = [[11, 52, 3], [7, 90, 33, 64, 25, 18, 41, 9, 100], [60, 61], [5, 77, 12, 98, 43]]


@pytest.fixture(scope="module")
def model(hf_tiny):
  path, _ = hf_tiny(tie=False, seed=2)
  config, params = hf.load_pretrained(path)
  return config, {**params, "lm_head": params["lm_head"] * 20.0}


@functools.lru_cache(maxsize=None)
def _full_logits_fn(config):
  causal = jnp.tril(jnp.ones((REF_LEN, REF_LEN), bool))[None]
  positions = jnp.arange(REF_LEN)[None]
  return jax.jit(lambda params, tokens: qwen2.forward(
      config, params, tokens[None], positions, causal)[0])


def full_logits(config, params, seq):
  """Uncached causal forward over `seq` (padded at the end) -> float32[len(seq), vocab]."""
  assert len(seq) <= REF_LEN
  tokens = np.zeros((REF_LEN,), np.int32)
  tokens[:len(seq)] = seq
  return np.asarray(_full_logits_fn(config)(params, tokens))[:len(seq)]


def gate_np(logits, tau, metric):
  p = np.exp(logits.astype(np.float64) - logits.max())
  p /= p.sum()
  top = np.sort(p)[::-1]
  if metric == "probability":
    return top[0] >= tau
  if metric == "margin":
    return top[0] - top[1] >= tau
  return -np.sum(p * np.log(p)) <= tau


def naive_ar(config, params, prompt, max_new, eos):
  out = []
  while len(out) < max_new and not (out and out[-1] in eos):
    out.append(int(np.argmax(full_logits(config, params, prompt + out)[-1])))
  return out


def naive_mars(config, params, prompt, max_new, eos, tau, window, metric):
  """The rule on the full sequence plus W-1 MASKs, recomputed every step.

  -> (tokens, windows: the tokens accepted by each forward, cut: the budget
  stopped a window whose next proposal passed its gate).
  """
  out, windows, cut = [], [], False
  while len(out) < max_new and not (out and out[-1] in eos):
    n = len(prompt) + len(out)
    logits = full_logits(config, params, prompt + out + [MASK_ID] * (window - 1))[n - 1:]
    taken = []
    for k in range(window):
      if k > 0 and not gate_np(logits[k], tau, metric):
        break
      taken.append(int(np.argmax(logits[k])))
      if taken[-1] in eos:
        break
      if len(out) + len(taken) == max_new:
        cut = k + 1 < window and gate_np(logits[k + 1], tau, metric)
        break
    out += taken
    windows.append(taken)
  return out, windows, cut


def first_new_at_mask(windows):
  """The first token accepted at a MASK slot (k >= 1) that was not produced before it."""
  seen = set()
  for w in windows:
    for k, token in enumerate(w):
      if k > 0 and token not in seen:
        return token
      seen.add(token)
  return None


@pytest.mark.device
@pytest.mark.parametrize("window,metric,head_scale", [
    (1, "probability", 1.0), (BLOCK + 1, "probability", 1.0), (BLOCK + 1, "margin", 1.0),
    (BLOCK + 1, "probability", 50.0), (BLOCK + 1, "margin", 50.0)])
def test_tau_one_is_greedy_ar(model, window, metric, head_scale):
  """head_scale 50: logits so peaked that float32 rounds many top probabilities to 1."""
  config, params = model
  params = {**params, "lm_head": params["lm_head"] * head_scale}
  first = naive_ar(config, params, PROMPTS[1], 12, ())
  eos = (first[5], 126)  # sample 1 stops at its 6th token; 126 is a second EOS id
  ref = [naive_ar(config, params, p, 12, eos) for p in PROMPTS]
  out = sampling.generate(config, params, PROMPTS, max_new_tokens=12, mask_token_id=MASK_ID,
                          eos_token_ids=eos, tau=1.0, window=window, metric=metric)
  assert out.tokens == ref
  assert len(ref[1]) <= 6 and ref[1][-1] in eos
  assert out.num_forwards == [len(r) for r in ref]
  assert out.tokens_per_forward == 1.0


@pytest.mark.parametrize("window", [2, BLOCK + 1])
@pytest.mark.parametrize("metric", ["probability", "margin", "entropy"])
def test_mars_equals_naive_reference(model, metric, window):
  config, params = model
  tau = TAUS[metric]
  run = functools.partial(naive_mars, config, params, eos=(), tau=tau, window=window,
                          metric=metric)
  # A budget that ends one token into the last multi-token window of some sample.
  long = [run(p, max_new=26)[1] for p in PROMPTS]
  max_new = max(sum(map(len, w[:j])) + 1 for w in long for j in range(len(w)) if len(w[j]) > 1)
  run = functools.partial(run, max_new=max_new)
  gen = functools.partial(sampling.generate, config, params, PROMPTS, max_new_tokens=max_new,
                          mask_token_id=MASK_ID, tau=tau, window=window, metric=metric)
  free = [run(p) for p in PROMPTS]
  out = gen(eos_token_ids=())
  assert out.tokens == [r[0] for r in free]
  assert out.num_forwards == [len(r[1]) for r in free]
  assert out.tokens_per_forward > 1.0
  assert any(r[2] for r in free)                               # the budget cut a window
  # EOS ids: the first new token some sample accepts at a MASK slot, and one never produced.
  firsts = [first_new_at_mask(r[1]) for r in free]
  eos = (next(t for t in firsts if t is not None), 126)
  ref = [run(p, eos=eos) for p in PROMPTS]
  out = gen(eos_token_ids=eos)
  assert out.tokens == [r[0] for r in ref]
  assert out.num_forwards == [len(r[1]) for r in ref]
  assert any(r[1][-1][-1] in eos and len(r[1][-1]) > 1 for r in ref)  # EOS inside a window


def test_batched_equals_one_by_one(model):
  config, params = model
  kw = dict(max_new_tokens=20, mask_token_id=MASK_ID, eos_token_ids=(126,),
            tau=TAUS["probability"], window=BLOCK + 1, metric="probability")
  batch = sampling.generate(config, params, PROMPTS, **kw)
  alone = [sampling.generate(config, params, [p], **kw) for p in PROMPTS]
  assert batch.tokens == [a.tokens[0] for a in alone]
  assert batch.num_forwards == [a.forwards for a in alone]
  assert len(set(batch.num_forwards)) > 1       # samples advanced by different counts
  assert batch.forwards == max(batch.num_forwards)


@pytest.mark.e2e   # time: the default suite's 12 minutes
def test_cache_holds_committed_kv(model):
  config, params = model
  state = sampling.decode_batch(config, params, PROMPTS, max_new_tokens=20,
                                mask_token_id=MASK_ID, eos_token_ids=(),
                                tau=TAUS["margin"], window=BLOCK + 1, metric="margin")
  seq, cursor, length = (np.asarray(a) for a in (state.seq, state.cursor, state.length))
  for i in range(len(PROMPTS)):
    n = int(cursor[i])
    assert len(PROMPTS[i]) < n < length[i]       # some K/V deferred, the rest committed
    full = cached.forward_cached(
        config, params, seq[i:i + 1, :n], jnp.arange(n)[None], cached.init_cache(config, 1, n),
        jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), bool))[None])[1]
    for key in ("k", "v"):
      np.testing.assert_allclose(np.asarray(state.cache[key][:, i, :, :n]),
                                 np.asarray(full[key][:, 0]), atol=1e-5, rtol=0)


def test_one_compile_per_bucket_and_window(model):
  config, params = model
  compiles = []

  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  loop.decode.clear_cache()
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for window in (1, 3):
      for prompts, max_new, tau in ((PROMPTS[:3], 11, 1.0), (PROMPTS, 20, 0.5),
                                    (PROMPTS[1:], 14, 0.2)):
        sampling.generate(config, params, prompts, max_new_tokens=max_new,
                          mask_token_id=MASK_ID, eos_token_ids=(126,), tau=tau,
                          window=window)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert len(compiles) == 2
  assert loop.decode._cache_size() == 2


@pytest.mark.parametrize("window,mode,temperature", [(1, "gated", 0.0), (BLOCK + 1, "gated", 0.0),
                                                     (3, "lossless", 0.8)])
def test_chunked_prefill_equals_the_one_step_prefill(model, window, mode, temperature):
  """Prompts fed through the cache 5 tokens a step (the longest takes partial steps while
  the shortest already decode) give every row the tokens and forwards of the prefill
  that feeds each prompt whole."""
  from mars_jax.decoding import batching  # pylint: disable=import-outside-toplevel
  config, params = model
  prompts = PROMPTS + [list(range(3, 40))]
  b = batching.bucket(prompts, len(prompts), max_new_tokens=16, tau=TAUS["probability"],
                      temperature=temperature, seed=5, lossless=mode == "lossless")
  run = functools.partial(loop.decode, config, params, b.prompt, b.prompt_len,
                          b.max_new_tokens, b.controls, batching.eos_array((126,)),
                          np.int32(MASK_ID), window=window, mode=mode,
                          cache_len=b.cache_len(window, config.max_position_embeddings))
  whole, chunked = run(), run(prefill_chunk=5)
  assert b.prompt.shape[1] > 5 * 7
  for field in ("seq", "length", "forwards"):
    np.testing.assert_array_equal(np.asarray(getattr(whole, field)),
                                  np.asarray(getattr(chunked, field)), err_msg=field)
  assert int(chunked.steps) > int(whole.steps)
