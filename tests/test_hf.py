"""HF import/export: round trips, sharding, tokenizer `<|mask|>`, and clear errors."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from mars_jax.checkpoints import hf
from mars_jax.models import qwen2

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity


def _logits_torch(model, tokens):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()


def _causal_forward(config, params, tokens):
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
  return np.asarray(qwen2.forward(config, params, tokens, positions, mask))


QWEN3 = {"family": "qwen3", "head_dim": 24}  # hf_tiny kwargs: head_dim != hidden / heads
FAMILIES = {"qwen2": {}, "qwen3": QWEN3}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [True, False])
def test_export_loads_in_transformers(hf_tiny, tmp_path, tie, family):
  path, _ = hf_tiny(tie=tie, **FAMILIES[family])
  config, params = hf.load_pretrained(path)
  out = str(tmp_path / "export")
  hf.save_pretrained(config, params, out)
  names = set(hf.st.SafetensorsFile(os.path.join(out, "model.safetensors")).keys())
  assert names == set(hf.st.SafetensorsFile(os.path.join(path, "model.safetensors")).keys())
  assert ("lm_head.weight" in names) == (not tie)
  assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
  assert ("model.layers.1.self_attn.k_norm.weight" in names) == (family == "qwen3")
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(model).__name__ == config.family.architecture
  tokens = np.random.default_rng(0).integers(0, 128, (2, 10)).astype(np.int32)
  np.testing.assert_allclose(_logits_torch(model, tokens),
                             _causal_forward(config, params, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scan", [True, False])
def test_save_load_bitwise(hf_tiny, tmp_path, scan, family):
  path, _ = hf_tiny(tie=False, **FAMILIES[family])
  config, params = hf.load_pretrained(path, scan_layers=scan)
  out = str(tmp_path / "rt")
  hf.save_pretrained(config, params, out)
  config2, params2 = hf.load_pretrained(out, scan_layers=scan)
  assert config2 == config
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, params2)


def test_multi_shard_export(hf_tiny, tmp_path):
  path, model = hf_tiny(tie=False)
  config, params = hf.load_pretrained(path)
  out = str(tmp_path / "sharded")
  hf.save_pretrained(config, params, out, max_shard_size=40_000)
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  assert len(set(index["weight_map"].values())) > 2
  assert not os.path.exists(os.path.join(out, "model.safetensors"))
  _, params2 = hf.load_pretrained(out)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, params2)
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
  tokens = np.arange(12, dtype=np.int32)[None]
  np.testing.assert_allclose(_logits_torch(reloaded, tokens), _logits_torch(model, tokens),
                             atol=1e-5, rtol=0)


def test_bfloat16_load_and_export(hf_tiny, tmp_path):
  path, _ = hf_tiny(tie=True)
  config, params = hf.load_pretrained(path, dtype="bfloat16")
  assert all(x.dtype.name == "bfloat16" for x in jax.tree.leaves(params))
  out = str(tmp_path / "bf16")
  hf.save_pretrained(config, params, out)
  assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
  model = transformers.Qwen2ForCausalLM.from_pretrained(out)
  assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_config_accepts_rope_theta_and_rope_parameters(hf_tiny, tmp_path):
  path, _ = hf_tiny(tie=True)
  d = json.load(open(os.path.join(path, "config.json")))
  new = dict(d)
  new.pop("rope_parameters", None)
  new["rope_theta"] = 12345.0
  old_style = qwen2.Qwen2Config.from_hf_dict(new)
  assert old_style.rope_theta == 12345.0
  new.pop("rope_theta")
  new["rope_parameters"] = {"rope_type": "default", "rope_theta": 777.0}
  assert qwen2.Qwen2Config.from_hf_dict(new).rope_theta == 777.0
  rt = qwen2.Qwen2Config.from_hf_dict(old_style.to_hf_dict())
  assert rt == old_style


def test_qwen3_config_json_in_and_out(hf_tiny):
  """transformers' Qwen3 config.json -> ours -> config.json that transformers reads back
  the same; a Qwen3 config.json without head_dim means transformers' default, 128."""
  path, model = hf_tiny(tie=False, **QWEN3)
  d = json.load(open(os.path.join(path, "config.json")))
  config = qwen2.Qwen2Config.from_hf_dict(d)
  assert (config.model_type, config.head_dim, config.qk_norm, config.attention_bias) == (
      "qwen3", 24, True, False)
  out = config.to_hf_dict()
  assert (out["architectures"], out["model_type"], out["attention_bias"], out["head_dim"]) == (
      ["Qwen3ForCausalLM"], "qwen3", False, 24)
  assert qwen2.Qwen2Config.from_hf_dict(out) == config
  back = transformers.AutoConfig.for_model(**out)
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "rope_parameters", "tie_word_embeddings", "attention_bias", "use_sliding_window"):
    assert getattr(back, key) == getattr(model.config, key), key
  d.pop("head_dim")
  assert qwen2.Qwen2Config.from_hf_dict(d).head_dim == transformers.Qwen3Config().head_dim == 128
  assert "attention_bias" not in qwen2.preset("qwen2.5-0.5b").to_hf_dict()


def _write_tokenizer(path, n_tokens):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {f"t{i}": i for i in range(n_tokens)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
  fast.save_pretrained(path)


def config_vocab(path):
  return json.load(open(os.path.join(path, "config.json")))["vocab_size"]


def test_tokenizer_mask_token_takes_spare_row(hf_tiny, tmp_path):
  path, model = hf_tiny(tie=True)
  d = str(tmp_path / "with_tok")
  shutil.copytree(path, d)
  _write_tokenizer(d, 100)
  tok, mask_id = hf.load_tokenizer(d)
  assert mask_id == len(tok) - 1 < config_vocab(d) and tok.convert_ids_to_tokens(mask_id) == hf.MASK_TOKEN
  config, params = hf.load_pretrained(d)
  assert config.vocab_size == 128
  out = str(tmp_path / "export_tok")
  hf.save_pretrained(config, params, out, tokenizer=tok)
  tok2, mask_id2 = hf.load_tokenizer(out)
  assert mask_id2 == mask_id and len(tok2) == len(tok)
  assert transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(
      hf.MASK_TOKEN) == mask_id


def test_tokenizer_without_spare_row_fails(hf_tiny, tmp_path):
  path, _ = hf_tiny(tie=True)
  d = str(tmp_path / "full_tok")
  shutil.copytree(path, d)
  _write_tokenizer(d, 128)
  with pytest.raises(ValueError, match="no spare embedding row"):
    hf.load_tokenizer(d)


# ---- bad input ----------------------------------------------------------------------


def _copy_with_config(hf_tiny, tmp_path, name, base=None, **changes):
  """A copy of the tied tiny checkpoint (Qwen2, or hf_tiny(**base)), with `changes`
  written into its config.json."""
  path, _ = hf_tiny(tie=True, **(base or {}))
  d = str(tmp_path / name)
  shutil.copytree(path, d)
  if changes:
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
  return d


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such model directory"):
    hf.load_pretrained(str(tmp_path / "nope"))


def test_missing_config(hf_tiny, tmp_path):
  d = _copy_with_config(hf_tiny, tmp_path, "noconf")
  os.remove(os.path.join(d, "config.json"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf.load_pretrained(d)


def test_wrong_architecture(hf_tiny, tmp_path):
  d = _copy_with_config(hf_tiny, tmp_path, "llama", architectures=["LlamaForCausalLM"],
                        model_type="llama")
  with pytest.raises(ValueError, match=r"config.json.*LlamaForCausalLM.*Qwen2ForCausalLM"):
    hf.load_pretrained(d)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": None}, r"no 'architectures' entry.*Qwen2ForCausalLM"),
    ({"model_type": "qwen3"}, r"model_type='qwen3'.*supports model_type 'qwen2'"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
     r"model_type='qwen3_moe'.*supports model_type 'qwen2'.*'qwen3' \(Qwen3ForCausalLM"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
])
def test_config_json_that_is_not_a_standard_qwen2(hf_tiny, tmp_path, changes, message):
  d = _copy_with_config(hf_tiny, tmp_path, "odd", **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_pretrained(d)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": None}, r"no 'architectures' entry.*\[\"Qwen3ForCausalLM\"\] if this is a "
     r"Qwen3 dense checkpoint"),
    ({"architectures": ["Qwen2ForCausalLM"]},
     r"model_type='qwen3', architectures=\['Qwen2ForCausalLM'\]; mars_jax supports"),
    ({"attention_bias": True}, r"attention_bias=True is not supported; Qwen3 dense "
     r"checkpoints ship with attention_bias=False"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; Qwen3 dense uses 'silu'"),
])
def test_config_json_that_is_not_a_standard_qwen3(hf_tiny, tmp_path, changes, message):
  d = _copy_with_config(hf_tiny, tmp_path, "odd3", base=QWEN3, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_pretrained(d)


def test_load_layout_follows_the_runtime(hf_tiny):
  """`scan_layers` and `dtype` choose the params tree; `relayout` converts between them."""
  path, _ = hf_tiny(tie=False)
  _, scanned = hf.load_pretrained(path)
  _, unrolled = hf.load_pretrained(path, dtype="bfloat16", scan_layers=False)
  assert "layers" in scanned and "layers_0" in unrolled
  assert {x.dtype.name for x in jax.tree.leaves(unrolled)} == {"bfloat16"}
  back = qwen2.relayout(unrolled, qwen2.Runtime(param_dtype="bfloat16"))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back, jax.tree.map(lambda x: x.astype("bfloat16"), scanned))


def test_truncated_safetensors(hf_tiny, tmp_path):
  d = _copy_with_config(hf_tiny, tmp_path, "trunc")
  f = os.path.join(d, "model.safetensors")
  size = os.path.getsize(f)
  with open(f, "r+b") as fh:
    fh.truncate(size // 2)
  with pytest.raises(ValueError, match=r"model.safetensors: truncated"):
    hf.load_pretrained(d)


def test_wrong_tensor_shape(hf_tiny, tmp_path):
  d = _copy_with_config(hf_tiny, tmp_path, "shape", intermediate_size=80)
  with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.0.mlp.gate_proj"
                     r".weight has shape \(96, 64\), config.json implies \(80, 64\)"):
    hf.load_pretrained(d)


def test_failed_export_leaves_nothing(hf_tiny, tmp_path):
  path, _ = hf_tiny(tie=True)
  config, params = hf.load_pretrained(path)
  del params["final_norm"]
  out = tmp_path / "broken"
  with pytest.raises(KeyError):
    hf.save_pretrained(config, params, str(out))
  assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
