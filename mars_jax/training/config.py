"""The experiment ConfigDict: every field with its default, and its typed views.

configs/*.py start from `base_config()` and override; command-line overrides
(`--config.a.b=value`) can only set fields that exist here, so a typo is an error.
`typed(cfg)` builds the typed per-concern configs and checks every value before
anything is compiled.

  model.init        "random" (preset + overrides), an HF directory, or an earlier
                    run's directory (stage 2 from stage 1: its latest checkpoint)
  model.preset      Qwen2.5 or Qwen3 shape for random init ("qwen2.5-0.5b", "qwen3-0.6b", ...)
  model.overrides   Qwen2Config fields over the preset (a tiny model for CPU)
  model.dtype, model.param_dtype, model.attention_impl, model.remat, model.scan_layers
                    the `Runtime` (mars_jax.models.config): how the model is stored
                    and computed; recorded in each run's layout.json
  tokenizer         "char" or "words" (the embedded task's tokenizers, for random
                    init; mars_jax.data.tokenizer), an HF directory, or None: the
                    tokenizer of model.init (also what an embedded name means when
                    model.init is a model or run)
  lora.*            rank (0: full fine-tuning), alpha, dropout, targets (a regex over
                    "attn/q_kernel" .. "mlp/down_kernel"), train_mask_row: LoRA over
                    the frozen model (mars_jax/training/lora.py); a MARS stage also trains the
                    `<|mask|>` embedding row unless train_mask_row is False
  objective.*       mars_jax.training.objective.ObjectiveConfig (kind "ar_sft" | "mars", ...);
                    stream_length unset: the trainer derives the shortest target
                    stream that holds every example's target blocks (the whole row
                    when packing); random_block_offset True here (each row's blocks
                    shifted at random every step, docs/design.md), False: the
                    paper's fixed partition position // B
  optimizer.*       mars_jax.training.optimizer.OptimizerConfig (total_steps comes from train.steps)
  data.*            mars_jax.data.default_config()
  mesh.*            mars_jax.parallel.sharding.MeshConfig (data, fsdp, tensor, context;
                    one may be -1; context > 1 splits each row's positions)
  train.*           batch_size (global), micro_batches, steps (None: from data epochs),
                    seed, log_every, eval_every, eval_batches (0: no eval loss; a
                    file source without data.num_eval has none), checkpoint_every,
                    max_to_keep, async_checkpoint, export_hf, export_dtype,
                    stop_at_step (end this invocation early, checkpointed, as a
                    preemption would; a rerun resumes)
  stage1.*          optional AR-SFT stage run first (enabled, steps, learning_rate);
                    the main stage then starts from it
  final_eval.*      after training: accuracy and tokens per forward on the synthetic
                    test split (num_problems 0 = skip), at each tau, window, gate
  distributed.*     coordinator_address, num_processes, process_id, port
"""

from __future__ import annotations

import dataclasses

import ml_collections

from mars_jax import data as data_lib
from mars_jax.core.choices import Kind
from mars_jax.models import qwen2
from mars_jax.training.objective import ObjectiveConfig
from mars_jax.training.optimizer import OptimizerConfig
from mars_jax.parallel.sharding import MeshConfig

placeholder = ml_collections.config_dict.placeholder


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(dict(
      init="random", preset="qwen2.5-0.5b", overrides=ml_collections.ConfigDict(),
      dtype="float32", param_dtype="float32", attention_impl="xla", remat="none",
      scan_layers=True))
  c.tokenizer = placeholder(str)
  c.lora = ml_collections.ConfigDict(dict(
      rank=0, alpha=16.0, dropout=0.0, targets=".*", train_mask_row=True))
  c.objective = ml_collections.ConfigDict(dict(
      kind="mars", block_size=4, ar_weight=1.0, intra_block="causal",
      normalization="sequence", chunk_size=256, stream_length=placeholder(int),
      attention_chunk=64, random_block_offset=True))
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=5e-6, warmup_ratio=0.03, decay="cosine", final_lr_ratio=0.0,
      weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, max_grad_norm=1.0))
  c.data = data_lib.default_config()
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, context=1))
  c.train = ml_collections.ConfigDict(dict(
      batch_size=32, micro_batches=1, steps=placeholder(int), seed=0, log_every=10,
      eval_every=200, eval_batches=4, checkpoint_every=200, max_to_keep=3,
      async_checkpoint=True, export_hf=False, export_dtype=placeholder(str),
      stop_at_step=placeholder(int)))
  c.stage1 = ml_collections.ConfigDict(dict(
      enabled=False, steps=placeholder(int), learning_rate=placeholder(float)))
  c.final_eval = ml_collections.ConfigDict(dict(
      num_problems=0, taus=(1.0, 0.9), metric="probability", window=placeholder(int),
      batch_size=64, max_new_tokens=64))
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address=placeholder(str), num_processes=placeholder(int),
      process_id=placeholder(int), port=12355))
  return c


@dataclasses.dataclass(frozen=True)
class Typed:
  objective: ObjectiveConfig
  optimizer: OptimizerConfig
  mesh: MeshConfig


def objective_config(cfg, mask_token_id: int | None, **override) -> ObjectiveConfig:
  return ObjectiveConfig(mask_token_id=mask_token_id,
                         **{**cfg.objective.to_dict(), **override})


def typed(cfg, *, total_steps: int, mask_token_id: int | None,
          stream_length: int | None = None) -> Typed:
  """Typed configs of one stage; raises ValueError naming the bad field.

  `stream_length`: the objective's target-stream length when the trainer derived it
  from the data (objective.stream_length unset)."""
  if cfg.train.batch_size < 1 or cfg.train.micro_batches < 1:
    raise ValueError(f"train.batch_size={cfg.train.batch_size}, train.micro_batches="
                     f"{cfg.train.micro_batches}; both must be >= 1.")
  if cfg.train.batch_size % cfg.train.micro_batches:
    raise ValueError(f"train.batch_size={cfg.train.batch_size} is not divisible by "
                     f"train.micro_batches={cfg.train.micro_batches}.")
  override = {} if stream_length is None else {"stream_length": stream_length}
  return Typed(objective=objective_config(cfg, mask_token_id, **override),
               optimizer=OptimizerConfig(total_steps=total_steps, **cfg.optimizer.to_dict()),
               mesh=MeshConfig(**cfg.mesh.to_dict()))


def validate(cfg) -> None:
  """Checks every field that can be checked without data or devices (fails fast)."""
  typed(cfg, total_steps=max(cfg.train.steps or 1, 1), mask_token_id=0)
  for name in ("log_every", "eval_every", "checkpoint_every", "max_to_keep"):
    if cfg.train[name] < 1:
      raise ValueError(f"train.{name}={cfg.train[name]}; must be >= 1.")
  if cfg.train.eval_batches < 0:
    raise ValueError(f"train.eval_batches={cfg.train.eval_batches}; must be >= 0 (0: no "
                     "eval loss).")
  if cfg.model.init == "random":
    random_model_config(cfg)
  else:
    runtime(cfg)
  stage_runtime(cfg, qwen2.DEFAULT_RUNTIME, mask_token_id=0)
  if cfg.final_eval.num_problems < 0 or cfg.final_eval.max_new_tokens < 1:
    raise ValueError("final_eval.num_problems must be >= 0 and max_new_tokens >= 1.")


def random_model_config(cfg, **extra) -> qwen2.Qwen2Config:
  """The Qwen2Config of model.init="random": preset + overrides (architecture only)."""
  return qwen2.preset(cfg.model.preset, **{**cfg.model.overrides.to_dict(), **extra})


def runtime(cfg) -> qwen2.Runtime:
  """The `Runtime` the config asks for (model.dtype, param_dtype, attention_impl, remat,
  scan_layers); raises ValueError naming a bad value."""
  m = cfg.model
  return qwen2.Runtime(dtype=m.dtype, param_dtype=m.param_dtype,
                       attention_impl=m.attention_impl, remat=m.remat,
                       scan_layers=m.scan_layers)


def stage_runtime(cfg, runtime: qwen2.Runtime, mask_token_id: int | None) -> qwen2.Runtime:
  """The runtime a stage trains with: `runtime` plus the adapters `lora.*` asks for (none
  at lora.rank 0). The mask row trains in a MARS stage unless lora.train_mask_row is
  False; an AR-SFT stage never feeds the mask token, so its row stays frozen there."""
  lc = cfg.lora
  if lc.rank < 0:
    raise ValueError(f"lora.rank={lc.rank}; must be >= 0 (0: no LoRA).")
  if lc.rank == 0:
    return runtime
  mask = mask_token_id if cfg.objective.kind == "mars" and lc.train_mask_row else None
  return runtime.replace(lora=qwen2.LoraSpec(rank=lc.rank, alpha=float(lc.alpha),
                                             dropout=float(lc.dropout), targets=lc.targets,
                                             mask_token_id=mask))


def paper_config(*, model_dir: str, preset: str, kind: Kind, fsdp: int, micro_batches: int,
                 remat: str, tensor: int = 1) -> ml_collections.ConfigDict:
  """The paper's recipe on a real Qwen2.5-Instruct or Qwen3 checkpoint: 5 epochs, lr 5e-6, warmup
  0.03 then cosine, effective batch 384, length 512, B=4, ar_weight 1; bfloat16 compute
  over float32 master weights; attention "auto" (the splash kernel on TPU). `model_dir` and `data.source` are local paths (override
  them on the command line); stage 2 (`kind="mars"`) starts from the stage-1 run dir.
  `preset` names the architecture, for `mars_jax.plan` on a host without the model
  (training reads model.init's own config). The mesh: `fsdp` x `tensor`, the rest data."""
  c = base_config()
  c.model.init = model_dir
  c.model.preset = preset
  c.model.dtype = "bfloat16"
  c.model.attention_impl = "auto"   # splash on TPU; GPU and CPU: flash on long rows, else xla
  c.model.remat = remat
  c.objective.kind = kind
  c.objective.block_size = 4
  c.objective.ar_weight = 1.0
  c.objective.chunk_size = 128
  c.optimizer.learning_rate = 5e-6
  c.optimizer.warmup_ratio = 0.03
  c.optimizer.decay = "cosine"
  c.data.source = "data/dolci_instruct_sft/*.jsonl"
  c.data.num_eval = 512
  c.data.max_length = 512
  c.data.num_epochs = 5
  c.mesh.data = -1
  c.mesh.fsdp = fsdp
  c.mesh.tensor = tensor
  c.train.batch_size = 384
  c.train.micro_batches = micro_batches
  c.train.log_every = 10
  c.train.eval_every = 500
  c.train.checkpoint_every = 500
  c.train.export_hf = True
  c.train.export_dtype = "bfloat16"
  return c
