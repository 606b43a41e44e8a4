"""What `python -m mars_jax.plan` reports: a config's train step, eval step and decoding
loop compiled for a TPU slice or GPU node on any host (compile-only devices,
`mars_jax.parallel.hardware`), their per-chip memory against the chip's, the micro-batch
count and remat that fit, and the step's FLOPs and time at a given MFU. The command line
and its output are described in mars_jax/plan.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.parallel import hardware, sharding
from mars_jax.training import config as train_config, masks, objective
from mars_jax.training import step as ts
from mars_jax.benchmarks.step import train_flops
from mars_jax.decoding import loop, mesh as decode_mesh
from mars_jax.models import attention, context, flash, qwen2, splash
from mars_jax.training.optimizer import make_optimizer


@dataclasses.dataclass
class Compiled:
  """What one compilation allocates per chip (bytes) and how long it took (seconds):
  args, temps, generated code, and outputs that do not reuse a donated argument's
  buffer (the train step's new state does; the decoding loop's final state does not)."""
  args: int
  temps: int
  code: int
  outputs: int
  seconds: float

  @property
  def total(self) -> int:
    return self.args + self.temps + self.code + self.outputs


def memory_of(lowered) -> Compiled:
  """Compiles a `jax.stages.Lowered` -> its per-device memory and compile time."""
  t0 = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  m = compiled.memory_analysis()
  return Compiled(args=int(m.argument_size_in_bytes), temps=int(m.temp_size_in_bytes),
                  code=int(m.generated_code_size_in_bytes),
                  outputs=int(m.output_size_in_bytes - m.alias_size_in_bytes),
                  seconds=seconds)


def model_config(cfg):
  """The architecture a config trains: model.init's config.json where it exists on this
  host, else model.preset with model.overrides (a run directory or a model path of
  another machine)."""
  path = os.path.join(cfg.model.init, "config.json")
  if cfg.model.init != "random" and os.path.isfile(path):
    return qwen2.Qwen2Config.from_json_file(path)
  return train_config.random_model_config(cfg)


def _batch_spec(cfg, rows: int) -> dict[str, Any]:
  shape = (rows, cfg.data.max_length)
  batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_)}
  if cfg.data.packing:
    batch["segment_ids"] = jax.ShapeDtypeStruct(shape, jnp.int32)
    batch["positions"] = jax.ShapeDtypeStruct(shape, jnp.int32)
  return batch


def _stream_length(cfg) -> int:
  """The target stream the step is compiled for: objective.stream_length, else the whole
  row (the longest any data can need; the trainer derives a shorter one from the data)."""
  return cfg.objective.stream_length or cfg.data.max_length


def _train_parts(cfg, config, devices, remat: str):
  """-> (typed configs, mesh, optimizer, runtime with `remat`) of the config's stage."""
  mask_id = config.vocab_size - 1
  runtime = train_config.stage_runtime(cfg, train_config.runtime(cfg), mask_id).replace(
      remat=remat)
  typed = train_config.typed(cfg, total_steps=1000, mask_token_id=mask_id,
                             stream_length=_stream_length(cfg))
  mesh = sharding.make_mesh(typed.mesh, devices=devices)
  return typed, mesh, make_optimizer(typed.optimizer), runtime


def compile_train(cfg, config, devices, *, micro_batches: int, remat: str) -> Compiled:
  """The config's train step with `micro_batches` and `remat`, compiled for `devices`."""
  typed, mesh, tx, runtime = _train_parts(cfg, config, devices, remat)
  step = ts.make_train_step(config, typed.objective, tx, mesh, micro_batches=micro_batches,
                            runtime=runtime)
  state = ts.abstract_train_state(config, tx, runtime=runtime)
  return memory_of(step.lower(state, _batch_spec(cfg, cfg.train.batch_size)))


def compile_eval(cfg, config, devices) -> Compiled:
  """The config's eval step (no micro-batches: one global batch, as the trainer runs it)."""
  typed, mesh, tx, runtime = _train_parts(cfg, config, devices, cfg.model.remat)
  step = ts.make_eval_step(config, typed.objective, mesh, runtime=runtime)
  params = ts.abstract_train_state(config, tx, runtime=runtime).params
  return memory_of(step.lower(params, _batch_spec(cfg, cfg.train.batch_size)))


def _micro_batch_choices(cfg, batch_shards: int) -> list[int]:
  """The config's micro-batch count doubled, again and again, while every micro-batch
  still splits evenly over the batch's devices: 8 -> [16, 32, ...]."""
  rows, out = cfg.train.batch_size, []
  m = 2 * cfg.train.micro_batches
  while rows % (m * batch_shards) == 0:
    out.append(m)
    m *= 2
  return out


def fit_train(cfg, config, topology: hardware.Topology, devices, *, search: bool) -> dict:
  """The config's train and eval steps as they are and, when the train step does not fit
  the chip, the first of `_micro_batch_choices` (then the same with remat "full") that
  does, found by compiling the train step."""
  hbm = topology.chip.hbm_bytes
  mb, remat = cfg.train.micro_batches, cfg.model.remat
  mesh = sharding.MeshConfig(**cfg.mesh.to_dict()).shape(len(devices))
  train = compile_train(cfg, config, devices, micro_batches=mb, remat=remat)
  tried = [{"micro_batches": mb, "remat": remat, "total": train.total}]
  fits = train.total <= hbm
  suggestion = None
  if not fits and search:
    more = _micro_batch_choices(cfg, mesh[0] * mesh[1])
    candidates = [(m, remat) for m in more]
    if remat != "full":
      candidates += [(m, "full") for m in [mb, *more]]
    for m, r in candidates:
      got = compile_train(cfg, config, devices, micro_batches=m, remat=r)
      tried.append({"micro_batches": m, "remat": r, "total": got.total})
      if got.total <= hbm:
        suggestion = {"micro_batches": m, "remat": r, "train": got}
        break
  return {"train": train, "eval": compile_eval(cfg, config, devices),
          "mesh": dict(zip(sharding.AXES, mesh)), "fits": fits, "suggestion": suggestion,
          "tried": tried}


def train_figures(cfg, config, topology: hardware.Topology) -> dict:
  """FLOPs per step from the model and the step time at 100% / 50% MFU on `topology`."""
  length = cfg.data.max_length
  positions = length + (_stream_length(cfg) if cfg.objective.kind == "mars" else 0)
  flops, _ = train_flops(config, cfg.train.batch_size, positions)
  peak = topology.chip.bf16_flops * topology.chips
  step_100 = flops / peak
  return {"flops_per_step": flops, "positions_per_row": positions,
          "step_s_mfu100": step_100, "step_s_mfu50": 2 * step_100,
          "tokens_per_s_per_chip_mfu50": cfg.train.batch_size * length
          / (2 * step_100) / topology.chips}


def attention_work(cfg, shards: int = 1) -> dict:
  """What the blockwise attention (`flash`) computes on one MARS row of the config's
  shape, a reasoning chat: a prompt of L / 8 tokens and a response to the end of the row,
  block offset 0. tiles: [TILE, TILE] score tiles that run (every tile pair less those
  the kernel skips); allowed: the (query, key) pairs the mask allows; ratio: tiles x
  TILE^2 / allowed, the attention FLOPs run per FLOP the mask needs. With `shards` > 1,
  the positions dealt out as context parallelism deals them: shard_tiles, each shard's
  queries against every key (balanced when they are equal)."""
  length = cfg.data.max_length
  loss_mask = np.zeros((1, length), bool)
  loss_mask[:, length // 8:] = True
  batch = {"tokens": np.zeros((1, length), np.int32), "loss_mask": loss_mask}
  if cfg.objective.kind == "mars":
    mask = objective.two_stream_token_mask(batch, block_size=cfg.objective.block_size,
                                           stream_length=_stream_length(cfg),
                                           intra_block=cfg.objective.intra_block)
  else:
    mask = flash.causal(jnp.ones((1, length), jnp.int32))
  tiles, allowed = int(flash.tile_pairs(mask)), int(flash.allowed_pairs(mask))
  out = {"positions": int(mask.segment.shape[1]), "tile": flash.TILE, "tiles": tiles,
         "allowed": allowed, "ratio": tiles * flash.TILE ** 2 / max(allowed, 1)}
  if shards > 1:
    dealt = mask.map(lambda a: context.split(a, shards))
    local = dealt.segment.shape[1] // shards
    out["shard_tiles"] = [int(flash.tile_pairs(
        dealt.map(lambda a, s=s: a[:, s * local:(s + 1) * local]), dealt))
        for s in range(shards)]
  return out


def cache_bytes_per_chip(config, mesh, *, batch: int, cache_len: int, runtime) -> int:
  """Bytes of one chip's shard of the KV cache (K and V) in the decode shardings."""
  shapes = jax.eval_shape(lambda: loop.new_state(config, batch, cache_len, runtime=runtime))
  where = decode_mesh.state_shardings(config, mesh, batch=batch, cache_len=cache_len,
                                      runtime=runtime)
  return sum(int(np.prod(where.cache[k].shard_shape(shapes.cache[k].shape)))
             * shapes.cache[k].dtype.itemsize for k in ("k", "v"))


def decode_plan(cfg, config, topology: hardware.Topology, devices, *, batch: int,
                cache_len: int, window: int, mesh_spec: str) -> dict:
  """Compiles the decoding loop for `batch` rows and `cache_len` slots at `window` (and
  at 1, AR) on a mesh over `devices` -> per-chip bytes and the HBM-roofline rates: a
  forward reads at least the chip's weight shard (its arguments) and, with the cache
  full, its shard of the KV cache (made inside the loop, so among the temporaries)."""
  runtime = train_config.runtime(cfg).replace(param_dtype=cfg.model.dtype, remat="none")
  mesh = decode_mesh.mesh_from_flag(mesh_spec, devices)
  cache = cache_bytes_per_chip(config, mesh, batch=batch, cache_len=cache_len,
                               runtime=runtime)
  out = {"batch": batch, "cache_len": cache_len, "window": window, "mesh": dict(mesh.shape),
         "dtype": runtime.param_dtype, "cache_bytes": cache, "windows": {}}
  for w in sorted({1, window}):
    lowered = decode_mesh.lower_decode(config, mesh, batch=batch, prompt_len=cache_len // 2,
                                       cache_len=cache_len, window=w, runtime=runtime)
    got = memory_of(lowered)
    forwards = topology.chip.hbm_bandwidth / (got.args + cache)
    out["windows"][w] = {**dataclasses.asdict(got), "total": got.total,
                         "forwards_per_s": forwards, "tokens_per_s_max": forwards * batch * w}
  out["fits"] = out["windows"][window]["total"] <= topology.chip.hbm_bytes
  return out


def attention_check(topology: hardware.Topology, devices, *, length: int = 256) -> dict:
  """Which attention implementations compile for the chip on a MARS two-stream mask
  (B = 4, [2 * length] positions, bf16, one chip): {impl: "compiles" | the compiler's or
  jax's first line of refusal}. TPU: splash and xla given the mask drawn out, and
  "splash-tokens", the loss's gradient through splash with its block table read off
  the mask's per-token vectors (as training runs it), over rows of 4 * length tokens
  (8 * length positions: 4 x 4 blocks of 512 at the default); GPU: cudnn and xla."""
  where = jax.sharding.SingleDeviceSharding(devices[0])
  shape = lambda t: jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16, sharding=where)
  mask = masks.two_stream_mask(length, 4)[None]
  row = {"tokens": np.zeros((1, 4 * length), np.int32),
         "loss_mask": np.ones((1, 4 * length), bool)}
  tokens = objective.two_stream_token_mask(row, block_size=4)

  def run(impl, q, k, v):
    if impl == "splash-tokens":
      return jax.grad(lambda *a: jnp.sum(splash.token_splash_attention(*a, tokens)
                                         .astype(jnp.float32)), (0, 1, 2))(q, k, v)
    return attention.attention(q, k, v, mask, impl)
  impls = (("splash", "splash-tokens", "xla") if topology.chip.platform == "tpu"
           else ("cudnn", "xla"))
  out = {}
  for impl in impls:
    fn = jax.jit(functools.partial(run, impl))
    qkv = shape(tokens.segment.shape[1] if impl == "splash-tokens" else 2 * length)
    try:
      fn.lower(qkv, qkv, qkv).compile()
      out[impl] = "compiles"
    except Exception as e:  # pylint: disable=broad-except  # reported, not raised
      out[impl] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
  return out


def _gib(n: float) -> str:
  return f"{n / hardware.GIB:.2f}"


def _row(name: str, c: dict, hbm: int) -> tuple[str, ...]:
  return (name, _gib(c["args"]), _gib(c["temps"]), _gib(c["total"]), _gib(hbm - c["total"]),
          "yes" if c["total"] <= hbm else "NO", f"{c['seconds']:.1f}")


def format_table(report: dict) -> str:
  """The report as the table the CLI prints."""
  t = report["topology"]
  hbm = t["hbm_bytes"]
  train, decode = report.get("train"), report.get("decode")
  lines = [f"{report['config']} on {t['name']} ({t['chips']} x {t['chip']}, "
           f"{_gib(hbm)} GiB each)" + (f", mesh {train['mesh']}" if train else "")]
  rows = [("step", "args GiB", "temps GiB", "total GiB", "headroom GiB", "fits",
           "compile s")]
  if train:
    rows += [_row(name, train[name], hbm) for name in ("train", "eval")]
    s = train["suggestion"]
    if s:
      rows.append(_row(f"train mb={s['micro_batches']} remat={s['remat']}", s["train"], hbm))
  if decode:
    rows += [_row(f"decode W={w} b={decode['batch']} S={decode['cache_len']}", c, hbm)
             for w, c in decode["windows"].items()]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
  if train:
    if not train["fits"] and not train["suggestion"]:
      lines.append("does not fit; no micro-batch count or remat tried fits either")
    f = report["flops"]
    lines.append(f"model FLOPs/step {f['flops_per_step']:.3e}: step {f['step_s_mfu100']:.3f} s"
                 f" at 100% MFU, {f['step_s_mfu50']:.3f} s at 50%; "
                 f"{f['tokens_per_s_per_chip_mfu50']:.0f} tokens/s/chip at 50%")
  work = report.get("attention_work")
  if work:
    lines.append(f"blockwise attention, one row ({work['positions']} positions, a prompt of "
                 f"1/8): {work['tiles']} tiles of {work['tile']}^2 run, {work['ratio']:.3f}x "
                 "the FLOPs the mask allows" + (
                     f"; tiles per context shard {min(work['shard_tiles'])}-"
                     f"{max(work['shard_tiles'])}" if "shard_tiles" in work else ""))
  lines.append("attention on the two-stream mask: " + "; ".join(
      f"{impl}: {status}" for impl, status in report["attention"].items()))
  if decode:
    for w, c in decode["windows"].items():
      lines.append(f"decode W={w} on mesh {decode['mesh']}: HBM roofline "
                   f"{c['forwards_per_s']:.1f} forwards/s, <= {c['tokens_per_s_max']:.0f} "
                   f"tokens/s ({decode['batch']} rows x {w} tokens per forward at most)")
  return "\n".join(lines)


def plan(cfg, config_name: str, topology_name: str, *, decode: tuple[int, int, int] | None
         = None, decode_mesh_spec: str = "tensor=-1", search: bool = True,
         train: bool = True) -> dict:
  """Everything the CLI reports, as a JSON-able dict (train=False: the decoding loop only)."""
  topology = hardware.parse_topology(topology_name)
  devices = hardware.compile_devices(topology)
  if train:   # the meshes are checked before anything is compiled
    sharding.MeshConfig(**cfg.mesh.to_dict()).shape(len(devices))
  if decode:
    decode_mesh.mesh_from_flag(decode_mesh_spec, devices)
  config = model_config(cfg)
  report = {
      "config": config_name,
      "topology": {"name": topology.name, "jax": topology.jax_topology,
                   "chip": topology.chip.name, "chips": topology.chips,
                   "hbm_bytes": topology.chip.hbm_bytes,
                   "device_kind": devices[0].device_kind},
      "model": {"params": _num_params(config), "layers": config.num_hidden_layers,
                "hidden": config.hidden_size},
      "runtime": {"dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype,
                  "attention_impl": cfg.model.attention_impl, "remat": cfg.model.remat},
  }
  report["attention"] = attention_check(topology, devices)
  if train:
    report["batch"] = {"global": cfg.train.batch_size, "micro_batches": cfg.train.micro_batches,
                       "length": cfg.data.max_length, "stream_length": _stream_length(cfg),
                       "kind": cfg.objective.kind}
    report["train"] = _plain(fit_train(cfg, config, topology, devices, search=search))
    report["flops"] = train_figures(cfg, config, topology)
    if attention.runs_flash(cfg.model.attention_impl, report["flops"][
        "positions_per_row"]) or cfg.mesh.context > 1:
      report["attention_work"] = attention_work(cfg, report["train"]["mesh"]["context"])
  if decode:
    b, s, w = decode
    report["decode"] = decode_plan(cfg, config, topology, devices, batch=b, cache_len=s,
                                   window=w, mesh_spec=decode_mesh_spec)
  return report


def _num_params(config) -> int:
  return qwen2.num_params(qwen2.abstract_params(config))


def _plain(x):
  """Compiled records -> dicts (for JSON)."""
  if isinstance(x, Compiled):
    return {**dataclasses.asdict(x), "total": x.total}
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_plain(v) for v in x]
  return x
