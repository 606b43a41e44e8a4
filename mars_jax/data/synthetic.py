"""The embedded default task: GSM8K-style arithmetic word problems, generated.

Each problem is one of a few two-step templates with a worked answer whose steps
are templated, so long stretches of it are predictable from the question (the
numbers are copied, the wording is fixed) and only the computed digits are hard:

  question: Uma buys 7 bags of 7 nuts and 3 more. How many?
  answer:   Bags: 7*7=49
            All: 49+3=52
            #### 52

A problem's identity is its template and numbers (names and items are dressing).
The train/test split is a pure function of (seed, identity): a hash puts each
identity in exactly one split, so `generate(n, seed=s, split="train")` and
`generate(m, seed=s, split="test")` never share a problem, whatever n and m, and
each split has no duplicates. The same (n, seed, split) always gives the same list.

With `mars_jax.data.tokenizer`'s character-level ChatML tokenizer a formatted
example (user turn + assistant turn) is 97-115 tokens, 109 on average; the answer
with its `<|im_end|>` (the targets) is 30-41 tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
from typing import Any, Callable, Mapping

_LOG = logging.getLogger(__name__)

SPLITS = ("train", "test")
NAMES = ("Ann", "Bob", "Cal", "Dan", "Eve", "Fay", "Gus", "Ida", "Jim", "Kim", "Leo",
         "Max", "Ned", "Pam", "Sam", "Tom", "Uma", "Val")
ITEMS = ("apples", "pens", "cups", "eggs", "books", "cards", "coins", "shells", "stamps",
         "toys", "beads", "nuts")


@dataclasses.dataclass(frozen=True)
class _Template:
  """question/answer format strings over fields n (name), it (item), a, b, c, and results.

  `sample` draws (a, b, c) at a difficulty: "standard" (two- and three-digit sums and
  differences, one-digit products) or "easy" (operands up to 20, factors up to 6).
  """
  question: str
  answer: str
  sample: Callable[[random.Random, bool], tuple[int, int, int]]   # (g, easy) -> (a, b, c)
  solve: Callable[[int, int, int], dict[str, int]]                # intermediate results and r


DIFFICULTIES = ("standard", "easy")


def _sample_add_sub(g: random.Random, easy: bool) -> tuple[int, int, int]:
  a, b = (g.randint(2, 20), g.randint(2, 20)) if easy else (g.randint(5, 60), g.randint(2, 40))
  return a, b, g.randint(1, min(15 if easy else 30, a + b - 1))


def _sample_product_then(c_range: tuple[int, int], easy_c_range: tuple[int, int], *,
                         above_product: bool):
  """Factors a, b (2..9, or 2..6 when easy) and c in its range (above a*b if asked)."""
  def sample(g: random.Random, easy: bool) -> tuple[int, int, int]:
    top = 6 if easy else 9
    a, b = g.randint(2, top), g.randint(2, top)
    low, high = easy_c_range if easy else c_range
    return a, b, g.randint(max(low, a * b + 1) if above_product else low, high)
  return sample


def _sample_split(g: random.Random, easy: bool) -> tuple[int, int, int]:
  if easy:
    return g.randint(2, 9), g.randint(2, 6), g.randint(1, 20)
  return g.randint(2, 12), g.randint(2, 9), g.randint(1, 60)


TEMPLATES = (
    _Template(
        "{n} has {a} {it}, gets {b}, gives away {c}. How many now?",
        "Got: {a}+{b}={s}\nLeft: {s}-{c}={r}\n#### {r}",
        _sample_add_sub,
        lambda a, b, c: {"s": a + b, "r": a + b - c}),
    _Template(
        "{n} buys {a} bags of {b} {it} and {c} more. How many?",
        "Bags: {a}*{b}={p}\nAll: {p}+{c}={r}\n#### {r}",
        _sample_product_then((1, 99), (1, 20), above_product=False),
        lambda a, b, c: {"p": a * b, "r": a * b + c}),
    _Template(
        "{n} has {c} {it}, sells {a} packs of {b}. How many left?",
        "Sold: {a}*{b}={p}\nLeft: {c}-{p}={r}\n#### {r}",
        _sample_product_then((82, 199), (37, 60), above_product=True),
        lambda a, b, c: {"p": a * b, "r": c - a * b}),
    _Template(
        "{b} kids split {q} {it}. Each gets {c} more. How many each?",
        "Each: {q}/{b}={a}\nNow: {a}+{c}={r}\n#### {r}",
        _sample_split,
        lambda a, b, c: {"q": a * b, "r": a + c}),
    _Template(
        "{n} buys {b} {it} at {a} dollars each, pays {c}. Change?",
        "Cost: {b}*{a}={p}\nChange: {c}-{p}={r}\n#### {r}",
        _sample_product_then((60, 150), (37, 60), above_product=True),
        lambda a, b, c: {"p": a * b, "r": c - a * b}),
)


def _in_split(key: tuple, seed: int, test_fraction: float) -> str:
  digest = hashlib.blake2b(repr((seed,) + key).encode(), digest_size=8).digest()
  return "test" if int.from_bytes(digest, "big") < test_fraction * 2.0**64 else "train"


def generate(num: int, *, seed: int = 0, split: str = "train", test_fraction: float = 0.1,
             difficulty: str = "standard") -> list[dict[str, str]]:
  """`num` distinct problems of `split` as GSM8K records {"question", "answer"}.

  Deterministic in (num, seed, split, test_fraction); a list is a prefix of any
  longer list with the same arguments. Train and test never share a (template,
  numbers) identity. Raises ValueError if the split has fewer than `num` problems.
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; expected one of {SPLITS}.")
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"difficulty={difficulty!r}; expected one of {DIFFICULTIES}.")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction={test_fraction}; expected a value in (0, 1).")
  g = random.Random(f"mars_jax.synthetic:{seed}:{split}")
  seen: set[tuple] = set()
  out = []
  attempts = 0
  while len(out) < num:
    attempts += 1
    if attempts > 100 * num + 10_000:
      raise ValueError(f"could not draw {num} distinct {split} problems (found {len(out)}); "
                       "ask for fewer or change test_fraction.")
    t = g.randrange(len(TEMPLATES))
    template = TEMPLATES[t]
    a, b, c = template.sample(g, difficulty == "easy")
    name, item = g.choice(NAMES), g.choice(ITEMS)
    key = (t, a, b, c)
    if key in seen or _in_split(key, seed, test_fraction) != split:
      continue
    seen.add(key)
    fields = dict(n=name, it=item, a=a, b=b, c=c, **template.solve(a, b, c))
    out.append({"question": template.question.format(**fields),
                "answer": template.answer.format(**fields)})
  return out


def to_chat(record: dict[str, str]) -> dict[str, list[dict[str, str]]]:
  """{"question", "answer"} -> {"messages": [user question, assistant answer]}."""
  return {"messages": [{"role": "user", "content": record["question"]},
                       {"role": "assistant", "content": record["answer"]}]}


def chat_records(num: int, *, seed: int = 0, split: str = "train",
                 test_fraction: float = 0.1, difficulty: str = "standard") -> list[dict]:
  """`generate(...)` as chat records, the shape the data pipeline trains on."""
  return [to_chat(r) for r in generate(num, seed=seed, split=split,
                                       test_fraction=test_fraction, difficulty=difficulty)]


_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str) -> str | None:
  """The final answer after the last `#### ` as a normalised number string, else None.

  Commas and a trailing ".0" are dropped ("1,000" -> "1000", "7.0" -> "7"), so
  exact match compares numbers the way GSM8K's graders do.
  """
  found = _ANSWER.findall(text)
  if not found:
    return None
  value = found[-1].replace(",", "")
  if "." in value:
    value = value.rstrip("0").rstrip(".") or "0"
  return value


def is_correct(prediction: str, reference: str) -> bool:
  """Exact match of the extracted final answers; a prediction without one is wrong."""
  got = extract_answer(prediction)
  return got is not None and got == extract_answer(reference)


# --- The task record: which synthetic problems a run trained on -------------------------
#
# TASK_FILE in a run directory (written by the trainer) and in an HF export (written after
# the weights) holds {"source": data.source, "synthetic": {seed, test_fraction,
# difficulty, num_train, num_test}}: the data settings of the run, so that evaluation
# draws its held-out problems from the split the run held out, at its difficulty.

TASK_FILE = "task.json"
# The generator settings that decide which problems the test split holds, at their
# `generate` defaults (used, with a notice, for a model that has no record).
SPLIT_DEFAULTS = {"seed": 0, "test_fraction": 0.1, "difficulty": "standard"}


def check_split_settings(settings: Mapping[str, Any], where: str = "") -> None:
  """Raises ValueError unless seed, test_fraction and difficulty are valid `generate` args."""
  seed, frac, diff = (settings.get(k) for k in SPLIT_DEFAULTS)
  bad = ([f"seed={seed!r} (expected an int)"] if not isinstance(seed, int)
         or isinstance(seed, bool) else [])
  bad += ([f"test_fraction={frac!r} (expected a number in (0, 1))"]
          if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1
          else [])
  bad += [f"difficulty={diff!r} (expected one of {DIFFICULTIES})"] if (
      diff not in DIFFICULTIES) else []
  if bad:
    raise ValueError(f"{where + ': ' if where else ''}invalid synthetic settings: "
                     + "; ".join(bad) + ".")


def save_task_settings(directory: str, settings: Mapping[str, Any]) -> str:
  """Writes `settings` ({"source", "synthetic": {...}}) to DIRECTORY/task.json; -> path.

  Atomic (a temporary file renamed into place); overwrites an older record.
  """
  check_split_settings(settings["synthetic"], "save_task_settings")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, TASK_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"source": settings["source"], "synthetic": dict(settings["synthetic"])}, f,
              indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


def record_task_settings(directory: str, settings: Mapping[str, Any]) -> dict:
  """The trainer's write: saves `settings` to DIRECTORY/task.json unless a record is
  already there (a resumed or reused run keeps what it started on; a differing split
  setting is logged as a warning). -> the record in effect."""
  old = load_task_settings(directory)
  if old is None:
    save_task_settings(directory, settings)
    return {"source": settings["source"], "synthetic": dict(settings["synthetic"])}
  diffs = [f"{k}: recorded {old['synthetic'].get(k)!r}, config {settings['synthetic'][k]!r}"
           for k in SPLIT_DEFAULTS if old["synthetic"].get(k) != settings["synthetic"][k]]
  if old["source"] != settings["source"]:
    diffs.insert(0, f"source: recorded {old['source']!r}, config {settings['source']!r}")
  if diffs:
    _LOG.warning("warning: %s keeps the data settings this run started on (%s); evaluation "
                 "uses the record.", os.path.join(directory, TASK_FILE), "; ".join(diffs))
  return old


def load_task_settings(directory: str) -> dict | None:
  """DIRECTORY/task.json as {"source", "synthetic": {...}}, or None when there is none.

  A record that is not valid JSON or holds invalid generator settings is a ValueError
  naming the file (never silently replaced by defaults).
  """
  path = os.path.join(directory, TASK_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      rec = json.load(f)
    syn = rec["synthetic"]
    source = rec["source"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"{path}: not a task record ({e}); expected "
                     '{"source": ..., "synthetic": {"seed", "test_fraction", "difficulty", '
                     '...}}.') from e
  check_split_settings(syn, path)
  return {"source": source, "synthetic": dict(syn)}
