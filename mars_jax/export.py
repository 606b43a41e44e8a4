"""`python -m mars_jax.export --checkpoint RUN_DIR[/STEP] --out HF_DIR [--dtype bfloat16]`.

Writes a training checkpoint (from any number of processes) as a Hugging Face
directory that `transformers.AutoModelForCausalLM` loads, with the run's tokenizer
(which knows `<|mask|>`; files transformers 5.x and 4.5x both read) and the source
checkpoint's generation_config.json when the run saved them. Permissions follow the
umask.

--out must be new or empty, or an earlier export by mars_jax with --overwrite; it
may not be inside the run or the model the run started from (its `model.init`), nor
contain either. A failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
import sys

from mars_jax import checkpoint, hf
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
           overwrite: bool = False) -> str:
  """Exports RUN_DIR (latest step) or RUN_DIR/STEP to `out`; returns `out`.

  Raises `hf.ExportTargetError` before loading anything when `out` is not a
  directory an export may go to (see `check_out`, `hf.check_export_target`)."""
  run_dir, step = checkpoint.resolve_checkpoint(checkpoint_path)
  layout = checkpoint.read_layout(run_dir)
  check_out(out, run_dir, layout.get("init"))
  hf.check_export_target(os.path.realpath(out), overwrite=overwrite)
  config, _, params = checkpoint.load_params(checkpoint_path)
  tok_dir = checkpoint.tokenizer_dir(run_dir)
  tokenizer = None
  if os.path.isdir(tok_dir):
    tokenizer, _ = hf.load_tokenizer(tok_dir, config.vocab_size)
  hf.save_pretrained(config, params, out, tokenizer=tokenizer, dtype=dtype,
                     max_shard_size=max_shard_size, progress=progress, overwrite=overwrite,
                     generation_config=hf.read_generation_config(tok_dir),
                     source={"run_dir": run_dir, "step": step,
                             "objective": layout.get("objective", {})})
  task = synthetic.load_task_settings(run_dir)
  if task is not None:   # after the weights (save_pretrained replaces `out`), for evaluate
    synthetic.save_task_settings(out, task)
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="RUN_DIR (latest step) or RUN_DIR/STEP")
  p.add_argument("--out", required=True, help="output Hugging Face directory")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                 help="storage dtype of the exported weights (default: the run's)")
  p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
  p.add_argument("--overwrite", action="store_true",
                 help="replace --out (the whole directory) when it holds an earlier "
                      "export by mars_jax; a directory without its mars_jax_export.json "
                      "is never replaced")
  args = p.parse_args(argv)
  try:
    out = export(args.checkpoint, args.out, dtype=args.dtype,
                 max_shard_size=args.max_shard_size, overwrite=args.overwrite)
  except hf.ExportTargetError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
  main()
