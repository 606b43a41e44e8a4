"""lm-evaluation-harness backend: the model class `MarsJaxLM`, registered as `mars_jax`
when this module is imported, with tau and window; tokens per forward in the harness's
results; local tasks from the synthetic test split (`write_tasks`).

lm-eval 0.4.13 finds no model outside its own package: a process must import this
module (from Python, `import mars_jax.evaluation.lm_eval` then
`lm_eval.simple_evaluate(model="mars_jax", ...)`). The CLI is mars_jax/lm_eval.py
(`python -m mars_jax.lm_eval`, docs/lm_eval.md). Not the evaluate CLI's exact-match
sweeps: those are mars_jax.evaluation.evaluate.

Requests:
  generate_until          `mars_jax.decoding.sampler.generate` (AR, MARS at tau, or lossless),
                          batched; greedy, or sampled when the request asks
                          (`do_sample`, `temperature`, `top_k`, `top_p`); decoding ends
                          at an EOS, at an `until` string (the text is cut before it)
                          or after `max_gen_toks` tokens.
  loglikelihood(_rolling) one uncached forward (`qwen2.forward_hidden`, then the
                          unembedding of the scored positions only) per right-padded
                          batch, with explicit lengths, positions and a causal mask.

model_args: pretrained (an HF directory, a run directory or RUN_DIR/STEP), window
(int >= 1 or "auto"), tau, metric (probability | margin | entropy), mode (gated |
lossless), batch_size, dtype (float32 | bfloat16 | float16: weights and compute),
attention_impl, max_length (default: the model's max_position_embeddings),
max_gen_toks (default budget when a task sets none: 256), mesh (decode on a mesh
of the devices, AXIS=SIZE pairs joined by "+" since commas separate model_args:
mesh=data=2+tensor=4, or mesh=tensor=8; see docs/serving.md), seed (sampling: the
i-th request of a generate_until call samples with seed + i; default 0), drafter (a
second model with the same tokenizer: generate_until decodes with it drafting up to
draft_window tokens a round, default 4, and gives the target's AR output; window is
then the target's, 1 for an AR target), drafter_window (default: a MARS run's B + 1,
at most draft_window, else 1).

Tokens per forward: generated tokens (up to the EOS or the token that completed a
stop string, included; nothing decoded past it) / forwards of the samples,
accumulated per task over the generate_until requests, and added to each task's
results as the metric `tokens_per_forward` (in the printed table and the results
JSON; groups get the token-weighted value of their tasks). `MarsJaxLM.get_model_info`
puts the raw counts under results["config"]["mars_jax"] for Python callers as well,
and `add_tokens_per_forward(results)` copies them into the tasks' metrics.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  (the harness's own models first: see `_register`)
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from mars_jax.decoding import sampler as sampling
from mars_jax.training import masks, objective
from mars_jax.decoding import gates
from mars_jax.core.choices import Metric, Mode
from mars_jax.decoding import batching
from mars_jax.decoding import mesh as decode_mesh
from mars_jax.decoding.prompts import check_seed, prompt_seeds
from mars_jax.decoding.loading import load_drafter, load_model, warn_untrained_windows
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import DEFAULT_RUNTIME, Qwen2Config, Runtime

log = logging.getLogger(__name__)

MODEL_NAME = "mars_jax"
METRIC = "tokens_per_forward"
MIN_LENGTH_BUCKET = 16
CE_CHUNK = 256


def sampling_kwargs(gen_kwargs: dict) -> dict:
  """A request's normalized generation kwargs -> `sampling.generate`'s temperature, top_k
  and top_p. do_sample false (or temperature 0) is greedy; do_sample true samples at
  `temperature` (1.0 when the request gives none, as transformers does), within
  `top_k` (0 or none: off) and `top_p` (1.0 or none: off). Other kwargs are ignored."""
  if not gen_kwargs.get("do_sample"):
    return {"temperature": 0.0}
  temperature, top_k, top_p = (gen_kwargs.get(k) for k in ("temperature", "top_k", "top_p"))
  return {"temperature": 1.0 if temperature is None else float(temperature),
          "top_k": int(top_k or 0), "top_p": 1.0 if top_p is None else float(top_p)}


@functools.partial(jax.jit, static_argnames=("config", "runtime", "span"))
def _score(params, tokens, targets, lengths, *, config: Qwen2Config, runtime: Runtime,
           span: int):
  """Log-probabilities of `targets` at the last `span` positions before each row's length.

  tokens, targets: int32[b, t] right-padded (targets[i, p] = the token after
  tokens[i, p]); lengths: int32[b] >= 1, the real tokens of each row: a query attends
  keys k <= q with k < length, whatever the padding ids are.
  -> (logprob float32[b, span], greedy bool[b, span]) for positions
  length-span .. length-1 (clipped at 0; the caller reads the last n of them).
  """
  b, t = tokens.shape
  key_real = jnp.arange(t)[None, :] < lengths[:, None]
  mask = masks.causal_mask(t)[None] & key_real[:, None, :]
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden = qwen2.forward_hidden(config, params, tokens, positions, mask, runtime=runtime)
  idx = jnp.clip(lengths[:, None] - span + jnp.arange(span)[None], 0, t - 1)
  picked = jnp.take_along_axis(hidden, idx[..., None], axis=1)
  labels = jnp.take_along_axis(targets, idx, axis=1)
  ce, greedy = objective.token_cross_entropy(config, params, picked, labels,
                                             chunk_size=CE_CHUNK, runtime=runtime)
  return -ce, greedy


class MarsJaxLM(TemplateLM):
  """lm-eval model over a mars_jax checkpoint (see the module docstring)."""

  def __init__(self, pretrained: str, window: int | str = 4, tau: float = 0.9,
               metric: Metric = "probability", mode: Mode = "gated", batch_size: int | str = 8,
               dtype: str | None = None, attention_impl: str | None = None,
               max_length: int | None = None, max_gen_toks: int = 256,
               mesh: str | None = None, seed: int = 0, device: str | None = None,
               max_batch_size: int | None = None, drafter: str | None = None,
               draft_window: int = 4, drafter_window: int | None = None) -> None:
    super().__init__()
    del device, max_batch_size  # JAX places the model; batches are fixed-size
    if isinstance(batch_size, str) and not batch_size.isdigit():
      raise ValueError(f"batch_size={batch_size!r}: mars_jax needs an integer batch size "
                       "(no 'auto').")
    self._batch_size = int(batch_size)
    if self._batch_size < 1:
      raise ValueError(f"batch_size={batch_size}; must be >= 1.")
    self.window = window if window == "auto" else int(window)
    self.tau = float(tau)
    self.metric = str(metric)
    self.mode = str(mode)
    gates.metric_ids(self.metric, 1)
    runtime = None
    if dtype is not None or attention_impl is not None:
      runtime = DEFAULT_RUNTIME.replace(
          **({"param_dtype": str(dtype), "dtype": str(dtype)} if dtype is not None else {}),
          **({"attention_impl": str(attention_impl)} if attention_impl is not None else {}))
    self.pretrained = str(pretrained)
    mesh = decode_mesh.mesh_from_flag(mesh and str(mesh).replace("+", ","))
    self.model = load_model(self.pretrained, runtime=runtime, mesh=mesh)
    batching.check_args(self.model.config,
                        window=4 if self.window == "auto" else self.window, mode=self.mode,
                        mask_token_id=self.model.mask_token_id)
    if self.window != "auto":
      warn_untrained_windows(self.pretrained, [self.window])
    self.drafter = None
    self.draft_window = int(draft_window)
    if drafter is not None:
      if self.window == "auto":
        raise ValueError("window=auto is not available with a drafter; give the target's "
                         "window (1: an AR target).")
      self.drafter = load_drafter(str(drafter), self.model, self.pretrained,
                                  draft_window=self.draft_window,
                                  window=None if drafter_window is None else int(drafter_window),
                                  runtime=runtime)
    self.drafter_path = drafter and str(drafter)
    self.tokenizer = self.model.tokenizer
    self._max_length = int(max_length or self.model.config.max_position_embeddings)
    self._max_gen_toks = int(max_gen_toks)
    self.seed = check_seed(int(seed))
    self.stats: dict[str, dict[str, int]] = {}

  # -- construction from the harness's model_args ---------------------------------------

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                          additional_config: dict[str, Any] | None = None) -> "MarsJaxLM":
    """model_args win over the CLI's `--batch_size` (whose default 1 is always passed)."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
    for k in set(extra) & set(arg_dict):
      if extra[k] != arg_dict[k]:
        log.info("model_args %s=%s overrides the harness's %s=%s", k, arg_dict[k], k, extra[k])
    return cls(**{**extra, **arg_dict})

  @classmethod
  def create_from_arg_string(cls, arg_string: str,
                             additional_config: dict[str, Any] | None = None) -> "MarsJaxLM":
    from lm_eval.utils import simple_parse_args_string  # pylint: disable=import-outside-toplevel
    return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

  # -- what TemplateLM asks for ---------------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_token_id

  @property
  def prefix_token_id(self) -> int:
    """Conditions an empty context: BOS when the tokenizer has one (Qwen's have none), else EOS."""
    bos = self.tokenizer.bos_token_id
    return bos if bos is not None else self.eot_token_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def tokenizer_name(self) -> str:
    return self.tokenizer.name_or_path.replace("/", "__")

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs) -> list[int]:
    """Token ids of `string`, no special tokens added unless asked (Qwen's tokenizers add
    none anyway; special-token text in `string`, e.g. a chat template's, is parsed)."""
    return list(self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)))

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The chat in the tokenizer's template (the string the harness then tokenizes)."""
    import jinja2  # pylint: disable=import-outside-toplevel

    def render(history):
      return self.tokenizer.apply_chat_template(
          history, tokenize=False, add_generation_prompt=add_generation_prompt,
          continue_final_message=not add_generation_prompt)
    try:
      return render(chat_history)
    except jinja2.exceptions.TemplateError:
      log.warning("the chat template failed; retrying without the system turn.")
      return render([m for m in chat_history if m["role"] != "system"])

  def get_model_info(self) -> dict:
    """Merged into results["config"] by `simple_evaluate`: the decoding settings and,
    per task, the generated tokens and forwards of its generate_until requests."""
    return {MODEL_NAME: {
        "pretrained": self.pretrained, "window": self.window, "tau": self.tau,
        "metric": self.metric, "mode": self.mode, "seed": self.seed,
        "drafter": self.drafter_path, "draft_window": self.draft_window,
        "drafter_window": self.drafter and self.drafter.window,
        "runtime": self.model.runtime.to_dict(),
        "max_length": self.max_length,
        "tasks": {task: {**s, METRIC: s["generated_tokens"] / max(s["forwards"], 1),
                         **({"drafter_forwards_per_token": s["drafter_forwards"]
                             / max(s["generated_tokens"], 1)} if self.drafter else {})}
                  for task, s in self.stats.items()}}}

  # -- generate_until -------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Decoding through the MARS sampler, batched per generation settings: greedy or
    sampled (`sampling_kwargs`; the i-th request with the seed self.seed + i), ending
    at an EOS, an `until` string or `max_gen_toks`; -> the texts, cut before the stop."""
    out: list[str | None] = [None] * len(requests)
    seeds = prompt_seeds(self.seed, len(requests))
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    bar = tqdm(total=len(requests), desc="generate_until (mars_jax)", disable=disable_tqdm)
    for members in groups.values():
      kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
      until = [s for s in kwargs["until"] if s]
      budget = int(kwargs["max_gen_toks"])
      sample = sampling_kwargs(kwargs)
      max_ctx = self.max_length - budget
      if max_ctx < 1:
        raise ValueError(f"max_gen_toks {budget} leaves no room for a prompt in max_length "
                         f"{self.max_length}.")
      prompts = {i: self.tok_encode(requests[i].args[0]) for i in members}
      long = [i for i in members if len(prompts[i]) > max_ctx]
      if long:
        log.warning("%d of %d prompts (up to %d tokens) left-truncated to %d tokens "
                    "(max_length %d - max_gen_toks %d).", len(long), len(members),
                    max(len(prompts[i]) for i in long), max_ctx, self.max_length, budget)
        for i in long:
          prompts[i] = prompts[i][-max_ctx:]
      order = sorted(members, key=lambda i: -len(prompts[i]))
      for start in range(0, len(order), self.batch_size):
        batch = order[start:start + self.batch_size]
        res = sampling.generate(
            self.model.config, self.model.params, [prompts[i] for i in batch],
            max_new_tokens=budget, mask_token_id=self.model.mask_token_id,
            eos_token_ids=self.model.eos_token_ids, tau=self.tau, window=self.window,
            metric=self.metric, mode=self.mode, seed=[seeds[i] for i in batch],
            stop=until, tokenizer=self.tokenizer, runtime=self.model.runtime,
            mesh=self.model.mesh, drafter=self.drafter, draft_window=self.draft_window,
            **sample)
        drafted = res.drafter_forwards or [0] * len(batch)
        for i, text, toks, fwd, dfwd in zip(batch, res.texts, res.tokens, res.num_forwards,
                                            drafted):
          out[i] = text
          s = self.stats.setdefault(requests[i].task_name or "", {
              "generated_tokens": 0, "forwards": 0, "requests": 0,
              **({"drafter_forwards": 0} if self.drafter else {})})
          s["generated_tokens"] += len(toks)
          s["forwards"] += int(fwd)
          if self.drafter:
            s["drafter_forwards"] += int(dfwd)
          s["requests"] += 1
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.update(len(batch))
    bar.close()
    return out  # type: ignore[return-value]

  # -- loglikelihood --------------------------------------------------------------------

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                            **kwargs) -> list[tuple[float, bool]]:
    """requests: ((context, continuation), context_ids, continuation_ids) ->
    (sum of the continuation's log-probabilities, whether greedy decoding gives it)."""
    rows = []
    for _, ctx, cont in requests:
      if not ctx or not cont:
        raise ValueError("loglikelihood needs a non-empty context and continuation.")
      if len(cont) > self.max_length:
        raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length "
                         f"{self.max_length}.")
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
      rows.append((whole[:-1], whole[1:], len(cont)))
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    bar = tqdm(total=len(rows), desc="loglikelihood (mars_jax)", disable=disable_tqdm)
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      b = batching.pow2(len(batch))
      t = batching.pow2(max(len(rows[i][0]) for i in batch), MIN_LENGTH_BUCKET)
      span = min(batching.pow2(max(rows[i][2] for i in batch)), t)
      tokens = np.zeros((b, t), np.int32)
      targets = np.zeros((b, t), np.int32)
      lengths = np.ones((b,), np.int32)  # padding rows: one (ignored) token
      for r, i in enumerate(batch):
        inp, tgt, _ = rows[i]
        tokens[r, :len(inp)] = inp
        targets[r, :len(tgt)] = tgt
        lengths[r] = len(inp)
      logprob, greedy = jax.device_get(_score(
          self.model.params, tokens, targets, lengths, config=self.model.config,
          runtime=self.model.runtime, span=span))
      for r, i in enumerate(batch):
        n = rows[i][2]
        out[i] = (float(np.sum(logprob[r, span - n:], dtype=np.float64)),
                  bool(np.all(greedy[r, span - n:])))
        if requests[i][0] is not None:
          self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
      bar.update(len(batch))
    bar.close()
    return out  # type: ignore[return-value]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log-likelihood of each whole string, in disjoint windows of max_length tokens
    (each conditioned on the token before it; the first on `prefix_token_id`)."""
    windows, owner = [], []
    for k, req in enumerate(requests):
      for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
          token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((None, ctx, cont))
        owner.append(k)
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    totals = [0.0] * len(requests)
    for k, (lp, _) in zip(owner, scores):
      totals[k] += lp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals


def _register() -> None:
  """Registers `MarsJaxLM` as `mars_jax` once (importing mars_jax.lm_eval, the CLI, runs
  this module once too; a reload keeps the first class). lm_eval.models is imported first:
  lm-eval only fills its registry with its own models while the registry is empty."""
  if MODEL_NAME not in model_registry:
    register_model(MODEL_NAME)(MarsJaxLM)


# -- tokens per forward in the harness's results ----------------------------------------


def _leaves(group: str, subtasks: dict[str, list[str]], seen: set[str]) -> list[str]:
  out = []
  for name in subtasks.get(group, []):
    if name in seen:
      continue
    seen.add(name)
    out += _leaves(name, subtasks, seen) if name in subtasks else [name]
  return out


def add_tokens_per_forward(results: dict | None) -> dict | None:
  """Adds `tokens_per_forward` (filter "none") to every task of `results` that decoded
  with mars_jax, and the token-weighted value to each group holding such tasks."""
  if not results:
    return results
  tasks = results.get("config", {}).get(MODEL_NAME, {}).get("tasks", {})
  key = f"{METRIC},none"

  def put(name, value):
    for section in ("results", "groups"):
      if name in results.get(section, {}):
        results[section][name][key] = value
    results.setdefault("higher_is_better", {}).setdefault(name, {})[METRIC] = True

  for name, s in tasks.items():
    if s["forwards"]:
      put(name, s[METRIC])
  subtasks = results.get("group_subtasks", {})
  for group in subtasks:
    members = [tasks[t] for t in _leaves(group, subtasks, set()) if t in tasks]
    forwards = sum(s["forwards"] for s in members)
    if forwards:
      put(group, sum(s["generated_tokens"] for s in members) / forwards)
  return results


def _patch_simple_evaluate() -> None:
  """Makes `lm_eval.simple_evaluate` (what the CLI calls, looked up at call time) add
  tokens per forward: `add_tokens_per_forward` on its results, which changes nothing
  for a run that did not decode with mars_jax. (`from lm_eval.evaluator import
  simple_evaluate` done before this module was imported keeps the original.)"""
  import lm_eval  # pylint: disable=import-outside-toplevel
  import lm_eval.evaluator  # pylint: disable=import-outside-toplevel
  original = lm_eval.evaluator.simple_evaluate
  if getattr(original, "_mars_jax", False):
    return

  @functools.wraps(original)
  def simple_evaluate(*args, **kwargs):
    return add_tokens_per_forward(original(*args, **kwargs))

  simple_evaluate._mars_jax = True  # type: ignore[attr-defined]
  lm_eval.evaluator.simple_evaluate = simple_evaluate
  lm_eval.simple_evaluate = simple_evaluate


_register()
_patch_simple_evaluate()


# -- local tasks from the synthetic test split --------------------------------------------


def _final_number(answer: str) -> int:
  return int(answer.rsplit("####", 1)[1].strip().replace(",", ""))


def multiple_choice_records(problems: Sequence[dict]) -> list[dict]:
  """{question, choices, label}: the answer and three copies with a wrong final number
  (+1, -1, +10), in an order that depends on the problem's index."""
  out = []
  for k, p in enumerate(problems):
    head, _ = p["answer"].rsplit("####", 1)
    n = _final_number(p["answer"])
    wrong = [f"{head}#### {n + d}" for d in (1, -1, 10)]
    label = k % 4
    choices = wrong[:label] + [p["answer"]] + wrong[label:]
    out.append({"question": p["question"], "choices": choices, "label": label})
  return out


def task_configs(name: str, gen_data: str, mc_data: str, *, max_gen_toks: int = 64
                 ) -> dict[str, dict]:
  """The two task configs (as the YAML files hold them) over local JSONL files."""
  gen = {
      "task": name, "dataset_path": "json",
      "dataset_kwargs": {"data_files": {"test": gen_data}},
      "output_type": "generate_until", "test_split": "test", "num_fewshot": 0,
      "doc_to_text": "{{question}}",
      "doc_to_target": "{{answer.split('####')[-1].strip()}}",
      "generation_kwargs": {"until": ["Question:", "</s>", "<|im_end|>"],
                            "max_gen_toks": max_gen_toks,
                            "do_sample": False, "temperature": 0.0},
      "filter_list": [{"name": "final-number", "filter": [
          {"function": "regex", "regex_pattern": r"#### (\-?[0-9\.\,]+)",
           "group_select": -1},
          {"function": "take_first"}]}],
      "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                       "higher_is_better": True, "regexes_to_ignore": [","]}],
      "metadata": {"version": 1.0},
  }
  mc = {
      "task": f"{name}_mc", "dataset_path": "json",
      "dataset_kwargs": {"data_files": {"test": mc_data}},
      "output_type": "multiple_choice", "test_split": "test", "num_fewshot": 0,
      "doc_to_text": "{{question}}", "doc_to_choice": "choices", "doc_to_target": "label",
      "target_delimiter": "",
      "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                      {"metric": "acc_norm", "aggregation": "mean",
                       "higher_is_better": True}],
      "metadata": {"version": 1.0},
  }
  return {name: gen, f"{name}_mc": mc}


def write_tasks(out_dir: str, problems: Sequence[dict], *, name: str = "synthetic_arith",
                max_gen_toks: int = 64) -> dict[str, str]:
  """Writes `{name}.jsonl` (GSM8K format), `{name}_mc.jsonl` and the two task YAMLs
  (absolute data paths) to `out_dir`; -> {task name: YAML path}. Run them with
  `--include_path out_dir --tasks {name},{name}_mc`."""
  import yaml  # pylint: disable=import-outside-toplevel
  out_dir = os.path.abspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  gen_data = os.path.join(out_dir, f"{name}.jsonl")
  mc_data = os.path.join(out_dir, f"{name}_mc.jsonl")
  for path, records in ((gen_data, [{"question": p["question"], "answer": p["answer"]}
                                    for p in problems]),
                        (mc_data, multiple_choice_records(problems))):
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
  paths = {}
  for task, cfg in task_configs(name, gen_data, mc_data, max_gen_toks=max_gen_toks).items():
    paths[task] = os.path.join(out_dir, f"{task}.yaml")
    with open(paths[task], "w") as f:
      yaml.safe_dump(cfg, f, sort_keys=False, allow_unicode=True)
  return paths
