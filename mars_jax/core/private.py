"""Directories whose files a process runs as code (saved executables, JAX's compilation
cache): refused unless only the user can have put them there, as ssh treats its keys.

  path = private_dir("~/.cache/mars_jax/jax", "--compilation-cache")   # made 0700 if new
  check_file(path + "/f.xla", "--compilation-cache")                    # before reading it

A path is private when it and every directory above it are owned by the user (or root)
and writable by no one else: no group or other write bit, except on a directory with the
sticky bit (/tmp), where others cannot rename or remove what the user made. Anything else
raises `NotPrivate`, whose message names the path, what is wrong and the fix.
"""

from __future__ import annotations

import contextlib
import os
import stat


class NotPrivate(PermissionError):
  """A cache path that someone besides the user could write."""


def _problem(path: str, st: os.stat_result, *, ancestor: bool) -> str | None:
  uid = os.getuid()
  if st.st_uid not in (uid, 0):
    return (f"is owned by uid {st.st_uid}, not by you (uid {uid}); `chown` it to yourself "
            "or choose a directory of your own")
  sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
  if st.st_mode & 0o022 and not (ancestor and sticky_dir):
    return (f"is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod go-w {path}`" + (" (and `chmod -R go-w` on the cache)"
                                         if not ancestor else "")
            + " or choose a directory of your own")
  return None


def check_file(path: str, what: str) -> None:
  """Raises `NotPrivate` unless `path` (a file, or a directory's own entry) is owned by
  the user (or root) and writable by no one else. A symbolic link is judged by its
  target."""
  problem = _problem(path, os.stat(path), ancestor=False)
  if problem:
    raise NotPrivate(f"{what}: {path} {problem}: anyone who can write it can make this "
                     "server run their code.")


def private_dir(path: str, what: str) -> str:
  """`path` (user-expanded; it and each missing directory above it made with mode 0700)
  once it and every directory above it are private (module doc); -> its real path.
  NotPrivate otherwise."""
  path = os.path.abspath(os.path.expanduser(path))
  missing, up = [], path
  while not os.path.exists(up):
    missing.append(up)
    up = os.path.dirname(up)
  for directory in reversed(missing):
    with contextlib.suppress(FileExistsError):
      os.mkdir(directory, 0o700)
  real = os.path.realpath(path)
  check_file(real, what)
  parent = os.path.dirname(real)
  while True:
    problem = _problem(parent, os.stat(parent), ancestor=True)
    if problem:
      raise NotPrivate(f"{what}: {real} sits in {parent}, which {problem}: anyone who can "
                       "write there can swap the cache for their own and make this server "
                       "run their code.")
    if parent == os.path.dirname(parent):
      return real
    parent = os.path.dirname(parent)


def check_tree(path: str, what: str) -> None:
  """`check_file` on every file and directory under `path` (a cache another program
  writes, read by it later)."""
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      check_file(os.path.join(root, name), what)
