"""The Flax decoder equals transformers' PyTorch Qwen2 and Qwen3 (float32, 1e-4)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mars_jax.checkpoints import hf
from mars_jax.models import attention, cached, qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

TOL = 1e-4
# hf_tiny kwargs of each family; Qwen3's head_dim 24 is not hidden / heads (16).
FAMILIES = {"qwen2": {}, "qwen3": {"family": "qwen3", "head_dim": 24}}
family = pytest.mark.parametrize("family", FAMILIES)


def torch_logits(model, tokens, positions, mask):
  """transformers' logits under an explicit boolean mask [b, t, t] (eager attention)."""
  add = torch.zeros(mask.shape, dtype=torch.float32)
  add[~torch.from_numpy(np.array(mask))] = torch.finfo(torch.float32).min
  model.config._attn_implementation = "eager"
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(np.asarray(tokens)).long(),
                position_ids=torch.from_numpy(np.asarray(positions)).long(),
                attention_mask=add[:, None])
  return out.logits.numpy()


def causal(b, t):
  return np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))


@pytest.mark.device
@family
@pytest.mark.parametrize("tie,kv", [(True, 2), (False, 2), (True, 1), (False, 4)])
def test_logits_match_transformers(hf_tiny, family, tie, kv):
  path, model = hf_tiny(tie=tie, num_kv_heads=kv, **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 128, (2, 12)).astype(np.int32)
  positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
  mask = causal(2, 12)
  ours = np.asarray(qwen2.forward(config, params, tokens, positions, mask))
  ref = torch_logits(model, tokens, positions, mask)
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


SCALINGS = {"yarn": (("rope_type", "yarn"), ("factor", 4.0),
                     ("original_max_position_embeddings", 64)),
            "linear": (("rope_type", "linear"), ("factor", 2.0))}


@family
@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_scaling_matches_transformers_past_the_original_window(hf_tiny, tmp_path,
                                                                     family, scaling):
  """A checkpoint with `rope_scaling` (YaRN over a 64-position original window, or
  linear): logits at positions 180-219 equal transformers', and an export keeps it."""
  path, model = hf_tiny(tie=False, num_kv_heads=2, rope_scaling=SCALINGS[scaling],
                        **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  assert config.rope_scaling.rope_type == scaling
  tokens = np.random.default_rng(3).integers(0, 128, (2, 40)).astype(np.int32)
  positions = np.broadcast_to(np.arange(180, 220, dtype=np.int32), (2, 40))
  ours = np.asarray(qwen2.forward(config, params, tokens, positions, causal(2, 40)))
  np.testing.assert_allclose(ours, torch_logits(model, tokens, positions, causal(2, 40)),
                             atol=TOL, rtol=0)
  hf.save_pretrained(config, params, str(tmp_path / "export"))
  assert hf.load_pretrained(str(tmp_path / "export"))[0] == config
  again = type(model).from_pretrained(str(tmp_path / "export")).eval()
  np.testing.assert_allclose(ours, torch_logits(again, tokens, positions, causal(2, 40)),
                             atol=TOL, rtol=0)


def test_unsupported_rope_scaling_is_refused_by_name():
  with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
    qwen2.Qwen2Config.from_hf_dict({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 8,
        "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, source="config.json")


@family
def test_right_padded_batch(hf_tiny, family):
  path, model = hf_tiny(tie=True, num_kv_heads=2, **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  rng = np.random.default_rng(1)
  lengths = [10, 6, 3]
  t = 10
  tokens = rng.integers(0, 128, (3, t)).astype(np.int32)
  tokens[1, 6:] = 0  # id 0 is a real token: padding comes only from the mask
  valid = np.arange(t)[None] < np.array(lengths)[:, None]
  mask = causal(3, t) & valid[:, None, :] & valid[:, :, None]
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (3, t))
  ours = np.asarray(qwen2.forward(config, params, tokens, positions, mask))
  for i, n in enumerate(lengths):
    ref = torch_logits(model, tokens[i:i + 1, :n], positions[i:i + 1, :n], causal(1, n))
    np.testing.assert_allclose(ours[i, :n], ref[0], atol=TOL, rtol=0)


@family
def test_arbitrary_mask_and_offset_positions(hf_tiny, family):
  path, model = hf_tiny(tie=False, num_kv_heads=2, **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 128, (2, 9)).astype(np.int32)
  positions = (np.arange(9, dtype=np.int32)[None] + np.array([[17], [3]])).astype(np.int32)
  mask = rng.random((2, 9, 9)) < 0.5
  mask[:, np.arange(9), np.arange(9)] = True  # every query sees at least itself
  ours = np.asarray(qwen2.forward(config, params, tokens, positions, mask))
  ref = torch_logits(model, tokens, positions, mask)
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


@family
@pytest.mark.parametrize("impl", ["dot_product_attention"])
@pytest.mark.parametrize("scan", [True, False])
def test_runtime_variants_equal(hf_tiny, family, impl, scan):
  path, _ = hf_tiny(tie=True, num_kv_heads=2, **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  other_cfg, other_params = hf.load_pretrained(path, scan_layers=scan)
  other = qwen2.Runtime(attention_impl=impl, scan_layers=scan, remat="full")
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 128, (2, 8)).astype(np.int32)
  positions = np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8))
  a = qwen2.forward(config, params, tokens, positions, causal(2, 8))
  b = qwen2.forward(other_cfg, other_params, tokens, positions, causal(2, 8), runtime=other)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [4, 8, 32])
def test_cached_attention_equals_dense_attention_over_the_written_cache(chunk):
  """Blocks of `chunk` slots up to the last visible one, with this step's K/V read in
  place of the slots they overwrite, equal one softmax over the cache after the writes
  (holes in the mask, a dropped write, a visible slot in the last block only)."""
  rng = np.random.default_rng(7)
  b, t, h, kvh, d, slots = 2, 3, 4, 2, 8, 32
  q = rng.standard_normal((b, t, h, d)).astype(np.float32)
  k, v = (rng.standard_normal((b, t, kvh, d)).astype(np.float32) for _ in range(2))
  cache_k, cache_v = (rng.standard_normal((b, kvh, slots, d)).astype(np.float32)
                      for _ in range(2))
  write = np.array([[5, 6, slots], [9, 10, 11]], np.int32)
  mask = rng.random((b, t, slots)) < 0.4
  mask[0, 0] = False
  mask[0, 0, slots - 1] = True            # only the last block is visible to this query
  got = attention.cached_attention(q, k, v, np.stack([0 * cache_k, cache_k]),
                                   np.stack([0 * cache_v, cache_v]), 1, mask, write, chunk=chunk)
  after_k, after_v = cache_k.copy(), cache_v.copy()
  for i in range(b):
    for j in range(t):
      if write[i, j] < slots:
        after_k[i, :, write[i, j]], after_v[i, :, write[i, j]] = k[i, j], v[i, j]
  want = attention.attention(q, after_k.transpose(0, 2, 1, 3),
                             after_v.transpose(0, 2, 1, 3), mask, "xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@family
def test_cached_steps_equal_full_forward(hf_tiny, family):
  """Prefill then token-by-token cached steps give the full forward's logits and K/V."""
  path, _ = hf_tiny(tie=True, num_kv_heads=2, **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  rng = np.random.default_rng(4)
  b, t, prefill, max_len = 2, 10, 4, 16
  tokens = rng.integers(0, 128, (b, t)).astype(np.int32)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  full = np.asarray(qwen2.forward(config, params, tokens, positions, causal(b, t)))
  cache = cached.init_cache(config, b, max_len)
  slots = np.arange(max_len)
  logits, cache = cached.forward_cached(
      config, params, tokens[:, :prefill], positions[:, :prefill], cache,
      positions[:, :prefill], slots[None, None, :] <= positions[:, :prefill, None])
  got = [np.asarray(logits)]
  for s in range(prefill, t):
    mask = slots[None, None, :] <= s
    logits, cache = cached.forward_cached(
        config, params, tokens[:, s:s + 1], positions[:, s:s + 1], cache,
        positions[:, s:s + 1], np.broadcast_to(mask, (b, 1, max_len)))
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, 1), full, atol=TOL, rtol=0)
  # a dropped write (index >= max_len) leaves the cache untouched
  _, same = cached.forward_cached(
      config, params, tokens[:, :1], positions[:, :1], cache,
      np.full((b, 1), max_len, np.int32), np.ones((b, 1, max_len), bool))
  np.testing.assert_array_equal(np.asarray(same["k"]), np.asarray(cache["k"]))


@pytest.mark.parametrize("name,expected", [("qwen2.5-0.5b", 494_032_768),
                                           ("qwen2.5-7b", 7_615_616_512),
                                           ("qwen3-0.6b", 596_049_920),
                                           ("qwen3-8b", 8_190_735_360)])
def test_preset_param_counts(name, expected):
  n = qwen2.num_params(qwen2.abstract_params(qwen2.preset(name)))
  assert n == expected


@pytest.mark.parametrize("name", sorted(qwen2.PRESETS))
def test_preset_param_counts_equal_transformers(name):
  """Every preset has exactly the parameters transformers builds from its config.json
  (on the meta device: shapes only)."""
  config = qwen2.preset(name)
  hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
  assert type(model).__name__ == config.family.architecture
  assert qwen2.num_params(qwen2.abstract_params(config)) == sum(
      p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_logical_axes_cover_every_weight(name):
  config = qwen2.preset(name, num_hidden_layers=2, tie_word_embeddings=False)
  shapes = qwen2.abstract_params(config)
  axes = qwen2.logical_axes(config)
  import jax
  for shape, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(
      axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
    assert len(spec) == len(shape.shape) and all(a is not None for a in spec)


@family
def test_scoring_logprobs_equal_transformers_log_softmax(hf_tiny, family, monkeypatch):
  """`scoring.token_logprobs` (what the server's logprobs and echo report) over 37 tokens
  (padded to 64, unembedded in 4 chunks of 16): each token's log-probability and the
  top 5, as transformers' log-softmax of its causal logits gives them."""
  from mars_jax.decoding import scoring
  monkeypatch.setattr(scoring, "CHUNK", 16)
  path, model = hf_tiny(**FAMILIES[family])
  config, params = hf.load_pretrained(path)
  ids = np.random.default_rng(3).integers(0, 128, 37).tolist()
  got = scoring.token_logprobs(config, params, ids, top=5)
  with torch.no_grad():
    ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
  ref = ref.numpy()[:-1]
  np.testing.assert_allclose(got.logprob, ref[np.arange(36), ids[1:]], atol=TOL, rtol=0)
  top = np.sort(ref, axis=-1)[:, ::-1][:, :5]
  np.testing.assert_allclose(got.top_logprobs, top, atol=TOL, rtol=0)
  np.testing.assert_allclose(np.take_along_axis(ref, got.top_ids, axis=-1), top, atol=TOL,
                             rtol=0)
