"""What the config-file CLIs (train, data.prepare, plan, study) share: a mistake in their
flags (a missing or misspelled --config, an unknown config key, a bad value, a missing
required flag) or a config or data error raised in main is printed as one line,
`error: ...`, with exit status 2; MARS_JAX_TRACEBACK=1 raises it instead, traceback and
all. --help and --helpfull exit 0.

  if __name__ == "__main__":
    cli.run(main, required=("config", "workdir"))   # instead of absl's app.run(main)

  with cli.one_line_errors():
    experiment.run(cfg, workdir)
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from typing import Callable, Sequence

from absl import app, flags

CONFIG_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)
# What parsing a config flag raises: absl's flag errors, ml_collections' unknown key
# (KeyError, or AttributeError around it) and its unreadable config file (OSError).
FLAG_ERRORS = (flags.Error, AttributeError, KeyError, OSError)


def fail(message: str) -> None:
  """Prints `error: MESSAGE` as one line on stderr and exits with status 2."""
  print("error: " + " ".join(line.strip() for line in message.splitlines() if line.strip()),
        file=sys.stderr)
  sys.exit(2)


@contextlib.contextmanager
def one_line_errors(errors: tuple[type[BaseException], ...] = CONFIG_ERRORS):
  try:
    yield
  except errors as e:
    if os.environ.get("MARS_JAX_TRACEBACK"):
      raise
    fail(str(e))


def run(main: Callable, argv: Sequence[str] | None = None,
        required: Sequence[str] = ("config",)) -> None:
  """absl's `app.run(main)`, its flag mistakes (and a missing `required` flag, or
  arguments that are not flags) printed as one line with exit status 2."""
  app.run(main, argv=argv, flags_parser=functools.partial(_parse_flags, required=required))


def _parse_flags(argv: list[str], required: Sequence[str]) -> list[str]:
  try:
    rest = flags.FLAGS(argv)
  except SystemExit as e:  # --help, --helpshort, --helpfull: absl printed the usage
    sys.exit(0 if e.code == 1 else e.code)
  except FLAG_ERRORS as e:
    if os.environ.get("MARS_JAX_TRACEBACK"):
      raise
    fail(_config_file_missing(argv) or _unknown_key(argv, e) or _without_traceback(str(e)))
  missing = _config_file_missing(argv)
  if missing:
    fail(missing)
  for name in required:
    if flags.FLAGS[name].value is None:
      fail(f"--{name} is required ({flags.FLAGS[name].help}).")
  if len(rest) > 1:
    fail(f"unexpected arguments {rest[1:]}; every argument is a --flag.")
  return rest


def _config_file_missing(argv: Sequence[str]) -> str | None:
  """The message for a --config FILE[:ARG] in argv that is not a file, else None."""
  for i, arg in enumerate(argv):
    if arg in ("--config", "-config") and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith(("--config=", "-config=")):
      value = arg.split("=", 1)[1]
    else:
      continue
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
      return f"{path}: no such config file."
  return None


def _without_traceback(text: str) -> str:
  """A flag error's text with a traceback in it (a config file's get_config raised) cut
  to the exception's line."""
  head, _, trace = text.partition("Traceback (most recent call last):")
  return head + trace.strip().splitlines()[-1] if trace.strip() else text


def _unknown_key(argv: Sequence[str], e: BaseException) -> str | None:
  """The message for ml_collections' unknown config key (KeyError "'key'\\nDid you mean
  "other" instead of "key"?", maybe in an AttributeError), naming the override."""
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  text = str(e.args[0]) if e.args else ""
  key = re.match(r"'(\w+)'", text)
  if not isinstance(e, KeyError) or not key:
    return None
  for arg in argv:
    path = re.match(r"--?config\.([\w.]+)", arg)
    parts = path.group(1).split(".") if path else []
    if key.group(1) in parts:
      suggestion = re.search(r'Did you mean "(\w+)"', text)
      hint = ""
      if suggestion:
        parts[parts.index(key.group(1))] = suggestion.group(1)
        hint = f" (did you mean {'.'.join(parts)}?)"
      return f"--config.{path.group(1)}: no such key in the config{hint}."
  return None
