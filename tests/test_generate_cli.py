"""`python -m mars_jax.generate` in process (`main([...])`) on a tiny checkpoint with a
real BPE ChatML tokenizer (tests/user_path_fixtures.py) and a 64-position context.

--temperature 0 prints the greedy text the sampler's tokens decode to; a sampled run is
the same text for the same --seed, and a repeated prompt of a file samples differently;
--stop ends decoding at the stop string (cut from the text, `finish: stop` in the
header); without --max-new-tokens a prompt decodes until its context is full.
"""

import json
import re

import pytest

import user_path_fixtures as fx

from mars_jax import generate
from mars_jax.decoding import sampler as sampling
from mars_jax.decoding.loading import chat_prompt_ids, load_model

CONTEXT = 64
HEADER = re.compile(r"^=== \[(\d+)\] (\d+) tokens, (\d+) forwards, [0-9.]+ tokens/forward, "
                    r"finish: (eos|stop|length)\n", re.M)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("generate_cli")
  hf = fx.make_qwen2_checkpoint(tmp / "hf", texts=fx.task_texts(fx.task_records(60, seed=0)),
                                max_positions=CONTEXT)
  question = fx.task_records(1, seed=0, split="test")[0]["question"]
  prompts = tmp / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": question}) + "\n" for _ in range(2)))
  return {"hf": hf, "model": load_model(hf), "question": question, "prompts": str(prompts)}


def _run(capsys, tiny, *args) -> list[dict]:
  """main(--model tiny *args) -> per prompt {tokens, forwards, finish, text}."""
  generate.main(["--model", tiny["hf"], *args])
  printed = capsys.readouterr().out
  assert printed.splitlines()[-1].startswith("--- ")
  body = printed[:printed.rstrip("\n").rindex("\n") + 1]   # without the summary line
  heads = list(HEADER.finditer(body))
  assert heads and heads[0].start() == 0, printed
  ends = [h.start() for h in heads[1:]] + [len(body)]
  return [{"tokens": int(h[2]), "forwards": int(h[3]), "finish": h[4],
           "text": body[h.end():end - 1]} for h, end in zip(heads, ends)]


def _texts(samples):
  return [s["text"] for s in samples]


def test_temperature_zero_is_greedy_and_a_seed_reproduces_a_sample(capsys, tiny):
  m = tiny["model"]
  prompt = chat_prompt_ids(m.tokenizer, [{"role": "user", "content": tiny["question"]}])
  ref = sampling.generate(m.config, m.params, [prompt] * 2, max_new_tokens=8,
                          mask_token_id=m.mask_token_id, eos_token_ids=m.eos_token_ids)
  greedy = _run(capsys, tiny, "--prompts", tiny["prompts"], "--max-new-tokens", "8")
  assert _texts(greedy) == [m.tokenizer.decode(t, skip_special_tokens=True)
                            for t in ref.tokens]
  assert [s["tokens"] for s in greedy] == ref.num_tokens
  assert _run(capsys, tiny, "--prompts", tiny["prompts"], "--max-new-tokens", "8",
              "--temperature", "0", "--seed", "5") == greedy
  flags = ["--prompts", tiny["prompts"], "--max-new-tokens", "8", "--temperature", "1.0"]
  sampled = _run(capsys, tiny, *flags, "--seed", "3")
  assert _run(capsys, tiny, *flags, "--seed", "3") == sampled
  assert sampled[0]["text"] != sampled[1]["text"]      # the repeated prompt: seeds 3 and 4
  assert _texts(sampled) != _texts(greedy)
  assert _texts(_run(capsys, tiny, *flags, "--seed", "4"))[0] == sampled[1]["text"]


def test_stop_ends_decoding_before_the_stop_string(capsys, tiny):
  [free] = _run(capsys, tiny, "--prompt", tiny["question"], "--max-new-tokens", "12")
  assert free["finish"] == "length" and len(free["text"]) >= 6, free
  stop = free["text"][3:6]
  [cut] = _run(capsys, tiny, "--prompt", tiny["question"], "--max-new-tokens", "12",
               "--stop", "zzz", "--stop", stop)
  assert cut["text"] == free["text"][:free["text"].index(stop)]
  assert cut["finish"] == "stop" and cut["tokens"] < free["tokens"]
  assert cut["forwards"] == cut["tokens"]     # AR: one forward per kept token


def test_unset_max_new_tokens_fills_the_context(capsys, tiny):
  m = tiny["model"]
  prompt = chat_prompt_ids(m.tokenizer, [{"role": "user", "content": tiny["question"]}])
  assert CONTEXT - len(prompt) >= 8                # room for a few tokens, not 256
  [full] = _run(capsys, tiny, "--prompt", tiny["question"])
  assert (full["finish"], full["tokens"]) == ("length", CONTEXT - len(prompt))
  for args, message in (
      (["--prompt", "7 " * CONTEXT, "--raw"],
       f"leave no room to generate in the model's max_position_embeddings ({CONTEXT})"),
      (["--prompt", "2+3?", "--seed", "-1"], "seed=[-1]; it must be in [0, 2**32)"),
      (["--prompt", "2+3?", "--temperature", "-1"], "temperature=[-1.0]; it must be >= 0"),
      (["--prompt", "2+3?", "--stop", ""], "stop strings must be non-empty")):
    with pytest.raises(SystemExit) as e:
      generate.main(["--model", tiny["hf"], *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
