"""Qwen2 / Qwen2.5 and Qwen3 (dense) model configuration: HF config.json in and out,
published presets.

Two frozen (hashable) dataclasses, both usable as static arguments of `jax.jit`:

  Qwen2Config  the architecture, exactly what `config.json` holds, for either family
               (`model_type` "qwen2" or "qwen3"; see `Family` and docs/models.md);
  Runtime      how the same weights are stored and computed (parameter dtype,
               compute dtype, attention implementation, remat, scanned layers), and
               the low-rank adapters trained over them (`LoraSpec`, mars_jax/training/lora.py).

A checkpoint means the same under any `Runtime` without adapters; functions that
compute take the runtime as an explicit `runtime=` keyword whose default is float32
with the plain einsum attention, scanned layers, no remat and no adapters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax.numpy as jnp

from mars_jax.core import choices
from mars_jax.core.choices import AttentionImpl, Remat
from mars_jax.models.rope import RopeScaling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Family:
  """What sets a model family apart from the shared decoder (see docs/models.md).

  model_type, architecture: the names HF's config.json carries; title: for messages.
  attention_bias: the q/k/v projections carry biases.
  qk_norm: an RMSNorm over head_dim on each head's queries and keys, before RoPE.
  default_head_dim: head_dim when config.json omits it (None: hidden / heads), as
    transformers' config class of the family defaults it.
  reads_attention_bias: the family's transformers config has an `attention_bias`
    key (Qwen3 does; Qwen2 hard-codes its biases and has none).
  """

  model_type: str
  architecture: str
  title: str
  attention_bias: bool
  qk_norm: bool
  default_head_dim: int | None
  reads_attention_bias: bool


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5", attention_bias=True,
           qk_norm=False, default_head_dim=None, reads_attention_bias=False),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3 dense", attention_bias=False,
           qk_norm=True, default_head_dim=128, reads_attention_bias=True),
)}


def _supported() -> str:
  return ", ".join(f"{f.model_type!r} ({f.architecture}: {f.title})"
                   for f in FAMILIES.values())


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Shapes of a Qwen2 or Qwen3 decoder, as in Hugging Face's `config.json` (nothing
  else). `model_type` picks the family; head_dim None means the family's default."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = False
  bos_token_id: int | None = 151643
  eos_token_id: int | tuple[int, ...] | None = 151645
  model_type: str = "qwen2"
  rope_scaling: RopeScaling | None = None  # None: the default RoPE

  def __post_init__(self):
    if self.model_type not in FAMILIES:
      raise ValueError(f"model_type={self.model_type!r}; supported: {_supported()}.")
    if self.head_dim is None and self.family.default_head_dim is not None:
      object.__setattr__(self, "head_dim", self.family.default_head_dim)
    if self.head_dim is None:
      if self.hidden_size % self.num_attention_heads:
        raise ValueError(
            f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
            f"{self.num_attention_heads}; set head_dim explicitly.")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads {self.num_attention_heads} must be a multiple of "
          f"num_key_value_heads {self.num_key_value_heads}.")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def family(self) -> Family:
    return FAMILIES[self.model_type]

  @property
  def attention_bias(self) -> bool:
    return self.family.attention_bias

  @property
  def qk_norm(self) -> bool:
    return self.family.qk_norm

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def replace(self, **kwargs) -> "Qwen2Config":
    return dataclasses.replace(self, **kwargs)

  # ---- Hugging Face config.json ------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "Qwen2Config":
    """Builds a config from an HF config dict (transformers 4 or 5 layout).

    `model_type` must name a supported family ("qwen2" or "qwen3") and `architectures`
    its causal LM (Qwen2ForCausalLM, Qwen3ForCausalLM), as transformers'
    `save_pretrained` writes them."""
    model_type = d.get("model_type")
    family = FAMILIES.get(model_type)
    archs = d.get("architectures")
    if not archs:
      hint = (f"[\"{family.architecture}\"] if this is a {family.title} checkpoint"
              if family else " or ".join(f"[\"{f.architecture}\"] ({f.title})"
                                         for f in FAMILIES.values()))
      raise ValueError(
          f"{source}: no 'architectures' entry, so it is not known which model these "
          f"weights are for. Add \"architectures\": {hint}, or re-save it with "
          "transformers' save_pretrained.")
    if family is None or family.architecture not in archs:
      raise ValueError(
          f"{source}: model_type={model_type!r}, architectures={archs}; mars_jax supports "
          f"model_type {_supported()} only. Point --config.model.init / --model at such a "
          "checkpoint directory.")
    bias = d.get("attention_bias", False) if family.reads_attention_bias else family.attention_bias
    if bias != family.attention_bias:
      raise ValueError(f"{source}: attention_bias={bias!r} is not supported; "
                       f"{family.title} checkpoints ship with attention_bias="
                       f"{family.attention_bias}.")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{source}: hidden_act={act!r} is not supported; {family.title} uses "
                       f"'silu' (SwiGLU). This checkpoint is not a standard {family.title}.")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    scaling = RopeScaling.from_hf(rope, source)
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if d.get("use_sliding_window", False):
      raise ValueError(f"{source}: use_sliding_window=true is not supported; {family.title} "
                       "checkpoints ship with it disabled.")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in d]
    if missing:
      raise ValueError(f"{source}: missing required keys {missing}.")
    return cls(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        model_type=model_type,
        rope_scaling=scaling,
    )

  @classmethod
  def from_json_file(cls, path: str) -> "Qwen2Config":
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: no config.json; an HF model directory needs one.")
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}).") from e
    return cls.from_hf_dict(d, source=path)

  def to_hf_dict(self, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json transformers writes for the family's causal LM (both rope keys;
    `attention_bias` where the family's transformers config has it)."""
    eos = self.eos_token_id
    family = self.family
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                            **(self.rope_scaling.to_hf() if self.rope_scaling else {})},
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "dtype": torch_dtype,
        "use_cache": True,
    }
    if family.reads_attention_bias:
      out["attention_bias"] = family.attention_bias
    if self.rope_scaling is not None:  # the key transformers 4 reads
      out["rope_scaling"] = self.rope_scaling.to_hf()
    return out


# The projections an adapter may target, by the name its regex is matched against.
LORA_PROJECTIONS = ("attn/q_kernel", "attn/k_kernel", "attn/v_kernel", "attn/o_kernel",
                    "mlp/gate_kernel", "mlp/up_kernel", "mlp/down_kernel")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Low-rank adapters over frozen weights (mars_jax/training/lora.py, docs/design.md).

  Each targeted projection W: [*in, *out] computes x W + (alpha / rank) (drop(x) A) B
  with A: [*in, rank], B: [rank, *out] (B starts at zero, so training starts from the
  base model). targets: a regex searched in each projection's name in
  `LORA_PROJECTIONS` ("attn/q_kernel" .. "mlp/down_kernel"; default all seven).
  dropout: on the adapters' input, training only. mask_token_id: when set, the
  embedding row of that token is a trained vector of its own (`mask_embedding`,
  replacing the row in the lookup and, with tied embeddings, in the logits), as
  PEFT's trainable token indices do; None leaves the row frozen.
  """

  rank: int
  alpha: float
  dropout: float = 0.0
  targets: str = ".*"
  mask_token_id: int | None = None

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"lora.rank={self.rank}; must be >= 1 (0 turns LoRA off).")
    if not self.alpha > 0:
      raise ValueError(f"lora.alpha={self.alpha}; must be > 0.")
    if not 0 <= self.dropout < 1:
      raise ValueError(f"lora.dropout={self.dropout}; must be in [0, 1).")
    try:
      pattern = re.compile(self.targets)
    except re.error as e:
      raise ValueError(f"lora.targets={self.targets!r} is not a regex: {e}.") from e
    if not any(pattern.search(n) for n in LORA_PROJECTIONS):
      raise ValueError(f"lora.targets={self.targets!r} matches none of "
                       f"{list(LORA_PROJECTIONS)}.")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def targets_projection(self, name: str) -> bool:
    """Whether the projection `name` (one of `LORA_PROJECTIONS`) has an adapter."""
    return re.search(self.targets, name) is not None


@dataclasses.dataclass(frozen=True)
class Runtime:
  """How a model's weights are stored and computed; never what they mean.

  param_dtype: storage of the weights (the float32 master copy when training).
  dtype: compute of activations; norms, softmax and logits stay float32.
  attention_impl: "xla" (plain einsum), "dot_product_attention"
    (`jax.nn.dot_product_attention`, backend chosen by JAX), "cudnn" (the fused
    cuDNN kernel on GPU), "splash" (JAX's Pallas splash kernel on TPU, skipping
    the mask's empty blocks; interpreted elsewhere, `mars_jax.models.splash`),
    "flash" (blockwise, the mask computed per tile from per-token vectors, never
    [t, t]: `mars_jax.models.flash`) or "auto" ("splash" where the computation is
    compiled for TPU; elsewhere "flash" from `attention.FLASH_FROM` positions a pass
    on, "xla" below).
  remat: rematerialisation policy of each decoder layer: "none", "full" (save
    nothing), "dots", "dots_with_no_batch_dims" (JAX's matmul policies) or "names"
    (save the model's named checkpoints, `qwen2.CHECKPOINT_NAMES`). With flash,
    "dots" and "names" also keep its output and log-sum-exp (`flash.RESIDUALS`).
  scan_layers: layers stacked on a leading axis under `nn.scan` (the params tree
    then holds `layers/...`; unrolled it holds `layers_0 .. layers_{L-1}`).
  lora: the adapters the params tree holds beside the weights and the forward adds
    (`LoraSpec`; a dict, as layout.json stores it, is read as one); None: none.
  """

  param_dtype: str = "float32"
  dtype: str = "float32"
  attention_impl: AttentionImpl = "xla"
  remat: Remat = "none"
  scan_layers: bool = True
  lora: LoraSpec | None = None

  def __post_init__(self):
    if isinstance(self.lora, dict):
      object.__setattr__(self, "lora", LoraSpec(**self.lora))
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {list(DTYPES)}.")
    choices.check(AttentionImpl, self.attention_impl, "attention_impl")
    choices.check(Remat, self.remat, "remat")

  @property
  def jnp_param_dtype(self):
    return DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return DTYPES[self.dtype]

  def replace(self, **kwargs) -> "Runtime":
    return dataclasses.replace(self, **kwargs)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


DEFAULT_RUNTIME = Runtime()  # float32, plain einsum attention, scanned layers, no remat


def scan_layers_of(params: Any) -> bool:
  """Whether a params tree holds stacked (scanned) layers: `layers` vs `layers_0..`."""
  if "layers" in params:
    return True
  if "layers_0" in params:
    return False
  raise ValueError(f"not a mars_jax params tree (top-level keys: {sorted(params)}).")


def _preset(hidden, inter, layers, heads, kv, tie, vocab=151936, **kw):
  return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
              num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, tie_word_embeddings=tie, **kw)


def _qwen3(hidden, inter, layers, heads, kv, tie):
  return _preset(hidden, inter, layers, heads, kv, tie, model_type="qwen3", head_dim=128,
                 max_position_embeddings=40960)


# Shapes of the published Qwen2.5-*-Instruct and Qwen3-* config.json files.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _preset(896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _preset(1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": _preset(2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": _preset(3584, 18944, 28, 28, 4, False, vocab=152064),
    "qwen2.5-14b": _preset(5120, 13824, 48, 40, 8, False, vocab=152064),
    "qwen2.5-32b": _preset(5120, 27648, 64, 40, 8, False, vocab=152064),
    "qwen2.5-72b": _preset(8192, 29568, 80, 64, 8, False, vocab=152064),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
}


def preset(name: str, **overrides) -> Qwen2Config:
  """A published Qwen2.5 or Qwen3 shape by name (e.g. "qwen2.5-7b", "qwen3-8b"), with
  overrides."""
  key = name.lower()
  if key not in PRESETS:
    raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
  return Qwen2Config(**{**PRESETS[key], **overrides})
