"""The host's bookkeeping of a paged KV cache: which pages are free, held, or cached.

The device keeps K/V in `num_pages` pages of `page_size` token slots each; a request's
pages, in order, hold its token slots [i * page_size, (i + 1) * page_size) in page i.
`PagePool` hands pages out and takes them back, and, with prefix caching, remembers what
full pages hold so that a later request whose prompt starts with the same tokens reuses
their K/V instead of computing it again (vLLM V1's KVCacheManager and BlockPool work
this way). Pages [0, reserved) are never handed out: page 0 is the engine's trash page,
where padding writes land.

Every page is in exactly one state:

  free        refcount 0, no hash; in `_free`
  evictable   refcount 0, registered hash; in `_lru` (least recently released first)
  in use      refcount >= 1 (a page shared by n requests has refcount n)

  allocate: free -> in use; when free pages run out, evictable -> (hash dropped) in use
  release:  in use -> evictable when it holds a registered hash, else -> free
  match:    evictable or in use -> in use (refcount + 1)

A full page is known by a chained hash of the tokens up to its end:

  hash(page i) = blake2b(hash(page i - 1) or ROOT, tokens of page i)

so equal hashes mean equal prefixes, not only equal pages. blake2b rather than Python's
`hash`: the prompts are users', and a crafted collision of a 64-bit hash would hand one
user's K/V to another; `match` also compares the page's own tokens, stored with its
hash. A hash is registered (`register`) only once the page's K/V are final, and dropped
when the page is evicted, so `match` never returns a page that was handed out again.
Two requests that computed the same prefix at once hold equal pages; the first to
register keeps the hash and the other's page stays unregistered (it knows its hash, to
chain the next ones, but goes back to free on release).

`release` takes a request's pages from last to first, so the head of a prefix, which
more requests share, is the most recently used and evicted last. Everything here is
plain Python over lists and dicts: it runs every scheduling step for every row, and
`register` costs the pages that became full since its last call, not the request's.
"""

from __future__ import annotations

import array
import collections
import hashlib
from typing import Sequence

ROOT = bytes(16)   # the chained hash before a request's first page


def chain(parent: bytes, tokens: tuple[int, ...]) -> bytes:
  """The hash of a page holding `tokens` after the prefix whose hash is `parent`."""
  return hashlib.blake2b(parent + array.array("q", tokens).tobytes(), digest_size=16).digest()


class OutOfPages(RuntimeError):
  """`PagePool.allocate` was asked for more pages than are free and evictable."""


class PagePool:
  """The pages of one paged KV cache, on the host.

    pool = PagePool(num_pages=1024, page_size=16)
    pages = pool.match(prompt, len(prompt) - 1)          # cached prefix, refcount + 1
    pages += pool.allocate(-(-len(prompt) // 16) - len(pages))
    ...                                                  # the device fills them
    pool.register(pages, prompt)                         # their full pages are cached
    pool.release(pages)                                  # the request ended

  num_pages, page_size: the device's pages and token slots per page; prefix_caching:
  whether `match` and `register` do anything; reserved: pages [0, reserved) are never
  handed out. hit_tokens, query_tokens: tokens `match` found cached and was asked about,
  since creation (reset keeps them).
  """

  def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True,
               reserved: int = 1):
    if page_size < 1 or not 0 <= reserved < num_pages:
      raise ValueError(f"PagePool(num_pages={num_pages}, page_size={page_size}, "
                       f"reserved={reserved}): need page_size >= 1 and "
                       "0 <= reserved < num_pages.")
    self.num_pages, self.page_size = num_pages, page_size
    self.prefix_caching, self.reserved = prefix_caching, reserved
    self.hit_tokens = 0
    self.query_tokens = 0
    self.reset()

  def reset(self) -> None:
    """Every page free and the cache empty (nothing on the device can be trusted after
    an engine restart); the counters are kept. Pages held before are not held now:
    releasing them raises."""
    self._refs = [0] * self.num_pages                      # per page
    self._hash: list[bytes | None] = [None] * self.num_pages  # per page, once final
    self._free = list(range(self.num_pages - 1, self.reserved - 1, -1))  # popped from the end
    self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable
    self._cache: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> (page, tokens)
    self._in_use = 0

  @property
  def free(self) -> int:
    """Pages `allocate` can give now: free ones and evictable cached ones."""
    return len(self._free) + len(self._lru)

  @property
  def in_use(self) -> int:
    """Pages held by at least one request."""
    return self._in_use

  @property
  def cached(self) -> int:
    """Pages holding a registered hash, held or evictable."""
    return len(self._cache)

  def allocate(self, n: int) -> list[int]:
    """n pages no request holds, refcount 1 each and no hash -> their ids. Free pages go
    first, then the least recently used evictable ones (their hashes dropped). Raises
    OutOfPages, allocating nothing, when fewer than n can be given."""
    if n < 0:
      raise ValueError(f"allocate({n}): n must be >= 0.")
    if n > self.free:
      raise OutOfPages(f"asked for {n} pages, {self.free} free "
                       f"({len(self._free)} empty, {len(self._lru)} evictable cached) "
                       f"of {self.num_pages - self.reserved}.")
    if n == 0:
      return []
    take = min(n, len(self._free))
    pages = self._free[len(self._free) - take:][::-1]
    del self._free[len(self._free) - take:]
    for _ in range(n - take):
      page, _ = self._lru.popitem(last=False)
      del self._cache[self._hash[page]]
      self._hash[page] = None
      pages.append(page)
    for page in pages:
      self._refs[page] = 1
    self._in_use += n
    return pages

  def release(self, pages: Sequence[int]) -> None:
    """A request's pages, in order, let go of: refcount - 1 each, last page first. A page
    no request holds any more becomes evictable (most recently used) when it holds a
    registered hash, else free. Raises ValueError, releasing nothing, when a page is
    released more times than it is held (a bug in the caller)."""
    for page, times in collections.Counter(pages).items():
      if not self.reserved <= page < self.num_pages or self._refs[page] < times:
        held = self._refs[page] if 0 <= page < self.num_pages else "no such page"
        raise ValueError(f"release: page {page} released {times} time(s) but held "
                         f"{held} time(s); a page is released once per allocate or match.")
    for page in reversed(pages):
      self._refs[page] -= 1
      if self._refs[page]:
        continue
      self._in_use -= 1
      h = self._hash[page]
      if h is not None and self._cache.get(h, (None,))[0] == page:
        self._lru[page] = None
      else:
        self._hash[page] = None
        self._free.append(page)

  def match(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
    """The cached pages of the longest prefix of `tokens` made of full pages, at most
    `max_tokens` tokens long -> their ids, in order, refcount + 1 each ([] without
    prefix caching). Counts len(tokens) queried and the pages' tokens hit."""
    if not self.prefix_caching:
      return []
    size, parent, pages = self.page_size, ROOT, []
    for start in range(0, min(len(tokens), max_tokens) - size + 1, size):
      chunk = tuple(tokens[start:start + size])
      parent = chain(parent, chunk)
      hit = self._cache.get(parent)
      if hit is None or hit[1] != chunk:
        break
      pages.append(hit[0])
    for page in pages:
      if not self._refs[page]:
        del self._lru[page]
        self._in_use += 1
      self._refs[page] += 1
    self.query_tokens += len(tokens)
    self.hit_tokens += len(pages) * size
    return pages

  def register(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
    """A request's pages in order, and its tokens whose K/V are final in them (all of
    tokens): registers the hash of each full page that has none yet, unless another page
    holds that hash already. Calling it again as tokens grow registers only the pages
    that became full since. No-op without prefix caching."""
    if not self.prefix_caching:
      return
    size = self.page_size
    if len(tokens) > len(pages) * size:
      raise ValueError(f"register: {len(tokens)} tokens do not fit in {len(pages)} "
                       f"pages of {size}.")
    full = len(tokens) // size
    first = full   # the request's hashed pages are a prefix of them: find its end
    while first and self._hash[pages[first - 1]] is None:
      first -= 1
    parent = self._hash[pages[first - 1]] if first else ROOT
    for i in range(first, full):
      page, chunk = pages[i], tuple(tokens[i * size:(i + 1) * size])
      parent = self._hash[page] = chain(parent, chunk)
      if parent not in self._cache:
        self._cache[parent] = (page, chunk)
