"""A toy MARS model trained in seconds on one CPU: its MASK proposals are right.

The task is a cycle of `PERIOD` distinct tokens repeated, entered at a random
phase: the prompt shows a few tokens of the cycle, the response continues it.
Every continuation token is a function of the last real token and its distance
from it, so a tiny Qwen2 trained with `objective.mars_loss` (block size B)
predicts both the AR token and the B MASK-slot tokens, and MARS decoding of it
commits up to W tokens per forward: the regime of a trained checkpoint, without
one. Used by the sampler tests and by `python -m mars_jax.bench sample --model toy`.

  cycle   c0 c1 c2 ... c7 c0 c1 ...
  row     [c5 c6 c7 c0 | c1 c2 c3 ...]      prompt (PROMPT_LEN) | response
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mars_jax.checkpoints import hf
from mars_jax.training import objective
from mars_jax.models import qwen2
from mars_jax.models.qwen2 import Qwen2Config

PERIOD = 8
PROMPT_LEN = 4
MASK_ID = 127
CONFIG = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     tie_word_embeddings=True, rope_theta=10000.0)
TRAIN_RUNTIME = qwen2.Runtime(scan_layers=False)  # unrolled: compiles faster on CPU


@dataclasses.dataclass(frozen=True)
class Toy:
  """A trained toy: config, params (in the default `Runtime`'s layout), the cycle
  (int32[PERIOD]), the `<|mask|>` id and the MARS block size it was trained with."""
  config: Qwen2Config
  params: Any
  cycle: np.ndarray
  mask_token_id: int
  block_size: int

  def prompts(self, n: int, seed: int = 0, length: int = PROMPT_LEN) -> list[list[int]]:
    """`n` prompts: `length` consecutive cycle tokens from random phases."""
    phases = np.random.default_rng(seed).integers(0, PERIOD, n)
    return [self.cycle[(p + np.arange(length)) % PERIOD].tolist() for p in phases]

  def continuation(self, prompt: list[int], n: int) -> list[int]:
    """The `n` cycle tokens after `prompt` (what the toy learned to produce)."""
    start = int(np.flatnonzero(self.cycle == prompt[-1])[0]) + 1
    return self.cycle[(start + np.arange(n)) % PERIOD].tolist()


def batch(cycle: np.ndarray, rng: np.random.Generator, rows: int, length: int
          ) -> dict[str, np.ndarray]:
  """{"tokens": int32[rows, length], "loss_mask": bool[rows, length]}: the cycle from a
  random phase, response after PROMPT_LEN tokens."""
  phases = rng.integers(0, PERIOD, (rows, 1))
  tokens = cycle[(phases + np.arange(length)[None]) % PERIOD].astype(np.int32)
  return {"tokens": tokens, "loss_mask": np.broadcast_to(np.arange(length) >= PROMPT_LEN,
                                                         tokens.shape)}


def train(*, block_size: int = 4, steps: int = 60, rows: int = 8, length: int = 24,
          learning_rate: float = 5e-3, seed: int = 0, config: Qwen2Config = CONFIG) -> Toy:
  """Trains the toy with `objective.mars_loss` (AR + MASK terms) and Adam; `config`: its
  shape (vocab_size must stay CONFIG's)."""
  rng = np.random.default_rng(seed)
  cycle = rng.choice(np.arange(1, MASK_ID), PERIOD, replace=False).astype(np.int32)
  params = qwen2.init_params(config, jax.random.key(seed), runtime=TRAIN_RUNTIME)
  tx = optax.adam(learning_rate)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      return objective.mars_loss(config, p, batch, block_size=block_size,
                                 mask_token_id=MASK_ID, chunk_size=None,
                                 runtime=TRAIN_RUNTIME)[0]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  for _ in range(steps):
    params, opt_state, _ = step(params, opt_state, batch(cycle, rng, rows, length))
  return Toy(config, qwen2.relayout(jax.tree.map(jnp.asarray, params), qwen2.DEFAULT_RUNTIME),
             cycle, MASK_ID, block_size)


EOS_ID = 0  # never in the cycle (drawn from 1..MASK_ID-1), so EOS never cuts a continuation
EOS_TOKEN = "<|endoftext|>"


def tokenizer():
  """A `PreTrainedTokenizerFast` with one token per id: EOS at EOS_ID, " c{i}" for every
  other id below MASK_ID and `<|mask|>` at MASK_ID, so ids decode to " c5 c6 c7".

  Byte-level BPE as Qwen2's: transformers 5 loads the tokenizer of a qwen2 config.json
  as `Qwen2Tokenizer` whatever tokenizer_config.json names, which keeps the vocabulary
  and rebuilds a byte-level pre-tokenizer and decoder around it; this one decodes the
  same under either. No merges: it decodes ids, it does not encode text."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  vocab = {EOS_TOKEN if i == EOS_ID else f"\u0120c{i}": i for i in range(MASK_ID)}  # Ġ: " "
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges=[]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN,
                                pad_token=EOS_TOKEN)
  tok.add_tokens([hf.MASK_TOKEN], special_tokens=True)  # the next id: MASK_ID
  return tok


def export(t: Toy, directory: str) -> str:
  """Writes the trained toy as an HF directory (float32 weights, bos/eos EOS_ID, the
  `tokenizer()`, `pard_token` and its MARS record) that `python -m mars_jax.serve
  --model`, transformers' `AutoModelForCausalLM.from_pretrained` and vLLM load.
  -> `directory`."""
  config = dataclasses.replace(t.config, bos_token_id=EOS_ID, eos_token_id=EOS_ID)
  hf.save_pretrained(config, t.params, directory, tokenizer=tokenizer(), dtype="float32",
                     source={"model": "mars_jax.benchmarks.toy", "objective": {
                         "kind": "mars", "block_size": t.block_size}},
                     pard_token=t.mask_token_id)
  return directory
