"""Lossless mode, per-request gates, the window policy and continuous batching.

Two models: the random tiny Qwen2 of test_sampling (drafts mostly wrong: every
verification path, rollbacks included, runs often), and the toy of
`mars_jax.benchmarks.toy`, trained with the MARS loss in seconds, whose drafts
are right (lossless mode commits several tokens per forward).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax import serve
from mars_jax.checkpoints import hf
from mars_jax.decoding import sampler as sampling
from mars_jax.decoding import gates
from mars_jax.decoding import loop
from mars_jax.decoding import programs as serve_programs
from mars_jax.benchmarks import toy
from mars_jax.models import cached
from mars_jax.decoding.window_policy import AcceptanceStats, CostTable, WindowPolicy
from test_sampling import BLOCK, MASK_ID, PROMPTS, TAUS, naive_ar, naive_mars

EOS_NEVER = 126


@pytest.fixture(scope="module")
def model(hf_tiny):
  path, _ = hf_tiny(tie=False, seed=2)
  config, params = hf.load_pretrained(path)
  return config, {**params, "lm_head": params["lm_head"] * 20.0}


@pytest.fixture(scope="module")
def trained():
  return toy.train()


@pytest.fixture(scope="module")
def eos_ids(model):
  """EOS ids: sample 1's 6th greedy token (it stops there), and one never produced."""
  config, params = model
  return (naive_ar(config, params, PROMPTS[1], 12, ())[5], EOS_NEVER)


@pytest.fixture(scope="module")
def greedy_ref(model, eos_ids):
  config, params = model
  return [naive_ar(config, params, p, 14, eos_ids) for p in PROMPTS]


def test_verify_takes_the_matching_prefix_and_the_correction():
  greedy = jnp.array([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
  draft = jnp.array([[4, 9, 6], [4, 5, 6], [4, 5, 6], [4, 5, 6], [9, 5, 6]])
  num_draft = jnp.array([3, 3, 2, 3, 3])
  remaining = jnp.array([9, 9, 9, 2, 9])
  eos = jnp.array([-1, -1])
  accepted, hit_eos = gates.verify(greedy, draft, num_draft, eos, remaining)
  assert accepted.tolist() == [2, 4, 3, 2, 1]
  accepted, hit_eos = gates.verify(greedy, draft, num_draft, jnp.array([5, -1]), remaining)
  assert accepted.tolist() == [2, 2, 2, 2, 1] and hit_eos.tolist() == [1, 1, 1, 1, 0]


def test_gates_equal_a_float64_reference():
  """greedy, gate and take against numpy: ties in the top logits, every metric at
  several taus, an EOS inside and outside the accepted run, a budget cut."""
  rng = np.random.default_rng(5)
  logits = (rng.standard_normal((64, 4, 32)) * 3).astype(np.float32)
  logits[:8, :, 7] = logits[:8, :, 3] = 50.0  # a tie: the first index wins, margin 0
  proposals = np.asarray(gates.greedy(jnp.asarray(logits)))
  np.testing.assert_array_equal(proposals, np.argmax(logits, axis=-1))
  p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = -np.sort(-p, axis=-1)
  ref = {"probability": top[..., 0], "margin": top[..., 0] - top[..., 1],
         "entropy": -np.sum(p * np.log(p), axis=-1)}
  for tau in (0.2, 0.5, 0.9, 1.0):
    for m, value in ref.items():
      passes = value <= tau if m == "entropy" else (value >= tau) & (tau < 1)
      near = np.abs(value - tau) < 1e-5  # float32 rounding may fall on either side
      got = np.asarray(gates.gate(jnp.asarray(logits), jnp.float32(tau), m))
      np.testing.assert_array_equal(got[~near], passes[~near])
      ids = jnp.full((64, 4), gates.METRICS.index(m), jnp.int32)
      np.testing.assert_array_equal(np.asarray(gates.gate(jnp.asarray(logits), tau, ids)), got)
  passes = rng.random((64, 4)) < 0.7
  eos = np.array([proposals[0, 1], proposals[1, 3], -1, -1], np.int32)
  remaining = rng.integers(0, 6, 64).astype(np.int32)
  accepted, hit_eos = gates.take(jnp.asarray(proposals), jnp.asarray(passes), jnp.asarray(eos),
                                 jnp.asarray(remaining))
  for i in range(64):
    n, stop = 0, False
    for k in range(4):
      if n == remaining[i] or (k and not passes[i, k]) or stop:
        break
      n, stop = n + 1, proposals[i, k] in eos[:2]
    assert (int(accepted[i]), bool(hit_eos[i])) == (n, stop), i


@pytest.mark.parametrize("window", range(2, BLOCK + 2))
def test_lossless_is_greedy_ar(model, eos_ids, greedy_ref, window):
  config, params = model
  out = sampling.generate(config, params, PROMPTS, max_new_tokens=14, mask_token_id=MASK_ID,
                          eos_token_ids=eos_ids, window=window, mode="lossless")
  assert out.tokens == greedy_ref
  assert sum(r[-1] in eos_ids for r in greedy_ref) >= 2         # EOS stopped some samples
  assert all(f <= len(t) for f, t in zip(out.num_forwards, out.tokens))
  assert out.tokens_per_forward > 1.0                         # some drafts were right


def test_lossless_cache_holds_committed_kv_after_rollbacks(model):
  """After rejected drafts the cursor rolled back; the K/V below it are the true ones."""
  config, params = model
  state = sampling.decode_batch(config, params, PROMPTS, max_new_tokens=14,
                                mask_token_id=MASK_ID, eos_token_ids=(), window=BLOCK + 1,
                                mode="lossless")
  seq, cursor, length = (np.asarray(a) for a in (state.seq, state.cursor, state.length))
  assert np.all(cursor[:4] == length[:4] - 1)                  # the budget ended each sample
  n = int(cursor.max())
  full = cached.forward_cached(
      config, params, seq[:, :n], jnp.broadcast_to(jnp.arange(n), (4, n)),
      cached.init_cache(config, 4, n), jnp.broadcast_to(jnp.arange(n), (4, n)),
      jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (4, n, n)))[1]
  for i in range(len(PROMPTS)):
    for key in ("k", "v"):
      np.testing.assert_allclose(np.asarray(state.cache[key][:, i, :, :cursor[i]]),
                                 np.asarray(full[key][:, i, :, :cursor[i]]), atol=1e-5, rtol=0)


def toy_prompts(m):
  """Ragged: three cycle prompts (4, 5, 7 tokens) and one the toy never saw."""
  return [m.prompts(1, seed=s, length=k)[0] for s, k in ((1, 4), (2, 5), (3, 7))] + [[5, 9, 100]]


def test_lossless_on_trained_toy_commits_several_tokens_per_forward(trained):
  m = trained
  prompts = toy_prompts(m)
  kw = dict(max_new_tokens=21, mask_token_id=m.mask_token_id, eos_token_ids=())
  ar = sampling.generate(m.config, m.params, prompts, window=1, **kw)
  assert ar.tokens[:3] == [m.continuation(p, 21) for p in prompts[:3]]
  rates = []
  for window in range(2, BLOCK + 2):
    out = sampling.generate(m.config, m.params, prompts, window=window, mode="lossless", **kw)
    assert out.tokens == ar.tokens
    rates.append(out.tokens_per_forward)
  assert rates == sorted(rates) and rates[0] > 1.5 and rates[-1] > 2.5


def test_mixed_per_request_gates_equal_each_alone(model):
  """One batch: exact AR (tau 1), and each gate at its own tau, without recompiling."""
  config, params = model
  taus = [1.0, TAUS["probability"], TAUS["margin"], TAUS["entropy"]]
  metrics = ["probability", "probability", "margin", "entropy"]
  kw = dict(max_new_tokens=16, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
            window=BLOCK + 1)
  loop.decode.clear_cache()
  batch = sampling.generate(config, params, PROMPTS, tau=taus, metric=metrics, **kw)
  sampling.generate(config, params, PROMPTS, tau=taus[::-1], metric=metrics[::-1], **kw)
  assert loop.decode._cache_size() == 1
  for i, p in enumerate(PROMPTS):
    alone = sampling.generate(config, params, [p], tau=taus[i], metric=metrics[i], **kw)
    ref, windows, _ = naive_mars(config, params, p, 16, (EOS_NEVER,), taus[i], BLOCK + 1,
                                 metrics[i])
    assert batch.tokens[i] == alone.tokens[0] == ref
    assert batch.num_forwards[i] == alone.num_forwards[0] == len(windows)
  assert batch.num_forwards[0] == len(batch.tokens[0])         # tau 1: one token a forward
  assert min(batch.num_forwards[1:]) < 16                      # the others went faster


def test_per_prompt_arguments_are_checked(model):
  config, params = model
  kw = dict(max_new_tokens=4, mask_token_id=MASK_ID, eos_token_ids=())
  with pytest.raises(ValueError, match="2 values for 4 prompts"):
    sampling.generate(config, params, PROMPTS, tau=[1.0, 0.5], **kw)
  with pytest.raises(ValueError, match="metric='top'"):
    sampling.generate(config, params, PROMPTS, metric=["top"] * 4, **kw)
  with pytest.raises(ValueError, match="mode="):
    sampling.generate(config, params, PROMPTS, mode="exact", **kw)


# ---- the window policy ---------------------------------------------------------------


def _table(batch, cache_len, costs):
  table = CostTable()
  for window, seconds in costs.items():
    table.put(batch, cache_len, window, seconds)
  return table


def test_policy_picks_w1_when_the_cost_table_makes_w_gt_1_slower():
  # Even at the optimistic prior (W tokens per forward), W > 1 loses.
  policy = WindowPolicy((1, 2, 5), _table(64, 256, {1: 1.0, 2: 2.1, 5: 5.5}))
  assert policy.choose(64, 256, active=64) == 1
  # Cheap W > 1 at a small batch: the prior makes W=5 worth trying first.
  policy.costs.put(4, 256, 1, 1.0)
  policy.costs.put(4, 256, 2, 1.1)
  policy.costs.put(4, 256, 5, 1.3)
  assert policy.choose(4, 256, active=3) == 5
  # It accepted little at W=5: W=2 is tried next, and poor acceptance there ends at 1.
  policy.observe(5, tokens=100, forwards=100)
  assert policy.choose(4, 256, active=3) == 2
  policy.observe(2, tokens=100, forwards=98)
  assert policy.choose(4, 256, active=3) == 1
  assert policy.choose(4, 256, active=0) == 1
  assert [c[2] for c in policy.choices] == [1, 5, 2, 1, 1]


def test_cost_table_file_and_lookup(tmp_path):
  table = _table(8, 128, {1: 0.01, 3: 0.012})
  table.meta["device"] = "cpu"
  table.save(str(tmp_path / "costs.json"))
  policy = WindowPolicy((1, 3), str(tmp_path / "costs.json"))
  assert policy.costs.seconds == table.seconds and policy.costs.meta == {"device": "cpu"}
  assert policy.costs.get(8, 512, 3) == 0.012                 # nearest cache length
  assert policy.costs.get(16, 128, 3) is None
  with pytest.raises(ValueError, match="no cost for W=1"):
    policy.choose(16, 128, active=16)
  calls = []

  def measure(batch, cache_len, window):  # the first round is slowed down by other load
    calls.append(window)
    return {1: 0.02, 3: 0.07}[window] * (1.5 if len(calls) <= 2 else 1.0)

  policy.calibration_rounds = 3
  assert policy.choose(16, 128, active=16, measure=measure) == 1
  assert calls == [1, 3] * 3                                   # round-robin over windows
  assert policy.costs.get(16, 128, 3) == pytest.approx(0.07)
  assert policy.choose(16, 128, active=16, measure=measure) == 1 and len(calls) == 6
  assert AcceptanceStats(prior_forwards=2.0).tokens_per_forward(4) == 4.0


def test_policy_rounds_double_while_the_window_stays(model):
  """A W chosen again runs a round twice as long (2, 4, 8, ... steps), so the 13 steps
  after the prefill take 3 rounds, not 7; the output is the fixed-window output."""
  config, params = model
  kw = dict(max_new_tokens=14, mask_token_id=MASK_ID, eos_token_ids=())
  policy = WindowPolicy((1, 3), _table(4, 32, {1: 1.0, 3: 9.0}), round_steps=2)
  out = sampling.generate(config, params, PROMPTS, window="auto", policy=policy, **kw)
  assert out.tokens == sampling.generate(config, params, PROMPTS, window=1, **kw).tokens
  assert out.windows == {1: 14}
  assert [w for _, _, w in policy.choices] == [1, 1, 1]


@pytest.mark.slow  # ~20 s; the policy's choice rules have their own fast tests
def test_auto_window_follows_the_cost_table(trained, model, eos_ids, greedy_ref):
  """Lossless output is greedy AR whatever W the policy picks; the table decides W."""
  m = trained
  prompts = toy_prompts(m)
  kw = dict(max_new_tokens=21, mask_token_id=m.mask_token_id, eos_token_ids=(),
            mode="lossless")
  ar = sampling.generate(m.config, m.params, prompts, window=1, **kw)
  cache_len = 32
  cheap = WindowPolicy((1, 5), _table(4, cache_len, {1: 1.0, 5: 1.2}), round_steps=2)
  out = sampling.generate(m.config, m.params, prompts, window="auto", policy=cheap, **kw)
  assert out.tokens == ar.tokens and set(out.windows) == {5}
  assert out.tokens_per_forward > 2.5
  dear = WindowPolicy((1, 5), _table(4, cache_len, {1: 1.0, 5: 6.0}), round_steps=2)
  out = sampling.generate(m.config, m.params, prompts, window="auto", policy=dear, **kw)
  assert out.tokens == ar.tokens and out.windows == {5: 1, 1: out.forwards - 1}
  assert out.tokens_per_forward == 1.0                         # the prefill's drafts were cut
  # Costs measured on the spot, on the random model (drafts mostly wrong).
  config, params = model
  measured = WindowPolicy((1, 3), round_steps=3)
  out = sampling.generate(config, params, PROMPTS, max_new_tokens=14, mask_token_id=MASK_ID,
                          eos_token_ids=eos_ids, window="auto", policy=measured,
                          mode="lossless")
  assert out.tokens == greedy_ref
  assert {(b, w) for b, _, w in measured.costs.seconds} == {(4, 1), (4, 3)}
  assert sum(out.windows.values()) == out.forwards


# ---- continuous batching ---------------------------------------------------------------


def _requests(seed=0, n=7):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, 120, int(rng.integers(2, 14))).tolist() for _ in range(n)]
  prompts[2] = list(range(20, 39))                           # longer than the prefill chunk
  budgets = [5, 18, 9, 14, 3, 17, 11][:n]
  return prompts, budgets


def test_continuous_batching_equals_each_request_alone(model):
  config, params = model
  prompts, budgets = _requests()
  taus = [1.0, 0.45, 0.3, 0.6, TAUS["entropy"], 1.0, 0.2]
  metrics = ["probability", "probability", "margin", "probability", "entropy", "margin",
             "margin"]
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                        batch_size=2, max_len=64, window=3, prefill_chunk=8, round_steps=4)
  ids = [server.submit(p, max_new_tokens=b, tau=t, metric=g)
         for p, b, t, g in zip(prompts, budgets, taus, metrics)]
  streamed = {i: [] for i in ids}
  finished = []
  for update in server.stream():
    assert update.request_id not in finished
    streamed[update.request_id] += update.tokens
    assert len(streamed[update.request_id]) == update.num_tokens
    if update.done:
      finished.append(update.request_id)
  assert sorted(finished) == ids and finished != ids         # later requests overtook
  for i, p in enumerate(prompts):   # alone: the uncached reference (== `generate` alone)
    tokens, windows, _ = naive_mars(config, params, p, budgets[i], (EOS_NEVER,), taus[i], 3,
                                    metrics[i])
    done = server.completed[ids[i]]
    assert done.tokens == streamed[ids[i]] == tokens
    assert done.forwards == len(windows)
  assert server.idle and len(server.slots) == 2


def test_continuous_batching_lossless_with_load_aware_window(model):
  """W follows the policy over the costs of the real step (its flat width at each W: the
  server's widths), and the output is AR whatever W it picks."""
  config, params = model
  prompts, budgets = _requests(seed=1, n=6)
  policy = WindowPolicy((1, 3), round_steps=4)
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                        batch_size=4, max_len=64, window=policy, mode="lossless",
                        prefill_chunk=8)
  for width in server.widths:
    policy.costs.put(width, 64, 1, 1.0)
    policy.costs.put(width, 64, 3, 1.5)
  ids = [server.submit(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
  done = server.run()
  for i, p in enumerate(prompts):
    assert done[ids[i]].tokens == naive_ar(config, params, p, budgets[i], (EOS_NEVER,))
  assert max(c[0] for c in policy.choices) == 4                # rows decoding at once
  assert {c[2] for c in policy.choices} == {1, 3}            # the acceptance moved it to 1
  with pytest.raises(ValueError, match="exceeds the server's max_len"):
    server.submit(list(range(60)), max_new_tokens=8)


def test_per_request_windows_and_modes_share_a_batch(model):
  """Gated requests at windows 1..4 and lossless ones in one batch of a W = 1 server
  (max_window 4: each row runs at its own window in the flat batch, the "auto" ones at
  the server's W = 1) each get what they get alone at their window; a cancelled request
  frees its row and its pages, leaves no completion and changes nobody's tokens."""
  config, params = model
  prompts, budgets = _requests(seed=2, n=7)
  kinds = [("gated", 2, 0.45), ("lossless", "auto", 1.0), ("gated", 3, 0.3),
           ("gated", 1, 0.2), ("lossless", 2, 1.0), ("gated", 4, 0.6), ("gated", 3, 0.3)]
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                        batch_size=4, max_len=64, window=1, max_window=4, prefill_chunk=8,
                        round_steps=3)
  doomed = server.submit(prompts[0], max_new_tokens=30, window=3, tau=0.3)
  ids = [server.submit(p, max_new_tokens=b, tau=t, window=w, mode=m)
         for p, b, (m, w, t) in zip(prompts, budgets, kinds)]
  server.step()
  assert server.window == 1 and server.slots[0] == doomed
  assert server.cancel(doomed) and not server.cancel(10 ** 6)
  done = server.run()
  assert doomed not in done and server.idle
  assert server.pool.free == server.pool.num_pages - 1 and not server.rows
  for i, (p, b, (mode, w, t)) in enumerate(zip(prompts, budgets, kinds)):
    if mode == "lossless":
      want = naive_ar(config, params, p, b, (EOS_NEVER,))
    else:
      want = naive_mars(config, params, p, b, (EOS_NEVER,), t, w, "probability")[0]
    assert done[ids[i]].tokens == want, (i, mode, w)
  with pytest.raises(ValueError, match="max_window"):
    server.submit(prompts[0], max_new_tokens=4, window=5)
  with pytest.raises(ValueError, match="mode"):
    server.submit(prompts[0], max_new_tokens=4, mode="exact")


@pytest.mark.e2e   # 15-25 s of compiling: the default suite has tests/test_programs.py
def test_saved_programs_serve_what_jit_serves_and_a_second_server_loads_them(model, tmp_path):
  """A server calling its kernels through `Programs` (executables written to disk) gives
  the AR tokens and frees every page; a second server over the same directory loads
  every program its warmup needs, compiles none, and serves the same."""
  config, params = model
  prompts, budgets = _requests(seed=1, n=5)
  outputs = []
  for attempt in range(2):
    programs = serve_programs.Programs(str(tmp_path))
    server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                          batch_size=4, min_batch_size=1, max_len=32, window=1,
                          mode="lossless", prefill_chunk=8, programs=programs)
    server.warmup(8)
    assert (programs.compiled, programs.loaded) == ((len(programs), 0) if attempt == 0
                                                    else (0, len(programs)))
    ids = [server.submit(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    done = server.run()
    outputs.append([done[i].tokens for i in ids])
    assert server.pool.free == server.pool.num_pages - 1
  assert outputs[0] == outputs[1] == [naive_ar(config, params, p, b, (EOS_NEVER,))
                                      for p, b in zip(prompts, budgets)]
