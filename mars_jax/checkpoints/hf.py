"""Hugging Face import and export: config.json, safetensors (single or sharded), tokenizer.

Weight mapping (HF `Qwen2ForCausalLM` / `Qwen3ForCausalLM` -> mars_jax params, see
models/qwen2.py):

  model.embed_tokens.weight [V, D]                   -> embedding [V, D]
  model.layers.N.self_attn.{q,k,v}_proj.weight [H*d, D] -> layers/attn/{q,k,v}_kernel [N, D, H, d]
  model.layers.N.self_attn.{q,k,v}_proj.bias [H*d]   -> layers/attn/{q,k,v}_bias [N, H, d]  (Qwen2)
  model.layers.N.self_attn.{q,k}_norm.weight [d]     -> layers/attn/{q,k}_norm/scale [N, d] (Qwen3)
  model.layers.N.self_attn.o_proj.weight [D, H*d]    -> layers/attn/o_kernel [N, H, d, D]
  model.layers.N.mlp.{gate,up}_proj.weight [I, D]    -> layers/mlp/{gate,up}_kernel [N, D, I]
  model.layers.N.mlp.down_proj.weight [D, I]         -> layers/mlp/down_kernel [N, I, D]
  model.layers.N.{input,post_attention}_layernorm.weight -> layers/{input,post}_norm/scale
  model.norm.weight                                  -> final_norm/scale
  lm_head.weight [V, D]                              -> lm_head [D, V]  (untied only)

Only transposes and reshapes: RoPE uses HF's rotate-half layout on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.checkpoints import safetensors_io as st
from mars_jax.checkpoints import vllm_recipe
from mars_jax.models.qwen2 import Qwen2Config, scan_layers_of

MASK_TOKEN = "<|mask|>"
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
EXPORT_MARKER = "mars_jax_export.json"  # in every export: marks a directory as ours
GENERATION_CONFIG = "generation_config.json"
_MARKER_FORMAT = "mars_jax_export"


@dataclasses.dataclass(frozen=True)
class _Entry:
  hf: str                           # HF name; "{i}" for the layer index
  path: tuple[str, ...]             # path in the params tree (layer axis first if stacked)
  hf_shape: Callable[[Qwen2Config], tuple[int, ...]]
  to_ours: Callable[[np.ndarray, Qwen2Config], np.ndarray]
  to_hf: Callable[[np.ndarray, Qwen2Config], np.ndarray]

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf


def _qkv(name: str, heads: Callable[[Qwen2Config], int], bias: bool) -> list[_Entry]:
  """The projection `name` (q, k or v): its kernel, and its bias when `bias` (Qwen2)."""
  proj = f"model.layers.{{i}}.self_attn.{name}_proj"
  out = [_Entry(f"{proj}.weight", ("layers", "attn", f"{name}_kernel"),
                lambda c: (heads(c) * c.head_dim, c.hidden_size),
                lambda w, c: w.T.reshape(c.hidden_size, heads(c), c.head_dim),
                lambda w, c: w.reshape(c.hidden_size, -1).T)]
  if bias:
    out.append(_Entry(f"{proj}.bias", ("layers", "attn", f"{name}_bias"),
                      lambda c: (heads(c) * c.head_dim,),
                      lambda w, c: w.reshape(heads(c), c.head_dim),
                      lambda w, c: w.reshape(-1)))
  return out


def _qk_norms(config: Qwen2Config) -> list[_Entry]:
  """Qwen3's per-head query and key RMSNorm scales [head_dim] (none for Qwen2)."""
  if not config.qk_norm:
    return []
  return [_same(f"model.layers.{{i}}.self_attn.{name}_norm.weight",
                ("layers", "attn", f"{name}_norm", "scale"), lambda c: (c.head_dim,))
          for name in ("q", "k")]


def _linear(hf: str, path: tuple[str, ...], out_dim, in_dim) -> _Entry:
  return _Entry(hf, path, lambda c: (out_dim(c), in_dim(c)),
                lambda w, c: w.T, lambda w, c: w.T)


def _same(hf: str, path: tuple[str, ...], shape) -> _Entry:
  return _Entry(hf, path, shape, lambda w, c: w, lambda w, c: w)


def _entries(config: Qwen2Config) -> list[_Entry]:
  """The HF <-> params table, in the order transformers writes tensors."""
  d = lambda c: c.hidden_size  # noqa: E731
  i = lambda c: c.intermediate_size  # noqa: E731
  layer = "model.layers.{i}"
  out = [_same("model.embed_tokens.weight", ("embedding",),
               lambda c: (c.vocab_size, c.hidden_size))]
  out += [
      _same(f"{layer}.input_layernorm.weight", ("layers", "input_norm", "scale"),
            lambda c: (c.hidden_size,)),
      *_qkv("q", lambda c: c.num_attention_heads, config.attention_bias),
      *_qkv("k", lambda c: c.num_key_value_heads, config.attention_bias),
      *_qkv("v", lambda c: c.num_key_value_heads, config.attention_bias),
      _Entry(f"{layer}.self_attn.o_proj.weight", ("layers", "attn", "o_kernel"),
             lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
             lambda w, c: w.T.reshape(c.num_attention_heads, c.head_dim, c.hidden_size),
             lambda w, c: w.reshape(-1, c.hidden_size).T),
      *_qk_norms(config),
      _same(f"{layer}.post_attention_layernorm.weight", ("layers", "post_norm", "scale"),
            lambda c: (c.hidden_size,)),
      _linear(f"{layer}.mlp.gate_proj.weight", ("layers", "mlp", "gate_kernel"), i, d),
      _linear(f"{layer}.mlp.up_proj.weight", ("layers", "mlp", "up_kernel"), i, d),
      _linear(f"{layer}.mlp.down_proj.weight", ("layers", "mlp", "down_kernel"), d, i),
  ]
  out.append(_same("model.norm.weight", ("final_norm", "scale"), lambda c: (c.hidden_size,)))
  if not config.tie_word_embeddings:
    out.append(_linear("lm_head.weight", ("lm_head",), lambda c: c.vocab_size, d))
  return out


def _tree_path(entry: _Entry, scan_layers: bool, layer: int | None) -> tuple[str, ...]:
  if layer is None or scan_layers:
    return entry.path
  return (f"layers_{layer}",) + entry.path[1:]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


# ---- loading ------------------------------------------------------------------------


def _check_dir(path: str) -> None:
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no such model directory. Pass a local Hugging Face "
                            "directory holding config.json and *.safetensors.")


def _weight_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file path."""
  index = os.path.join(path, _INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not weight_map:
      raise ValueError(f"{index}: no 'weight_map'; re-export the checkpoint.")
    return {name: os.path.join(path, fn) for name, fn in weight_map.items()}
  single = os.path.join(path, _SINGLE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{path}: neither {_SINGLE} nor {_INDEX} found; mars_jax reads "
                            "safetensors weights only (convert .bin with transformers' "
                            "save_pretrained(safe_serialization=True)).")
  return {name: single for name in st.SafetensorsFile(single).keys()}


def load_pretrained(path: str, *, dtype=jnp.float32, scan_layers: bool = True
                    ) -> tuple[Qwen2Config, Any]:
  """Loads a local HF Qwen2 or Qwen3 directory -> (config, params).

  `dtype`: the params' dtype (a `Runtime.param_dtype`); `scan_layers`: stacked
  layers (`layers/...`) or unrolled (`layers_0..`), as the `Runtime` that will
  compute them says. Reads tensor by tensor from memory-mapped safetensors and
  casts on the way into preallocated stacked arrays, so at most one parameter's
  host copy is alive next to the device params.
  """
  _check_dir(path)
  dtype_name = jnp.dtype(dtype).name
  config = Qwen2Config.from_json_file(os.path.join(path, "config.json"))
  files = _weight_files(path)
  opened: dict[str, st.SafetensorsFile] = {}
  np_dt = st.np_dtype(dtype_name)
  entries = _entries(config)
  expected = set()
  params: dict = {}

  def read(name: str) -> np.ndarray:
    if name not in files:
      raise ValueError(f"{path}: tensor {name!r} is missing from the checkpoint; it does "
                       "not match config.json (tie_word_embeddings? num_hidden_layers?).")
    fn = files[name]
    if fn not in opened:
      if not os.path.isfile(fn):
        raise FileNotFoundError(f"{fn}: listed in {_INDEX} but missing.")
      opened[fn] = st.SafetensorsFile(fn)
    return opened[fn].get(name)

  for e in entries:
    layers = range(config.num_hidden_layers) if e.per_layer else [None]
    stacked = None
    for layer in layers:
      name = e.hf.format(i=layer)
      expected.add(name)
      w = read(name)
      if tuple(w.shape) != e.hf_shape(config):
        raise ValueError(f"{files[name]}: tensor {name} has shape {tuple(w.shape)}, "
                         f"config.json implies {e.hf_shape(config)}; the weights and "
                         "config.json disagree.")
      w = e.to_ours(w, config).astype(np_dt)
      if layer is not None and scan_layers:
        if stacked is None:
          stacked = np.empty((config.num_hidden_layers,) + w.shape, np_dt)
        stacked[layer] = w
      else:
        _set(params, _tree_path(e, scan_layers, layer), jnp.asarray(w))
    if stacked is not None:
      _set(params, e.path, jnp.asarray(stacked))
      del stacked
  extra = sorted(n for n in files if n not in expected
                 and not n.endswith(_IGNORED_SUFFIXES)
                 and not (n == "lm_head.weight" and config.tie_word_embeddings))
  if extra:
    raise ValueError(f"{path}: unexpected tensors {extra[:5]}{'...' if len(extra) > 5 else ''}"
                     f" not used by {config.num_hidden_layers}-layer {config.family.title}; "
                     "config.json and the weights disagree.")
  return config, params


# ---- saving -------------------------------------------------------------------------


def _hf_tensors(config: Qwen2Config, params, np_dt):
  """Yields (hf_name, host array) one tensor at a time (stacked or unrolled params)."""
  scan_layers = scan_layers_of(params)
  for e in _entries(config):
    layers = range(config.num_hidden_layers) if e.per_layer else [None]
    for layer in layers:
      leaf = _get(params, _tree_path(e, scan_layers, layer))
      if layer is not None and scan_layers:
        leaf = leaf[layer]
      yield e.hf.format(i=layer), e.to_hf(np.asarray(jax.device_get(leaf)), config).astype(np_dt)


def _tensor_bytes(config: Qwen2Config, itemsize: int) -> list[tuple[str, int]]:
  out = []
  for e in _entries(config):
    layers = range(config.num_hidden_layers) if e.per_layer else [None]
    n = int(np.prod(e.hf_shape(config))) * itemsize
    out += [(e.hf.format(i=layer), n) for layer in layers]
  return out


def _parse_size(size: int | str) -> int:
  if isinstance(size, int):
    return size
  units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
  s = size.strip().upper()
  for u in sorted(units, key=len, reverse=True):
    if s.endswith(u):
      return int(float(s[: -len(u)]) * units[u])
  return int(s)


def save_pretrained(config: Qwen2Config, params, path: str, *, tokenizer=None,
                    max_shard_size: int | str = "5GB", dtype: str | None = None,
                    progress: bool = False, overwrite: bool = False,
                    source: dict | None = None,
                    generation_config: dict | None = None,
                    pard_token: int | None = None, keep_config: dict | None = None) -> None:
  """Writes an HF directory loadable by `Qwen2ForCausalLM` / `Qwen3ForCausalLM` (the
  config's family) `.from_pretrained`.

  `path` must be new, an empty directory, or (with `overwrite=True`) an earlier
  mars_jax export: every export holds `EXPORT_MARKER` (what was exported: dtype,
  files, and `source`, e.g. the run and its objective), and a directory without it
  is never deleted (see `check_export_target`). The old export is replaced only
  once the new one is complete.

  Shards of at most `max_shard_size` bytes (plus an index) or one `model.safetensors`;
  config.json, generation_config.json (`generation_config`, the source checkpoint's
  with its eos list and sampling defaults, when given; else bos/eos of the config and
  greedy), and the tokenizer files when given (`save_tokenizer`: readable by
  transformers 5.x and 4.5x); the marker records the `<|mask|>` id. Directory and
  files get the permissions the umask gives, as any file a user writes. Tied
  embeddings write no `lm_head.weight`. `dtype`: storage dtype of the written weights
  (default: the params'). `pard_token`: the `<|mask|>` id of a MARS model, written into
  config.json under that key, where vLLM's parallel drafting reads it
  (`checkpoints.vllm_recipe`; transformers keeps the key and ignores it). `keep_config`:
  a source checkpoint's config.json, whose keys the written one lacks are kept (its
  pad_token_id, say; not its dtype). Written to a temporary sibling directory and
  renamed into place, so an interrupted export never leaves a half-written `path`.
  """
  dtype = dtype or jnp.dtype(params["embedding"].dtype).name
  np_dt = st.np_dtype(dtype)
  limit = _parse_size(max_shard_size)
  sizes = _tensor_bytes(config, np_dt.itemsize)
  shards: list[list[str]] = [[]]
  used = 0
  for name, n in sizes:
    if shards[-1] and used + n > limit:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += n
  with staged_export(path, overwrite=overwrite) as tmp:
    names = ([_SINGLE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map = {}
    tensors = _hf_tensors(config, params, np_dt)
    bar = _progress(len(sizes), progress)
    for fn, shard in zip(names, shards):
      batch = []
      for _ in shard:
        batch.append(next(tensors))
        bar.update(1)
      st.write(os.path.join(tmp, fn), batch)
      weight_map.update({n: fn for n, _ in batch})
      del batch
    bar.close()
    if len(shards) > 1:
      with open(os.path.join(tmp, _INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(n for _, n in sizes)},
                   "weight_map": weight_map}, f, indent=2)
    hf_config = config.to_hf_dict(torch_dtype=dtype)
    hf_config.update({k: v for k, v in (keep_config or {}).items()
                      if k not in hf_config and k not in ("torch_dtype", "transformers_version")})
    if pard_token is not None:
      hf_config[vllm_recipe.PARD_TOKEN] = int(pard_token)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2)
    if generation_config is None:
      generation_config = {"bos_token_id": config.bos_token_id,
                           "eos_token_id": config.to_hf_dict()["eos_token_id"],
                           "do_sample": False}
    with open(os.path.join(tmp, GENERATION_CONFIG), "w") as f:
      json.dump(generation_config, f, indent=2)
    mask_id = None
    if tokenizer is not None:
      save_tokenizer(tokenizer, tmp)
      if MASK_TOKEN in tokenizer.get_vocab():
        mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    write_marker(tmp, dtype=dtype, source=source, mask_token_id=mask_id)


def pard_token_of(objective: dict | None, tokenizer) -> int | None:
  """The `<|mask|>` id to write as config.json's `pard_token` (`save_pretrained`), or None
  when the model is not MARS: a model is MARS when its tokenizer has `<|mask|>` and its
  record (`objective`: a run's layout or an export's marker; None when there is none)
  names no other kind."""
  if tokenizer is None or MASK_TOKEN not in tokenizer.get_vocab():
    return None
  if (objective or {}).get("kind") not in (None, "mars"):
    return None
  return tokenizer.convert_tokens_to_ids(MASK_TOKEN)


@contextlib.contextmanager
def staged_export(path: str, *, overwrite: bool = False):
  """-> a temporary sibling directory of `path` to write an export into; on a clean exit
  it replaces `path` (`check_export_target` first, before the write, and again at the
  rename), on an error it is deleted and `path` is left as it was. The directory gets
  the permissions the umask gives (mkdtemp makes it 0700 whatever the umask). Write the
  marker (`write_marker`) last, inside the block."""
  path = os.path.realpath(path)
  check_export_target(path, overwrite=overwrite)
  parent = os.path.dirname(os.path.abspath(path)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
  try:
    os.chmod(tmp, 0o777 & ~_umask())
    yield tmp
    _move_into_place(tmp, path, overwrite=overwrite)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


class ExportTargetError(ValueError):
  """An export destination mars_jax refuses to write (it would delete or mix with
  files it did not write)."""


def read_export_marker(path: str) -> dict | None:
  """The `EXPORT_MARKER` record of a mars_jax export directory, or None."""
  try:
    with open(os.path.join(path, EXPORT_MARKER)) as f:
      marker = json.load(f)
  except (OSError, ValueError):
    return None
  return marker if isinstance(marker, dict) and marker.get("format") == _MARKER_FORMAT else None


def check_export_target(path: str, *, overwrite: bool = False) -> None:
  """Raises `ExportTargetError` unless an export may be written to `path`: it does not
  exist, is an empty directory, or is an earlier mars_jax export (it holds
  `EXPORT_MARKER`) and `overwrite` is set; an overwrite replaces that whole directory."""
  if not os.path.lexists(path):
    return
  if not os.path.isdir(path):
    raise ExportTargetError(f"{path}: exists and is not a directory; pass another --out.")
  if not os.listdir(path):
    return
  marker = read_export_marker(path)
  if marker is None:
    raise ExportTargetError(
        f"{path}: not empty and not a mars_jax export (no {EXPORT_MARKER}); mars_jax never "
        "deletes what it did not write. Pass a new or empty --out directory, or move the "
        "directory away yourself.")
  if not overwrite:
    raise ExportTargetError(
        f"{path}: holds an earlier mars_jax export; pass --overwrite (overwrite=True) to "
        "replace it, or another --out.")


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_marker(tmp: str, *, dtype: str, source: dict | None,
                 mask_token_id: int | None, kind: str | None = None) -> None:
  """The `EXPORT_MARKER` of the export being written in `tmp` (kind: "peft_adapter" for
  an adapter directory; absent for a model)."""
  record = {"format": _MARKER_FORMAT, "version": 1, "dtype": dtype,
            "files": sorted(os.listdir(tmp)), "source": source or {},
            "mask_token": MASK_TOKEN, "mask_token_id": mask_token_id}
  if kind is not None:
    record["kind"] = kind
  with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
    json.dump(record, f, indent=2, sort_keys=True)


def _move_into_place(tmp: str, path: str, *, overwrite: bool) -> None:
  """Renames the complete export `tmp` to `path`; an earlier export there (checked
  again: it may have changed during the write) is set aside first and deleted last."""
  check_export_target(path, overwrite=overwrite)
  if not os.path.lexists(path):
    os.rename(tmp, path)
    return
  if not os.listdir(path):
    os.rmdir(path)
    os.rename(tmp, path)
    return
  old = tempfile.mkdtemp(prefix=".old-export-", dir=os.path.dirname(path))
  aside = os.path.join(old, "export")
  os.rename(path, aside)
  try:
    os.rename(tmp, path)
  except BaseException:
    os.rename(aside, path)
    os.rmdir(old)
    raise
  shutil.rmtree(old)


def _progress(total: int, enabled: bool):
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc="export", unit="tensor", disable=not enabled)


# ---- tokenizer ----------------------------------------------------------------------


# transformers 5 spellings in tokenizer_config.json that 4.x (still pinned by many serving
# stacks) cannot read, and the spelling both read.
_TOKENIZER_CLASS_4X = {"TokenizersBackend": "PreTrainedTokenizerFast"}
_LOAD_ONLY_KEYS = ("backend", "is_local", "local_files_only")


def save_tokenizer(tokenizer, path: str, *, generation_config: dict | None = None) -> None:
  """Writes `tokenizer` to `path` so that transformers 5.x and 4.5x both load it with the
  same ids and chat template, and `generation_config` (when given) as
  generation_config.json.

  transformers 5 writes extra special tokens as a list (4.x expects a dict and fails on
  it) and its own tokenizer class name; both are rewritten to the spelling both read
  (`additional_special_tokens`, `PreTrainedTokenizerFast`)."""
  tokenizer.save_pretrained(path)
  config_path = os.path.join(path, "tokenizer_config.json")
  with open(config_path) as f:
    config = json.load(f)
  extra = config.pop("extra_special_tokens", None)
  if isinstance(extra, list):
    config["additional_special_tokens"] = extra
  elif extra:
    config["extra_special_tokens"] = extra
  if config.get("tokenizer_class") in _TOKENIZER_CLASS_4X:
    config["tokenizer_class"] = _TOKENIZER_CLASS_4X[config["tokenizer_class"]]
  for key in _LOAD_ONLY_KEYS:
    config.pop(key, None)
  with open(config_path, "w") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
  if generation_config is not None:
    with open(os.path.join(path, GENERATION_CONFIG), "w") as f:
      json.dump(generation_config, f, indent=2)


def read_generation_config(path: str) -> dict | None:
  """The generation_config.json of a directory (a checkpoint, or a run's tokenizer
  directory), or None when it has none."""
  try:
    with open(os.path.join(path, GENERATION_CONFIG)) as f:
      record = json.load(f)
  except FileNotFoundError:
    return None
  except ValueError as e:
    raise ValueError(f"{os.path.join(path, GENERATION_CONFIG)}: not JSON ({e}).") from e
  return record if isinstance(record, dict) else None


def config_token_ids(path: str) -> set[int]:
  """The token ids the checkpoint's config.json and generation_config.json name (bos, eos,
  pad, decoder start), for the `<|mask|>` row to stay clear of."""
  ids: set[int] = set()
  try:
    with open(os.path.join(path, "config.json")) as f:
      config = json.load(f)
  except (OSError, ValueError):
    config = None
  for record in (config, read_generation_config(path)):
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
      value = record.get(key) if isinstance(record, dict) else None
      for i in value if isinstance(value, list) else [value]:
        if isinstance(i, int) and not isinstance(i, bool):
          ids.add(i)
  return ids


def _added_tokens(tok) -> dict[int, str]:
  """id -> text of a tokenizer's added (special and other) tokens."""
  return {i: t.content for i, t in tok.added_tokens_decoder.items()}


def check_covers(tok, model_tok, where: str, model_where: str) -> None:
  """Raises ValueError naming the added or special tokens of the model's own tokenizer
  `model_tok` that `tok` lacks (or holds at another id), `<|mask|>` aside: a tokenizer
  without them would put `<|mask|>` on a trained row, and split the model's own tokens."""
  have = _added_tokens(tok)
  missing = [(i, t) for i, t in sorted(_added_tokens(model_tok).items())
             if t != MASK_TOKEN and have.get(i) != t]
  if missing:
    names = ", ".join(f"{t} ({i})" for i, t in missing[:8]) + (
        f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise ValueError(
        f"{where}: the tokenizer lacks special tokens of the model's own tokenizer "
        f"({model_where}): {names}. Leave `tokenizer` unset to train with the model's own "
        "tokenizer and chat template, or pass one that has these tokens at these ids.")


def load_tokenizer(path: str, vocab_size: int | None = None, *,
                   reserved_ids: set[int] | frozenset = frozenset(), model_tokenizer=None,
                   model_where: str = "the model"):
  """`AutoTokenizer` from an HF directory, with `<|mask|>` added as a special token.

  The mask token takes a spare embedding row: above every id the tokenizer knows
  (added and special tokens included), every id the directory's config.json and
  generation_config.json name, and `reserved_ids` (e.g. the ids of the model's own
  tokenizer), and below `vocab_size` (the checkpoint's, read from config.json when
  not given), which is kept unchanged. A tokenizer that already has `<|mask|>` (a
  mars_jax run or export) keeps its id. `model_tokenizer`: the model's own, when this
  one is another: it must cover its added tokens (`check_covers`), and the mask row
  stays above its ids too.
  Returns (tokenizer, mask_token_id).
  """
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  _check_dir(path)
  if vocab_size is None:
    vocab_size = Qwen2Config.from_json_file(os.path.join(path, "config.json")).vocab_size
  tok = AutoTokenizer.from_pretrained(path)
  if model_tokenizer is not None:
    check_covers(tok, model_tokenizer, path, model_where)
    reserved_ids = set(reserved_ids) | {i for t, i in model_tokenizer.get_vocab().items()
                                        if t != MASK_TOKEN}
  added = MASK_TOKEN not in tok.get_vocab()
  if added:
    tok.add_tokens([MASK_TOKEN], special_tokens=True)
  mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
  taken = [i for i in (*tok.get_vocab().values(), *config_token_ids(path), *reserved_ids)
           if i != mask_id]
  if added and taken and mask_id <= max(taken):
    raise ValueError(
        f"{path}: {MASK_TOKEN} would take row {mask_id}, but id {max(taken)} is in use (by "
        "the tokenizer, config.json or generation_config.json, or the model's own "
        "tokenizer); mars_jax needs a row above every id in use.")
  if mask_id >= vocab_size:
    raise ValueError(
        f"{path}: no spare embedding row for {MASK_TOKEN}: the tokenizer already has "
        f"{len(tok) - 1} tokens and the checkpoint's vocab_size is {vocab_size}. Resize the "
        "embeddings (e.g. transformers' resize_token_embeddings) before fine-tuning.")
  return tok, mask_id
