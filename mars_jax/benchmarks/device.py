"""`python -m mars_jax.bench device --out DIR`: the project's accelerator figures.

What `launch/device_check.sh` runs on a GPU after the device-marked tests, in three
sections, each under its own time limit (--limits; an item that would not fit is
skipped and listed, never started late):

  train      MARS and AR-SFT train steps on a Qwen2.5-0.5B-shaped random model,
             params float32, compute bfloat16: step time, MARS / AR ratio, and model
             FLOPs utilisation (`step.train_flops`: dense attention, 3x forward)
             against the chip's peak dense bf16 FLOP/s.
  decode     `sampling.generate` on the 0.5B shape (bf16 params and compute) at
             each batch size: our AR loop (W=1), MARS at W=4 and W=5 with tau 0
             (every proposal accepted on random weights: the upper bound), and W=5
             with tau 1 (probability gate: nothing accepted, exact AR: the pure
             cost of the W-1 extra slots). Per forward, next to the HBM roofline.
  decode_7b  one decoding step (`decoding.timing.step_seconds`) of a Qwen2.5-7B-shaped
             model, bf16 params initialised on the device, at batch 1 and each W,
             against the memory-bandwidth roofline: (parameter bytes read + KV
             cache bytes read) / HBM bandwidth. The einsum attention reads the
             whole fixed-shape cache, so its bytes count in full.

Chip figures come from DEVICE_PEAKS by `jax.devices()[0].device_kind` (vendor
datasheet, dense, no sparsity), or --peak-tflops / --hbm-tbps; otherwise they are
"unknown" and so are MFU and roofline. Results: DIR/device.json and DIR/device.md,
rewritten after every measured item, so a section stopped from outside keeps what
it finished. --merge updates the sections it runs in an existing device.json (the
shell script runs one section per process); --report only re-renders both files,
adding DIR/sections.tsv (the shell script's log of its sections) when present.
--smoke: the same code paths on tiny shapes (CPU, seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import time
import traceback
from typing import Any, Callable

import jax
import numpy as np

from mars_jax.core import choices
from mars_jax.parallel import hardware, sharding
from mars_jax.training import objective, optimizer
from mars_jax.benchmarks import sample, step, toy
from mars_jax.benchmarks.roofline import forward_bytes
from mars_jax.core.choices import AttentionImpl, Remat
from mars_jax.decoding import batching, timing
from mars_jax.models import qwen2
from mars_jax.models.config import Qwen2Config

SECTIONS = ("train", "decode", "decode_7b")
# Soft limits (seconds) of each section run alone; launch/device_check.sh passes its
# own (each section's limit less 15 s of start-up). docs/performance.md, "Accelerator
# check", has the whole budget.
DEFAULT_LIMITS = {"train": 50.0, "decode": 80.0, "decode_7b": 50.0}
# device_kind -> (dense bf16 TFLOP/s, HBM TB/s): the published figures of `hardware.CHIPS`.
DEVICE_PEAKS = {c.device_kind: (c.bf16_flops / 1e12, c.hbm_bandwidth / 1e12)
                for c in hardware.CHIPS.values()}
# Decoding rows: (label, W, tau). On random weights tau 0 accepts every proposal and
# tau 1 (probability gate) none: the bounds of what a trained model reaches.
DECODE_ROWS = (("AR", 1, 1.0), ("MARS all accepted", 4, 0.0),
               ("MARS all accepted", 5, 0.0), ("MARS none accepted", 5, 1.0))
TINY = toy.CONFIG  # --smoke's shape


@dataclasses.dataclass(frozen=True)
class Plan:
  """Shapes and sizes of one run (the accelerator's, or --smoke's tiny ones)."""
  train_model: str
  train_batch: int
  train_length: int
  train_steps: int
  decode_model: str
  batch_sizes: tuple[int, ...]
  prompt_len: int
  max_new_tokens: int
  repeats: int
  big_model: str
  big_cache_len: int
  big_windows: tuple[int, ...]
  big_steps: int


FULL = Plan(train_model="qwen2.5-0.5b", train_batch=16, train_length=512, train_steps=5,
            decode_model="qwen2.5-0.5b", batch_sizes=(1, 4, 16, 64), prompt_len=32,
            max_new_tokens=128, repeats=3, big_model="qwen2.5-7b", big_cache_len=1024,
            big_windows=(1, 5, 4), big_steps=32)
SMOKE = Plan(train_model="tiny", train_batch=2, train_length=32, train_steps=1,
             decode_model="tiny", batch_sizes=(2,), prompt_len=8, max_new_tokens=10,
             repeats=1, big_model="tiny", big_cache_len=64, big_windows=(1, 5),
             big_steps=4)


def model_config(name: str) -> Qwen2Config:
  return TINY if name == "tiny" else qwen2.preset(name)


def describe(config: Qwen2Config) -> str:
  return (f"hidden={config.hidden_size} layers={config.num_hidden_layers} "
          f"heads={config.num_attention_heads}/{config.num_key_value_heads} "
          f"mlp={config.intermediate_size} vocab={config.vocab_size} "
          f"tied={config.tie_word_embeddings}")


# ---- chip figures and rooflines -------------------------------------------------------


def chip_figures(device_kind: str, peak_tflops: float | None = None,
                 hbm_tbps: float | None = None) -> dict[str, Any]:
  """Peak dense bf16 FLOP/s and HBM bandwidth: a flag, else DEVICE_PEAKS, else None."""
  table = DEVICE_PEAKS.get(device_kind)
  out = {}
  for key, flag, index in (("peak_bf16_tflops", peak_tflops, 0), ("hbm_tbps", hbm_tbps, 1)):
    if flag:
      out[key], out[key + "_source"] = float(flag), "flag"
    elif table:
      out[key], out[key + "_source"] = table[index], f"table ({device_kind})"
    else:
      out[key], out[key + "_source"] = None, "unknown"
  return out


def roofline_ms(total_bytes: int, hbm_tbps: float | None) -> float | None:
  return None if not hbm_tbps else total_bytes / (hbm_tbps * 1e12) * 1e3


# ---- time budget ----------------------------------------------------------------------


class Budget:
  """A section's soft time limit: an item starts only if its estimated cost fits."""

  def __init__(self, limit_s: float):
    self.limit_s, self.start = limit_s, time.perf_counter()

  def used(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> float:
    return self.limit_s - self.used()

  def allows(self, estimate_s: float) -> bool:
    return self.left() > max(estimate_s, 0.0)


# ---- results --------------------------------------------------------------------------


class Report:
  """device.json (the results) and device.md (rendered from it), rewritten on `save`."""

  def __init__(self, out: str, meta: dict[str, Any] | None, merge: bool):
    self.json_path, self.md_path = os.path.join(out, "device.json"), os.path.join(out, "device.md")
    self.sections_path = os.path.join(out, "sections.tsv")
    os.makedirs(out, exist_ok=True)
    self.data: dict[str, Any] = {}
    if merge and os.path.isfile(self.json_path):
      with open(self.json_path) as f:
        self.data = json.load(f)
    if meta is not None:
      self.data["meta"] = meta

  def section(self, name: str, facts: dict[str, Any]) -> dict[str, Any]:
    self.data[name] = {**facts, "rows": [], "skipped": [], "errors": [], "seconds": 0.0,
                       "date": datetime.datetime.now().isoformat(timespec="seconds")}
    self.save()
    return self.data[name]

  def save(self) -> None:
    if os.path.isfile(self.sections_path):
      self.data["sections"] = read_sections(self.sections_path)
    tmp = self.json_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=2)
    os.replace(tmp, self.json_path)
    with open(self.md_path, "w") as f:
      f.write(render_markdown(self.data))


def read_sections(path: str) -> list[dict[str, str]]:
  """The shell script's log: one tab-separated line per section
  (name, limit_s, used_s, status, detail)."""
  rows = []
  with open(path) as f:
    for line in f:
      parts = line.rstrip("\n").split("\t")
      if len(parts) >= 4:
        rows.append(dict(zip(("section", "limit_s", "used_s", "status", "detail"),
                             parts + [""] * (5 - len(parts)))))
  return rows


def run_item(sec: dict, report: Report, budget: Budget, name: str, estimate_s: float,
             fn: Callable[[], Any]) -> tuple[Any, float]:
  """Runs `fn` if the budget allows -> (its value or None, seconds it took). A skip or
  an error is recorded in the section and printed; the report is saved either way."""
  if not budget.allows(estimate_s):
    why = (f"{name}: skipped, {budget.left():.0f} s left of {budget.limit_s:.0f} s "
           f"(estimated {estimate_s:.0f} s)")
    sec["skipped"].append(why)
    print(why, flush=True)
    report.save()
    return None, 0.0
  begin = time.perf_counter()
  value = None
  try:
    value = fn()
  except Exception as e:  # pylint: disable=broad-except  # an OOM must not end the check
    msg = f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    sec["errors"].append(msg)
    print("ERROR " + msg, flush=True)
    traceback.print_exc()
  seconds = time.perf_counter() - begin
  sec["seconds"] = budget.used()
  report.save()
  return value, seconds


_INITS: dict[Qwen2Config, Any] = {}


def _jit_init(config: Qwen2Config, runtime: qwen2.Runtime):
  """Random params (seed 0) computed on the device in `runtime`'s param dtype. A shape
  initialised before in this process (--smoke runs every section in one) is cast
  instead: the compilation of the init is most of a tiny section's time."""
  if config in _INITS:
    return jax.block_until_ready(qwen2.relayout(_INITS[config], runtime))
  _INITS.clear()  # hold at most one model's params
  params = jax.jit(functools.partial(qwen2.init_params, config, runtime=runtime))(
      jax.random.key(0))
  _INITS[config] = params
  return jax.block_until_ready(params)


# ---- sections -------------------------------------------------------------------------


def train_section(plan: Plan, args, chip, report: Report, budget: Budget) -> None:
  config = model_config(plan.train_model)
  runtime = qwen2.Runtime(dtype="bfloat16", attention_impl=args.attention_impl,
                          remat=args.remat)
  sec = report.section("train", {
      "model": plan.train_model, "shape": describe(config), "runtime": runtime.to_dict(),
      "batch": plan.train_batch, "length": plan.train_length, "block_size": 4,
      "timed_steps": plan.train_steps, "limit_s": budget.limit_s})
  print(f"[train] {plan.train_model} ({describe(config)}), b={plan.train_batch} "
        f"L={plan.train_length}, params float32, compute bfloat16", flush=True)
  mesh = sharding.make_mesh(sharding.MeshConfig(-1, 1, 1))
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(total_steps=plan.train_steps + 1))
  params, _ = run_item(sec, report, budget, "train: init params", 0.0,
                       lambda: _jit_init(config, runtime))
  if params is None:
    return
  batch = step.synthetic_batch(config, plan.train_batch, plan.train_length)
  estimate, ar = 0.0, None
  for kind in ("ar_sft", "mars"):
    obj = objective.ObjectiveConfig(kind=kind, block_size=4,
                                    mask_token_id=config.vocab_size - 1)
    out, took = run_item(sec, report, budget, f"train: {kind} step", estimate,
                         lambda obj=obj: step.time_step(config, runtime, obj, tx, mesh, params,
                                                        batch, plan.train_steps))
    estimate = 1.5 * took
    if out is None:
      continue
    seconds, temp_mib = out
    positions = plan.train_length * (2 if kind == "mars" else 1)
    flops, attention = step.train_flops(config, plan.train_batch, positions)
    peak = chip["peak_bf16_tflops"]
    row = {"objective": kind, "positions": plan.train_batch * positions,
           "ms_per_step": seconds * 1e3, "tflop_per_step": flops / 1e12,
           "attention_share": attention / flops, "tflops": flops / seconds / 1e12,
           "mfu": flops / seconds / (peak * 1e12) if peak else None,
           "temp_gib": temp_mib / 1024, "x_ar": None}
    if kind == "ar_sft":
      ar = row
    elif ar is not None:
      row["x_ar"] = row["ms_per_step"] / ar["ms_per_step"]
    sec["rows"].append(row)
    report.save()
    print(f"[train] {kind}: {row['ms_per_step']:.1f} ms/step, {row['tflops']:.1f} TFLOP/s, "
          f"MFU {_fmt(row['mfu'], '.1%')}", flush=True)


def decode_section(plan: Plan, args, chip, report: Report, budget: Budget) -> None:
  config = model_config(plan.decode_model)
  runtime = qwen2.Runtime(param_dtype="bfloat16", dtype="bfloat16",
                          attention_impl=args.attention_impl)
  sec = report.section("decode", {
      "model": plan.decode_model, "shape": describe(config), "runtime": runtime.to_dict(),
      "prompt_len": plan.prompt_len, "max_new_tokens": plan.max_new_tokens,
      "repeats": plan.repeats, "metric": "probability", "limit_s": budget.limit_s})
  print(f"[decode] {plan.decode_model} ({describe(config)}), bf16, prompt {plan.prompt_len} "
        f"random tokens, {plan.max_new_tokens} new tokens (no EOS)", flush=True)
  params, _ = run_item(sec, report, budget, "decode: init params", 0.0,
                       lambda: _jit_init(config, runtime))
  if params is None:
    return
  mask_id = config.vocab_size - 1
  m = sample.BenchModel(config, params, mask_id,
                        sample._random_prompts(plan.prompt_len, mask_id))  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  estimate = 0.0
  for bs in plan.batch_sizes:
    prompts = m.prompts(bs, rng)
    calls = {(label, w, tau): sample.ours(m, prompts, max_new=plan.max_new_tokens, window=w,
                                          tau=tau, metric="probability", runtime=runtime)
             for label, w, tau in DECODE_ROWS}
    out, took = run_item(sec, report, budget, f"decode: batch {bs}", estimate,
                         lambda calls=calls: sample.best_times(calls, plan.repeats))
    estimate = 1.3 * took
    if out is None:
      continue
    seconds, outputs = out
    ar_key = DECODE_ROWS[0]
    ar_tokens = outputs[ar_key][0]
    ar_rate = sum(map(len, ar_tokens)) / seconds[ar_key]
    for key in calls:
      label, window, tau = key
      tokens, per_forward, forwards, _ = outputs[key]
      cache_len = batching.pow2(plan.prompt_len + plan.max_new_tokens + window - 1,
                                batching.pow2(plan.prompt_len, batching.MIN_PROMPT_BUCKET))
      pbytes, kvbytes = forward_bytes(config, runtime, batching.pow2(bs), cache_len)
      rate = sum(map(len, tokens)) / seconds[key]
      sec["rows"].append({
          "batch": bs, "row": label, "window": window, "tau": tau, "tokens_per_s": rate,
          "tokens_per_forward": per_forward, "forwards": forwards,
          "ms_per_forward": seconds[key] / forwards * 1e3,
          "roofline_ms_per_forward": roofline_ms(pbytes + kvbytes, chip["hbm_tbps"]),
          "bytes_per_forward": pbytes + kvbytes, "cache_len": cache_len,
          "x_ar": rate / ar_rate,
          "same_as_ar": float(np.mean([a == b for a, b in zip(ar_tokens, tokens)]))})
      r = sec["rows"][-1]
      print(f"[decode] b={bs:<3d} {label:<19} W={window} tau={tau:.1f}: "
            f"{rate:10.1f} tok/s {per_forward:5.2f} tok/fwd {r['ms_per_forward']:7.2f} ms/fwd "
            f"x{r['x_ar']:.2f} AR", flush=True)
    report.save()


def decode_7b_section(plan: Plan, args, chip, report: Report, budget: Budget) -> None:
  config = model_config(plan.big_model)
  runtime = qwen2.Runtime(param_dtype="bfloat16", dtype="bfloat16",
                          attention_impl=args.attention_impl)
  sec = report.section("decode_7b", {
      "model": plan.big_model, "shape": describe(config), "runtime": runtime.to_dict(),
      "batch": 1, "cache_len": plan.big_cache_len, "steps": plan.big_steps,
      "repeats": plan.repeats, "limit_s": budget.limit_s})
  print(f"[decode_7b] {plan.big_model} ({describe(config)}), bf16 params on device, batch 1, "
        f"cache {plan.big_cache_len}", flush=True)
  params, took = run_item(sec, report, budget, "decode_7b: init params", 0.0,
                          lambda: _jit_init(config, runtime))
  if params is None:
    return
  sec["params"] = qwen2.num_params(params)
  pbytes, kvbytes = forward_bytes(config, runtime, 1, plan.big_cache_len)
  roof = roofline_ms(pbytes + kvbytes, chip["hbm_tbps"])
  estimate, ar_ms = took, None
  for window in plan.big_windows:
    seconds, took = run_item(
        sec, report, budget, f"decode_7b: W={window}", estimate,
        lambda window=window: timing.step_seconds(
            config, params, batch=1, cache_len=plan.big_cache_len, window=window,
            mode="gated", mask_token_id=config.vocab_size - 1, steps=plan.big_steps,
            repeats=plan.repeats, runtime=runtime))
    estimate = 1.3 * took
    if seconds is None:
      continue
    ms = seconds * 1e3
    ar_ms = ms if window == 1 else ar_ms
    sec["rows"].append({
        "window": window, "ms_per_forward": ms, "param_bytes": pbytes, "kv_bytes": kvbytes,
        "roofline_ms_per_forward": roof,
        "roofline_fraction": roof / ms if roof else None,
        "x_ar_forward": ms / ar_ms if ar_ms else None,
        "tokens_per_s_tau0_bound": window / seconds})
    report.save()
    print(f"[decode_7b] W={window}: {ms:.2f} ms/forward, roofline {_fmt(roof, '.2f')} ms, "
          f"up to {window / seconds:.1f} tokens/s", flush=True)


RUNNERS = {"train": train_section, "decode": decode_section, "decode_7b": decode_7b_section}


# ---- markdown -------------------------------------------------------------------------


def _fmt(value, spec: str, missing: str = "unknown") -> str:
  return missing if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(r) + " |" for r in rows])


def _notes(sec: dict) -> list[str]:
  lines = [f"- skipped: {s}" for s in sec.get("skipped", [])]
  lines += [f"- error: {e}" for e in sec.get("errors", [])]
  return lines + [f"- measured {sec.get('date', '?')} in {sec.get('seconds', 0.0):.0f} s "
                  f"(limit {sec.get('limit_s', 0.0):.0f} s)"]


def render_markdown(data: dict[str, Any]) -> str:
  """device.md from device.json's dict."""
  meta = data.get("meta", {})
  chip = meta.get("chip", {})
  lines = ["# Accelerator check", "",
           f"{meta.get('device_kind', '?')} ({meta.get('platform', '?')}, "
           f"{meta.get('device_count', '?')} device(s)), jax {meta.get('jax', '?')}, "
           f"{meta.get('date', '?')}{', SMOKE (tiny shapes)' if meta.get('smoke') else ''}. "
           f"Peak dense bf16: {_fmt(chip.get('peak_bf16_tflops'), 'g')} TFLOP/s "
           f"({chip.get('peak_bf16_tflops_source', 'unknown')}); HBM: "
           f"{_fmt(chip.get('hbm_tbps'), 'g')} TB/s ({chip.get('hbm_tbps_source', 'unknown')}). "
           "Random weights throughout.", ""]
  if data.get("sections"):
    lines += ["## Sections", ""]
    lines += _table(["section", "limit s", "used s", "status", "detail"],
                    [[s["section"], s["limit_s"], s["used_s"], s["status"], s["detail"]]
                     for s in data["sections"]])
    lines.append("")
  if "train" in data:
    sec = data["train"]
    rt = sec["runtime"]
    lines += ["## Train step: MARS vs AR-SFT", "",
              f"{sec['model']} shape ({sec['shape']}), params {rt['param_dtype']}, compute "
              f"{rt['dtype']}, attention {rt['attention_impl']}, remat {rt['remat']}; "
              f"b={sec['batch']}, L={sec['length']}, B={sec['block_size']}; "
              f"{sec['timed_steps']} timed steps after a warm-up. FLOPs: dense attention, "
              "3x forward (`step.train_flops`).", ""]
    lines += _table(["objective", "positions", "ms/step", "x AR", "TFLOP/step", "attn %",
                     "TFLOP/s", "MFU", "temp GiB"],
                    [[r["objective"], str(r["positions"]), f"{r['ms_per_step']:.1f}",
                      _fmt(r["x_ar"], ".2f", "1.00" if r["objective"] == "ar_sft" else "n/a"),
                      f"{r['tflop_per_step']:.2f}", f"{r['attention_share'] * 100:.1f}",
                      f"{r['tflops']:.1f}", _fmt(r["mfu"], ".1%"), f"{r['temp_gib']:.2f}"]
                     for r in sec["rows"]])
    lines += [""] + _notes(sec) + [""]
  if "decode" in data:
    sec = data["decode"]
    lines += ["## Decoding: our AR loop vs MARS", "",
              f"{sec['model']} shape ({sec['shape']}), params and compute "
              f"{sec['runtime']['dtype']}; prompts of {sec['prompt_len']} random tokens, "
              f"{sec['max_new_tokens']} new tokens each (EOS ignored), best of "
              f"{sec['repeats']}, probability gate. tau 0 accepts every proposal (upper "
              "bound), tau 1 none (the cost of the W-1 extra slots; = AR). ms/forward "
              "includes the prefill; roofline: (weights + whole KV cache) / HBM bandwidth. "
              "=AR: share of samples equal to the AR loop's (bf16 near-ties on random "
              "weights can differ).", ""]
    lines += _table(["batch", "row", "W", "tau", "tokens/s", "tok/fwd", "ms/fwd",
                     "roofline ms/fwd", "x AR", "=AR"],
                    [[str(r["batch"]), r["row"], str(r["window"]), f"{r['tau']:.1f}",
                      f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_forward']:.2f}",
                      f"{r['ms_per_forward']:.3f}",
                      _fmt(r["roofline_ms_per_forward"], ".3f"), f"{r['x_ar']:.2f}",
                      f"{r['same_as_ar']:.0%}"] for r in sec["rows"]])
    lines += [""] + _notes(sec) + [""]
  if "decode_7b" in data:
    sec = data["decode_7b"]
    rows = sec["rows"]
    lines += ["## Decoding a 7B shape at batch 1 vs the HBM roofline", "",
              f"{sec['model']} shape ({sec['shape']}), "
              f"{sec.get('params', 0) / 1e9:.2f}B params in {sec['runtime']['param_dtype']}, "
              f"cache {sec['cache_len']} slots; best of {sec['repeats']} runs of "
              f"{sec['steps']} steps (`decoding.timing.step_seconds`). Bytes per forward: weights "
              "(an untied embedding table excluded) + the whole KV cache. tokens/s bound: "
              "W / step time (tau 0, every proposal accepted).", ""]
    lines += _table(["W", "ms/forward", "GB read/forward", "roofline ms", "roofline/measured",
                     "x AR forward", "tokens/s bound"],
                    [[str(r["window"]), f"{r['ms_per_forward']:.2f}",
                      f"{(r['param_bytes'] + r['kv_bytes']) / 1e9:.2f}",
                      _fmt(r["roofline_ms_per_forward"], ".2f"),
                      _fmt(r["roofline_fraction"], ".0%"), _fmt(r["x_ar_forward"], ".2f"),
                      f"{r['tokens_per_s_tau0_bound']:.1f}"] for r in rows])
    lines += [""] + _notes(sec) + [""]
  return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------


def parse_limits(text: str) -> dict[str, float]:
  limits = dict(DEFAULT_LIMITS)
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in SECTIONS or not value:
      raise SystemExit(f"--limits {item!r}: expected SECTION=SECONDS, SECTION in {SECTIONS}")
    limits[name] = float(value)
  return limits


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m mars_jax.bench device", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="directory for device.json and device.md")
  p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds)")
  p.add_argument("--sections", default=",".join(SECTIONS),
                 help=f"comma list of {', '.join(SECTIONS)}")
  p.add_argument("--limits", default="",
                 help="soft seconds per section, e.g. train=70,decode=80 (defaults: "
                 + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_LIMITS.items()) + ")")
  p.add_argument("--merge", action="store_true",
                 help="update these sections in an existing DIR/device.json")
  p.add_argument("--report", action="store_true",
                 help="measure nothing: re-render DIR/device.json (+ sections.tsv)")
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="the chip's dense bf16 TFLOP/s (default: DEVICE_PEAKS by device kind)")
  p.add_argument("--hbm-tbps", type=float, default=None,
                 help="the chip's HBM bandwidth in TB/s (default: DEVICE_PEAKS)")
  p.add_argument("--attention-impl", default="xla", choices=choices.values(AttentionImpl))
  p.add_argument("--remat", default="none", choices=choices.values(Remat),
                 help="train section only")
  p.add_argument("--batch-sizes", default="", help="decode section (default 1,4,16,64)")
  args = p.parse_args(argv)
  args.sections = [s for s in args.sections.split(",") if s]
  unknown = sorted(set(args.sections) - set(SECTIONS))
  if unknown:
    p.error(f"--sections: unknown {unknown}; expected some of {list(SECTIONS)}")
  args.limits = parse_limits(args.limits)
  return args


def machine_facts(args) -> dict[str, Any]:
  device = jax.devices()[0]
  return {"device_kind": device.device_kind, "platform": device.platform,
          "device_count": jax.device_count(), "jax": jax.__version__,
          "python": platform.python_version(), "smoke": args.smoke,
          "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "chip": chip_figures(device.device_kind, args.peak_tflops, args.hbm_tbps)}


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.report:  # the facts of the run that measured (the accelerator is not started)
    report = Report(args.out, None, merge=True)
    if "meta" not in report.data:
      report.data["meta"] = machine_facts(args)
    report.save()
    print(f"wrote {report.json_path} and {report.md_path}")
    return
  meta = machine_facts(args)
  device = jax.devices()[0]
  report = Report(args.out, meta, merge=args.merge)
  plan = SMOKE if args.smoke else FULL
  if args.batch_sizes:
    plan = dataclasses.replace(plan, batch_sizes=tuple(sample._ints(args.batch_sizes)))  # pylint: disable=protected-access
  print(f"device: {device.device_kind} ({device.platform}) x {jax.device_count()}; peak bf16 "
        f"{_fmt(meta['chip']['peak_bf16_tflops'], 'g')} TFLOP/s, HBM "
        f"{_fmt(meta['chip']['hbm_tbps'], 'g')} TB/s; sections {args.sections}", flush=True)
  for name in args.sections:
    RUNNERS[name](plan, args, meta["chip"], report, Budget(args.limits[name]))
  report.save()
  print(f"wrote {report.json_path} and {report.md_path}")


if __name__ == "__main__":
  main()
