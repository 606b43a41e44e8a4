"""`python -m mars_jax.evaluate`: exact-match accuracy and tokens per forward.

Greedy decoding through `mars_jax.decoding.sampler` on GSM8K-format problems (the
synthetic test split, or a local JSONL of {"question", "answer"} with `#### N`),
for every (gate, window, tau) asked; prints a table and writes JSON and a Pareto
plot (accuracy vs tokens per forward). --temperature > 0 (with --top-k, --top-p,
--sample-seed) samples instead: problem i gets the seed sample_seed + i at every
setting, so a run is reproducible.

  python -m mars_jax.evaluate --model RUN_DIR_OR_HF_DIR --task synthetic \
      --taus 1.0,0.95,0.9 --windows 1,4,5 --metrics probability,margin --out eval/

The synthetic task is drawn with the model's own data settings: the `task.json` that
training writes into its run directory and into the HF export (difficulty, split
seed, test fraction, and num_test as the default --num-problems), so a model is
scored on held-out problems of the distribution it trained on. --difficulty, --seed
and --test-fraction override single settings; with no record the generator defaults
are used, with a notice. The settings used and their origin are printed.
"""

from __future__ import annotations

import argparse

from mars_jax.core import cli
from mars_jax.data import synthetic
from mars_jax.decoding.prompts import add_sampling_flags
from mars_jax.evaluation.evaluate import run


def _positive_int(s: str) -> int:
  try:
    n = int(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
  if n < 1:
    raise argparse.ArgumentTypeError(f"{n}: must be >= 1 (omit the flag for the default)")
  return n


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.evaluate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True,
                 help="HF directory, RUN_DIR, RUN_DIR/STEP, or the top of a run in stages")
  p.add_argument("--task", default="synthetic", help="'synthetic' or a GSM8K-format JSONL")
  p.add_argument("--num-problems", type=_positive_int, default=None,
                 help="default: synthetic, the run's recorded data.synthetic.num_test "
                 "(else 500); a JSONL, 500")
  p.add_argument("--difficulty", choices=synthetic.DIFFICULTIES, default=None,
                 help="synthetic: override the run's recorded difficulty")
  p.add_argument("--seed", type=int, default=None,
                 help="synthetic: override the run's recorded split seed")
  p.add_argument("--test-fraction", type=float, default=None,
                 help="synthetic: override the run's recorded test fraction")
  p.add_argument("--taus", default="1.0,0.95,0.9,0.8,0.7")
  p.add_argument("--windows", default="1,4,5", help="proposals per forward (1 = AR)")
  p.add_argument("--metrics", default="probability,margin",
                 help="gates: probability, margin, entropy")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="tokens to generate per problem (default: as many as fit the context; "
                      "decoding ends at EOS)")
  add_sampling_flags(p, "--sample-seed", "sampling seed: problem i gets sample_seed + i, at "
                     "every setting (--seed is the synthetic split's)")
  p.add_argument("--out", default=None, help="directory for results.json and pareto.png")
  p.add_argument("--mesh", default=None,
                 help="decode on a mesh of the devices: AXIS=SIZE pairs over data, fsdp, "
                      "tensor (e.g. tensor=8 or data=2,tensor=4; see docs/serving.md); "
                      "default: one device")
  args = p.parse_args(argv)
  with cli.one_line_errors():  # bad input: one line, status 2
    run(args)


if __name__ == "__main__":
  main()
