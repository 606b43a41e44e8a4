"""A LoRA run's adapters as a PEFT adapter directory (`peft.PeftModel.from_pretrained`).

  save_adapter(config, params, spec, out, tokenizer=tok, base_model=BASE_DIR)

  OUT/adapter_config.json          peft_type LORA: r, lora_alpha, lora_dropout, the
                                   targeted modules (q_proj .. down_proj) and, with a
                                   trained mask row, trainable_token_indices
                                   {"embed_tokens": [mask id]}
  OUT/adapter_model.safetensors    per layer i and module:
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]
    base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta  [1, embed]
  OUT/tokenizer files              the run's (it knows `<|mask|>`)
  OUT/mars_jax_export.json         the export marker (an --overwrite may replace OUT)

PEFT computes x W^T + (lora_alpha / r) (x A^T) B^T on each Linear; ours computes
x K + (alpha / rank) (x a) b with K = W^T flattened, so A = a^T and B = b^T with the
head axes flattened as the model export flattens them (mars_jax/hf.py). PEFT's
trainable tokens hold the new rows themselves (not a difference), and with tied
embeddings PEFT applies them to the tied LM head too, as our model does.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from mars_jax.checkpoints import hf, safetensors_io as st
from mars_jax.models.config import LORA_PROJECTIONS, LoraSpec, Qwen2Config
from mars_jax.models.qwen2 import scan_layers_of

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# our projection -> its HF module under model.layers.{i}
_MODULES = {"attn/q_kernel": "self_attn.q_proj", "attn/k_kernel": "self_attn.k_proj",
            "attn/v_kernel": "self_attn.v_proj", "attn/o_kernel": "self_attn.o_proj",
            "mlp/gate_kernel": "mlp.gate_proj", "mlp/up_kernel": "mlp.up_proj",
            "mlp/down_kernel": "mlp.down_proj"}
_PREFIX = "base_model.model.model"


def adapter_config(config: Qwen2Config, spec: LoraSpec, base_model: str | None) -> dict:
  """adapter_config.json of `spec` (the fields PEFT's LoraConfig reads; the rest default)."""
  targets = [_MODULES[p].split(".")[-1] for p in LORA_PROJECTIONS
             if spec.targets_projection(p)]
  out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
         "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
         "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
         "use_rslora": False, "use_dora": False, "init_lora_weights": True,
         "inference_mode": True, "modules_to_save": None}
  if spec.mask_token_id is not None:
    out["trainable_token_indices"] = {"embed_tokens": [spec.mask_token_id]}
  return out


def adapter_tensors(config: Qwen2Config, params, spec: LoraSpec, np_dt
                    ) -> list[tuple[str, np.ndarray]]:
  """(PEFT name, array) of every adapter weight (and the mask row) in `params`."""
  scanned = scan_layers_of(params)
  out = []
  for layer in range(config.num_hidden_layers):
    tree = params["layers"] if scanned else params[f"layers_{layer}"]
    for proj, module in _MODULES.items():
      if not spec.targets_projection(proj):
        continue
      group, kernel = proj.split("/")
      prefix = kernel.removesuffix("_kernel")
      a, b = (np.asarray(jax.device_get(tree[group][f"{prefix}_lora_{x}"]))
              for x in ("a", "b"))
      if scanned:
        a, b = a[layer], b[layer]
      name = f"{_PREFIX}.layers.{layer}.{module}"
      out.append((f"{name}.lora_A.weight", a.reshape(-1, spec.rank).T.astype(np_dt)))
      out.append((f"{name}.lora_B.weight", b.reshape(spec.rank, -1).T.astype(np_dt)))
  if spec.mask_token_id is not None:
    row = np.asarray(jax.device_get(params["mask_embedding"]))
    out.append((f"{_PREFIX}.embed_tokens.token_adapter.trainable_tokens_delta",
                row[None].astype(np_dt)))
  return out


def save_adapter(config: Qwen2Config, params, spec: LoraSpec, path: str, *,
                 tokenizer=None, base_model: str | None = None, dtype: str | None = None,
                 overwrite: bool = False, source: dict | None = None) -> None:
  """Writes the adapters of `params` (a LoRA run's, unmerged) as a PEFT directory.

  `base_model`: the HF directory the run's weights started from, recorded as
  base_model_name_or_path (PeftModel.from_pretrained takes the base model itself; this
  names it). `path`, `overwrite`: as `hf.save_pretrained` (never replaces a directory
  mars_jax did not write; staged and renamed into place). dtype: default float32."""
  dtype = dtype or "float32"
  with hf.staged_export(path, overwrite=overwrite) as tmp:
    st.write(os.path.join(tmp, ADAPTER_WEIGHTS),
             adapter_tensors(config, params, spec, st.np_dtype(dtype)))
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
      json.dump(adapter_config(config, spec, base_model), f, indent=2)
    if tokenizer is not None:
      hf.save_tokenizer(tokenizer, tmp)
    hf.write_marker(tmp, dtype=dtype, source=source, mask_token_id=spec.mask_token_id,
                    kind="peft_adapter")
