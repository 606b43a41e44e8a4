"""`python -m mars_jax.lm_eval`: lm-evaluation-harness with the `mars_jax` backend.

  python -m mars_jax.lm_eval --model mars_jax \
      --model_args pretrained=DIR,window=4,tau=0.9,metric=probability,mode=gated \
      --batch_size 16 --tasks gsm8k --apply_chat_template --output_path out/

is lm-eval's own CLI (every flag of `lm_eval run`) with the backend,
mars_jax.evaluation.lm_eval (its model_args and requests), imported: that registers the
model class `MarsJaxLM` as `mars_jax`. The wrapper also sets HF_HUB_OFFLINE,
HF_DATASETS_OFFLINE and HF_EVALUATE_OFFLINE to 1 unless they are set, so nothing is
looked up on the Hub (docs/lm_eval.md).

`python -m mars_jax.lm_eval synthetic-tasks --out DIR --model MODEL` writes local
tasks (JSONL data + task YAML) from the synthetic test split the model was trained
next to: `synthetic_arith` (generate_until, exact match on the `#### N` number) and
`synthetic_arith_mc` (multiple choice among the answer and three wrong final numbers).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before anything imports huggingface_hub or datasets
  for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from typing import Sequence  # noqa: E402

from mars_jax.data import synthetic  # noqa: E402
from mars_jax.evaluation import evaluate  # noqa: E402
from mars_jax.evaluation.lm_eval import MODEL_NAME, write_tasks  # noqa: E402  (registers the model)


def synthetic_tasks_main(argv: Sequence[str]) -> None:
  """`python -m mars_jax.lm_eval synthetic-tasks ...`."""
  p = argparse.ArgumentParser(
      prog="python -m mars_jax.lm_eval synthetic-tasks",
      description="Local lm-eval tasks (JSONL + YAML) from the synthetic test split, drawn "
      "with the model's recorded data settings (task.json) as `mars_jax.evaluate` does.")
  p.add_argument("--out", required=True, help="directory for the JSONL and YAML files")
  p.add_argument("--model", default=None, help="HF directory or run whose task.json to use")
  p.add_argument("--num", type=int, default=None, help="problems (default: the record's "
                 "num_test, else 500)")
  p.add_argument("--name", default="synthetic_arith", help="task name (and NAME_mc)")
  p.add_argument("--max-gen-toks", type=int, default=64)
  p.add_argument("--difficulty", choices=synthetic.DIFFICULTIES, default=None)
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--test-fraction", type=float, default=None)
  args = p.parse_args(list(argv))
  settings, origins, notices = evaluate.synthetic_settings(
      args.model, seed=args.seed, test_fraction=args.test_fraction,
      difficulty=args.difficulty)
  for line in notices:
    print(line)
  num = args.num or settings["num_test"] or 500
  problems = evaluate.load_problems("synthetic", num, **{
      k: settings[k] for k in synthetic.SPLIT_DEFAULTS})
  paths = write_tasks(args.out, problems, name=args.name, max_gen_toks=args.max_gen_toks)
  print(f"synthetic test split, {num} problems:\n"
        + evaluate.describe_settings(settings, origins))
  print("wrote " + ", ".join(paths.values()))
  print(f"run: python -m mars_jax.lm_eval --model {MODEL_NAME} --model_args "
        f"pretrained={args.model or 'MODEL'},window=4,tau=0.9 --include_path "
        f"{os.path.abspath(args.out)} --tasks {','.join(paths)} --apply_chat_template")


def main(argv: Sequence[str] | None = None) -> None:
  """lm-eval's CLI with the mars_jax model registered and tokens per forward reported;
  `synthetic-tasks` writes local tasks (see the module docstring)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["synthetic-tasks"]:
    synthetic_tasks_main(argv[1:])
    return
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(var, "1")
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  saved = sys.argv
  sys.argv = ["lm_eval", *argv]
  try:
    cli_evaluate()
  finally:
    sys.argv = saved


if __name__ == "__main__":
  main()
