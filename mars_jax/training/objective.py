"""The MARS and AR-SFT objectives: two-stream batches, chunked cross-entropy, metrics.

A batch is `{"tokens": int32[b, L], "loss_mask": bool[b, L]}` plus optionally
`"segment_ids": int32[b, L]` (packed rows: contiguous runs, 0 = padding) and
`"positions": int32[b, L]` (RoPE positions; default: per-segment positions when
segments are given, else 0..L-1) and `"block_offset": int32[b]` (each row's blocks are
(position + offset) // B; default 0, the fixed partition; `block_offsets` draws the
random shifts the train step uses with `random_block_offset`). The output at position p predicts
`tokens[p+1]` and counts where `loss_mask[p+1]` (within one segment), in both
streams (docs/design.md).

Losses are computed as sums (`objective_sums`) and normalised once at the end
(`finalize`), so that micro-batch accumulation and data parallelism give exactly
the loss of the whole batch:

  "sequence"  each sequence (row, or segment of a packed row) contributes the
              mean CE over its targets; the loss is the mean over sequences
              (a sequence without targets contributes 0 but still counts);
  "token"     sum of CE over all targets / number of targets.

Only the blocks that hold a target reach the parts of the step that only targets
need: the MARS noisy stream carries each row's target blocks (`target_stream`,
n = `stream_length` positions, each token with its own position and segment, the
mask built from those), and the unembedding and cross-entropy run at those n
positions of each stream (B = 1 for AR-SFT: the targets themselves). The loss is
the full two-stream loss whenever the target blocks fit in n.

The unembedding and cross-entropy run over chunks of the sequence in a
`lax.scan` whose body is rematerialised, so float32 logits exist for one chunk
`[b, chunk, vocab]` at a time, forward and backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.core import choices
from mars_jax.training import masks
from mars_jax.core.choices import IntraBlock, Kind, Normalization
from mars_jax.models import context, flash, qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Runtime

Array = jax.Array
Batch = dict[str, Array]


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """What the train step optimises.

  kind: "mars" (two streams, stage 2) or "ar_sft" (plain causal, stage 1).
  block_size: B, the MARS block size. mask_token_id: id of `<|mask|>` (mars only).
  ar_weight: weight of the clean-stream AR term (0 = the "no SFT loss" ablation).
  intra_block: "causal" (MARS) or "bidirectional" (Block Diffusion baseline).
  normalization: "sequence" or "token". chunk_size: sequence positions per
  cross-entropy chunk; None computes full logits at once (reference only).
  stream_length: n, the static length of each row's target stream (`target_stream`:
  the blocks that hold a target, packed to the end): the MARS noisy stream and
  the positions unembedded in both streams. None: the row length L (nothing can be
  cut). A row whose target blocks exceed n loses the targets past the first n
  positions (`rows_cut` counts it); the trainer derives an n that fits the data.
  attention_chunk: queries per chunk of the block-skipping attention ("xla" attention
  only: each chunk scores only the keys its rows may see, `masks.causal_spans` and
  `masks.two_stream_spans`); None: every query scores every key (the reference).
  random_block_offset: the train step shifts each row's block partition by a random
  offset in [0, B) every step, drawn from (seed, step) and the row's tokens
  (`block_offsets`), and the eval step by one drawn from a fixed key and the tokens;
  False: blocks are position // B, the partition of docs/design.md (mars only).
  """

  kind: Kind = "mars"
  block_size: int = 4
  mask_token_id: int | None = None
  ar_weight: float = 1.0
  intra_block: IntraBlock = "causal"
  normalization: Normalization = "sequence"
  chunk_size: int | None = 256
  stream_length: int | None = None
  attention_chunk: int | None = 64
  random_block_offset: bool = False

  def __post_init__(self):
    choices.check(Kind, self.kind, "objective.kind")
    if self.block_size < 1:
      raise ValueError(f"objective.block_size={self.block_size}; must be >= 1.")
    if self.kind == "mars" and self.mask_token_id is None:
      raise ValueError("objective.mask_token_id is required for kind='mars' (the id of "
                       "<|mask|>, see mars_jax.checkpoints.hf.load_tokenizer).")
    if self.ar_weight < 0:
      raise ValueError(f"objective.ar_weight={self.ar_weight}; must be >= 0.")
    choices.check(IntraBlock, self.intra_block, "objective.intra_block")
    choices.check(Normalization, self.normalization, "objective.normalization")
    if self.chunk_size is not None and self.chunk_size < 1:
      raise ValueError(f"objective.chunk_size={self.chunk_size}; must be >= 1 or None.")
    if self.attention_chunk is not None and self.attention_chunk < 1:
      raise ValueError(f"objective.attention_chunk={self.attention_chunk}; must be >= 1 or "
                       "None.")
    if self.stream_length is not None and self.stream_length < 1:
      raise ValueError(f"objective.stream_length={self.stream_length}; must be >= 1 or "
                       "None (the row length).")


# ---- batch fields ------------------------------------------------------------------


def prepare(batch: Batch) -> dict[str, Array]:
  """Validated fields of a batch, with the defaults filled in.

  batch: tokens, loss_mask [b, L] (+ segment_ids, positions [b, L]; block_offset
  int32[b], default 0: each row's block partition shifted, see `block_offsets`).
  -> tokens, segment_ids, positions: int32[b, L]; loss_mask: bool[b, L];
     labels: int32[b, L] (labels[p] = tokens[p+1]); target: bool[b, L] (output p counts);
     block_pos: int32[b, L] (positions + block_offset: blocks are block_pos // B).
  """
  for key in ("tokens", "loss_mask"):
    if key not in batch:
      raise KeyError(f"batch has no {key!r} (keys: {sorted(batch)}).")
  tokens = jnp.asarray(batch["tokens"])
  if tokens.ndim != 2:
    raise ValueError(f"batch['tokens'] must be [b, L], got shape {tokens.shape}.")
  for key in ("loss_mask", "segment_ids", "positions"):
    if key in batch and jnp.shape(batch[key]) != tokens.shape:
      raise ValueError(f"batch[{key!r}] has shape {jnp.shape(batch[key])}; expected "
                       f"{tokens.shape} like batch['tokens'].")
  tokens = tokens.astype(jnp.int32)
  loss_mask = jnp.asarray(batch["loss_mask"]).astype(bool)
  if "segment_ids" in batch:
    seg = jnp.asarray(batch["segment_ids"]).astype(jnp.int32)
    default_pos = masks.segment_positions(seg)
  else:
    seg = jnp.ones_like(tokens)
    default_pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                   tokens.shape)
  positions = jnp.asarray(batch.get("positions", default_pos)).astype(jnp.int32)
  offset = jnp.asarray(batch.get("block_offset", jnp.zeros(tokens.shape[:1], jnp.int32)))
  if offset.shape != tokens.shape[:1]:
    raise ValueError(f"batch['block_offset'] has shape {offset.shape}; expected "
                     f"({tokens.shape[0]},): one offset per row.")
  labels = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  same_next = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
  target = jnp.concatenate([loss_mask[:, 1:] & same_next,
                            jnp.zeros_like(loss_mask[:, :1])], axis=1)
  return dict(tokens=tokens, loss_mask=loss_mask, segment_ids=seg, positions=positions,
              labels=labels, target=target,
              block_pos=positions + offset.astype(jnp.int32)[:, None])


def block_offsets(key: Array, tokens: Array, block_size: int) -> Array:
  """int32[b]: a random shift in [0, B) of each row's block partition, drawn from `key`
  and the row's own tokens (int32[b, L]), so a row gets the same shift wherever it
  sits in the batch and however the batch is split over processes.

  With offset o a row's blocks are (position + o) // B, so across steps the masked
  blocks start at every position mod B, as the sampler's MASK slots do (they follow
  whatever token was accepted last). With the fixed partition (o = 0) a small
  model learns its in-block slot from its absolute position mod B, and its MASK
  proposals fail wherever decoding is not block-aligned (docs/default.md).
  The row's tokens enter as `row_hashes`."""
  draw = lambda h: jax.random.randint(jax.random.fold_in(key, h), (), 0, block_size, jnp.int32)
  return jax.vmap(draw)(row_hashes(tokens))


def row_hashes(tokens: Array) -> Array:
  """uint32[b]: sum_j tokens[j] * (2j + 1) * 0x9E3779B1 (mod 2^32) of each row of
  int32[b, L]. The multipliers are odd, so rows that differ in one token get different
  hashes: what a per-row random draw folds into its key to give a row the same draw
  wherever it sits in the batch (block offsets, LoRA dropout masks)."""
  length = tokens.shape[1]
  weights = (2 * jnp.arange(length, dtype=jnp.uint32) + 1) * jnp.uint32(0x9E3779B1)
  return jnp.sum(tokens.astype(jnp.uint32) * weights, axis=1, dtype=jnp.uint32)


def two_stream_inputs(batch: Batch, *, block_size: int, mask_token_id: int,
                      intra_block: IntraBlock = "causal") -> tuple[Array, Array, Array]:
  """Model inputs of the full two-stream pass over [clean | noisy] (every block kept).

  -> tokens: int32[b, 2L] (noisy = MASK on every loss_mask token), positions:
     int32[b, 2L] (the same positions twice), attn_mask: bool[b, 2L, 2L].
  """
  f = prepare(batch)
  length = f["tokens"].shape[1]
  everything = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), f["tokens"].shape)
  stream = {"index": everything, "valid": jnp.ones(f["tokens"].shape, bool)}
  tokens, positions, mask = _two_stream(f, stream, block_size, mask_token_id, intra_block)
  return tokens, positions, flash.dense_mask(mask)


def two_stream_token_mask(batch: Batch, *, block_size: int, stream_length: int | None = None,
                          intra_block: IntraBlock = "causal") -> flash.TokenMask:
  """The mask of the MARS pass over `batch` as the train step builds it, per token:
  [clean row (L) | target stream (n = stream_length, default L)] -> a TokenMask of
  [b, L + n] fields (`mars_jax.benchmarks.plan` counts the attention's tiles with it)."""
  f = prepare(batch)
  stream = target_stream(f, block_size, min(stream_length or f["tokens"].shape[1],
                                            f["tokens"].shape[1]))
  return _two_stream(f, stream, block_size, 0, intra_block)[2]


def running_count(flags: Array) -> Array:
  """bool[b, L] -> int32[b, L]: how many flags are set up to each position (a cumsum
  along the row). An associative scan rather than `jnp.cumsum`, whose reduce-window XLA
  constant-folds slowly where the flags are a constant (an unpacked row's segments):
  1.4 s of compile for one [96, 512] cumsum here, with XLA's slow-folding warning, in
  every step that traces one."""
  return jax.lax.associative_scan(jnp.add, flags.astype(jnp.int32), axis=1)


def target_block_lengths(f: dict[str, Array], block_size: int) -> Array:
  """Positions of each row in blocks that hold a target: int32[b].

  f: the fields of `prepare`. A block is B consecutive positions of one segment,
  counted from its start (block_pos // B); it holds a target when any of its
  outputs counts (`target`). Padding (segment 0) is never kept.
  """
  keep = _in_target_block(f, block_size)
  return jnp.sum(keep, axis=1, dtype=jnp.int32)


def _in_target_block(f: dict[str, Array], block_size: int) -> Array:
  """bool[b, L]: the position is in a block (of its segment) that holds a target."""
  seg, blk = f["segment_ids"], f["block_pos"] // block_size
  new_block = jnp.concatenate([jnp.ones_like(seg[:, :1], bool),
                               (seg[:, 1:] != seg[:, :-1]) | (blk[:, 1:] != blk[:, :-1])],
                              axis=1)
  run = running_count(new_block) - 1
  length = seg.shape[1]
  has = jax.vmap(lambda t, r: jax.ops.segment_max(t, r, num_segments=length))(
      f["target"].astype(jnp.int32), run)
  return (jnp.take_along_axis(has, run, axis=1) > 0) & (seg != 0)


def example_target_block_lengths(loss_mask: np.ndarray, offsets: np.ndarray,
                                 block_size: int, row_length: int,
                                 block_offsets=(0,)) -> np.ndarray:
  """`target_block_lengths` of each example's own padded row (unpacked), for examples
  stored back to back, computed in numpy from the targets alone: int32[n], the most
  over `block_offsets`.

  loss_mask: bool[T], example i's mask is loss_mask[offsets[i]:offsets[i+1]]
  (untruncated or cut to row_length); offsets: int[n + 1]. A row's output p counts
  when its loss_mask[p + 1] does (p + 1 < min(len, row_length)); every position of an
  unpacked row is in its one segment, padding included.
  """
  n = len(offsets) - 1
  hits = np.flatnonzero(loss_mask)
  example = np.searchsorted(offsets, hits, side="right") - 1
  q = hits - offsets[example]
  keep = (q >= 1) & (q < np.minimum(np.diff(offsets)[example], row_length))
  example, p = example[keep], q[keep] - 1
  best = np.zeros(n, np.int64)
  for o in block_offsets:
    k = (p + o) // block_size
    first = np.ones(len(k), bool)
    first[1:] = (k[1:] != k[:-1]) | (example[1:] != example[:-1])
    k, e = k[first], example[first]
    span = np.minimum(row_length, k * block_size - o + block_size) - np.maximum(
        0, k * block_size - o)
    best = np.maximum(best, np.bincount(e, weights=span, minlength=n).astype(np.int64))
  return best.astype(np.int32)


def fitting_stream_length(longest: int, block_size: int, row_length: int) -> int:
  """The stream length for rows of at most `longest` target-block positions: rounded up
  to a multiple of 8 and of B, at most the row length."""
  unit = int(np.lcm(8, block_size))
  return min(-(-int(longest) // unit) * unit, row_length)


def target_stream(f: dict[str, Array], block_size: int, length: int) -> dict[str, Array]:
  """Each row's target blocks, in row order, packed to the end of `length` slots.

  f: the fields of `prepare` ([b, L]). -> index: int32[b, length] (the row position
  each slot holds; L on padding slots), valid: bool[b, length], cut: bool[b] (the
  row's target blocks have more than `length` positions; those past it are dropped).

    target      . . . . . . T T T T T . . .     (B = 4, L = 14)
    blocks      [0      ] [1      ] [2      ] [3  ]
    index       L L 4 5 6 7 8 9 10 11         (blocks 1 and 2, length 10)

  Packed to the end, slot i holds a row position of at most i + L - length (a row
  skips at most L - kept positions before its kept ones, and starts length - kept
  slots in), so the noisy queries of slot i see clean keys before that position only:
  the bound `masks.two_stream_spans` reads.
  """
  keep = _in_target_block(f, block_size)
  b, rows = keep.shape
  rank = running_count(keep) - 1
  kept = jnp.sum(keep, axis=1)
  start = jnp.maximum(length - kept, 0)[:, None]              # a cut row starts at 0
  slot = jnp.where(keep & (rank < length), rank + start, length)   # out of range: dropped
  index = jnp.full((b, length), rows, jnp.int32).at[jnp.arange(b)[:, None], slot].set(
      jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), (b, rows)), mode="drop")
  return {"index": index, "valid": index < rows, "cut": kept > length}


def _gather(a: Array, stream: dict[str, Array], fill=0) -> Array:
  """a: [b, L, ...] -> [b, n, ...] at the stream's positions (`fill` on padding slots)."""
  index = jnp.minimum(stream["index"], a.shape[1] - 1)
  index = index.reshape(index.shape + (1,) * (a.ndim - 2))
  valid = stream["valid"].reshape(index.shape)
  return jnp.where(valid, jnp.take_along_axis(a, index, axis=1), fill)


def _two_stream(f: dict[str, Array], stream: dict[str, Array], block_size: int,
                mask_token_id: int, intra_block: IntraBlock
                ) -> tuple[Array, Array, flash.TokenMask]:
  """[clean row | noisy target stream] inputs: tokens, positions int32[b, L + n] and
  their mask, per token (`flash.TokenMask`, the rule of `masks.two_stream_target_mask`);
  each noisy token is MASK where the clean one is a response token (loss_mask), the
  clean token elsewhere, at its own position."""
  noisy = _gather(jnp.where(f["loss_mask"], jnp.int32(mask_token_id), f["tokens"]), stream)
  noisy_pos = _gather(f["positions"], stream)
  noisy_seg = _gather(f["segment_ids"], stream)
  tokens = jnp.concatenate([f["tokens"], noisy], axis=1)
  positions = jnp.concatenate([f["positions"], noisy_pos], axis=1)
  # the mask from block positions: a per-row shift keeps every order inside the row
  block_pos = jnp.concatenate([f["block_pos"], _gather(f["block_pos"], stream)], axis=1)
  stream_of = jnp.concatenate([jnp.zeros_like(f["loss_mask"]), stream["valid"]], axis=1)
  segments = jnp.concatenate([f["segment_ids"], noisy_seg], axis=1)
  causal_blocks = choices.check(IntraBlock, intra_block, "intra_block") == "causal"
  attn_mask = flash.TokenMask(segments, stream_of, block_pos, block_pos // block_size,
                              flash.pass_index(segments), causal_blocks=causal_blocks)
  return tokens, positions, attn_mask


def sequence_weights(target: Array, segment_ids: Array,
                     normalization: Normalization) -> tuple[Array, Array]:
  """Per-output weights and the loss denominator.

  target: bool[b, L]; segment_ids: int32[b, L] (contiguous runs, 0 = padding)
  -> weights: float32[b, L], denom: float32[] such that the loss is
     sum(weights * ce) / denom (see the module docstring).
  """
  t = target.astype(jnp.float32)
  if choices.check(Normalization, normalization, "normalization") == "token":
    return t, jnp.sum(t)
  length = target.shape[1]
  new_run = jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
      axis=1)
  runs = running_count(new_run) - 1
  per_run = jax.vmap(lambda v, r: jax.ops.segment_sum(v, r, num_segments=length))(t, runs)
  count = jnp.take_along_axis(per_run, runs, axis=1)
  weights = t / jnp.maximum(count, 1.0)
  num_sequences = jnp.sum((new_run & (segment_ids != 0)).astype(jnp.float32))
  return weights, num_sequences


# ---- chunked unembedding + cross-entropy --------------------------------------------


def _cross_entropy(logits: Array, labels: Array) -> tuple[Array, Array]:
  """logits: float32[..., V]; labels: int32[...] -> (ce: float32[...], correct: bool[...])."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return lse - picked, jnp.argmax(logits, axis=-1) == labels


def token_cross_entropy(config: qwen2.Qwen2Config, params: Any, hidden: Array,
                        labels: Array, *, chunk_size: int | None,
                        runtime: Runtime = DEFAULT_RUNTIME) -> tuple[Array, Array]:
  """Per-position CE and top-1 correctness of the unembedded hidden states.

  hidden: [b, t, embed] (final-normed); labels: int32[b, t]
  -> ce: float32[b, t], correct: bool[b, t].
  With `chunk_size`, the t axis is cut into the fewest chunks of at most that many
  positions, of equal size (t = 368, chunk_size 256: two chunks of 184, not 256 and
  a padded 112), and scanned; each chunk's float32 logits [b, chunk, vocab] are
  recomputed in the backward pass instead of stored. `chunk_size=None` builds
  [b, t, vocab] at once.
  """
  head = {k: params[k] for k in ("embedding", "lm_head", "mask_embedding") if k in params}
  if chunk_size is None:
    return _cross_entropy(qwen2.unembed(config, head, hidden, runtime=runtime), labels)
  b, t, e = hidden.shape
  n = -(-t // chunk_size)
  c = -(-t // n)
  pad = n * c - t
  hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, e).swapaxes(0, 1)
  ys = jnp.pad(labels, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

  @jax.checkpoint
  def chunk(head, h, y):
    return _cross_entropy(qwen2.unembed(config, head, h, runtime=runtime), y)

  _, (ce, correct) = jax.lax.scan(lambda _, xs: (None, chunk(head, *xs)), None, (hs, ys))
  unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return unchunk(ce), unchunk(correct)


# ---- objectives as sums -----------------------------------------------------------


def check_mask_token_id(config: qwen2.Qwen2Config, mask_token_id) -> None:
  """Raises ValueError when a static mask id is not a row of the embedding (a traced
  id is not checked)."""
  if isinstance(mask_token_id, (int, np.integer)) and not (
      0 <= mask_token_id < config.vocab_size):
    raise ValueError(
        f"mask_token_id={int(mask_token_id)} is outside the model's vocabulary "
        f"[0, {config.vocab_size}); use the id hf.load_tokenizer returns for <|mask|> "
        "(it takes a spare embedding row), or resize the embeddings.")


def _stream(f: dict[str, Array], block_size: int, objective: ObjectiveConfig
            ) -> dict[str, Array]:
  """The objective's `target_stream` of the fields `f`, with empty slots put in front up
  to a multiple of `context.length_shards()` (which keeps the stream packed to its end:
  the bound of `target_stream` holds). The pass is the same function (empty slots are
  padding); a [b, n] array is then never split unevenly, where XLA's partitioner would
  send the gradient of `_gather` for the padding into position 0 (seen at n = 63 on
  context 2 x tensor 2)."""
  length = f["tokens"].shape[1]
  stream = target_stream(f, block_size, min(objective.stream_length or length, length))
  n = stream["index"].shape[1]
  pad = -n % context.length_shards()
  if pad:
    stream = dict(stream, index=jnp.pad(stream["index"], ((0, 0), (pad, 0)),
                                        constant_values=length),
                  valid=jnp.pad(stream["valid"], ((0, 0), (pad, 0))))
  return stream


def _mars_sums(config: qwen2.Qwen2Config, params: Any, f: dict[str, Array],
               objective: ObjectiveConfig, runtime: Runtime,
               dropout_rng: Array | None) -> dict[str, Array]:
  """MARS sums of the fields `f` of one batch (see `objective_sums`)."""
  block = objective.block_size
  length = f["tokens"].shape[1]
  stream = _stream(f, block, objective)
  n = stream["index"].shape[1]
  tokens, positions, attn_mask = _two_stream(f, stream, block, objective.mask_token_id,
                                             objective.intra_block)
  spans = objective.attention_chunk and masks.two_stream_spans(
      length, n, block, objective.attention_chunk)
  hidden = qwen2.forward_hidden(config, params, tokens, positions, attn_mask,
                                runtime=runtime, spans=spans or None, dropout_rng=dropout_rng,
                                dropout_rows=row_hashes(f["tokens"]))
  # unembed only the target stream's positions, in both streams: [b, 2n, embed]
  hidden = jnp.concatenate([_gather(hidden[:, :length], stream), hidden[:, length:]], axis=1)
  labels = _gather(f["labels"], stream)
  ce, correct = token_cross_entropy(config, params, hidden,
                                    jnp.concatenate([labels, labels], axis=1),
                                    chunk_size=objective.chunk_size, runtime=runtime)
  weights, denom = sequence_weights(f["target"], f["segment_ids"], objective.normalization)
  weights = _gather(weights, stream, 0.0)
  target = _gather(f["target"], stream, False).astype(jnp.float32)
  ce_ar = jnp.sum(weights * ce[:, :n])
  ce_mask = jnp.sum(weights * ce[:, n:])
  offset = (jax.nn.one_hot(_gather(f["block_pos"], stream) % block, block)
            * target[..., None])
  return dict(
      loss=ce_mask + objective.ar_weight * ce_ar, ce_ar=ce_ar, ce_mask=ce_mask, denom=denom,
      targets=jnp.sum(target), correct_ar=jnp.sum(target * correct[:, :n]),
      correct_offset=jnp.einsum("blk,bl->k", offset, correct[:, n:].astype(jnp.float32)),
      count_offset=jnp.sum(offset, axis=(0, 1)),
      rows_cut=jnp.sum(stream["cut"], dtype=jnp.float32))


def _ar_sft_sums(config: qwen2.Qwen2Config, params: Any, f: dict[str, Array],
                 objective: ObjectiveConfig, runtime: Runtime,
                 dropout_rng: Array | None) -> dict[str, Array]:
  """AR-SFT sums of the fields `f` of one batch: a causal pass over L, unembedded only
  at the targets (`target_stream` with B = 1)."""
  attn_mask = flash.causal(f["segment_ids"])
  spans = objective.attention_chunk and masks.causal_spans(f["tokens"].shape[1],
                                                           objective.attention_chunk)
  hidden = qwen2.forward_hidden(config, params, f["tokens"], f["positions"], attn_mask,
                                runtime=runtime, spans=spans or None, dropout_rng=dropout_rng,
                                dropout_rows=row_hashes(f["tokens"]))
  stream = _stream(f, 1, objective)
  ce, correct = token_cross_entropy(config, params, _gather(hidden, stream),
                                    _gather(f["labels"], stream),
                                    chunk_size=objective.chunk_size, runtime=runtime)
  weights, denom = sequence_weights(f["target"], f["segment_ids"], objective.normalization)
  weights = _gather(weights, stream, 0.0)
  target = _gather(f["target"], stream, False).astype(jnp.float32)
  ce_ar = jnp.sum(weights * ce)
  return dict(loss=ce_ar, ce_ar=ce_ar, denom=denom, targets=jnp.sum(target),
              correct_ar=jnp.sum(target * correct),
              rows_cut=jnp.sum(stream["cut"], dtype=jnp.float32))


def objective_sums(config: qwen2.Qwen2Config, params: Any, batch: Batch,
                   objective: ObjectiveConfig, *, runtime: Runtime = DEFAULT_RUNTIME,
                   dropout_rng: Array | None = None) -> dict[str, Array]:
  """Unnormalised loss and metric sums of one batch, as `objective.kind` says (see
  `finalize`). dropout_rng: the LoRA adapters' dropout (`runtime.lora`); None: none.

  MARS: one forward pass over [clean row (L) | noisy target stream (n)]. Sums: loss,
  ce_ar, ce_mask, denom, targets, correct_ar, rows_cut: float32[]; correct_offset,
  count_offset: float32[B] (noisy-stream outputs at in-block offset 1..B: slot j of a
  block, whose target is j+1 tokens past the last clean token it sees).
  AR-SFT: a causal pass over L. Sums: loss, ce_ar, denom, targets, correct_ar, rows_cut.
  """
  if objective.kind == "ar_sft":
    return _ar_sft_sums(config, params, prepare(batch), objective, runtime, dropout_rng)
  check_mask_token_id(config, objective.mask_token_id)
  return _mars_sums(config, params, prepare(batch), objective, runtime, dropout_rng)


def finalize(sums: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
  """Sums (of one batch, or added over micro-batches) -> (loss, metrics).

  metrics (float32 scalars): loss, ce_ar, acc_ar, targets, rows_cut (rows whose target
  blocks did not fit `stream_length`), and for MARS ce_mask and acc_offset_1 .. B.
  """
  denom = jnp.maximum(sums["denom"], 1.0)
  targets = jnp.maximum(sums["targets"], 1.0)
  loss = sums["loss"] / denom
  metrics = dict(loss=loss, ce_ar=sums["ce_ar"] / denom, acc_ar=sums["correct_ar"] / targets,
                 targets=sums["targets"], rows_cut=sums["rows_cut"])
  if "ce_mask" in sums:
    metrics["ce_mask"] = sums["ce_mask"] / denom
    acc = sums["correct_offset"] / jnp.maximum(sums["count_offset"], 1.0)
    for j in range(acc.shape[0]):
      metrics[f"acc_offset_{j + 1}"] = acc[j]
  return loss, metrics


# ---- public losses ---------------------------------------------------------------


def mars_loss(config: qwen2.Qwen2Config, params: Any, batch: Batch, *, block_size: int,
              mask_token_id: int, ar_weight: float = 1.0, intra_block: IntraBlock = "causal",
              normalization: Normalization = "sequence", chunk_size: int | None = 256,
              stream_length: int | None = None, attention_chunk: int | None = 64,
              runtime: Runtime = DEFAULT_RUNTIME) -> tuple[Array, dict[str, Array]]:
  """L = CE_mask + ar_weight * CE_AR from one two-stream pass (docs/design.md).

  batch: {"tokens": int32[b, L], "loss_mask": bool[b, L]} (+ "segment_ids",
  "positions": int32[b, L]; "block_offset": int32[b], each row's blocks shifted, see
  `prepare`). -> (loss: float32[], metrics: see `finalize`). The keywords are the
  fields of `ObjectiveConfig` (`random_block_offset` is the train step's business).
  """
  objective = ObjectiveConfig(kind="mars", block_size=block_size, mask_token_id=mask_token_id,
                              ar_weight=ar_weight, intra_block=intra_block,
                              normalization=normalization, chunk_size=chunk_size,
                              stream_length=stream_length, attention_chunk=attention_chunk)
  return finalize(objective_sums(config, params, batch, objective, runtime=runtime))


def ar_sft_loss(config: qwen2.Qwen2Config, params: Any, batch: Batch, *,
                normalization: Normalization = "sequence", chunk_size: int | None = 256,
                stream_length: int | None = None, attention_chunk: int | None = 64,
                runtime: Runtime = DEFAULT_RUNTIME) -> tuple[Array, dict[str, Array]]:
  """Stage-1 AR SFT: causal CE on response tokens only. -> (loss, metrics)."""
  objective = ObjectiveConfig(kind="ar_sft", normalization=normalization,
                              chunk_size=chunk_size, stream_length=stream_length,
                              attention_chunk=attention_chunk)
  return finalize(objective_sums(config, params, batch, objective, runtime=runtime))
