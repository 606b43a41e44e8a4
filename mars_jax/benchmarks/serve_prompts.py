"""The model and prompts of `python -m mars_jax.bench serve` (serve_load): the embedded
default model, trained once under the bench's work directory, and the prompt sets: the
held-out problems of the task a directory's task.json records, or the short user chats
of CHATS; a shared system prompt on top when asked."""

from __future__ import annotations

import os
import subprocess
import sys

from mars_jax.benchmarks.serve_procs import ROOT, child_env

CHATS = (
    "I'm planning a weekend in Lisbon with two friends. We like food and old "
    "neighbourhoods more than museums. What should we not miss?",
    "My sourdough starter smells like nail polish remover. I feed it rye flour once a "
    "day. Is it dead, or can I save it?",
    "Can you explain what a hash map is? I'm new to programming and my textbook lost me "
    "at 'buckets'.",
    "Write a short, friendly reminder to my team that the quarterly reports are due on "
    "Friday. Keep it under three sentences.",
    "What's the difference between weather and climate? My daughter asked me and I "
    "realised I'm not sure.",
    "I run 5 km three times a week, but my knees ache afterwards. Should I change my "
    "shoes or my route?",
    "Summarise the plot of Romeo and Juliet in a few sentences for a ten-year-old.",
    "My landlord wants to raise the rent by 15 percent. Is that normal? How should I "
    "answer politely?",
    "Give me three ideas for a vegetarian dinner in under thirty minutes. I have "
    "chickpeas, spinach and rice.",
    "Why does my Python script say 'list index out of range'? It loops over a list and "
    "reads the next element too.",
    "Translate 'Where is the train station, and when does the last train leave?' into "
    "Spanish and French.",
    "I have an interview tomorrow for a junior data analyst job. Which questions should "
    "I expect?",
    "How do I politely decline a wedding invitation from a coworker I barely know?",
    "Explain compound interest with a simple example. I save 100 euros a month.",
    "The bottom leaves of my tomato plants are turning yellow. They get full sun and I "
    "water them every evening. What's wrong?",
    "Suggest a name for a small bakery that makes cinnamon rolls. Something warm and a "
    "bit playful.",
)


def default_model_dir(work_dir: str) -> str:
  """Where the embedded default's export is: WORK/tiny/hf (absolute)."""
  return os.path.abspath(os.path.join(work_dir, "tiny", "hf"))


def default_model(work_dir: str) -> str:
  """The embedded default's export `default_model_dir`, trained (README's first command)
  when absent; the training's output goes to WORK/tiny.log."""
  out = default_model_dir(work_dir)
  run = os.path.dirname(out)
  if os.path.isfile(os.path.join(out, "config.json")):
    return out
  os.makedirs(work_dir, exist_ok=True)
  print(f"training the default model into {run} (log: {run}.log)", flush=True)
  with open(f"{run}.log", "w") as log:
    subprocess.run([sys.executable, "-m", "mars_jax.train", "--config",
                    os.path.join(ROOT, "configs", "tiny.py"), "--workdir", run],
                   stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT, env=child_env())
  return out


def prompt_set(model_dir: str, kind: str, count: int = 256) -> tuple[str, list[list[dict]]]:
  """(the prompt set's kind, its chats: one user turn each; see the module doc)."""
  from mars_jax.data import synthetic  # pylint: disable=import-outside-toplevel
  task = synthetic.load_task_settings(model_dir)
  kind = ("task" if task else "chat") if kind == "auto" else kind
  if kind == "chat":
    return kind, [[{"role": "user", "content": text}] for text in CHATS]
  if task is None:
    raise ValueError(f"--prompts task: {model_dir} has no task.json.")
  settings = {k: task["synthetic"][k] for k in ("seed", "test_fraction", "difficulty")
              if k in task["synthetic"]}
  problems = synthetic.generate(count, split="test", **settings)
  return kind, [[{"role": "user", "content": p["question"]}] for p in problems]


SYSTEM_SENTENCE = ("You are a careful assistant. Answer the question that follows in as "
                   "few words as it needs, and check every number twice. ")


def with_system_prompt(chats: list, model_dir: str, tokens: int) -> list:
  """Each chat with one shared system message of at least `tokens` tokens (a sentence
  repeated, counted by the model's tokenizer): what a prefix cache saves."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  per = len(tokenizer(SYSTEM_SENTENCE).input_ids)
  text = SYSTEM_SENTENCE * -(-tokens // per)
  return [[{"role": "system", "content": text}, *chat] for chat in chats]


