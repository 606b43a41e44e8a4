"""Realistic SFT chats, generated fast and deterministically, for `python -m mars_jax.bench
data`: N OpenAI records {"messages": [...]} as JSONL, a third with a system prompt,
1-3 user/assistant turns, English-like text from a word list (Zipf frequencies,
capitals, commas, numbers, questions, paragraphs in replies), turn lengths varied per
chat: ~340 tokens a chat with the Qwen2.5 template. Built with numpy in chunks of CHUNK
chats, a few seconds per million.

  path, seconds = chats_file(work_dir, n, seed)   # seconds None: an existing file reused
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

GENERATOR_VERSION = 1
CHUNK = 4096          # chats per generated chunk (part of the determinism: fixed)

# Ordered roughly by frequency: the generator draws rank r with weight 1 / (r + 8).
WORDS = list(dict.fromkeys("""
the of and to a in is that for it you with as on be this are was or your can by not
have from at but an they more if will we one all which about their has so there what
when would also been other some these into time them only than its do how most may
then should like out could first any make each use many just over because very well
those both where after need new way work people such good here even through much while
before same between different part same system data number example problem question
answer point case group result value process change order model level form line place
right set small large long high early last next own important possible general simple
clear common local public real main free full open short true whole able sure best
better known given found used called based made take give find think know look come
keep start show help try ask turn move play run write read learn understand explain
consider provide include follow allow create build check test measure compare describe
support report describe choose decide plan prepare manage improve reduce increase
remain become seem appear happen continue begin stop wait leave bring hold feel mean
water food house city world home family friend school student teacher book story
history science music art game team company market price money cost business service
product customer office meeting project report budget schedule deadline week month
year morning evening night day hour minute moment weekend holiday season summer winter
spring autumn weather rain sun garden tree plant flower leaf soil seed fruit vegetable
kitchen recipe dinner lunch breakfast bread rice pasta cheese coffee tea sugar salt oil
flour oven pan knife table chair window door room floor wall roof street road car train
bus bike ticket station airport flight hotel trip travel map country river mountain
lake sea island coast beach forest field farm village town neighbourhood museum church
library hospital doctor nurse patient health body heart head hand foot knee back pain
sleep exercise running walking swimming training diet energy muscle habit routine
computer program code function variable list loop error file folder server network
database query table index memory disk screen keyboard phone message email password
account website browser version update install setting option feature button menu
language grammar word sentence paragraph letter name title page chapter author reader
idea reason method approach strategy solution step stage goal task effort detail
information knowledge experience skill practice lesson course exam grade class subject
math physics chemistry biology economics law policy government election vote rule
community society culture tradition language history war peace power energy light heat
sound color shape size weight distance speed direction position area space surface
edge corner center side top bottom front middle inside outside above below near far
quick slow easy hard cheap expensive warm cold hot dry wet fresh old young new great
little big bright dark heavy light quiet loud safe dangerous careful honest kind polite
friendly helpful useful practical popular traditional modern recent current final
basic specific particular similar typical necessary available certain likely unlikely
usually often sometimes rarely always never already still almost quite rather really
probably perhaps especially actually simply exactly nearly mostly slightly instead
however therefore although unless whether though since until during without within
across along around behind beyond toward against among despite except including
maybe please thanks sorry yes okay hello
""".split()))

# Numbers as they appear in chats.
NUMBERS = ("2 3 4 5 6 7 8 10 12 15 20 24 25 30 40 50 60 90 100 120 150 200 250 300 500 "
           "1000 1500 2000 2020 2023 2024 3.5 1.2 0.5 10% 15% 50% $20 $99 $1,200 7:30 "
           "9am 5pm 3pm 2nd 3rd 10th").split()

_SYSTEMS_FIRST = '{"messages": [{"role": "system", "content": "'
_USER_FIRST = '{"messages": [{"role": "user", "content": "'
_TAIL = '"}]}\n'
# separators after a word: inside a sentence, then (punctuation x (space, paragraph, end))
_INNER = (" ", ", ")
_ENDS = tuple(p + s for s in (" ", "\\n\\n", "") for p in (".", "?", "!"))
_HEADS = (_SYSTEMS_FIRST, _USER_FIRST, _TAIL + _SYSTEMS_FIRST, _TAIL + _USER_FIRST,
          '"}, {"role": "user", "content": "', '"}, {"role": "assistant", "content": "')


def _items() -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
  """The generator's pieces: (bytes uint8[total], starts int64[k], lengths int64[k],
  {kind: first id}) for words, Capitalised words, numbers, separators, ends, headers."""
  pieces, first = [], {}
  for kind, group in (("word", WORDS), ("cap", [w[:1].upper() + w[1:] for w in WORDS]),
                      ("num", NUMBERS), ("inner", _INNER), ("end", _ENDS),
                      ("head", _HEADS), ("tail", (_TAIL,))):
    first[kind] = len(pieces)
    pieces.extend(group)
  encoded = [p.encode() for p in pieces]
  lengths = np.array([len(b) for b in encoded], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  return np.frombuffer(b"".join(encoded), np.uint8), starts, lengths, first


_ITEMS = _items()
# word ids at the Zipf frequencies 1 / (rank + 8), as a table of 2^16 equally likely slots
_ZIPF = np.minimum(np.searchsorted(
    np.cumsum(1.0 / (np.arange(len(WORDS)) + 8.0)) / np.sum(1.0 / (np.arange(len(WORDS)) + 8.0)),
    (np.arange(1 << 16) + 0.5) / (1 << 16)), len(WORDS) - 1).astype(np.int32)


def _chunk(seed: int, index: int, n: int) -> bytes:
  """The JSONL bytes of chats [index * CHUNK, index * CHUNK + n)."""
  blob, starts, lengths, first = _ITEMS
  rng = np.random.default_rng([seed, index])
  v = len(WORDS)
  has_sys = rng.random(n) < 1 / 3
  turns = rng.integers(1, 4, n)
  verbose = np.clip(rng.lognormal(0.0, 0.6, n), 0.25, 3.0)  # per chat: long or terse
  per_chat = has_sys + 2 * turns
  chat = np.repeat(np.arange(n), per_chat)
  k = np.arange(len(chat)) - np.repeat(np.cumsum(per_chat) - per_chat, per_chat)
  role = np.where(has_sys[chat] & (k == 0), 0, 1 + (k - has_sys[chat]) % 2)  # sys/user/asst
  m = len(chat)
  sentences = np.select(
      [role == 0, role == 1],
      [1 + rng.binomial(2, 0.4, m),
       np.clip(1 + rng.poisson(1.3 * verbose[chat]), 1, 4)],
      np.clip(1 + rng.poisson(7.0 * verbose[chat]), 2, 12))
  msg_of = np.repeat(np.arange(m), sentences)
  words = np.clip(np.round(rng.gamma(4.0, 3.0, len(msg_of))), 3, 22).astype(np.int64)
  sent_of = np.repeat(np.arange(len(msg_of)), words)
  total = len(sent_of)
  ids = _ZIPF[rng.integers(0, len(_ZIPF), total, dtype=np.uint16)].astype(np.int64)
  numbers = rng.random(total) < 0.025
  ids[numbers] = first["num"] + rng.integers(0, len(NUMBERS), numbers.sum())
  sent_first = np.cumsum(words) - words               # word index of each sentence start
  capital = ids[sent_first] < v
  ids[sent_first[capital]] += first["cap"]
  seps = np.full(total, first["inner"], np.int64)
  seps[rng.random(total) < 0.07] += 1                  # ", "
  last_word = np.cumsum(words) - 1
  srole = role[msg_of]
  punct = np.where(rng.random(len(msg_of)) < np.where(srole == 1, 0.3, 0.06),
                   1, np.where(rng.random(len(msg_of)) < 0.04, 2, 0))
  msg_last = np.zeros(len(msg_of), bool)
  msg_last[np.cumsum(sentences) - 1] = True
  paragraph = (srole == 2) & (rng.random(len(msg_of)) < 0.2)
  variant = np.where(msg_last, 2, np.where(paragraph, 1, 0))
  seps[last_word] = first["end"] + 3 * variant + punct
  stream = np.empty(2 * total, np.int64)
  stream[0::2], stream[1::2] = ids, seps
  msg_first_word = (np.cumsum(sentences) - sentences)
  msg_first_word = (np.cumsum(words)[msg_first_word] - words[msg_first_word])
  head = np.where(role == 0, 0, np.where(role == 1, 1, 5))
  head = np.where(k == 0, head, np.where(role == 1, 4, 5))
  head[(k == 0) & (chat > 0)] += 2                     # closes the previous chat
  stream = np.insert(stream, 2 * msg_first_word, first["head"] + head)
  stream = np.append(stream, first["tail"])
  lens = lengths[stream]
  ends = np.cumsum(lens)
  gather = np.repeat(starts[stream] - (ends - lens), lens) + np.arange(ends[-1])
  return blob[gather].tobytes()


def write_chats(path: str, n: int, seed: int) -> None:
  """Writes n chats (JSONL) to `path` in one pass, via a temporary sibling."""
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    for index, begin in enumerate(range(0, n, CHUNK)):
      f.write(_chunk(seed, index, min(CHUNK, n - begin)))
  os.replace(tmp, path)


def chats_file(work_dir: str, n: int, seed: int) -> tuple[str, float | None]:
  """(WORK/chats-N-seedS.jsonl, seconds it took to write or None when reused)."""
  os.makedirs(work_dir, exist_ok=True)
  path = os.path.abspath(os.path.join(work_dir, f"chats-{n}-seed{seed}.jsonl"))
  side = path[:-len(".jsonl")] + ".json"
  want = {"chats": n, "seed": seed, "generator_version": GENERATOR_VERSION}
  if os.path.isfile(path) and os.path.isfile(side):
    with open(side) as f:
      have = json.load(f)
    if {k: have.get(k) for k in want} == want and have.get("bytes") == os.path.getsize(path):
      return path, None
  begin = time.perf_counter()
  write_chats(path, n, seed)
  seconds = time.perf_counter() - begin
  with open(side, "w") as f:
    json.dump({**want, "bytes": os.path.getsize(path)}, f)
  return path, seconds
