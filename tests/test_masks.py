"""Every mask equals a naive double loop over the table in docs/design.md."""

import numpy as np
import pytest

from mars_jax.training import masks


def naive_two_stream(positions, segment_ids, block_size, intra_block):
  """The table of docs/design.md, one (query, key) pair at a time, over [clean | noisy]."""
  length = len(positions)
  out = np.zeros((2 * length, 2 * length), bool)
  for i in range(2 * length):
    for j in range(2 * length):
      a, b = i % length, j % length
      if segment_ids[a] == 0 or segment_ids[a] != segment_ids[b]:
        continue
      pi, pj = positions[a], positions[b]
      bi, bj = pi // block_size, pj // block_size
      q_noisy, k_noisy = i >= length, j >= length
      if not q_noisy and not k_noisy:
        out[i, j] = pj <= pi
      elif q_noisy and k_noisy:
        out[i, j] = bj == bi and (pj <= pi or intra_block == "bidirectional")
      elif q_noisy and not k_noisy:
        out[i, j] = bj < bi
  return out


def naive_causal(segment_ids):
  length = len(segment_ids)
  return np.array([[j <= i and segment_ids[i] != 0 and segment_ids[i] == segment_ids[j]
                    for j in range(length)] for i in range(length)])


SIZES = [(8, 4), (10, 4), (7, 3), (5, 1), (6, 8), (12, 16), (9, 2)]


@pytest.mark.parametrize("length,block", SIZES)
@pytest.mark.parametrize("intra", ["causal", "bidirectional"])
def test_two_stream_mask_matches_table(length, block, intra):
  ref = naive_two_stream(np.arange(length), np.ones(length, int), block, intra)
  np.testing.assert_array_equal(
      np.asarray(masks.two_stream_mask(length, block, intra_block=intra)), ref)


@pytest.mark.parametrize("block", [1, 3, 4])
@pytest.mark.parametrize("intra", ["causal", "bidirectional"])
def test_two_stream_segment_mask_matches_table(block, intra):
  segs = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 0, 0],
                   [5, 5, 5, 5, 5, 5, 5, 5, 5, 0, 0, 0, 0, 0],
                   [1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]], np.int32)
  positions = np.asarray(masks.segment_positions(segs))
  got = np.asarray(masks.two_stream_segment_mask(segs, positions, block, intra_block=intra))
  assert got.shape == (3, 28, 28)
  for row in range(3):
    np.testing.assert_array_equal(
        got[row], naive_two_stream(positions[row], segs[row], block, intra))


def test_segment_positions_restart_in_each_segment():
  segs = np.array([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]], np.int32)
  np.testing.assert_array_equal(np.asarray(masks.segment_positions(segs)),
                                [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])


@pytest.mark.parametrize("length", [1, 5, 9])
def test_causal_mask(length):
  np.testing.assert_array_equal(np.asarray(masks.causal_mask(length)),
                                naive_causal(np.ones(length, int)))


def test_segment_causal_mask():
  segs = np.array([[1, 1, 2, 2, 2, 0], [4, 4, 4, 4, 4, 4], [0, 0, 0, 0, 0, 0]], np.int32)
  got = np.asarray(masks.segment_causal_mask(segs))
  for row in range(3):
    np.testing.assert_array_equal(got[row], naive_causal(segs[row]))


@pytest.mark.parametrize("length,block", [(8, 4), (10, 4), (7, 3)])
def test_bidirectional_differs_only_noisy_to_noisy_inside_a_block(length, block):
  causal = np.asarray(masks.two_stream_mask(length, block, intra_block="causal"))
  bidir = np.asarray(masks.two_stream_mask(length, block, intra_block="bidirectional"))
  blk = np.arange(length) // block
  later_in_block = (blk[:, None] == blk[None, :]) & (np.arange(length)[None] > np.arange(
      length)[:, None])
  expected = np.zeros((2 * length, 2 * length), bool)
  expected[length:, length:] = later_in_block
  np.testing.assert_array_equal(causal != bidir, expected)
  assert not np.any(causal & ~bidir)


def test_bad_arguments():
  with pytest.raises(ValueError, match="intra_block"):
    masks.two_stream_mask(4, 2, intra_block="full")
  with pytest.raises(ValueError, match="block_size"):
    masks.two_stream_mask(4, 0)


@pytest.mark.parametrize("intra", ["causal", "bidirectional"])
def test_two_stream_target_mask_is_the_full_mask_at_the_kept_tokens(intra):
  """A noisy stream holding some of the row's tokens (in row order, padded) gets exactly
  the rows and columns of the full two-stream mask at those tokens; padding sees nothing."""
  segs = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 0, 0]], np.int32)
  positions = np.asarray(masks.segment_positions(segs))
  keep = np.array([1, 2, 3, 4, 7, 8, 9, 10, 11])
  noisy_pos = np.concatenate([positions[0, keep], [0, 0]])[None]
  noisy_seg = np.concatenate([segs[0, keep], [0, 0]])[None]
  got = np.asarray(masks.two_stream_target_mask(segs, positions, noisy_seg, noisy_pos, 4,
                                                intra_block=intra))[0]
  full = naive_two_stream(positions[0], segs[0], 4, intra)
  rows = np.concatenate([np.arange(14), 14 + keep])
  np.testing.assert_array_equal(got[:23, :23], full[np.ix_(rows, rows)])
  assert not got[23:].any() and not got[:, 23:].any()
