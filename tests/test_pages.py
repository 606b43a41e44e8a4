"""The host's page pool (`mars_jax.decoding.pages`): allocation, refcounts, prefix
matching and registration, LRU eviction, and 10,000 simulated requests against a model
of the device's pages."""

from __future__ import annotations

import random

import pytest

from mars_jax.decoding.pages import OutOfPages, PagePool


def check(pool: PagePool) -> None:
  """Every page outside the reserved ones is in exactly one state, and the counts agree."""
  pages = range(pool.reserved, pool.num_pages)
  free, lru = set(pool._free), set(pool._lru)
  held = {p for p in pages if pool._refs[p] > 0}
  assert len(free) == len(pool._free) and not free & lru and not free & held
  assert not lru & held and free | lru | held == set(pages)
  assert all(pool._refs[p] == 0 for p in range(pool.reserved))
  assert all(pool._hash[p] is None for p in free)
  cached = {page: h for h, (page, _) in pool._cache.items()}
  assert len(cached) == len(pool._cache) and lru <= set(cached)
  assert all(pool._hash[p] == h for p, h in cached.items())
  assert pool.free == len(free) + len(lru) and pool.in_use == len(held)
  assert pool.free + pool.in_use == pool.num_pages - pool.reserved
  assert pool.cached == len(cached)


def test_allocate_and_release_count_pages_and_never_hand_out_the_reserved_ones():
  pool = PagePool(10, 4)
  assert (pool.free, pool.in_use, pool.cached) == (9, 0, 0)
  a = pool.allocate(3)
  b = pool.allocate(6)
  assert a == [1, 2, 3] and sorted(a + b) == list(range(1, 10))
  assert (pool.free, pool.in_use) == (0, 9)
  pool.release(a)
  assert (pool.free, pool.in_use) == (3, 6)
  assert sorted(pool.allocate(3)) == a and pool.allocate(0) == []
  check(pool)
  assert PagePool(5, 2, reserved=0).allocate(5) == [0, 1, 2, 3, 4]


def test_out_of_pages_allocates_nothing_and_says_how_many():
  pool = PagePool(8, 4)
  pool.allocate(5)
  with pytest.raises(OutOfPages, match="asked for 3 pages, 2 free"):
    pool.allocate(3)
  assert (pool.free, pool.in_use) == (2, 5)
  check(pool)
  with pytest.raises(ValueError):
    pool.allocate(-1)


def test_releasing_a_page_not_held_raises_and_releases_nothing():
  pool = PagePool(8, 4)
  a = pool.allocate(2)
  pool.release(a[:1])
  with pytest.raises(ValueError, match="page 1 released 1 time"):
    pool.release(a)
  assert pool.in_use == 1
  with pytest.raises(ValueError):
    pool.release([a[1], a[1]])
  with pytest.raises(ValueError):
    pool.release([0])
  assert pool.in_use == 1
  check(pool)


def filled(pool: PagePool, tokens: list[int]) -> list[int]:
  """A request of `tokens` whose K/V are all computed and registered -> its pages."""
  pages = pool.allocate(-(-len(tokens) // pool.page_size))
  pool.register(pages, tokens)
  return pages


def test_match_finds_registered_full_pages_up_to_max_tokens_and_the_first_mismatch():
  pool = PagePool(16, 4)
  tokens = list(range(100, 114))         # 3 full pages and 2 tokens
  pages = filled(pool, tokens)
  assert pool.cached == 3
  pool.release(pages)
  assert (pool.cached, pool.in_use, pool.free) == (3, 0, 15)
  assert pool.match(tokens, len(tokens)) == pages[:3]   # the partial page never matches
  pool.release(pages[:3])
  assert pool.match(tokens, 11) == pages[:2]            # 3 pages would be 12 tokens
  pool.release(pages[:2])
  assert pool.match(tokens[:11], 100) == pages[:2]
  pool.release(pages[:2])
  assert pool.match(tokens[:5] + [0] + tokens[6:], 14) == pages[:1]
  pool.release(pages[:1])
  assert pool.match([0] + tokens[1:], 14) == []
  assert pool.match(tokens[4:], 14) == []               # page-aligned from the start only
  assert pool.match(tokens, 3) == []
  assert pool.query_tokens == 14 + 14 + 11 + 14 + 14 + 10 + 14
  assert pool.hit_tokens == 12 + 8 + 8 + 4
  check(pool)


def test_requests_sharing_a_prefix_share_its_pages():
  pool = PagePool(16, 4)
  prefix = [7, 7, 7, 7, 8, 8, 8, 8]
  a = filled(pool, prefix + [1, 2, 3])
  b = pool.match(prefix + [4, 5, 6], 10)
  assert b == a[:2] and [pool._refs[p] for p in a] == [2, 2, 1]
  b += pool.allocate(1)
  pool.register(b, prefix + [4, 5, 6])
  assert pool.in_use == 4
  pool.release(a)
  assert [pool._refs[p] for p in a] == [1, 1, 0] and pool.in_use == 3
  assert pool.free == 12 and pool.cached == 2
  assert not set(a[:2]) & set(pool.allocate(12))   # the shared pages are still held
  pool.release(b)
  assert pool.in_use == 12 and pool.free == 3 and pool.cached == 2   # a[:2] evictable
  check(pool)


def test_eviction_takes_free_pages_first_then_the_least_recently_released_cached_ones():
  pool = PagePool(8, 2)                          # 7 pages
  a = filled(pool, [1, 1, 2, 2])                 # pages 1, 2
  b = filled(pool, [3, 3, 4, 4])                 # pages 3, 4
  pool.release(b)                                # released first: 4 then 3
  pool.release(a)                                # 2 then 1: page 1 most recent
  assert (pool.free, pool.cached) == (7, 4)
  assert pool.allocate(3) == [5, 6, 7]           # never-used pages first
  assert pool.allocate(1) == [4]                 # b's tail, least recently released
  assert pool.match([3, 3, 4, 4], 4) == [3]      # its hash is gone: a shorter match
  assert pool.cached == 3
  pool.release([3])
  assert pool.allocate(1) == [2]                 # LRU order now: 2, 1, 3
  assert pool.match([1, 1, 2, 2], 4) == [1]
  pool.release([1])
  assert pool.allocate(2) == [3, 1] and pool.cached == 0
  assert pool.match([1, 1, 2, 2], 4) == [] and pool.match([3, 3], 2) == []
  check(pool)


def test_a_page_is_hashed_only_once_registered_and_a_reused_page_never_matches():
  pool = PagePool(4, 2)
  a = pool.allocate(2)
  assert pool.match([5, 6, 7, 8], 4) == []       # allocated, not registered
  pool.register(a, [5, 6, 7, 8])
  pool.release(a)
  b = pool.allocate(3)                           # every page, the cached two evicted
  assert pool.cached == 0 and all(pool._hash[p] is None for p in b)
  pool.release(b)
  assert pool.match([5, 6, 7, 8], 4) == []
  check(pool)


def test_register_is_idempotent_and_skips_a_prefix_another_page_holds():
  pool = PagePool(16, 4)
  tokens = list(range(12))
  a = pool.allocate(3)
  pool.register(a, tokens[:3])
  assert pool.cached == 0
  pool.register(a, tokens[:6])
  assert pool.cached == 1
  pool.register(a, tokens[:6])
  pool.register(a, tokens)
  assert pool.cached == 3
  b = pool.allocate(3)                           # the same prompt, computed at once
  pool.register(b, tokens)
  assert pool.cached == 3
  pool.release(a)
  pool.release(b)
  assert pool.free == 15 and pool.cached == 3    # b's pages went back to free
  assert pool.match(tokens, 12) == a
  with pytest.raises(ValueError, match="13 tokens do not fit"):
    pool.register(a, tokens + [0])
  check(pool)


def test_a_duplicate_page_still_chains_the_pages_after_it():
  pool = PagePool(16, 2)
  a = filled(pool, [1, 2])
  b = filled(pool, [1, 2, 3, 4])     # b's first page is a duplicate of a's
  pool.release(a)
  pool.release(b)
  assert pool.match([1, 2, 3, 4], 4) == [a[0], b[1]]
  check(pool)


def test_without_prefix_caching_nothing_is_cached_or_matched():
  pool = PagePool(8, 2, prefix_caching=False)
  a = filled(pool, [1, 2, 3, 4])
  assert pool.cached == 0
  pool.release(a)
  assert pool.match([1, 2, 3, 4], 4) == [] and pool.free == 7
  assert (pool.hit_tokens, pool.query_tokens) == (0, 0)
  check(pool)


def test_reset_frees_every_page_and_forgets_the_cache_but_keeps_the_counters():
  pool = PagePool(8, 2)
  a = filled(pool, [1, 2, 3, 4])
  pool.allocate(2)
  pool.release(a)
  pool.release(pool.match([1, 2, 3, 4], 4))
  pool.reset()
  assert (pool.free, pool.in_use, pool.cached) == (7, 0, 0)
  assert pool.match([1, 2, 3, 4], 4) == []
  assert (pool.hit_tokens, pool.query_tokens) == (4, 8)
  with pytest.raises(ValueError):
    pool.release(a)
  check(pool)


def test_ten_thousand_requests_keep_the_invariants_and_read_only_what_was_written():
  """Requests start (match, allocate), compute their prompts in chunks and then decode
  a token at a time (allocate, register), and end early at random (release); a few run
  at once. `device[page]` is what the simulated device wrote in each slot: every page
  `match` returns holds exactly the tokens asked for, and a page written is held by its
  writer alone."""
  rng = random.Random(0)
  pool = PagePool(40, 4)
  device = [[None] * 4 for _ in range(40)]
  prefixes = [[rng.randrange(3) for _ in range(n)] for n in (0, 5, 8, 13, 21)]
  refs = [0] * 40
  live, started, done_requests = [], 0, 0

  def start():
    prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
    pages = pool.match(prompt, len(prompt) - 1)
    for i, page in enumerate(pages):
      assert device[page] == prompt[i * 4:(i + 1) * 4]
      refs[page] += 1
    return {"seq": prompt, "prompt": len(prompt), "pages": pages,
            "final": len(pages) * 4, "decode": rng.randrange(1, 24)}

  def end(request):
    pool.release(request["pages"])
    for page in request["pages"]:
      refs[page] -= 1

  def advance(request):
    """One step: the next chunk of the prompt, or one decoded token -> whether it ended."""
    seq, final = request["seq"], request["final"]
    if final == request["prompt"] + request["decode"] or rng.random() < 0.03:
      return True
    if final >= request["prompt"]:
      seq.append(rng.randrange(3))
    upto = min(len(seq), final + rng.randrange(1, 10))
    need = -(-upto // 4) - len(request["pages"])
    free = pool.free
    try:
      fresh = pool.allocate(need)
    except OutOfPages:
      assert need > free and pool.free == free
      return True                                  # preempted
    for page in fresh:
      assert refs[page] == 0 and pool._hash[page] is None and page != 0
      refs[page], device[page] = 1, [None] * 4
    request["pages"] += fresh
    for i in range(final, upto):
      page = request["pages"][i // 4]
      assert refs[page] == 1
      device[page][i % 4] = seq[i]
    pool.register(request["pages"], seq[:upto])
    request["final"] = upto
    return False

  while done_requests < 10_000:
    if started < 10_000 and (len(live) < 4 or rng.random() < 0.05) and len(live) < 6:
      live.append(start())
      started += 1
    else:
      request = live[rng.randrange(len(live))]
      if advance(request):
        end(request)
        live.remove(request)
        done_requests += 1
    check(pool)
    assert pool.in_use == sum(r > 0 for r in refs)
  assert pool.free == 39 and pool.in_use == 0 and pool.cached > 0
  assert 0 < pool.hit_tokens < pool.query_tokens
