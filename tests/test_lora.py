"""LoRA (`--config.lora.rank=R`): the adapted forward, the frozen base, the merged and PEFT
exports against transformers and peft, resume after kill -9, two processes equal one, and
a LoRA run loaded by generate and evaluate."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen_tokenizers as qt
import user_path_fixtures as fx
from test_multiprocess import train_2proc
from test_train import assert_bitwise, kill_after_a_checkpoint, losses, params_of, train
from test_user_path import ROOT, cli

from mars_jax.checkpoints import hf
from mars_jax.parallel import sharding
from mars_jax.training import objective
from mars_jax.checkpoints import runs
from mars_jax.models import lora
from mars_jax.checkpoints import peft as peft_adapter
from mars_jax.training import step as ts
from mars_jax.models import qwen2
from mars_jax.models.config import LoraSpec
from mars_jax.training.optimizer import OptimizerConfig, make_optimizer

# Tight numerical comparisons: .ci/run runs them again at XLA's default optimisation level.
pytestmark = pytest.mark.parity

TINY = qwen2.preset("qwen2.5-0.5b", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MASK = 60
LORA = ["--config.lora.rank=4", "--config.lora.alpha=8.0", "--config.lora.dropout=0.1"]


def _inputs(batch=2, t=9, vocab=64):
  tokens = jax.random.randint(jax.random.key(2), (batch, t), 0, vocab).at[:, 3].set(MASK)
  positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
  return tokens, positions, jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def _perturbed(params, scale=0.05):
  """Every adapter and the mask row moved off their init (B = 0 would hide a B bug)."""
  trainable, frozen = lora.partition(params)
  leaves, tree = jax.tree.flatten(trainable)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  moved = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return lora.combine(jax.tree.unflatten(tree, moved), frozen)


@pytest.mark.parametrize("scan", [True, False])
def test_adapters_start_at_the_base_and_merge_into_it(scan):
  base_rt = qwen2.Runtime(scan_layers=scan)
  rt = base_rt.replace(lora=LoraSpec(rank=4, alpha=8.0, mask_token_id=MASK))
  base = qwen2.init_params(TINY, jax.random.key(0), runtime=base_rt)
  adapted = lora.add_adapters(TINY, base, rt, jax.random.key(1))
  x = _inputs()
  ref = qwen2.forward(TINY, base, *x, runtime=base_rt)
  np.testing.assert_allclose(qwen2.forward(TINY, adapted, *x, runtime=rt), ref, atol=1e-6)
  adapted = _perturbed(adapted)
  ours = qwen2.forward(TINY, adapted, *x, runtime=rt)
  assert float(jnp.abs(ours - ref).max()) > 0.1
  merged = qwen2.forward(TINY, lora.merge(adapted, rt.lora), *x, runtime=base_rt)
  np.testing.assert_allclose(merged, ours, atol=1e-5)
  # 7 projections x 2 layers, A and B each, plus the mask row
  assert len(jax.tree.leaves(lora.partition(adapted)[0])) == 7 * 2 * (1 if scan else 2) + 1


def test_targets_pick_projections_and_the_mask_row_can_stay_frozen():
  rt = qwen2.Runtime(lora=LoraSpec(rank=2, alpha=2.0, targets="attn/(q|v)_kernel"))
  params = qwen2.abstract_params(TINY, runtime=rt)
  names = sorted("/".join(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(
      lora.partition(params)[0]))
  assert names == ["layers/attn/q_lora_a", "layers/attn/q_lora_b", "layers/attn/v_lora_a",
                   "layers/attn/v_lora_b"]
  assert "mask_embedding" not in params
  with pytest.raises(ValueError, match="matches none of"):
    LoraSpec(rank=2, alpha=2.0, targets="attention")
  with pytest.raises(ValueError, match="lora.rank=0"):
    LoraSpec(rank=0, alpha=2.0)


def test_adapters_shard_with_their_base_weights():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1))
  rt = qwen2.Runtime(lora=LoraSpec(rank=4, alpha=8.0, mask_token_id=MASK))
  axes = qwen2.logical_axes(TINY, runtime=rt)
  assert tuple(axes["layers"]["attn"]["q_lora_a"]) == ("layers", "embed", "lora_rank")
  assert tuple(axes["layers"]["attn"]["q_lora_b"]) == ("layers", "lora_rank", "heads",
                                                        "head_dim")
  assert tuple(axes["layers"]["mlp"]["down_lora_a"]) == ("layers", "mlp", "lora_rank")
  assert tuple(axes["mask_embedding"]) == ("embed",)
  rules = dict(sharding.LOGICAL_AXIS_RULES)
  assert rules["lora_rank"] is None
  assert jax.tree.structure(sharding.param_shardings(TINY, mesh, runtime=rt)) == \
      jax.tree.structure(qwen2.abstract_params(TINY, runtime=rt))


def _batch(rows=4, length=16):
  tokens = jax.random.randint(jax.random.key(3), (rows, length), 4, 50)
  return {"tokens": tokens, "loss_mask": jnp.arange(length)[None].repeat(rows, 0) >= 5}


def _step_setup(spec, micro_batches=1, seed=0):
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1))
  rt = qwen2.Runtime(lora=spec)
  tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, total_steps=10, warmup_ratio=0.0))
  obj = objective.ObjectiveConfig(kind="mars", block_size=4, mask_token_id=MASK,
                                  chunk_size=None, attention_chunk=None)
  base = qwen2.init_params(TINY, jax.random.key(0))
  state = ts.init_train_state(TINY, tx, mesh, params=base, rng=jax.random.key(5), runtime=rt)
  step = ts.make_train_step(TINY, obj, tx, mesh, micro_batches=micro_batches, runtime=rt,
                            seed=seed)
  return base, state, step


def test_a_step_trains_the_adapters_and_the_mask_row_and_nothing_else():
  spec = LoraSpec(rank=4, alpha=8.0, mask_token_id=MASK)
  base, state, step = _step_setup(spec)
  trainable0 = jax.tree.map(np.asarray, lora.partition(state.params)[0])
  for _ in range(2):
    state, metrics = step(state, _batch())
  assert np.isfinite(float(metrics["loss"]))
  trainable, frozen = lora.partition(state.params)
  assert_bitwise(jax.tree.map(np.asarray, frozen), jax.tree.map(np.asarray, base))
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), trainable, trainable0)
  assert all(jax.tree.leaves(moved)), moved
  # AdamW's moments exist for the trainable leaves alone: 2 x their size, plus counters
  n_trainable = qwen2.num_params(trainable)
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  assert moments == 2 * n_trainable and n_trainable < qwen2.num_params(frozen) / 5


@pytest.mark.e2e   # time: the default suite's 12 minutes
def test_micro_batches_are_exact_and_dropout_is_seeded():
  """Gradients of the adapters alone; 2 micro-batches give those of 1, with dropout too;
  dropout draws from its key (the same key, the same loss)."""
  spec = LoraSpec(rank=4, alpha=8.0, dropout=0.3, mask_token_id=MASK)
  _, state, _ = _step_setup(spec)
  obj = objective.ObjectiveConfig(kind="mars", block_size=4, mask_token_id=MASK,
                                  chunk_size=None, attention_chunk=None)
  rt = qwen2.Runtime(lora=spec)

  @jax.jit
  def grads(params, batch, key):
    g1, s1 = ts.loss_and_grads(TINY, obj, params, batch, runtime=rt)
    g2, _ = ts.loss_and_grads(TINY, obj, params, batch, micro_batches=2, runtime=rt)
    d1, d = ts.loss_and_grads(TINY, obj, params, batch, runtime=rt, dropout_rng=key)
    d2, _ = ts.loss_and_grads(TINY, obj, params, batch, micro_batches=2, runtime=rt,
                              dropout_rng=key)
    return (g1, g2, d1, d2), s1["loss"], d["loss"]

  params = _perturbed(state.params)
  (g1, g2, d1, d2), plain, dropped = grads(params, _batch(), jax.random.key(0))
  assert jax.tree.structure(g1) == jax.tree.structure(lora.partition(params)[0])
  close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
  jax.tree.map(close, g1, g2)
  jax.tree.map(close, d1, d2)   # a row's dropout masks do not depend on its micro-batch
  _, _, again = grads(params, _batch(), jax.random.key(0))
  _, _, other = grads(params, _batch(), jax.random.key(1))
  assert float(dropped) == float(again)
  assert float(dropped) != float(plain) and float(dropped) != float(other)


# ---- exports against transformers and peft (in process) ------------------------------


@pytest.fixture(scope="module", params=[("qwen2.5", True), ("qwen2.5", False), ("qwen3", True)],
                ids=["qwen2.5-tied", "qwen2.5-untied", "qwen3"])
def adapted_checkpoint(request, tmp_path_factory):
  """A real-vocabulary checkpoint, our adapters over it (moved off their init), both
  exports and the ids of the real Qwen tokenizer's `<|mask|>`."""
  family, tie = request.param
  tmp = tmp_path_factory.mktemp("lora_" + family.replace(".", ""))
  hf_dir = qt.make_qwen_checkpoint(tmp / "base", family, tie=tie)
  config, base = hf.load_pretrained(hf_dir)
  tok, mask_id = hf.load_tokenizer(hf_dir, config.vocab_size)
  rt = qwen2.Runtime(lora=LoraSpec(rank=4, alpha=8.0, mask_token_id=mask_id))
  params = _perturbed(lora.add_adapters(config, base, rt, jax.random.key(1)), scale=0.2)
  peft_adapter.save_adapter(config, params, rt.lora, str(tmp / "adapter"), tokenizer=tok,
                            base_model=hf_dir)
  hf.save_pretrained(config, lora.merge(params, rt.lora), str(tmp / "merged"), tokenizer=tok)
  ids = tok("<|im_start|>user\nWhat is 12 + 7?<|im_end|>").input_ids + [mask_id, mask_id]
  return dict(config=config, params=params, runtime=rt, hf=hf_dir, tmp=tmp, ids=ids,
              mask_id=mask_id)


def _ours(c, ids):
  t = jnp.asarray([ids])
  n = len(ids)
  return np.asarray(qwen2.forward(c["config"], c["params"], t, jnp.arange(n)[None],
                                  jnp.tril(jnp.ones((1, n, n), bool)), runtime=c["runtime"]))[0]


def _torch_logits(model, ids):
  import torch
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].float().numpy()


def test_merged_export_gives_transformers_our_adapted_logits(adapted_checkpoint):
  import torch
  import transformers
  c = adapted_checkpoint
  model = transformers.AutoModelForCausalLM.from_pretrained(str(c["tmp"] / "merged"),
                                                            dtype=torch.float32)
  ours = _ours(c, c["ids"])
  np.testing.assert_allclose(_torch_logits(model, c["ids"]), ours, atol=1e-4, rtol=0)


def test_peft_loads_the_adapter_with_our_logits(adapted_checkpoint):
  import peft
  import torch
  import transformers
  c = adapted_checkpoint
  out = c["tmp"] / "adapter"
  with open(out / "adapter_config.json") as f:
    cfg = json.load(f)
  assert cfg["trainable_token_indices"] == {"embed_tokens": [c["mask_id"]]}
  assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and len(cfg["target_modules"]) == 7
  assert hf.read_export_marker(str(out))["kind"] == "peft_adapter"
  base = transformers.AutoModelForCausalLM.from_pretrained(c["hf"], dtype=torch.float32)
  ref = _torch_logits(base, c["ids"])
  model = peft.PeftModel.from_pretrained(base, str(out)).eval()
  got = _torch_logits(model, c["ids"])
  ours = _ours(c, c["ids"])
  assert np.abs(ours - ref).max() > 1e-2       # the adapters change the model
  np.testing.assert_allclose(got, ours, atol=1e-4, rtol=0)
  # the mask token's row: an input that is all mask tokens sees the trained row
  masks = [c["mask_id"]] * 3
  np.testing.assert_allclose(_torch_logits(model, masks), _ours(c, masks), atol=1e-4, rtol=0)


# ---- the CLI: train, export both ways, generate and evaluate on the run ----------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """The shipped MARS config with LoRA from a real-vocabulary checkpoint, then both exports."""
  tmp = tmp_path_factory.mktemp("lora_cli")
  train_records = fx.task_records(240, seed=0)
  p = {"hf": qt.make_qwen_checkpoint(tmp / "Qwen2.5-tiny", "qwen2.5"),
       "chat": fx.write_chat_jsonl(tmp / "chat.jsonl", train_records),
       "gsm8k": fx.write_gsm8k_jsonl(tmp / "test.jsonl", fx.task_records(4, seed=0,
                                                                         split="test")),
       "run": str(tmp / "runs" / "lora"), "merged": str(tmp / "merged"),
       "adapter": str(tmp / "adapter"), "tmp": tmp}
  p["train_log"] = cli("mars_jax.train", "--config", "configs/qwen2_5_0_5b_mars.py",
                       "--workdir", p["run"], f"--config.model.init={p['hf']}",
                       f"--config.data.source={p['chat']}", "--config.train.batch_size=8",
                       "--config.train.steps=3", "--config.data.max_length=96",
                       "--config.data.num_eval=8", "--config.optimizer.learning_rate=0.02",
                       "--config.optimizer.warmup_ratio=0.0", "--config.lora.rank=4",
                       "--config.lora.alpha=8.0", "--config.lora.dropout=0.05").stderr
  cli("mars_jax.export", "--checkpoint", p["run"], "--out", p["merged"], "--merge")
  cli("mars_jax.export", "--checkpoint", p["run"], "--out", p["adapter"], "--adapter")
  return p


@pytest.mark.e2e
def test_the_run_trains_adapters_and_exports_both_ways(lora_run):
  import peft
  import torch
  import transformers
  p = lora_run
  assert "LoRA rank 4 over .* and the mask row: training" in p["train_log"]
  with open(os.path.join(p["run"], "layout.json")) as f:
    spec = json.load(f)["runtime"]["lora"]
  assert spec["rank"] == 4 and spec["mask_token_id"] is not None
  config, rt, params = runs.load_params(p["run"], runtime=qwen2.Runtime(),
                                              merge_adapters=False)
  assert rt.lora == LoraSpec(**spec)
  _, base = hf.load_pretrained(p["hf"])
  assert not np.array_equal(np.asarray(params["mask_embedding"]),
                            np.asarray(base["embedding"][spec["mask_token_id"]]))
  assert float(jnp.abs(params["layers"]["attn"]["q_lora_b"]).max()) > 0
  tok = transformers.AutoTokenizer.from_pretrained(p["adapter"])
  ids = tok("<|im_start|>user\nWhat is 3 + 4?<|im_end|>").input_ids + [spec["mask_token_id"]]
  n = len(ids)
  ours = np.asarray(qwen2.forward(config, params, jnp.asarray([ids]), jnp.arange(n)[None],
                                  jnp.tril(jnp.ones((1, n, n), bool)), runtime=rt))[0]
  merged = transformers.AutoModelForCausalLM.from_pretrained(p["merged"], dtype=torch.float32)
  np.testing.assert_allclose(_torch_logits(merged, ids), ours, atol=1e-4, rtol=0)
  base_model = transformers.AutoModelForCausalLM.from_pretrained(p["hf"], dtype=torch.float32)
  adapted = peft.PeftModel.from_pretrained(base_model, p["adapter"]).eval()
  np.testing.assert_allclose(_torch_logits(adapted, ids), ours, atol=1e-4, rtol=0)


@pytest.mark.e2e
def test_generate_and_evaluate_load_the_run_as_its_merged_export(lora_run):
  p = lora_run
  args = ["--prompt", "What is 3 + 4?", "--max-new-tokens", "12", "--tau", "0.9",
          "--window", "4"]
  # each prompt's header (tokens, forwards) and text; the summary line has the timing
  answer = lambda out: [l for l in out.splitlines() if not l.startswith("--- ")]
  on_run = answer(cli("mars_jax.generate", "--model", p["run"], *args).stdout)
  on_export = answer(cli("mars_jax.generate", "--model", p["merged"], *args).stdout)
  assert on_run[0].startswith("=== [0] 12 tokens") and on_run == on_export
  out = cli("mars_jax.evaluate", "--model", p["run"], "--task", p["gsm8k"],
            "--max-new-tokens", "8", "--taus", "1.0", "--windows", "1,4",
            "--metrics", "probability").stdout
  assert "accuracy" in out


@pytest.mark.e2e
def test_serve_answers_from_the_run_as_generate_does_from_the_export(lora_run):
  from test_http_server import NAME, Live
  p = lora_run
  # One window: the request decodes at W = 1, and the default ("auto") would compile
  # every window first (about 4 more minutes; test_http_server starts the defaults).
  server = Live(p["run"], p["tmp"], "--window", "1")
  try:
    r = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is 3 + 4?"}], max_tokens=12,
        temperature=0.0, extra_body={"window": 1, "tau": 1.0, "mode": "gated"})
  finally:
    server.proc.terminate()
    server.proc.wait(120)
    server.log.close()
  lines = cli("mars_jax.generate", "--model", p["merged"], "--prompt", "What is 3 + 4?",
              "--max-new-tokens", "12").stdout.splitlines()
  summary = next(i for i, l in enumerate(lines) if l.startswith("--- "))
  assert lines[0].startswith(f"=== [0] {r.usage.completion_tokens} tokens")
  assert r.choices[0].message.content == "\n".join(lines[1:summary])


@pytest.mark.e2e
def test_adapter_export_of_a_full_run_is_refused(tmp_path):
  run = str(tmp_path / "full")
  train(run, "--config.train.steps=1")
  r = subprocess.run([sys.executable, "-m", "mars_jax.export", "--checkpoint", run, "--out",
                      str(tmp_path / "a"), "--adapter"], cwd=ROOT, capture_output=True,
                     text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  assert r.returncode == 2 and "--adapter needs a LoRA run" in r.stderr
  assert not os.path.exists(tmp_path / "a")


# ---- resume and processes, as full fine-tuning ------------------------------------------


def _unmerged(run_dir):
  _, _, params = runs.load_params(run_dir, merge_adapters=False)
  return jax.tree.map(np.asarray, params)


@pytest.mark.e2e
def test_kill_9_then_resume_is_bitwise(tmp_path):
  straight = str(tmp_path / "straight")
  train(straight, *LORA, "--config.train.steps=6", "--config.train.checkpoint_every=3")
  d = str(tmp_path / "killed")
  killed_at = kill_after_a_checkpoint(d, *LORA)
  train(d, *LORA, "--config.train.steps=6", "--config.train.checkpoint_every=1")
  got, ref = losses(d), losses(straight)
  assert all(got[s] == ref[s] for s in range(killed_at + 1, 7))
  assert_bitwise(_unmerged(d), _unmerged(straight))
  assert_bitwise(params_of(d), params_of(straight))


@pytest.mark.e2e
def test_two_processes_equal_one(tmp_path):
  steps = ["--config.train.steps=4", "--config.train.checkpoint_every=2"]
  two = str(tmp_path / "two")
  train_2proc(two, *LORA, *steps)
  one = str(tmp_path / "one")
  train(one, *LORA, *steps)
  a, b = losses(two), losses(one)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], atol=1e-5, rtol=0)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0),
               _unmerged(two), _unmerged(one))


def test_study_lora_variants_train_mars_b4_through_adapters():
  from test_configs import load
  from mars_jax.experiments import study
  cfg = load(os.path.join(ROOT, "configs", "study.py"))
  c = study.variant_config(cfg, "lora_r32_frozen_mask", "runs/parent")
  assert (c.lora.rank, c.lora.alpha, c.lora.train_mask_row) == (32, 64.0, False)
  assert (c.objective.kind, c.objective.block_size, c.objective.ar_weight) == ("mars", 4, 1.0)
  assert c.model.init == "runs/parent" and c.train.steps == cfg.study.child_steps
  assert study.variant_config(cfg, "mars_b4", "runs/parent").lora.rank == 0
  with pytest.raises(ValueError, match="unknown variant 'lora_r7'"):
    study.variant_config(cfg, "lora_r7", "runs/parent")
