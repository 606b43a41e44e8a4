"""The ragged, paged engine: the attention over a page pool against the dense cached
forward, and `serve.Server` on it against `sampling.generate` alone (greedy, lossless,
sampled, stops, per-request windows) under random arrivals, cancels, prefix hits and
preemption; every page freed however a request ends; the budget checked at start."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax import serve
from mars_jax.checkpoints import hf
from mars_jax.decoding import ragged
from mars_jax.decoding import sampler as sampling
from mars_jax.models import cached, paged, qwen2

MASK_ID, EOS_NEVER = 127, 126


@pytest.fixture(scope="module")
def model(hf_tiny):
  path, _ = hf_tiny(tie=False, seed=3)
  config, params = hf.load_pretrained(path)
  return config, {**params, "lm_head": params["lm_head"] * 20.0}


@pytest.mark.parity
@pytest.mark.parametrize("page_size,tile", [(4, 1), (5, 8), (16, 3)])
def test_paged_forward_equals_the_dense_cached_forward(model, page_size, tile):
  """Rows of odd lengths (prompts of 1, 7, 13 and 30 tokens: no page or tile divides
  them), pages scattered over the pool in any order, fed as one flat batch in two calls
  (the prompts' first parts, then the rest with a few new tokens): each row's hidden
  states equal the dense cached forward's over its own cache."""
  config, params = model
  rng = np.random.default_rng(0)
  lengths = [1, 7, 13, 30]
  rows = len(lengths)
  seqs = [rng.integers(0, 120, n + 3).tolist() for n in lengths]
  max_pages = math.ceil(40 / page_size)
  order = rng.permutation(np.arange(1, rows * max_pages + 1))
  table = order.reshape(rows, max_pages).astype(np.int32)
  pool = paged.init_pool(config, rows * max_pages + 1, page_size, jnp.float32)
  got = [[] for _ in range(rows)]
  for lo, hi in [(0, lambda n: max(n // 2, 1)), (None, lambda n: n + 3)]:
    spans, tokens, positions = [], [], []
    for r, seq in enumerate(seqs):
      start = 0 if lo == 0 else max(lengths[r] // 2, 1)
      stop = hi(lengths[r])
      spans.append((r, stop - start, 1))
      tokens += seq[start:stop]
      positions += list(range(start, stop))
    width = len(tokens) + 5
    layout = ragged.layout(rows, spans, width, rows, width, tile)
    pos = np.zeros((width,), np.int32)
    pos[:len(positions)] = positions
    row_of = np.asarray(layout.row)
    page = np.where(row_of < rows, table[np.minimum(row_of, rows - 1), pos // page_size], 0)
    tok = np.zeros((width,), np.int32)
    tok[:len(tokens)] = tokens
    hidden, pg = cached.forward_paged(
        config, qwen2.DEFAULT_RUNTIME, params, jnp.asarray(tok),
        paged.Paged(pool["k"], pool["v"], jnp.asarray(table), jnp.asarray(page.astype(np.int32)),
                    jnp.asarray(pos % page_size), jnp.asarray(pos), layout.tiles))
    pool = {"k": pg.k, "v": pg.v}
    for r, (_, n, _) in enumerate(spans):
      got[r].append(np.asarray(hidden[layout.start[r]:layout.start[r] + n]))
  for r, seq in enumerate(seqs):
    n = lengths[r] + 3
    ids = jnp.asarray(seq)[None]
    mask = jnp.tril(jnp.ones((1, n, n), bool))
    want = qwen2.forward_hidden(config, params, ids, jnp.arange(n)[None], mask)[0]
    np.testing.assert_allclose(np.concatenate(got[r]), want, atol=2e-5, rtol=2e-5)


def _alone(config, params, prompt, budget, kind):
  mode, window, tau, temperature, seed, stop_ids = kind
  return sampling.generate(
      config, params, [prompt], max_new_tokens=budget, mask_token_id=MASK_ID,
      eos_token_ids=(EOS_NEVER,), window=window, mode=mode, tau=tau,
      temperature=temperature, seed=seed, stop_token_ids=stop_ids).tokens[0]


KINDS = [("gated", 1, 1.0, 0.0, 0, ()), ("lossless", 3, 1.0, 0.0, 0, ()),
         ("gated", 3, 0.3, 0.0, 0, ()), ("lossless", 2, 1.0, 0.8, 7, ()),
         ("gated", 4, 0.5, 0.0, 0, (5, 9)), ("gated", 2, 0.4, 0.9, 3, ()),
         ("lossless", 4, 1.0, 0.0, 0, (11,))]


@pytest.mark.e2e   # ~80 s of compiling `generate`'s references; the default suite runs the
# continuous-batching equivalences of tests/test_sampling_ext.py on this engine
def test_server_equals_generate_alone_under_arrivals_cancels_prefix_hits_and_preemption(model):
  """Requests of every kind arrive while others decode, some cancelled, many sharing
  prefixes (a prefix-cache hit starts their prefill past the shared pages), on a pool
  too small for all at once (rows are preempted and resumed): each completed request
  gets exactly what `generate` gives it alone, and the pool ends with every page free."""
  config, params = model
  rng = np.random.default_rng(1)
  shared = rng.integers(0, 120, 19).tolist()
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                        batch_size=4, max_len=64, window=1, max_window=4, prefill_chunk=6,
                        round_steps=3, page_size=4, num_pages=20, max_num_batched_tokens=32)
  expected, cancelled, submitted = {}, set(), 0
  for wave in range(4):
    for _ in range(5):
      tail = rng.integers(0, 120, int(rng.integers(1, 9))).tolist()
      prompt = (shared + tail) if rng.random() < 0.6 else tail
      budget = int(rng.integers(2, 24))
      kind = KINDS[submitted % len(KINDS)]
      mode, window, tau, temperature, seed, stop_ids = kind
      rid = server.submit(prompt, max_new_tokens=budget, window=window, mode=mode, tau=tau,
                          temperature=temperature, seed=seed, stop_token_ids=stop_ids)
      expected[rid] = (prompt, budget, kind)
      submitted += 1
    for _ in range(2 + wave):
      server.step()
    running = [r for r in server.slots if r is not None]
    if running:
      server.cancel(running[-1])
      cancelled.add(running[-1])
  done = server.run()
  assert server.idle and not server.rows
  assert server.pool.free == server.pool.num_pages - 1
  assert server.pool.hit_tokens > 0 and server.preemptions > 0
  assert set(done) == set(expected) - cancelled
  for rid, (prompt, budget, kind) in expected.items():
    if rid in done:
      assert done[rid].tokens == _alone(config, params, prompt, budget, kind), (rid, kind)


def _small_server(config, params):
  return serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                      batch_size=8, max_len=48, window=2, prefill_chunk=16, round_steps=2,
                      page_size=4, max_num_batched_tokens=64)


def test_every_page_is_freed_however_a_request_ends(model):
  """Finished, cut by a stop id, cancelled while queued or running, dropped by a reset
  (a failed round): the pool is full again each time."""
  config, params = model
  server = _small_server(config, params)
  full = server.pool.num_pages - 1
  a = server.submit(list(range(1, 12)), max_new_tokens=20)
  b = server.submit(list(range(3, 9)), max_new_tokens=20, stop_token_ids=[0, 1, 2, 3, 4, 5])
  c = server.submit(list(range(5, 30)), max_new_tokens=20)
  server.step()
  assert server.pool.in_use > 0
  server.cancel(c)
  server.run()
  assert a in server.completed and b in server.completed and c not in server.completed
  assert server.pool.free == full
  server.submit(list(range(2, 20)), max_new_tokens=20)
  server.step()
  assert server.pool.in_use > 0
  server.reset()
  assert server.pool.free == full and server.pool.cached == 0
  server.run()
  assert server.pool.free == full


@pytest.mark.e2e   # ~30 s
def test_after_10000_requests_the_pool_is_full_and_holds_the_shared_prefix(model):
  config, params = model
  server = _small_server(config, params)
  full = server.pool.num_pages - 1
  rng = np.random.default_rng(2)
  prefix = list(range(40, 52))
  for i in range(10_000):
    server.submit(prefix + rng.integers(0, 120, 3).tolist(), max_new_tokens=1)
    if i % 64 == 63:
      server.run()
  server.run()
  assert server.pool.free == full and not server.rows
  assert server.pool.cached >= len(prefix) // 4
  assert server.pool.hit_tokens >= 9_000 * 12


def test_a_budget_too_small_for_one_prompt_chunk_is_refused_at_start(model):
  config, params = model
  with pytest.raises(ValueError, match="cannot hold one prompt chunk"):
    serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                 batch_size=2, max_len=64, window=3, prefill_chunk=16,
                 max_num_batched_tokens=17)
  server = serve.Server(config, params, mask_token_id=MASK_ID, eos_token_ids=(EOS_NEVER,),
                        batch_size=2, max_len=64, window=1, page_size=4, num_pages=9)
  with pytest.raises(ValueError, match="the KV pool holds 32"):
    server.submit(list(range(1, 30)), max_new_tokens=8)
