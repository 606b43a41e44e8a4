"""What the config-file CLIs (train, data.prepare, plan) share: a config or data error
is printed as one line, `error: ...`, with exit status 2; MARS_JAX_TRACEBACK=1 raises
it instead, traceback and all.

  with cli.one_line_errors():
    experiment.run(cfg, workdir)
"""

from __future__ import annotations

import contextlib
import os
import sys

CONFIG_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


@contextlib.contextmanager
def one_line_errors(errors: tuple[type[BaseException], ...] = CONFIG_ERRORS):
  try:
    yield
  except errors as e:
    if os.environ.get("MARS_JAX_TRACEBACK"):
      raise
    print("error: " + " ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
    sys.exit(2)
