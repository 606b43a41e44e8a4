"""Attention masks (boolean, True = may attend) for AR and two-stream MARS training.

Pure functions, arrays in and arrays out. The two-stream layout concatenates the
clean stream (positions 0..L-1 of the concatenation) and the noisy stream
(positions L..2L-1); both carry the same RoPE positions 0..L-1. Rules, for a
query `i` and key `j` with in-stream positions `p` and blocks `blk = p // B`
(docs/design.md):

  clean -> clean   p(j) <= p(i)                          (plain causal)
  noisy -> noisy   blk(j) == blk(i) and p(j) <= p(i)     ("causal" intra-block)
                   blk(j) == blk(i)                      ("bidirectional": Block Diffusion)
  noisy -> clean   blk(j) < blk(i)
  clean -> noisy   never

With packed sequences every rule also requires equal, non-zero segment ids, and
blocks are counted from each segment's own positions (a packed sample has the
blocks it would have alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mars_jax.core import choices
from mars_jax.core.choices import IntraBlock

Array = jax.Array


def causal_mask(length: int) -> Array:
  """Plain causal mask: bool[L, L], [i, j] = j <= i."""
  idx = jnp.arange(length)
  return idx[None, :] <= idx[:, None]


def segment_positions(segment_ids: Array) -> Array:
  """Per-segment positions of packed rows.

  segment_ids: int32[b, L] (contiguous runs, 0 = padding) -> int32[b, L], counting
  0, 1, 2, ... from the first token of each run.

    segment_ids  1 1 1 2 2 0 0
    positions    0 1 2 0 1 0 1
  """
  length = segment_ids.shape[-1]
  idx = jnp.arange(length, dtype=jnp.int32)
  new_run = jnp.concatenate(
      [jnp.ones_like(segment_ids[..., :1], bool),
       segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
  run_start = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=segment_ids.ndim - 1)
  return idx - run_start


def segment_causal_mask(segment_ids: Array) -> Array:
  """Causal mask of packed rows: bool[b, L, L], [i, j] = j <= i and seg(i) == seg(j) != 0.

  segment_ids: int32[b, L], 0 = padding (a padding query attends to nothing).
  """
  same = _same_segment(segment_ids, segment_ids)
  return causal_mask(segment_ids.shape[-1])[None] & same


def two_stream_mask(length: int, block_size: int, *, intra_block: IntraBlock = "causal") -> Array:
  """The MARS two-stream mask over [clean | noisy]: bool[2L, 2L].

  L=6, B=2, intra_block="causal" (1 = may attend; rows are queries):

               clean             noisy
               0 1 2 3 4 5       0 1 2 3 4 5
    clean 0    1 . . . . .   |   . . . . . .
          1    1 1 . . . .   |   . . . . . .
          2    1 1 1 . . .   |   . . . . . .
          3    1 1 1 1 . .   |   . . . . . .
          4    1 1 1 1 1 .   |   . . . . . .
          5    1 1 1 1 1 1   |   . . . . . .
    noisy 0    . . . . . .   |   1 . . . . .
          1    . . . . . .   |   1 1 . . . .
          2    1 1 . . . .   |   . . 1 . . .
          3    1 1 . . . .   |   . . 1 1 . .
          4    1 1 1 1 . .   |   . . . . 1 .
          5    1 1 1 1 . .   |   . . . . 1 1

  "bidirectional" fills each noisy diagonal block (noisy 0-1 see noisy 0-1, ...).
  `length` need not be a multiple of `block_size` (the last block is shorter).
  """
  pos = jnp.arange(length, dtype=jnp.int32)
  seg = jnp.ones((length,), jnp.int32)
  return _two_stream(pos, seg, pos, seg, block_size, intra_block)


def two_stream_segment_mask(segment_ids: Array, positions: Array, block_size: int, *,
                            intra_block: IntraBlock = "causal") -> Array:
  """Two-stream mask of packed rows: bool[b, 2L, 2L].

  segment_ids: int32[b, L] (0 = padding); positions: int32[b, L], the per-segment
  positions that define the blocks (see `segment_positions`). Each rule of
  `two_stream_mask` additionally requires equal, non-zero segment ids.
  """
  return two_stream_target_mask(segment_ids, positions, segment_ids, positions, block_size,
                                intra_block=intra_block)


def two_stream_target_mask(segment_ids: Array, positions: Array, noisy_segment_ids: Array,
                           noisy_positions: Array, block_size: int, *,
                           intra_block: IntraBlock = "causal") -> Array:
  """Two-stream mask over [clean | a noisy stream of any tokens]: bool[b, L + n, L + n].

  segment_ids, positions: int32[b, L] of the clean row; noisy_segment_ids,
  noisy_positions: int32[b, n] of each noisy token (0 = padding), e.g. only the
  blocks that hold a target (`objective.target_stream`), in row order. Every rule
  that involves a noisy token is read off its segment, position and block
  (position // B), never its index, so a noisy stream that keeps only some blocks
  gets, for the tokens it keeps, exactly the rows and columns of the full mask.
  """
  return jax.vmap(lambda p, s, pn, sn: _two_stream(p, s, pn, sn, block_size, intra_block))(
      positions, segment_ids, noisy_positions, noisy_segment_ids)


def causal_spans(length: int, chunk: int) -> tuple:
  """Query chunks of a causal pass over `length` positions, each with the keys up to its
  end: ((q0, q1, ((0, q1),)), ...) for `attention.span_attention`."""
  return tuple((q0, min(q0 + chunk, length), ((0, min(q0 + chunk, length)),))
               for q0 in range(0, length, chunk))


def two_stream_spans(length: int, stream_length: int, block_size: int, chunk: int) -> tuple:
  """Query chunks of a [clean (L) | noisy target stream (n)] pass and the keys each may
  see (`attention.span_attention`): a clean chunk its causal prefix; a noisy chunk the clean
  keys before the last row position its slots can hold, and the noisy slots within
  B - 1 of it (a noisy query sees only its own block, at most B consecutive slots of
  the stream), never the noisy slots beyond:

    queries         keys: clean [0, L)            noisy [L, L + n)
    clean [q0, q1)        [0, q1)                 -
    noisy [q0, q1)        [0, q1 - n)  (in [0, L])  [q0 - B + 1, q1 + B - 1)

  The noisy bound holds for `objective.target_stream`'s layout (packed to the end):
  stream slot i holds a row position of at most i + L - n, and a noisy token sees
  clean keys of earlier blocks of its own segment only, all before its own position.
  """
  spans = list(causal_spans(length, chunk))
  end = length + stream_length
  for q0 in range(length, end, chunk):
    q1 = min(q0 + chunk, end)
    clean = max(0, min(length, q1 - stream_length))
    k0, k1 = max(length, q0 - block_size + 1), min(end, q1 + block_size - 1)
    ranges = ((0, k1),) if k0 == clean else ((0, clean), (k0, k1))
    spans.append((q0, q1, ranges))
  return tuple(spans)


def _same_segment(seg_q: Array, seg_k: Array) -> Array:
  """seg_q: int[..., Lq], seg_k: int[..., Lk] -> bool[..., Lq, Lk]."""
  return (seg_q[..., :, None] == seg_k[..., None, :]) & (seg_q[..., :, None] != 0)


def _two_stream(positions: Array, segment_ids: Array, noisy_positions: Array,
                noisy_segment_ids: Array, block_size: int, intra_block: IntraBlock) -> Array:
  """int32[L] clean and int32[n] noisy positions and segments -> bool[L + n, L + n]."""
  choices.check(IntraBlock, intra_block, "intra_block")
  if block_size < 1:
    raise ValueError(f"block_size={block_size}; must be >= 1.")
  causal = causal_mask(positions.shape[-1]) & _same_segment(segment_ids, segment_ids)
  blk, noisy_blk = positions // block_size, noisy_positions // block_size
  same_block = ((noisy_blk[:, None] == noisy_blk[None, :])
                & _same_segment(noisy_segment_ids, noisy_segment_ids))
  noisy_noisy = same_block & (noisy_positions[None, :] <= noisy_positions[:, None]
                              if intra_block == "causal" else True)
  noisy_clean = (blk[None, :] < noisy_blk[:, None]) & _same_segment(noisy_segment_ids,
                                                                    segment_ids)
  never = jnp.zeros((positions.shape[-1], noisy_positions.shape[-1]), bool)
  return jnp.block([[causal, never], [noisy_clean, noisy_noisy]])
