"""One writer per cache entry among the processes of a machine: the others wait for it, then read what it wrote.

The warm start (`warm_start.py`) and the pretrained weights' conversion (`models/pretrained.py`) are each made once
and cached under a name; runs started together (the arms of `compare --parallel=N`, a test run's workers) would
otherwise all make the same entry at once. Entries are still written beside their place and renamed into it, so a
reader that takes no lock never sees half of one: the lock only saves the duplicated work.
"""
import contextlib
import fcntl
import os

from absl import logging


@contextlib.contextmanager
def one_writer(path: str, what: str):
  """Holds `path`'s lock file (.NAME.lock beside it) while the caller checks for, makes and writes the entry. A
  process that cannot create the lock file (a read-only cache directory) goes on without it: it can still read an
  entry that is there."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = open(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock"), "a")
  except OSError:
    lock = None
  if lock is None:  # yielded outside the except clause: an error in the caller's block is not chained to this one
    yield
    return
  with lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info("%s: another process is making %s; waiting for it", what, path)
      fcntl.flock(lock, fcntl.LOCK_EX)
    yield  # closing the file releases the lock
