"""The one-pass MARS loss equals separate causal passes; chunked equals naive; it trains.

The jitted helpers take the config and loss options as static arguments, so tests
that use the same settings share one compilation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.parallel import sharding
from mars_jax.training import objective, optimizer, step as train_step
from mars_jax.models import qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

TOL = 1e-5
VOCAB = 64
MASK = VOCAB - 1
OPTIONS = ("block_size", "ar_weight", "intra_block", "normalization", "chunk_size",
           "stream_length", "attention_chunk")


# Unrolled layers compile twice as fast on CPU (test_sharding runs the scanned stack).
RT = qwen2.Runtime(scan_layers=False)


def tiny_config(tie=True):
  return qwen2.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           rope_theta=10000.0, tie_word_embeddings=tie)


def random_params(config, seed=0):
  """Weights large enough that every attention edge moves the loss well above 1e-5."""
  rng = np.random.default_rng(seed)
  def draw(path, x):
    name = path[-1].key
    if name == "scale":
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(x.shape), jnp.float32)
    return jnp.asarray((0.1 if name.endswith("bias") else 0.25)
                       * rng.standard_normal(x.shape), jnp.float32)
  return jax.tree_util.tree_map_with_path(draw, qwen2.abstract_params(config, runtime=RT))


def ragged_batch(length=11, seed=0):
  """Prompts of different lengths, right padding, one row without any target."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, MASK, (3, length)).astype(np.int32)
  loss_mask = np.zeros((3, length), bool)
  loss_mask[0, 3:] = True
  loss_mask[1, 5:9] = True
  return {"tokens": tokens, "loss_mask": loss_mask}


@functools.partial(jax.jit, static_argnums=0, static_argnames=OPTIONS)
def mars_vg(config, params, batch, block_size=4, ar_weight=1.0, intra_block="causal",
            normalization="sequence", chunk_size=256, stream_length=None,
            attention_chunk=64):
  """((loss, metrics), grads) of the one-pass `mars_loss`."""
  return jax.value_and_grad(
      lambda p: objective.mars_loss(config, p, batch, block_size=block_size, runtime=RT,
                                    mask_token_id=MASK, ar_weight=ar_weight,
                                    intra_block=intra_block, normalization=normalization,
                                    chunk_size=chunk_size, stream_length=stream_length,
                                    attention_chunk=attention_chunk),
      has_aux=True)(params)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("normalization",
                                                                "stream_length",
                                                                "attention_chunk"))
def ar_vg(config, params, batch, normalization="sequence", stream_length=None,
          attention_chunk=64):
  return jax.value_and_grad(
      lambda p: objective.ar_sft_loss(config, p, batch, normalization=normalization,
                                      runtime=RT, stream_length=stream_length,
                                      attention_chunk=attention_chunk),
      has_aux=True)(params)


def ce(logits, labels):
  return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[
      ..., 0]


def separate_pass_loss(config, params, batch, block, ar_weight=1.0, intra="causal",
                       normalization="sequence", offset=0):
  """docs/design.md with plain forward passes: the clean stream alone, and for each block k
  the clean tokens of blocks < k followed by the noisy tokens of block k. `offset`
  shifts every row's blocks: they start where (position + offset) % B == 0.

  The passes are stacked as rows of one forward call (each row right-padded to L,
  which a causal row never attends to), so the reference compiles once.
  """
  tokens, loss_mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
  b, length = tokens.shape
  labels = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1)
  target = jnp.concatenate([loss_mask[:, 1:], jnp.zeros((b, 1), bool)], 1).astype(jnp.float32)
  noisy = jnp.where(loss_mask, MASK, tokens)
  starts = [0] + [p for p in range(1, length) if (p + offset) % block == 0]
  ends = starts[1:] + [length]
  seqs, pass_masks = [tokens], [np.tril(np.ones((length, length), bool))]
  for start, end in zip(starts, ends):
    seqs.append(jnp.concatenate([tokens[:, :start], noisy[:, start:end], tokens[:, end:]], 1))
    mask = np.tril(np.ones((length, length), bool))
    if intra == "bidirectional":
      mask[start:end, start:end] = True
    pass_masks.append(mask)
  n = len(seqs)
  logits = qwen2.forward(
      config, params, jnp.concatenate(seqs, 0),
      jnp.broadcast_to(jnp.arange(length), (n * b, length)),
      jnp.asarray(np.repeat(np.stack(pass_masks), b, axis=0)),
      runtime=RT).reshape(n, b, length, -1)
  ce_clean = ce(logits[0], labels)
  ce_noisy = jnp.concatenate([ce(logits[k + 1][:, s:e], labels[:, s:e])
                              for k, (s, e) in enumerate(zip(starts, ends))], 1)
  if normalization == "sequence":
    weights = target / jnp.maximum(target.sum(1, keepdims=True), 1.0)
    denom = b
  else:
    weights, denom = target, target.sum()
  return (jnp.sum(weights * ce_noisy) + ar_weight * jnp.sum(weights * ce_clean)) / denom


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6))
def separate_vg(config, params, batch, block, intra="causal", normalization="sequence",
                offset=0):
  return jax.value_and_grad(lambda p: separate_pass_loss(
      config, p, batch, block, intra=intra, normalization=normalization,
      offset=offset))(params)


def max_tree_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))


@pytest.mark.device
@pytest.mark.parametrize("tie,block,normalization,length", [
    (True, 4, "sequence", 11), (False, 3, "token", 12)])
def test_one_pass_equals_separate_passes(tie, block, normalization, length):
  config = tiny_config(tie)
  params = random_params(config)
  batch = ragged_batch(length)
  (loss, _), grads = mars_vg(config, params, batch, block_size=block,
                             normalization=normalization)
  ref_loss, ref_grads = separate_vg(config, params, batch, block, "causal", normalization)
  assert abs(float(loss) - float(ref_loss)) < TOL, (float(loss), float(ref_loss))
  assert max_tree_diff(grads, ref_grads) < TOL


def test_bidirectional_equals_separate_passes_and_leaves_ar_term_alone():
  config = tiny_config()
  params = random_params(config)
  batch = ragged_batch()
  (loss, bidir), grads = mars_vg(config, params, batch, intra_block="bidirectional")
  ref_loss, ref_grads = separate_vg(config, params, batch, 4, "bidirectional", "sequence")
  assert abs(float(loss) - float(ref_loss)) < TOL
  assert max_tree_diff(grads, ref_grads) < TOL
  (_, causal), _ = mars_vg(config, params, batch)
  assert abs(float(causal["ce_ar"]) - float(bidir["ce_ar"])) < TOL
  assert abs(float(causal["ce_mask"]) - float(bidir["ce_mask"])) > 1e-3


def test_ar_weight_zero_removes_exactly_the_ar_term():
  config = tiny_config()
  params = random_params(config)
  batch = ragged_batch()
  (loss1, m1), g1 = mars_vg(config, params, batch, ar_weight=1.0)
  (loss0, m0), g0 = mars_vg(config, params, batch, ar_weight=0.0)
  (ar, _), g_ar = ar_vg(config, params, batch)
  assert abs(float(loss0) - float(m0["ce_mask"])) < TOL
  assert abs(float(loss1 - loss0) - float(ar)) < TOL
  assert abs(float(m1["ce_ar"]) - float(ar)) < TOL  # the clean stream is AR training
  assert max_tree_diff(jax.tree.map(jnp.subtract, g1, g0), g_ar) < TOL


def test_ar_sft_loss_is_causal_ce_on_response_tokens():
  config = tiny_config()
  params = random_params(config)
  batch = ragged_batch()
  tokens = jnp.asarray(batch["tokens"])
  b, length = tokens.shape
  logits = jax.jit(qwen2.forward, static_argnums=0, static_argnames="runtime")(
      config, params, tokens, jnp.broadcast_to(jnp.arange(length), (b, length)),
      jnp.broadcast_to(np.tril(np.ones((length, length), bool)), (b, length, length)),
      runtime=RT)
  per_tok = ce(logits[:, :-1], tokens[:, 1:])
  target = batch["loss_mask"][:, 1:]
  ref = np.mean([float(jnp.sum(per_tok[r] * target[r]) / max(target[r].sum(), 1))
                 for r in range(b)])
  (loss, metrics), _ = ar_vg(config, params, batch)
  assert abs(float(loss) - ref) < TOL
  assert float(metrics["targets"]) == target.sum()


def test_chunked_loss_equals_naive():
  """Tied embeddings: the embedding's gradient sums the lookup and every chunk's
  unembedding; 5 does not divide the 22 positions, so the last chunk is padded."""
  config, chunk = tiny_config(), 5
  params = random_params(config)
  batch = ragged_batch()
  (l_naive, m_naive), g_naive = mars_vg(config, params, batch, chunk_size=None)
  (l_chunk, m_chunk), g_chunk = mars_vg(config, params, batch, chunk_size=chunk)
  assert abs(float(l_naive) - float(l_chunk)) < TOL
  assert max_tree_diff(g_naive, g_chunk) < TOL
  for key in m_naive:
    assert abs(float(m_naive[key]) - float(m_chunk[key])) < TOL, key


def test_packed_rows_equal_unpacked_rows():
  config = tiny_config()
  params = random_params(config)
  rng = np.random.default_rng(3)
  a, b = rng.integers(0, MASK, 6), rng.integers(0, MASK, 9)
  ma, mb = np.arange(6) >= 2, np.arange(9) >= 4
  unpacked = {"tokens": np.zeros((2, 9), np.int32), "loss_mask": np.zeros((2, 9), bool)}
  unpacked["tokens"][0, :6], unpacked["tokens"][1] = a, b
  unpacked["loss_mask"][0, :6], unpacked["loss_mask"][1] = ma, mb
  packed = {"tokens": np.concatenate([a, b, [0]])[None].astype(np.int32),
            "loss_mask": np.concatenate([ma, mb, [False]])[None],
            "segment_ids": np.array([[1] * 6 + [2] * 9 + [0]], np.int32)}
  mars = jax.jit(lambda bt: objective.mars_loss(config, params, bt, block_size=3,
                                                mask_token_id=MASK, runtime=RT))
  ar = jax.jit(lambda bt: objective.ar_sft_loss(config, params, bt, runtime=RT))
  for loss_fn in (mars, ar):
    (l1, m1), (l2, m2) = loss_fn(unpacked), loss_fn(packed)
    assert abs(float(l1) - float(l2)) < TOL
    assert float(m1["targets"]) == float(m2["targets"]) == ma[1:].sum() + mb[1:].sum()


def test_offset_accuracy_counts_noisy_targets_by_slot():
  batch = ragged_batch()
  f = objective.prepare(batch)
  slot = np.asarray(f["positions"]) % 4
  target = np.asarray(f["target"])
  np.testing.assert_array_equal(target[:, :-1], batch["loss_mask"][:, 1:])
  config = tiny_config()
  obj = objective.ObjectiveConfig(kind="mars", block_size=4, mask_token_id=MASK)
  sums = jax.jit(lambda p: objective.objective_sums(config, p, batch, obj, runtime=RT))(
      random_params(config))
  np.testing.assert_array_equal(np.asarray(sums["count_offset"]),
                                [target[slot == j].sum() for j in range(4)])


def test_sequence_weights_count_each_segment_once():
  target = np.array([[0, 1, 1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]], bool)
  segs = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 0, 0, 0, 0]], np.int32)
  weights, denom = objective.sequence_weights(target, segs, "sequence")
  np.testing.assert_allclose(np.asarray(weights), [[0, .5, .5, 0, 1, 0, 0, 0], [0] * 8])
  assert float(denom) == 4.0  # segments 1, 2, 3 and 4; padding is no sequence
  weights, denom = objective.sequence_weights(target, segs, "token")
  assert float(denom) == 3.0


def test_objective_config_validation():
  with pytest.raises(ValueError, match="mask_token_id"):
    objective.ObjectiveConfig(kind="mars")
  with pytest.raises(ValueError, match="block_size"):
    objective.ObjectiveConfig(block_size=0, mask_token_id=1)
  with pytest.raises(ValueError, match="kind"):
    objective.ObjectiveConfig(kind="diffusion", mask_token_id=1)
  with pytest.raises(ValueError, match="shape"):
    objective.prepare({"tokens": np.zeros((2, 4), np.int32), "loss_mask": np.zeros((2, 5))})


@pytest.mark.parametrize("kind", ["ar_sft", "mars"])
def test_tiny_model_overfits_one_batch(kind):
  config = tiny_config()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MASK, (4, 16)).astype(np.int32)
  loss_mask = np.zeros((4, 16), bool)
  loss_mask[:, 6:] = True
  batch = {"tokens": tokens, "loss_mask": loss_mask}
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  opt = optimizer.OptimizerConfig(learning_rate=1e-2, total_steps=100, warmup_steps=5,
                                  decay="constant")
  tx = optimizer.make_optimizer(opt)
  obj = objective.ObjectiveConfig(kind=kind, block_size=4, mask_token_id=MASK)
  state = train_step.init_train_state(config, tx, mesh, rng=jax.random.key(0))
  step = train_step.make_train_step(config, obj, tx, mesh)
  losses = []
  for _ in range(opt.total_steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[0] > 3.0 and losses[-1] < 0.05, (losses[0], losses[-1])
  if kind == "mars":
    assert [float(metrics[f"acc_offset_{j}"]) for j in range(1, 5)] == [1.0] * 4


# ---- the target stream: only blocks that hold a target ---------------------------------


def packed_batch():
  """Two packed rows: segments of different lengths and prompts, padding at the end."""
  rng = np.random.default_rng(5)
  segs = np.array([[1] * 7 + [2] * 9 + [0] * 2, [3] * 12 + [4] * 5 + [0]], np.int32)
  loss_mask = np.zeros(segs.shape, bool)
  loss_mask[0, 4:7] = loss_mask[0, 13:16] = True     # segment 1: targets 3..5; 2: 12..14
  loss_mask[1, 9:12] = loss_mask[1, 15:17] = True
  return {"tokens": rng.integers(0, MASK, segs.shape).astype(np.int32),
          "loss_mask": loss_mask, "segment_ids": segs}


def long_prompt_batch():
  """`ragged_batch(14)` with a longer first prompt: target blocks are 6, 4, 0 positions."""
  batch = ragged_batch(14)
  batch["loss_mask"][0, :9] = False
  return batch


def test_target_stream_keeps_the_blocks_that_hold_a_target():
  # row 0: targets at outputs 5..9 (loss_mask 6..10): blocks 1 and 2 of B = 4
  batch = {"tokens": np.zeros((2, 14), np.int32), "loss_mask": np.zeros((2, 14), bool)}
  batch["loss_mask"][0, 6:11] = True
  f = objective.prepare(batch)
  stream = jax.tree.map(np.asarray, objective.target_stream(f, 4, 10))
  np.testing.assert_array_equal(stream["index"][0], [14, 14, 4, 5, 6, 7, 8, 9, 10, 11])
  np.testing.assert_array_equal(stream["index"][1], [14] * 10)   # row 1 has no target
  np.testing.assert_array_equal(stream["cut"], [False, False])
  np.testing.assert_array_equal(objective.target_block_lengths(f, 4), [8, 0])
  assert list(np.asarray(objective.target_stream(f, 4, 6)["cut"])) == [True, False]
  # packed rows: blocks count from each segment's start
  f = objective.prepare(packed_batch())
  lengths = np.asarray(objective.target_block_lengths(f, 4))
  # row 0: segment 1's targets are outputs 3..5 -> its blocks 0 and 1 (7 positions);
  # segment 2's are its outputs 5..7 -> its block 1 (4). Row 1: segment 3's outputs
  # 8..10 -> block 2 (4); segment 4's outputs 2..3 -> block 0 (4).
  np.testing.assert_array_equal(lengths, [11, 8])


def test_example_target_block_lengths_equal_the_padded_rows():
  """The numpy count the trainer sizes the stream with, on examples stored back to back
  (some longer than the row), equals `target_block_lengths` of their padded rows, for
  every block offset."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 40, 64)
  masks = [rng.random(n) < rng.choice([0.0, 0.1, 0.5, 1.0]) for n in lengths]
  flat, offsets = np.concatenate(masks), np.concatenate([[0], np.cumsum(lengths)])
  row, block = 24, 4
  padded = np.zeros((len(masks), row), bool)
  for i, m in enumerate(masks):
    padded[i, :min(len(m), row)] = m[:row]
  for o in range(block):
    want = objective.target_block_lengths(objective.prepare(
        {"tokens": np.zeros(padded.shape, np.int32), "loss_mask": padded,
         "block_offset": np.full(len(masks), o, np.int32)}), block)
    got = objective.example_target_block_lengths(flat, offsets, block, row, (o,))
    np.testing.assert_array_equal(got, want)
  every = objective.example_target_block_lengths(flat, offsets, block, row, range(block))
  assert every.max() > 0 and every.dtype == np.int32


@pytest.mark.parametrize("tie,intra,packed", [
    (True, "causal", False), (False, "causal", True), (True, "bidirectional", True)])
def test_short_target_stream_equals_the_full_loss(tie, intra, packed):
  """The loss over [clean | target blocks only], unembedded at the target blocks, equals
  the full two-stream loss (every block in the noisy stream, every position unembedded),
  values, metrics and gradients, whenever the target blocks fit."""
  config = tiny_config(tie)
  params = random_params(config)
  batch = packed_batch() if packed else long_prompt_batch()
  need = int(np.max(objective.target_block_lengths(objective.prepare(batch), 4)))
  assert need < batch["tokens"].shape[1]
  (full, m_full), g_full = mars_vg(config, params, batch, intra_block=intra)
  (short, m_short), g_short = mars_vg(config, params, batch, intra_block=intra,
                                      stream_length=need)
  assert abs(float(full) - float(short)) < TOL
  assert max_tree_diff(g_full, g_short) < TOL
  for key in m_full:
    assert abs(float(m_full[key]) - float(m_short[key])) < TOL, key
  (ar_full, _), g_ar_full = ar_vg(config, params, batch)
  (ar_short, _), g_ar_short = ar_vg(config, params, batch, stream_length=need)
  assert abs(float(ar_full) - float(ar_short)) < TOL
  assert max_tree_diff(g_ar_full, g_ar_short) < TOL


@pytest.mark.parametrize("tie,intra,packed,short,chunk", [
    (True, "bidirectional", True, True, 3), (False, "causal", False, False, 5),
    pytest.param(False, "causal", True, True, 4, marks=pytest.mark.slow),
    pytest.param(True, "causal", False, True, 8, marks=pytest.mark.slow)])
def test_block_skipping_attention_equals_the_dense_one(tie, intra, packed, short, chunk):
  """Attention that scores each query chunk only against the keys it may see
  (`attention_chunk`) gives the dense attention's loss, metrics and gradients, MARS
  (tied and untied, packed or not, causal and bidirectional blocks, full and short
  target streams, chunks that do and do not divide B and L) and AR-SFT."""
  config = tiny_config(tie)
  params = random_params(config)
  batch = packed_batch() if packed else long_prompt_batch()
  stream = (int(np.max(objective.target_block_lengths(objective.prepare(batch), 4)))
            if short else None)
  (dense, m_dense), g_dense = mars_vg(config, params, batch, intra_block=intra,
                                      stream_length=stream, attention_chunk=None)
  (spans, m_spans), g_spans = mars_vg(config, params, batch, intra_block=intra,
                                      stream_length=stream, attention_chunk=chunk)
  assert abs(float(dense) - float(spans)) < TOL
  assert max_tree_diff(g_dense, g_spans) < TOL
  for key in m_dense:
    assert abs(float(m_dense[key]) - float(m_spans[key])) < TOL, key
  (ar_dense, _), g_ar_dense = ar_vg(config, params, batch, attention_chunk=None)
  (ar_spans, _), g_ar_spans = ar_vg(config, params, batch, attention_chunk=chunk)
  assert abs(float(ar_dense) - float(ar_spans)) < TOL
  assert max_tree_diff(g_ar_dense, g_ar_spans) < TOL


def test_full_stream_equals_the_every_block_two_stream_pass():
  """stream_length=None keeps every block of the noisy stream in place: the pass over
  `two_stream_inputs` (all 2L positions, unembedded everywhere) gives the same loss."""
  config = tiny_config()
  params = random_params(config)
  batch = ragged_batch()
  tokens, positions, mask = objective.two_stream_inputs(batch, block_size=4,
                                                        mask_token_id=MASK)
  f = objective.prepare(batch)
  logits = qwen2.forward(config, params, tokens, positions, mask, runtime=RT)
  labels = jnp.concatenate([f["labels"], f["labels"]], 1)
  weights, denom = objective.sequence_weights(f["target"], f["segment_ids"], "sequence")
  per = ce(logits, labels) * jnp.concatenate([weights, weights], 1)
  (loss, _), _ = mars_vg(config, params, batch)
  assert abs(float(jnp.sum(per) / denom) - float(loss)) < TOL


def test_rows_that_do_not_fit_are_counted():
  config = tiny_config()
  params = random_params(config)
  batch = long_prompt_batch()
  need = np.asarray(objective.target_block_lengths(objective.prepare(batch), 4))
  short = int(need.max()) - 4
  (_, metrics), _ = mars_vg(config, params, batch, stream_length=short)
  assert float(metrics["rows_cut"]) == np.sum(need > short) >= 1
  (_, metrics), _ = mars_vg(config, params, batch)
  assert float(metrics["rows_cut"]) == 0


@pytest.mark.parametrize("attention_chunk", [None, 4])
def test_shifted_blocks_equal_separate_passes_row_by_row(attention_chunk):
  """Rows with block offsets 1, 3, 2: the one-pass loss is the mean of each row's
  separate-pass loss with its blocks shifted (sequence normalisation: one row, one share)."""
  config = tiny_config()
  params = random_params(config)
  batch = ragged_batch(11)
  offsets = (1, 3, 2)
  (loss, _), grads = mars_vg(config, params, {**batch, "block_offset": np.int32(offsets)},
                             attention_chunk=attention_chunk)
  refs = [separate_vg(config, params, {k: v[r:r + 1] for k, v in batch.items()}, 4,
                      offset=o) for r, o in enumerate(offsets)]
  ref_loss = sum(float(l) for l, _ in refs) / len(offsets)
  ref_grads = jax.tree.map(lambda *g: sum(g) / len(offsets), *[g for _, g in refs])
  assert abs(float(loss) - ref_loss) < TOL, (float(loss), ref_loss)
  assert max_tree_diff(grads, ref_grads) < TOL
  (unshifted, _), _ = mars_vg(config, params, batch, attention_chunk=attention_chunk)
  assert abs(float(unshifted) - float(loss)) > 1e-3     # the offsets change the blocks


def test_random_block_offsets_are_drawn_from_seed_step_and_row():
  """The train step's offsets: in [0, B), every offset drawn, the same for the same
  (seed, step) (a resumed run), others for the next step or seed; each row's from its
  own tokens: the same wherever the row sits and whatever rows are beside it (a run on
  another number of processes), another for a row that differs in one token."""
  tokens = np.random.default_rng(0).integers(0, 1000, (64, 16)).astype(np.int32)
  draw = lambda seed, step, t=tokens: np.asarray(objective.block_offsets(
      jax.random.fold_in(jax.random.key(seed), step), t, 4))
  a = draw(0, 7)
  assert a.min() == 0 and a.max() == 3 and set(a.tolist()) == {0, 1, 2, 3}
  assert (a == draw(0, 7)).all() and not (a == draw(0, 8)).all()
  assert not (a == draw(1, 7)).all()
  order = np.random.default_rng(1).permutation(64)
  np.testing.assert_array_equal(draw(0, 7, tokens[order]), a[order])
  np.testing.assert_array_equal(draw(0, 7, tokens[5:9]), a[5:9])
  one_token = np.repeat(tokens[:1], 32, axis=0)
  one_token[:, 3] = np.arange(32)                         # rows that differ in one token
  assert len(set(draw(0, 7, one_token).tolist())) > 1
  with pytest.raises(ValueError, match="one offset per row"):
    objective.prepare({**ragged_batch(), "block_offset": np.zeros((2,), np.int32)})
