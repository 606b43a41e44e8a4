"""`python -m mars_jax.export --checkpoint RUN_DIR[/STEP] --out HF_DIR [--dtype bfloat16]`.

Writes a training checkpoint (from any number of processes) as a Hugging Face
directory that `transformers.AutoModelForCausalLM` loads, with the run's tokenizer
(which knows `<|mask|>`; files transformers 5.x and 4.5x both read) and the source
checkpoint's generation_config.json when the run saved them. Permissions follow the
umask. RUN_DIR may be the top directory of a run in stages (configs/tiny.py's WORKDIR,
with WORKDIR/stage1 and WORKDIR/stage2): its last stage is exported, and named on stderr.

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
import os

from mars_jax.core import cli
from mars_jax.checkpoints import hf
from mars_jax.decoding import loading
from mars_jax.checkpoints import runs
from mars_jax.checkpoints import peft as peft_adapter
from mars_jax.data import synthetic


def _within(path: str, root: str) -> bool:
  return os.path.commonpath([path, root]) == root


def check_out(out: str, run_dir: str, source: str | None = None) -> None:
  """Raises `hf.ExportTargetError` when `out` is, is inside, or contains the run or the
  model it started from (`source`, when it is a local path)."""
  o, r = os.path.realpath(out), os.path.realpath(run_dir)
  suggestion = os.path.join(os.path.dirname(r), os.path.basename(r) + "-hf")
  protected = [("the run being exported", r)]
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
                     generation_config=hf.read_generation_config(tok_dir), source=source)
  task = synthetic.load_task_settings(run_dir)
  if task is not None:   # after the weights (save_pretrained replaces `out`), for evaluate
    synthetic.save_task_settings(out, task)
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True,
                 help="RUN_DIR (latest step), RUN_DIR/STEP, or the top of a run in stages "
                      "(its last stage)")
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
    out = export(source, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                 overwrite=args.overwrite, adapter=args.adapter)
  print(f"exported {source} -> {out}")


if __name__ == "__main__":
  main()
