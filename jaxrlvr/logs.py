"""What a run prints: jaxrlvr's own lines, every library's warnings and errors, and the progress bar.

Lines for a person. jaxrlvr's own log lines (the warm start, the held-out set, each evaluation, a health warning)
are shown on stderr as plain text, without absl's prefix (`I1207 00:45:52.354099 140630211124096 train.py:250]`),
above the progress bar; a warning starts with `jaxrlvr: warning:`. The few lines that answer the command itself
(the run is finished, preempted, warm-started on the embedded task) go to stdout once, through `say`, and are not
repeated on stderr. absl's format stays for whoever asks for it: `--verbosity=N`, `--verbose` (or JAXRLVR_VERBOSE=1),
and a log file (`--log_dir` with absl's file logging), which also get the `say` lines.

Libraries log at INFO through absl's logger and Python logging: orbax some 60 lines per checkpoint, jax one line per
backend it cannot start (`Unable to initialize backend 'tpu'` on a machine without TPUs). They buried the lines that
matter and cut the progress bar, so `setup` drops the INFO lines of code outside this package; --verbose keeps them.
Warnings and errors always show, with absl's prefix (a library's line names its file). (jax already keeps its C++
INFO lines off: it sets TF_CPP_MIN_LOG_LEVEL=1 unless the environment sets it.) A library's own progress bar (the
GGUF conversion's) is hidden (`third_party_bars_hidden`) unless --verbosity or --verbose asks.

The table of every parameter's shape and sharding (50 lines for the tiny model, hundreds for a 7B one) is logged only
with --log_sharding, JAXRLVR_LOG_SHARDING=1 or --verbose (`log_sharding`).
"""
import contextlib
import io
import logging
import os
import sys

import tqdm

VERBOSE_ENV = "JAXRLVR_VERBOSE"
SHARDING_ENV = "JAXRLVR_LOG_SHARDING"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_settings = {"log_sharding": False, "plain": False}
_SAID = "jaxrlvr_said"  # a record's attribute: its message went to stdout already (`say`)


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
    return record.levelno >= logging.WARNING or _ours(record)


def say(message: str) -> None:
  """`jaxrlvr: MESSAGE` on stdout, once, above the progress bar: a line that answers the command (the run is
  finished, preempted, ...). A log file has it too (absl INFO); stderr does not repeat it."""
  logging.getLogger("absl").info(message, extra={_SAID: True}, stacklevel=2)
  with tqdm.tqdm.external_write_mode(file=sys.stdout):
    print(f"jaxrlvr: {message}", flush=True)


def _plain(record: logging.LogRecord) -> str:
  """A jaxrlvr record as a person reads it: the message alone, a warning or error said to be one."""
  if record.levelno >= logging.WARNING:
    return f"jaxrlvr: {logging.getLevelName(record.levelno).lower()}: {record.getMessage()}"
  return record.getMessage()


class AboveProgressBar(logging.Handler):
  """Emits through `inner` with the open tqdm bars cleared first and drawn again after, so that a log line goes
  above the progress bar instead of splitting it. With `setup(plain=True)` (the default of `main`), jaxrlvr's own
  records bound for stderr are written as plain lines (`_plain`) instead of absl's; `say`'s records go to a log file
  only."""

  def __init__(self, inner: logging.Handler):
    super().__init__(inner.level)
    self.inner = inner

  def _to_stderr(self) -> bool:
    stream = getattr(getattr(self.inner, "python_handler", self.inner), "stream", None)  # absl's or a StreamHandler
    return stream is sys.stderr or stream is sys.__stderr__

  def emit(self, record: logging.LogRecord) -> None:
    to_stderr = self._to_stderr()
    if getattr(record, _SAID, False) and to_stderr:
      return  # on stdout already
    with tqdm.tqdm.external_write_mode(file=sys.stderr):
      if _settings["plain"] and to_stderr and _ours(record):
        sys.stderr.write(_plain(record) + "\n")
        sys.stderr.flush()
      else:
        self.inner.handle(record)

  def flush(self) -> None:
    self.inner.flush()

  def close(self) -> None:
    self.inner.close()
    super().close()


def _ours(record: logging.LogRecord) -> bool:
  return os.path.abspath(record.pathname).startswith(_PACKAGE_DIR)


@contextlib.contextmanager
def third_party_bars_hidden():
  """Hides what a library writes to stderr inside the block (a progress bar) when lines are plain (`setup`); what it
  wrote is shown after all if the block raises, so an error keeps its context. Python-level writes only."""
  if not _settings["plain"]:
    yield
    return
  captured = io.StringIO()
  try:
    with contextlib.redirect_stderr(captured):
      yield
  except BaseException:
    sys.stderr.write(captured.getvalue())
    raise


def _hide_library_bars() -> None:
  """The Hugging Face libraries' own progress bars off (transformers' and the hub's downloads and loads, a datasets
  directory's load): through their environment switches, which they read when imported (a value the environment
  sets already is kept), and for one imported already, its own switch."""
  os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
  os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
  if "transformers" in sys.modules:
    sys.modules["transformers"].utils.logging.disable_progress_bar()
  if "datasets" in sys.modules:
    sys.modules["datasets"].disable_progress_bars()


def setup(*, verbose: bool = False, log_sharding: bool = False, plain: bool = False) -> None:
  """Quiets the libraries' INFO lines (not with `verbose`), puts log lines above the progress bar and, with `plain`
  (main: unless --verbosity or --verbose asks for absl's format), writes jaxrlvr's own lines to stderr without absl's
  prefix and hides the libraries' progress bars. Call it once the root logger has its handlers (absl's app.run
  installs its handler before main) and before training starts; calling it again replaces the earlier settings."""
  _settings["log_sharding"] = log_sharding or verbose
  _settings["plain"] = plain and not verbose
  if _settings["plain"]:
    _hide_library_bars()
  root = logging.getLogger()
  for i, handler in enumerate(root.handlers):
    if not isinstance(handler, AboveProgressBar):
      root.handlers[i] = AboveProgressBar(handler)
  for handler in root.handlers:
    for old in [f for f in handler.filters if isinstance(f, OwnInfoOnly)]:
      handler.removeFilter(old)
    if not verbose:
      handler.addFilter(OwnInfoOnly())
