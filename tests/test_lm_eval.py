"""The lm-evaluation-harness backend (`mars_jax.lm_eval`) on a tiny checkpoint with a real
BPE ChatML tokenizer (tests/user_path_fixtures.py), local JSONL tasks, no network.

Generation through the harness: lossless MARS gives AR's responses sample for sample;
an `until` string, EOS and `max_gen_toks` end decoding; `do_sample` samples, the same
text for the same seeds.  Log-likelihoods (multiple
choice through the harness, plain and rolling directly) equal transformers' float32
computation on the same weights within 1e-4. The CLI wrapper prints and saves tokens
per forward with the task's metrics.
"""

import dataclasses
import functools
import glob
import json
import os

import pytest

import user_path_fixtures as fx

import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mars_jax import lm_eval as lm_eval_cli
from mars_jax.evaluation import lm_eval as mle
from mars_jax.decoding.loading import chat_prompt_ids

GEN, MC = "synthetic_arith", "synthetic_arith_mc"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lm_eval")
  train = fx.task_records(120, seed=0)
  test = fx.task_records(5, seed=0, split="test")
  hf = fx.make_qwen2_checkpoint(tmp / "hf", texts=fx.task_texts(train))
  mle.write_tasks(str(tmp / "tasks"), test, max_gen_toks=12)
  return {"hf": hf, "tasks": str(tmp / "tasks"), "tmp": tmp, "test": test}


def _evaluate(env, tasks, **model_args):
  manager = TaskManager(include_path=env["tasks"], include_defaults=False)
  return lm_eval.simple_evaluate(
      model="mars_jax", model_args={"pretrained": env["hf"], "batch_size": 8, **model_args},
      tasks=tasks, task_manager=manager, apply_chat_template=True, log_samples=True)


def _responses(results, task):
  return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def _instance(kind, args, task="t"):
  return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=(task, 0, 1))


@pytest.fixture(scope="module")
def lm(env):
  return mle.MarsJaxLM(pretrained=env["hf"], window=1, batch_size=8)


@pytest.fixture(scope="module")
def torch_model(env):
  import transformers
  return transformers.Qwen2ForCausalLM.from_pretrained(env["hf"],
                                                       dtype="float32").eval()


def _torch_loglikelihood(model, ctx, cont):
  """sum log p(cont | ctx) and whether greedy decoding gives cont, in float32 torch."""
  import torch
  ids = torch.tensor([list(ctx) + list(cont)])
  with torch.no_grad():
    logp = torch.log_softmax(model(ids).logits[0].double(), -1)
  pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
  target = torch.tensor(cont)
  return float(logp[pos, target].sum()), bool((logp[pos].argmax(-1) == target).all())


@pytest.mark.e2e  # generation through the harness
def test_lossless_responses_equal_ar_through_the_harness(env):
  ar = _evaluate(env, [GEN], window=1)
  lossless = _evaluate(env, [GEN], window=4, mode="lossless")
  assert _responses(lossless, GEN) == _responses(ar, GEN)
  assert len(_responses(ar, GEN)) == 5
  for res in (ar, lossless):  # reported with the task's metrics, AR exactly 1
    assert "exact_match,final-number" in res["results"][GEN]
    stats = res["config"]["mars_jax"]["tasks"][GEN]
    assert stats["requests"] == 5
    assert res["results"][GEN]["tokens_per_forward,none"] == stats["tokens_per_forward"]
  assert ar["results"][GEN]["tokens_per_forward,none"] == 1.0
  assert lossless["results"][GEN]["tokens_per_forward,none"] >= 1.0


def test_chat_template_tokens_are_the_samplers_prompt(lm):
  chat = [{"role": "user", "content": "Ann has 3 cups, gets 4. How many now?"}]
  assert lm.tok_encode(lm.apply_chat_template(chat)) == chat_prompt_ids(lm.tokenizer, chat)
  assert lm.tokenizer_name and lm.chat_template(True)


def _contexts(lm, env):
  return [lm.apply_chat_template([{"role": "user", "content": p["question"]}])
          for p in env["test"]]


def _generate(lm, ctxs, gen_kwargs):
  lm.stats.clear()
  return lm.generate_until([_instance("generate_until", (c, dict(gen_kwargs))) for c in ctxs],
                           disable_tqdm=True)


def _before(tokens, ids):
  """`tokens` before the first of `ids`."""
  return next((tokens[:k] for k, t in enumerate(tokens) if t in ids), tokens)


@pytest.mark.e2e  # generation through the harness
def test_a_drafter_gives_the_targets_responses_through_the_harness(env):
  """model_args drafter= (another random model over the same tokenizer) and
  draft_window=3: the AR responses, with the drafter's forwards counted."""
  drafter = fx.make_qwen2_checkpoint(env["tmp"] / "drafter", hidden=16, layers=1, seed=1,
                                     spare_rows=12,  # other embedding rows, same tokenizer
                                     texts=fx.task_texts(fx.task_records(120, seed=0)))
  ar = _evaluate(env, [GEN], window=1)
  two = _evaluate(env, [GEN], window=1, drafter=drafter, draft_window=3)
  assert _responses(two, GEN) == _responses(ar, GEN)
  stats = two["config"]["mars_jax"]["tasks"][GEN]
  assert stats["drafter_forwards"] > 0 and stats["requests"] == 5
  assert stats["drafter_forwards_per_token"] == stats["drafter_forwards"] / stats[
      "generated_tokens"]
  assert two["config"]["mars_jax"]["drafter"] == drafter


@pytest.mark.e2e  # generation through the harness
def test_until_eos_and_max_gen_toks(env, lm):
  """The task's prompts, so the sampler runs at the AR harness run's shapes (compiled)."""
  ctxs = _contexts(lm, env)
  res = mle.sampling.generate(lm.model.config, lm.model.params,
                              [lm.tok_encode(c) for c in ctxs], max_new_tokens=12,
                              mask_token_id=lm.model.mask_token_id,
                              eos_token_ids=lm.model.eos_token_ids)
  free = _generate(lm, ctxs, {"max_gen_toks": 12})
  assert lm.stats["t"] == {"generated_tokens": 60, "forwards": 60, "requests": 5}
  assert len(free[0]) >= 4
  stop = free[0][2:4]
  cut = _generate(lm, ctxs, {"until": [stop, "zzz"], "max_gen_toks": 12})
  assert cut[0] == free[0][:free[0].index(stop)] != free[0]
  assert not any(stop in c for c in cut)
  assert cut[1:] == [f[:f.index(stop)] if stop in f else f for f in free[1:]]
  # Decoding ended at the token that completed the stop: only the tokens up to it count.
  kept = [next((k for k in range(1, len(t) + 1)
                if stop in lm.tokenizer.decode(t[:k], skip_special_tokens=True)), len(t))
          for t in res.tokens]
  assert sum(kept) < 60
  assert lm.stats["t"] == {"generated_tokens": sum(kept), "forwards": sum(kept),
                           "requests": 5}
  # An EOS id that is prompt 0's first generated token: its decoding ends there.
  eos = res.tokens[0][0]
  saved = lm.model
  lm.model = dataclasses.replace(saved, eos_token_ids=(eos,))
  try:
    out = _generate(lm, ctxs, {"max_gen_toks": 12})
  finally:
    lm.model = saved
  kept = [_before(t, [eos]) for t in res.tokens]
  assert out == [lm.tokenizer.decode(k, skip_special_tokens=True) for k in kept]
  assert out[0] == "" and kept[0] == []
  assert lm.stats["t"]["generated_tokens"] == sum(min(len(k) + 1, 12) for k in kept)


def test_do_sample_is_reproducible_per_request_and_seed(env, lm):
  """Sampled requests: the same texts on a second call, different ones for a repeated
  context (its own seed) and for another `seed=` in model_args; top_k=1 and
  do_sample=False are greedy; no temperature samples at 1.0."""
  ctxs = _contexts(lm, env) + _contexts(lm, env)[:1]   # request 5 repeats request 0
  greedy = _generate(lm, ctxs, {"max_gen_toks": 12})
  hot = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 12}
  sampled = _generate(lm, ctxs, hot)
  assert _generate(lm, ctxs, hot) == sampled
  assert sampled != greedy and sampled[5] != sampled[0] and greedy[5] == greedy[0]
  assert _generate(lm, ctxs, {"do_sample": True, "max_gen_toks": 12}) == sampled
  assert _generate(lm, ctxs, {**hot, "top_k": 1}) == greedy
  assert _generate(lm, ctxs, {**hot, "do_sample": False}) == greedy
  other = mle.MarsJaxLM.create_from_arg_string(
      f"pretrained={env['hf']},window=1,batch_size=8,seed=7")
  assert other.get_model_info()["mars_jax"]["seed"] == 7
  reseeded = _generate(other, ctxs, hot)
  assert reseeded != sampled and reseeded == _generate(other, ctxs, hot)


def test_multiple_choice_loglikelihoods_equal_transformers(env, torch_model):
  res = _evaluate(env, [MC], window=4, tau=0.9, batch_size=4)
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(env["hf"])
  checked = 0
  for sample in res["samples"][MC]:
    for k, (got,) in enumerate(sample["resps"]):
      context, continuation = sample["arguments"][k]
      # The harness's split: trailing whitespace of the context (the chat template's
      # last "\n") goes with the continuation, the pair is encoded whole and split after
      # the context's tokens.
      context, continuation = context.rstrip(), context[len(context.rstrip()):] + continuation
      ctx = tok.encode(context, add_special_tokens=False)
      whole = tok.encode(context + continuation, add_special_tokens=False)
      want = _torch_loglikelihood(torch_model, ctx, whole[len(ctx):])
      assert abs(float(got[0]) - want[0]) < 1e-4, (got, want)
      assert bool(got[1]) == want[1]
      checked += 1
  assert checked == 5 * 4
  assert 0.0 <= res["results"][MC]["acc,none"] <= 1.0
  assert "tokens_per_forward,none" not in res["results"][MC]  # nothing was generated


def test_loglikelihood_padding_pad_ids_and_rolling_equal_transformers(lm, torch_model):
  pad = fx.PAD_TOKEN  # token id 0: real text here, never padding
  reqs = [("Ann has 3 cups", " and 4 pens"), (f"{pad}{pad} Bob", f" {pad} gets 7"),
          ("", "Cal buys 2 books"), ("Dan has 12 apples, sells 5, then", " buys 3 more.")]
  got = lm.loglikelihood([_instance("loglikelihood", r) for r in reqs])
  for (ctx, cont), (lp, greedy) in zip(reqs, got):
    if ctx:
      c = lm.tok_encode(ctx)
      t = lm.tok_encode(ctx + cont)[len(c):]
    else:
      c, t = [lm.prefix_token_id], lm.tok_encode(cont)
    assert (0 in c and 0 in t) == (pad in ctx)
    want = _torch_loglikelihood(torch_model, c, t)
    assert abs(lp - want[0]) < 1e-4 and greedy == want[1]

  text = "Eve has 9 shells, gets 4, gives away 2. How many now? Got: 9+4=13"
  ids = lm.tok_encode(text)
  want = _torch_loglikelihood(torch_model, [lm.prefix_token_id], ids)[0]
  saved = lm._max_length
  try:
    for max_length in (saved, 8):  # one window, then disjoint windows of 8 tokens
      lm._max_length = max_length
      [rolled] = lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))])
      if max_length == saved:
        assert abs(rolled - want) < 1e-4
      else:
        ref = sum(_torch_loglikelihood(torch_model, c, t)[0] for c, t in map(
            make_disjoint_window, get_rolling_token_windows(
                token_list=ids, prefix_token=lm.prefix_token_id, max_seq_len=8,
                context_len=1)))
        assert len(ids) > 16 and abs(rolled - ref) < 1e-4
  finally:
    lm._max_length = saved


@pytest.mark.e2e  # generation through the harness
def test_cli_prints_and_saves_tokens_per_forward(env, capsys, monkeypatch):
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    monkeypatch.delenv(var, raising=False)
  # lm-eval's CLI indexes its ~15k built-in tasks first (7 s); these are local only.
  monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                      functools.partial(TaskManager, include_defaults=False))
  out = env["tmp"] / "out"
  lm_eval_cli.main(["--model", "mars_jax", "--model_args",
                    f"pretrained={env['hf']},window=4,tau=0.9,metric=probability,mode=gated,"
                    "batch_size=2", "--include_path", env["tasks"], "--tasks", GEN,
                    "--apply_chat_template", "--limit", "2", "--output_path", str(out)])
  assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
  printed = capsys.readouterr().out
  row = next(line for line in printed.splitlines() if "tokens_per_forward" in line)
  [path] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
  with open(path) as f:
    saved = json.load(f)
  value = saved["results"][GEN]["tokens_per_forward,none"]
  assert value >= 1.0 and float(row.split("|")[7]) == pytest.approx(value, abs=1e-4)
  assert saved["config"]["mars_jax"]["window"] == 4
  assert saved["config"]["mars_jax"]["tasks"][GEN]["requests"] == 2


def test_sampling_kwargs_of_normalized_requests():
  def of(gen_kwargs):
    return mle.sampling_kwargs(normalize_gen_kwargs(gen_kwargs))
  assert of({}) == of({"temperature": 0.0}) == {"temperature": 0.0}
  assert of({"do_sample": False, "temperature": 0.7, "top_k": 5}) == {"temperature": 0.0}
  assert of({"do_sample": True}) == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
  assert of({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "seed": 1}) == {
      "temperature": 0.6, "top_k": 20, "top_p": 0.9}


def test_shipped_example_tasks_load_offline(monkeypatch):
  """mars_jax/evaluation/lm_eval_tasks: both YAMLs load their JSONL (paths relative to the repo
  root), targets are the `#### N` numbers, and the right choice is the answer."""
  from mars_jax.data import synthetic
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(root)
  manager = TaskManager(
      include_path=os.path.join(root, "mars_jax", "evaluation", "lm_eval_tasks"),
      include_defaults=False)
  tasks = manager.load([GEN, MC])["tasks"]
  gen, mc = list(tasks[GEN].test_docs()), list(tasks[MC].test_docs())
  assert len(gen) == len(mc) == 100
  for g, m in zip(gen, mc):
    assert str(tasks[GEN].doc_to_target(g)) == synthetic.extract_answer(g["answer"])
    assert m["choices"][tasks[MC].doc_to_target(m)] == g["answer"]
    assert m["question"] == g["question"] and len(set(m["choices"])) == 4
