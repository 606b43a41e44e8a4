"""`python -m mars_jax.export --checkpoint RUN_DIR[/STEP] --out HF_DIR [--dtype bfloat16]`.

Writes a training checkpoint (from any number of processes) as a Hugging Face
directory that `transformers.AutoModelForCausalLM` loads, with the run's tokenizer
(which knows `<|mask|>`) when the run saved one.
"""

from __future__ import annotations

import argparse
import os

from mars_jax import checkpoint, hf


def export(checkpoint_path: str, out: str, *, dtype: str | None = None,
           max_shard_size: str = "5GB", progress: bool = True) -> str:
  """Exports RUN_DIR (latest step) or RUN_DIR/STEP to `out`; returns `out`."""
  config, params = checkpoint.load_params(checkpoint_path)
  run_dir, _ = checkpoint.resolve_checkpoint(checkpoint_path)
  tok_dir = checkpoint.tokenizer_dir(run_dir)
  tokenizer = None
  if os.path.isdir(tok_dir):
    tokenizer, _ = hf.load_tokenizer(tok_dir, config.vocab_size)
  hf.save_pretrained(config, params, out, tokenizer=tokenizer, dtype=dtype,
                     max_shard_size=max_shard_size, progress=progress)
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="RUN_DIR (latest step) or RUN_DIR/STEP")
  p.add_argument("--out", required=True, help="output Hugging Face directory")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                 help="storage dtype of the exported weights (default: the run's)")
  p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
  args = p.parse_args(argv)
  out = export(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
  print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
  main()
