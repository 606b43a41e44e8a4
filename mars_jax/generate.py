"""`python -m mars_jax.generate`: AR or MARS decoding from the command line, greedy or
sampled.

  python -m mars_jax.generate --model HF_DIR --prompt "What is 2+3?"
  python -m mars_jax.generate --model RUN_DIR[/STEP] --prompts prompts.jsonl \\
      --window 5 --tau 0.95 --metric margin
  python -m mars_jax.generate --model HF_DIR --prompt "..." --temperature 0.7 --top-p 0.9 \\
      --seed 1 --stop "Question:"
  python -m mars_jax.generate --model HF_DIR --prompt "..." --mesh tensor=8
  python -m mars_jax.generate --model TARGET --drafter DRAFT --draft-window 4 --prompt "..."

--model is a Hugging Face directory (config.json + safetensors + tokenizer) or a
training run directory (latest checkpoint, or RUN_DIR/STEP; the top of a run in stages
reads its last stage). Prompts get the tokenizer's chat template as one user turn
(--system adds a system turn; --raw feeds the text as is). A JSONL line is
{"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}; a trailing
assistant turn is dropped, so chat data files work as prompt files.

--drafter DRAFT decodes with a second model that shares the target's tokenizer (AR or
MARS, any size): each round it drafts up to --draft-window K tokens and the target
verifies them in one forward (mars_jax.decoding.speculative). The output is the target's
AR output, greedy or sampled with the same seed. A MARS drafter (a run trained with
MARS, or --drafter-window > 1) drafts several tokens a forward while --tau holds; a
target --window W > 1 adds W - 1 MASK slots to its forward, whose proposals under the
gate start the next round's drafts.

Each prompt prints as a `=== [i] N tokens, F forwards, X tokens/forward, finish: R`
line (R: eos, stop or length; with a drafter, F counts the target's forwards and the
drafter's follow) and its text (special tokens skipped, cut before the first --stop
string); a `---` line sums up the run.
"""

from __future__ import annotations

import argparse
import time

from mars_jax import sampling
from mars_jax.core import choices, cli
from mars_jax.core.choices import Mode
from mars_jax.decoding import gates, mesh as decode_mesh
from mars_jax.decoding.loading import (load_drafter, load_model, model_path,
                                       warn_untrained_windows)
from mars_jax.decoding.prompts import (add_sampling_flags, budgets, check_sampling_flags,
                                       encode, prompt_seeds, read_prompts)
from mars_jax.models.qwen2 import Runtime


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mars_jax.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True,
                 help="HF directory, RUN_DIR[/STEP], or the top of a run in stages")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="one prompt (a user turn)")
  src.add_argument("--prompts", help="JSONL file of prompts")
  p.add_argument("--system", help="system turn put before every --prompt")
  p.add_argument("--raw", action="store_true", help="no chat template: feed the text as is")
  p.add_argument("--tau", type=float, default=1.0, help="gate threshold (1.0: exact AR)")
  p.add_argument("--window", default="1",
                 help="proposals per forward W, 1 <= W <= block size + 1 (1: AR), or 'auto' "
                      "(load-aware choice, mars_jax.decoding.window_policy)")
  p.add_argument("--mode", choices=choices.values(Mode), default="gated",
                 help="gated: MASK proposals committed under the gate; lossless: drafts "
                      "verified by the next forward, output equal to greedy AR")
  p.add_argument("--metric", choices=gates.METRICS, default="probability")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="tokens to generate per prompt (default: as many as fit the context, "
                      "max_position_embeddings - prompt length)")
  add_sampling_flags(p, "--seed", "sampling seed: prompt i of the file gets seed + i, so "
                     "repeated prompts sample differently; the same seed gives the same text")
  p.add_argument("--stop", action="append", default=None, metavar="STRING",
                 help="a stop string (repeatable): a sample ends at the token that "
                      "completes one, and its text is cut before it")
  p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="weights and compute dtype (default: float32 for an HF directory, "
                      "the run's own for a training run)")
  p.add_argument("--mesh", default=None,
                 help="decode on a mesh of the devices: AXIS=SIZE pairs over data, fsdp, "
                      "tensor (e.g. tensor=8 or data=2,tensor=4; see docs/serving.md); "
                      "default: one device")
  p.add_argument("--drafter", default=None,
                 help="a drafter model (HF directory or run) with the target's tokenizer: "
                      "two-model decoding, the target's AR output")
  p.add_argument("--draft-window", type=int, default=4,
                 help="with --drafter: tokens drafted per round, K")
  p.add_argument("--drafter-window", type=int, default=None,
                 help="with --drafter: its tokens per forward (1: AR drafting; default: a "
                      "MARS run's B + 1, at most K, else 1)")
  args = p.parse_args(argv)
  with cli.one_line_errors():  # bad input: one line, status 2
    run(args)


def run(args) -> None:
  """The command on parsed arguments (see `main`)."""
  window = args.window if args.window == "auto" else int(args.window)
  check_sampling_flags(args.temperature, args.top_k, args.top_p, args.seed)
  gates.check_tau(args.tau, args.metric, "--tau")
  args.model = model_path(args.model)
  runtime = args.dtype and Runtime(param_dtype=args.dtype, dtype=args.dtype)
  model = load_model(args.model, runtime=runtime, mesh=decode_mesh.mesh_from_flag(args.mesh))
  if window != "auto":
    warn_untrained_windows(args.model, [window])
  drafter = None
  if args.drafter is not None:
    if window == "auto":
      raise ValueError("--window auto is not available with --drafter; give the target's "
                       "window (1: an AR target).")
    drafter = load_drafter(args.drafter, model, args.model, draft_window=args.draft_window,
                           window=args.drafter_window, runtime=runtime)
  config, params, tokenizer = model.config, model.params, model.tokenizer
  if args.prompt is not None:
    chats = [([{"role": "system", "content": args.system}] if args.system else [])
             + [{"role": "user", "content": args.prompt}]]
  else:
    chats = read_prompts(args.prompts)
  prompts = encode(tokenizer, chats, raw=args.raw)
  budget = budgets(config.max_position_embeddings, prompts, args.max_new_tokens)
  seeds = prompt_seeds(args.seed, len(prompts))
  tokens = forwards = drafter_forwards = 0
  start = time.perf_counter()
  for b in range(0, len(prompts), args.batch_size):
    rows = slice(b, b + args.batch_size)
    out = sampling.generate(config, params, prompts[rows], max_new_tokens=budget[rows],
                            mask_token_id=model.mask_token_id,
                            eos_token_ids=model.eos_token_ids, tau=args.tau,
                            window=window, mode=args.mode, metric=args.metric,
                            temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=seeds[rows], stop=args.stop,
                            tokenizer=tokenizer, runtime=model.runtime, mesh=model.mesh,
                            drafter=drafter, draft_window=args.draft_window)
    for i, (toks, fwd) in enumerate(zip(out.tokens, out.num_forwards)):
      drafted = (f", {out.drafter_forwards[i]} drafter forwards" if drafter else "")
      print(f"=== [{b + i}] {len(toks)} tokens, {fwd} forwards, "
            f"{len(toks) / fwd:.2f} tokens/forward{drafted}, finish: {out.finish_reasons[i]}")
      print(out.texts[i])
    tokens += sum(out.num_tokens)
    forwards += sum(out.num_forwards)
    drafter_forwards += sum(out.drafter_forwards)
  seconds = time.perf_counter() - start
  drafted = (f"{drafter_forwards / max(tokens, 1):.3f} drafter forwards/token "
             f"(drafter {args.drafter}, K={args.draft_window}, drafter window "
             f"{drafter.window}); " if drafter else "")
  print(f"--- {len(prompts)} prompts, {tokens} tokens, {tokens / max(forwards, 1):.3f} "
        f"tokens/forward, {drafted}{tokens / seconds:.1f} tokens/s (compilation included); "
        f"window={args.window} mode={args.mode} tau={args.tau} metric={args.metric} "
        f"temperature={args.temperature} top_k={args.top_k} top_p={args.top_p} "
        f"seed={args.seed}")


if __name__ == "__main__":
  main()
