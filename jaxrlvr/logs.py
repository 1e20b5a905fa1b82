"""What a run prints: jaxrlvr's own log lines, every library's warnings and errors, and the progress bar.

Libraries log at INFO through absl's logger and Python logging: orbax some 60 lines per checkpoint, jax one line per
backend it cannot start (`Unable to initialize backend 'tpu'` on a machine without TPUs). They buried the lines that
matter (the warm start, a resumption, each evaluation) and cut the progress bar, so `setup` drops the INFO lines of
code outside this package; --verbose or JAXRLVR_VERBOSE=1 keeps them. Warnings and errors always show. (jax already
keeps its C++ INFO lines off: it sets TF_CPP_MIN_LOG_LEVEL=1 unless the environment sets it.)

The table of every parameter's shape and sharding (50 lines for the tiny model, hundreds for a 7B one) is logged only
with --log_sharding, JAXRLVR_LOG_SHARDING=1 or --verbose (`log_sharding`).
"""
import logging
import os
import sys

import tqdm

VERBOSE_ENV = "JAXRLVR_VERBOSE"
SHARDING_ENV = "JAXRLVR_LOG_SHARDING"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_settings = {"log_sharding": False}


def env_flag(name: str) -> bool:
  """Whether the environment variable `name` is set to 1, true or yes."""
  return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def log_sharding() -> bool:
  """Whether to log the parameters' sharding table: `setup(log_sharding=True)` or JAXRLVR_LOG_SHARDING=1."""
  return _settings["log_sharding"] or env_flag(SHARDING_ENV)


class OwnInfoOnly(logging.Filter):
  """Passes warnings and errors from anywhere, and lower levels only from jaxrlvr's own modules. absl's logger is
  shared (orbax and jaxrlvr both log through it), so the record's source file tells them apart, not its logger."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or os.path.abspath(record.pathname).startswith(_PACKAGE_DIR)


class AboveProgressBar(logging.Handler):
  """Emits through `inner` with the open tqdm bars cleared first and drawn again after, so that a log line goes
  above the progress bar instead of splitting it."""

  def __init__(self, inner: logging.Handler):
    super().__init__(inner.level)
    self.inner = inner

  def emit(self, record: logging.LogRecord) -> None:
    with tqdm.tqdm.external_write_mode(file=sys.stderr):
      self.inner.handle(record)

  def flush(self) -> None:
    self.inner.flush()

  def close(self) -> None:
    self.inner.close()
    super().close()


def setup(*, verbose: bool = False, log_sharding: bool = False) -> None:
  """Quiets the libraries' INFO lines (not with `verbose`) and puts log lines above the progress bar. Call it once
  the root logger has its handlers (absl's app.run installs its handler before main) and before training starts;
  calling it again replaces the earlier settings."""
  _settings["log_sharding"] = log_sharding or verbose
  root = logging.getLogger()
  for i, handler in enumerate(root.handlers):
    if not isinstance(handler, AboveProgressBar):
      root.handlers[i] = AboveProgressBar(handler)
  for handler in root.handlers:
    for old in [f for f in handler.filters if isinstance(f, OwnInfoOnly)]:
      handler.removeFilter(old)
    if not verbose:
      handler.addFilter(OwnInfoOnly())
