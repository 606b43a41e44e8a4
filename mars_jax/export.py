"""`python -m mars_jax.export --checkpoint RUN_DIR[/STEP] --out HF_DIR [--dtype bfloat16]`.

Writes a training checkpoint (from any number of processes) as a Hugging Face
directory that `transformers.AutoModelForCausalLM` loads, with the run's tokenizer
(which knows `<|mask|>`; files transformers 5.x and 4.5x both read) and the source
checkpoint's generation_config.json when the run saved them. Permissions follow the
umask. RUN_DIR may be the top directory of a run in stages (configs/tiny.py's WORKDIR,
with WORKDIR/stage1 and WORKDIR/stage2): its last stage is exported, and named on stderr.

A MARS model's config.json gets `pard_token`, the `<|mask|>` id, where vLLM's parallel
drafting reads it, and the export prints the `vllm serve` command that serves the model
as its own drafter (mars_jax/checkpoints/vllm_recipe.py). --checkpoint may also be a
Hugging Face directory (an earlier export, say): it is written again to --out with
`pard_token` (and --dtype, when given), its tokenizer, generation config, task record,
export record and config keys kept; a directory that is not a MARS model is refused.

A LoRA run (`--config.lora.rank=R`) exports two ways:
  --merge     (the default) the adapters folded into the weights and the trained
              `<|mask|>` row written into the embedding: a plain model;
  --adapter   a PEFT adapter directory (adapter_config.json, adapter_model.safetensors,
              the mask row as PEFT's trainable token indices, the tokenizer) that
              `peft.PeftModel.from_pretrained(base, OUT)` loads over the HF model the
              run started from (mars_jax/training/peft_adapter.py); a run that started from
              another run needs that one exported as the base.

--out must be new or empty, or an earlier export by mars_jax with --overwrite; it
may not be inside the run or the model the run started from (its `model.init`), nor
contain either. A failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os

import jax.numpy as jnp

from mars_jax.core import cli
from mars_jax.checkpoints import hf
from mars_jax.checkpoints import vllm_recipe
from mars_jax.decoding import loading
from mars_jax.checkpoints import runs
from mars_jax.checkpoints import peft as peft_adapter
from mars_jax.data import synthetic


def _within(path: str, root: str) -> bool:
  return os.path.commonpath([path, root]) == root


def check_out(out: str, run_dir: str, source: str | None = None, *,
              what: str = "the run being exported") -> None:
  """Raises `hf.ExportTargetError` when `out` is, is inside, or contains the run (or the
  directory, `what`) or the model it started from (`source`, when it is a local path)."""
  o, r = os.path.realpath(out), os.path.realpath(run_dir)
  suggestion = os.path.join(os.path.dirname(r), os.path.basename(r) + "-hf")
  protected = [(what, r)]
  if source and source != "random":
    protected.append(("the model the run started from", os.path.realpath(source)))
  for what, path in protected:
    if _within(o, path):
      where = "is" if o == path else "is inside"
    elif _within(path, o):
      where = "contains"
    else:
      continue
    raise hf.ExportTargetError(
        f"--out {out} {where} {what} ({path}); pass a directory outside the run and its "
        f"source model, e.g. --out {suggestion}.")



def export(checkpoint_path: str, out: str, *, dtype: str | None = None,
           max_shard_size: str = "5GB", progress: bool = True,
           overwrite: bool = False, adapter: bool = False) -> str:
  """Exports RUN_DIR (latest step) or RUN_DIR/STEP to `out`; returns `out`. A LoRA run
  exports merged, or with `adapter` as a PEFT adapter directory.

  Raises `hf.ExportTargetError` before loading anything when `out` is not a
  directory an export may go to (see `check_out`, `hf.check_export_target`), and
  ValueError when `adapter` is asked of a run without adapters."""
  run_dir, step = runs.resolve_checkpoint(checkpoint_path)
  layout = runs.read_layout(run_dir)
  check_out(out, run_dir, layout.get("init"))
  hf.check_export_target(os.path.realpath(out), overwrite=overwrite)
  if adapter and runs.config_from_layout(layout)[1].lora is None:
    raise ValueError(f"{run_dir}: --adapter needs a LoRA run (train with "
                     "--config.lora.rank=R); this run fine-tuned every weight, export it "
                     "without --adapter.")
  config, runtime, params = runs.load_params(checkpoint_path,
                                                   merge_adapters=not adapter)
  tok_dir = runs.tokenizer_dir(run_dir)
  tokenizer = None
  if os.path.isdir(tok_dir):
    tokenizer, _ = hf.load_tokenizer(tok_dir, config.vocab_size)
  source = {"run_dir": run_dir, "step": step, "objective": layout.get("objective", {})}
  if adapter:
    init = layout.get("init")
    peft_adapter.save_adapter(config, params, runtime.lora, out, tokenizer=tokenizer,
                              base_model=None if init == "random" else init, dtype=dtype,
                              overwrite=overwrite, source=source)
    return out
  hf.save_pretrained(config, params, out, tokenizer=tokenizer, dtype=dtype,
                     max_shard_size=max_shard_size, progress=progress, overwrite=overwrite,
                     generation_config=hf.read_generation_config(tok_dir), source=source,
                     pard_token=hf.pard_token_of(layout.get("objective"), tokenizer))
  task = synthetic.load_task_settings(run_dir)
  if task is not None:   # after the weights (save_pretrained replaces `out`), for evaluate
    synthetic.save_task_settings(out, task)
  return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def export_hf(model_dir: str, out: str, *, dtype: str | None = None,
              max_shard_size: str = "5GB", progress: bool = True,
              overwrite: bool = False) -> str:
  """Writes the MARS model in the Hugging Face directory `model_dir` again to `out`, with
  `pard_token` in its config.json (`hf.pard_token_of`), in `dtype` (default: its
  config's). Its tokenizer, generation config, task record, the export record's source
  and the config's other keys are kept. Returns `out`.

  Raises `hf.ExportTargetError` as `export` does, and ValueError, before reading any
  weight, when the model is not MARS (nothing to prepare for vLLM's parallel drafting)."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  check_out(out, model_dir, what="the model being exported")
  hf.check_export_target(os.path.realpath(out), overwrite=overwrite)
  with open(os.path.join(model_dir, "config.json")) as f:
    stored = json.load(f)
  record = (hf.read_export_marker(model_dir) or {}).get("source") or {}
  tokenizer = (AutoTokenizer.from_pretrained(model_dir) if any(
      os.path.isfile(os.path.join(model_dir, n)) for n in TOKENIZER_FILES) else None)
  pard = hf.pard_token_of(record.get("objective"), tokenizer)
  if pard is None:
    why = ("it has no tokenizer" if tokenizer is None else
           f"its tokenizer has no {hf.MASK_TOKEN}"
           if hf.MASK_TOKEN not in tokenizer.get_vocab() else
           f"its export record names the {record['objective'].get('kind')!r} objective")
    raise ValueError(f"{model_dir}: not a MARS model ({why}), so there is no mask id for "
                     "vLLM's parallel drafting; vLLM serves it as it is.")
  dtype = dtype or stored.get("dtype") or stored.get("torch_dtype") or "float32"
  if dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"{model_dir}/config.json: dtype {dtype!r}; pass --dtype float32, "
                     "bfloat16 or float16.")
  config, params = hf.load_pretrained(model_dir, dtype=jnp.dtype(dtype))
  hf.save_pretrained(config, params, out, tokenizer=tokenizer, dtype=dtype,
                     max_shard_size=max_shard_size, progress=progress, overwrite=overwrite,
                     generation_config=hf.read_generation_config(model_dir),
                     source={**record, "hf_dir": os.path.realpath(model_dir)},
                     pard_token=pard, keep_config=stored)
  task = synthetic.load_task_settings(model_dir)
  if task is not None:
    synthetic.save_task_settings(out, task)
  return out


def vllm_note(out: str) -> str:
  """`vllm_recipe.note` for the export at `out` (its config.json and export record)."""
  return vllm_recipe.note(out, vllm_recipe.read_pard_token(out),
                          loading.trained_block_size(out))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True,
                 help="RUN_DIR (latest step), RUN_DIR/STEP, the top of a run in stages "
                      "(its last stage), or a Hugging Face directory (written again with "
                      "pard_token)")
  p.add_argument("--out", required=True, help="output Hugging Face directory")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                 help="storage dtype of the exported weights (default: the run's)")
  p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
  p.add_argument("--overwrite", action="store_true",
                 help="replace --out (the whole directory) when it holds an earlier "
                      "export by mars_jax; a directory without its mars_jax_export.json "
                      "is never replaced")
  how = p.add_mutually_exclusive_group()
  how.add_argument("--merge", action="store_true",
                   help="a LoRA run: fold the adapters and the mask row into the weights "
                        "(the default)")
  how.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write a PEFT adapter directory instead of a model")
  args = p.parse_args(argv)
  with cli.one_line_errors():
    source = loading.model_path(args.checkpoint)
    if os.path.isfile(os.path.join(source, "config.json")):
      if args.adapter or args.merge:
        raise ValueError(f"{source} is a Hugging Face directory; --merge and --adapter are "
                         "for LoRA runs: drop them.")
      out = export_hf(source, args.out, dtype=args.dtype,
                      max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    else:
      out = export(source, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   overwrite=args.overwrite, adapter=args.adapter)
  print(f"exported {source} -> {out}")
  if not args.adapter:
    print(vllm_note(out))


if __name__ == "__main__":
  main()
