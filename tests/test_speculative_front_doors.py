"""Two-model decoding through its front doors, on tiny random Qwen2.5 checkpoints that
transformers wrote with the real Qwen2.5 vocabulary and tokenizer (a target, and a
smaller drafter with other weights): `python -m mars_jax.generate --drafter`, and
`python -m mars_jax.serve --drafter` through the official openai client. Each gives the
target's own AR text; a drafter with Qwen3's tokenizer is refused.
"""

import re

import pytest
from qwen_tokenizers import make_qwen_checkpoint
from test_http_server import NAME, Live, chat, complete

from mars_jax import generate
from mars_jax.decoding import sampler as sampling
from mars_jax.serve import __main__ as serve_cli
from mars_jax.decoding.loading import chat_prompt_ids, load_model

# The CLIs and the HTTP server with a drafter, as users run them: `-m e2e`.
pytestmark = pytest.mark.e2e

PROMPTS = ["Tell me a story.", "What is 2+3?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("speculative")
  return {"target": make_qwen_checkpoint(tmp / "target", "qwen2.5", hidden=32, seed=0),
          "drafter": make_qwen_checkpoint(tmp / "drafter", "qwen2.5", hidden=16, layers=1,
                                          seed=1),
          "qwen3": make_qwen_checkpoint(tmp / "qwen3", "qwen3", seed=2), "tmp": tmp}


def _texts(capsys, *args) -> tuple[list[str], str]:
  """main(args) -> (the texts printed, the summary line)."""
  generate.main(list(args))
  printed = capsys.readouterr().out
  body, summary = printed[:printed.rindex("\n---")], printed.rstrip("\n").split("\n")[-1]
  return [t[:-1] for t in re.split(r"^=== \[\d+\] [^\n]*\n", body + "\n", flags=re.M)[1:]], summary


def test_generate_cli_with_a_drafter_prints_the_targets_text(capsys, models):
  ar, _ = _texts(capsys, "--model", models["target"], "--prompt", PROMPTS[0],
                 "--max-new-tokens", "12")
  two, summary = _texts(capsys, "--model", models["target"], "--drafter", models["drafter"],
                        "--draft-window", "3", "--prompt", PROMPTS[0], "--max-new-tokens", "12")
  assert two == ar
  assert "drafter forwards/token" in summary and "K=3" in summary
  m = load_model(models["target"])
  ids = chat_prompt_ids(m.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
  want = sampling.generate(m.config, m.params, [ids], max_new_tokens=12,
                           mask_token_id=m.mask_token_id, eos_token_ids=m.eos_token_ids,
                           tokenizer=m.tokenizer)
  assert two == want.texts


def test_a_drafter_with_another_tokenizer_is_refused(capsys, models):
  with pytest.raises(SystemExit) as e:
    generate.main(["--model", models["target"], "--drafter", models["qwen3"], "--prompt", "x"])
  assert e.value.code == 2
  assert "the drafter's tokenizer is not the target's" in capsys.readouterr().err


def test_serve_with_a_drafter_refuses_an_explicit_warmup(capsys, models):
  """Warmup covers one-device serving without a drafter: asked for with --drafter, it is
  an argument error before anything loads (the default then compiles on first use)."""
  with pytest.raises(SystemExit) as e:
    serve_cli.main(["--model", models["target"], "--drafter", models["drafter"], "--warmup"])
  assert e.value.code == 2
  assert "--warmup covers one-device serving without a drafter" in capsys.readouterr().err


def test_http_server_with_a_drafter_answers_with_the_targets_text(models):
  """The OpenAI API with --drafter (K = 3): completions and chat, streamed and not, equal
  the served model's own greedy text; usage reports the drafter's forwards."""
  m = load_model(models["target"])
  live = Live(models["target"], models["tmp"], "--drafter", models["drafter"],
              "--draft-window", "3", "--window", "1")
  try:
    client = live.client()
    for prompt in PROMPTS:
      ids = m.tokenizer(prompt).input_ids
      want = sampling.generate(m.config, m.params, [ids], max_new_tokens=16,
                               mask_token_id=m.mask_token_id, eos_token_ids=m.eos_token_ids,
                               tokenizer=m.tokenizer).texts[0]
      text, _, use = complete(client, prompt)
      assert text == want
      assert use.model_extra["drafter_forwards"] > 0
      assert complete(client, prompt, stream=True)[0] == want
    assert chat(client, PROMPTS[1])[0] == chat(client, PROMPTS[1], stream=True)[0]
    assert live.metrics()["mars_drafter_forwards_total"] > 0
  finally:
    live.proc.terminate()
    live.proc.wait(120)
    live.log.close()
