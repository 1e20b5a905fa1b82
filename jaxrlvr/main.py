"""The main job: `python -m jaxrlvr.main --config=configs/exgrpo.py --workdir=DIR`.

Run from the repository root (the config files import `configs.base`). Structural choices go through the config arg
(`--config=configs/exgrpo.py:model=qwen2.5-math-7b,smoke`), scalars through `--config.optim.lr=1e-6`.

A user's mistake (a ConfigError or DataError, an unknown config key, preset or config arg, a value of the wrong type,
a --workdir that cannot be written) ends the job with one line on stderr, `jaxrlvr: error: ...`, and exit code 2;
`--verbose` or JAXRLVR_VERBOSE=1 shows its traceback instead. So does a run that cannot go on for a reason outside
the code (faults.RunError: a checkpoint the disk refuses, a diverged loss; a JudgeError: an HTTP judge that refuses
the run's key or model, or is down with exprl.judge.on_failure='error'; replay.QuestionsExhausted: ExGRPO retired
every question the run draws from; health.Collapsed: a run that stopped learning, with train.stop_on_collapse). Any
other exception is a bug and keeps its traceback. SIGTERM and Ctrl-C save the step in flight and exit 0 and 130
(faults.py).
"""
import gc

if __name__ == "__main__":
  # No cyclic GC while the libraries import: a full collection re-scans every object imported so far, and all of them
  # live until the job ends (`_freeze_long_lived_objects` turns it back on).
  gc.disable()

import importlib.util  # pylint: disable=g-import-not-at-top,wrong-import-position  (after gc.disable)
import os
import re
import sys
import tempfile

from absl import app
from absl import flags
import ml_collections
from ml_collections import config_flags

from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr import faults
from jaxrlvr import health
from jaxrlvr import logs
from jaxrlvr import replay
from jaxrlvr import rewards
from jaxrlvr import xla_cpu

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/exgrpo.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics.jsonl and TensorBoard events go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "Multi-process: host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Multi-process: how many processes in all.")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "Multi-process: this process's index.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout_s", 100, "Multi-process: seconds without a heartbeat after which "
                                  "a process counts as dead and the others stop (one error line, exit code 2).")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show the traceback of a user error (as JAXRLVR_VERBOSE=1 does).")
_LOG_SHARDING = flags.DEFINE_bool("log_sharding", False, "Log every parameter's shape and sharding (as "
                                   "JAXRLVR_LOG_SHARDING=1 does).")
flags.mark_flags_as_required(["config", "workdir"])

USER_ERROR_EXIT_CODE = 2  # as argparse's: the command line, or what it names, is wrong
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)(?:=(.*))?$", re.DOTALL)  # --config.optim.lr=1e-6


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}: every setting is a flag, e.g. --config.optim.lr=1e-6")
  _check_workdir(_WORKDIR.value)
  # Libraries' INFO lines off, ours plain (absl's format with --verbosity, logs.py).
  logs.setup(verbose=_verbose(), log_sharding=_LOG_SHARDING.value, plain=not flags.FLAGS["verbosity"].present)
  xla_cpu.setup_process()  # before JAX starts: the CPU client's threads, and a malloc that keeps freed memory
  use_compilation_cache(_CONFIG.value.get("compilation_cache_dir", ""))
  try:
    from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top  (flags parse before jax initialises)
    from jaxrlvr import train  # pylint: disable=g-import-not-at-top
    parallel.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                    heartbeat_timeout_s=_HEARTBEAT.value)
    _freeze_long_lived_objects()
    train.run(_CONFIG.value, _WORKDIR.value)
  except (config_lib.ConfigError, data_lib.DataError, faults.RunError, rewards.JudgeError,
          replay.QuestionsExhausted, health.Collapsed) as e:
    if _verbose():
      raise
    _fail(str(e))
  except Exception as e:  # pylint: disable=broad-except
    exit_if_peer_lost(e)
    raise


def _freeze_long_lived_objects() -> None:
  """The libraries, imported by now, leave Python's cyclic GC (`gc.freeze`), and its youngest generation is collected
  after 20,000 net allocations instead of 700: tracing and lowering allocate millions of short-lived objects, and
  every collection re-scanned what survived. grpo's smoke command with its programs cached spent 1.0-1.2 s of its
  7.2-8.3 CPU-s collecting, 0.13-0.22 s after (the command 6.3-7.2 CPU-s; four interleaved runs each, jax 0.10.2).
  The few cycles the imports left as garbage stay: collecting them first would cost the full scan this avoids."""
  gc.freeze()
  gc.set_threshold(20_000, 20, 20)
  gc.enable()


def use_compilation_cache(path: str, environ=os.environ) -> str:
  """Points JAX's persistent compilation cache at `path` (config compilation_cache_dir, `~` expanded) before anything
  compiles, and returns the directory in use ("" for none). JAX_COMPILATION_CACHE_DIR in the environment wins: JAX
  has read it already, and a caller that sets it (the tests: one directory a test run) means it."""
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return environ["JAX_COMPILATION_CACHE_DIR"]
  if not path:
    return ""
  import jax  # pylint: disable=g-import-not-at-top  (flags parse before jax initialises)
  path = os.path.expanduser(path)
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
    # Every program, the ones that compile in under JAX's default 1 s too: a run compiles dozens of them, and kept
    # they halved the smoke config's first step on a second run (4.4 -> 2.2 s, 1 CPU device).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path


def exit_if_peer_lost(error: Exception) -> None:
  """With several processes, a failed collective (in a multihost helper, or inside a jitted step: a JaxRuntimeError)
  means another process has stopped: says so in one line and leaves at once, exit code 2. The normal exit's shutdown
  barrier would wait for the dead process, then abort with a stack dump. Returns for any other error."""
  from jaxrlvr import multihost  # pylint: disable=g-import-not-at-top  (jax only once the flags are parsed)
  import jax  # pylint: disable=g-import-not-at-top
  if isinstance(error, multihost.PeerLost) or (isinstance(error, jax.errors.JaxRuntimeError)
                                               and jax.process_count() > 1):
    message = str(error if isinstance(error, multihost.PeerLost) else multihost.peer_lost(error))
    sys.stdout.flush()
    sys.stderr.write(f"jaxrlvr: error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    os._exit(USER_ERROR_EXIT_CODE)  # pylint: disable=protected-access


def _verbose(argv: list[str] | None = None) -> bool:
  """--verbose or JAXRLVR_VERBOSE=1; `argv` when the flags could not be parsed."""
  if os.environ.get("JAXRLVR_VERBOSE", "").lower() in ("1", "true", "yes"):
    return True
  if argv is not None:
    return any(arg in ("--verbose", "-verbose", "--verbose=true", "--verbose=1") for arg in argv)
  return _VERBOSE.value


def _fail(message: str) -> None:
  one_line = " ".join(message.strip().splitlines())
  sys.stderr.write(f"jaxrlvr: error: {one_line}\n")
  sys.exit(USER_ERROR_EXIT_CODE)


def _check_workdir(path: str) -> None:
  """Creates --workdir and writes a probe file in it, so that an unusable one stops here with what to do."""
  if not path:
    _fail("--workdir is empty: give the directory for checkpoints and metrics, e.g. --workdir=/tmp/run")
  if os.path.exists(path) and not os.path.isdir(path):
    _fail(f"--workdir={path} is a file, not a directory: give a directory (it is created if missing)")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    _fail(f"--workdir={path}: cannot create the directory ({e.strerror}): create it yourself, or give a --workdir "
          "under a directory you can write")
  try:
    with tempfile.NamedTemporaryFile(dir=path, prefix=".jaxrlvr-write-check-"):
      pass
  except OSError as e:
    _fail(f"--workdir={path}: cannot write in the directory ({e.strerror}): make it writable, or give another "
          "--workdir")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, where a mistake in a flag or in the config it loads is said in one line."""
  try:
    remaining = flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  (what is not a user's mistake is re-raised)
    message = _flag_error(e, argv)
    if message is None or _verbose(argv):
      raise
    _fail(message)
  if not isinstance(_CONFIG.value, ml_collections.ConfigDict):  # ml_collections defers a config file's load error
    _fail(_config_file_error(flags.FLAGS["config"].config_filename))
  return remaining


def _chain(error: BaseException) -> list[BaseException]:
  """`error` and the exceptions it was raised from or while handling, outermost first."""
  chain = []
  while error is not None and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  return chain


def _flag_error(error: Exception, argv: list[str]) -> str | None:
  """The one-line message for a flag-parsing failure that is a user's mistake; None for anything else."""
  spec = _flag_value(argv, "config") or ""
  chain = _chain(error)
  ours = [e for e in chain if isinstance(e, (config_lib.ConfigError, data_lib.DataError))]
  if ours:  # raised by get_config (ml_collections re-raises it with its traceback in the text; the innermost is ours)
    return f"--config={spec}: {ours[-1]}"
  for e in chain:
    if isinstance(e, ImportError) and (e.name or "").split(".")[0] == "configs":
      return (f"--config={spec}: cannot import {e.name!r}: run from the repository root (the config files import "
              f"configs.base; the current directory is {os.getcwd()})")
    if (isinstance(e, OSError) and "Failed loading config file" in str(e)) or (
        isinstance(e, AttributeError) and getattr(e, "name", None) == "get_config"):
      return _config_file_error(spec)
  overrides = [m.groups() for m in map(_OVERRIDE.match, argv) if m]
  if any(isinstance(e, (KeyError, AttributeError)) for e in chain) and overrides:
    config = _load_config(spec)
    for key, _ in overrides:
      message = config and config_lib.unknown_key_error(config, key)
      if message:
        return message
    return None
  if isinstance(error, flags.Error):
    text = " ".join(str(error).split())
    config = _load_config(spec) if overrides else None
    for key, value in overrides:
      prefix = f"flag --config.{key}={value}: "
      if config is not None and text.startswith(prefix) and not config_lib.unknown_key_error(config, key):
        default = config
        for part in key.split("."):
          default = default[part]
        return (f"--config.{key}={value}: {text[len(prefix):]} (config.{key} is of type {type(default).__name__}, "
                f"{default!r} by default)")
    return text
  return None


def _flag_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith((f"--{name}=", f"-{name}=")):
      return arg.split("=", 1)[1]
    if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _load_config(spec: str) -> ml_collections.ConfigDict | None:
  """The config `spec` names, without the command line's overrides (None if it does not load); loaded the way
  ml_collections loads it: `get_config(arg)` after a colon, `get_config()` without one."""
  path, *arg = spec.split(":", 1)
  try:
    module_spec = importlib.util.spec_from_file_location("jaxrlvr_main_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(*arg)
  except Exception:  # pylint: disable=broad-except  (the caller falls back to the error it already has)
    return None
  return config if isinstance(config, ml_collections.ConfigDict) else None


def _config_file_error(spec: str) -> str:
  path = spec.split(":", 1)[0]
  if not os.path.isfile(path):
    return (f"--config={spec}: there is no file {path!r} (relative to {os.getcwd()}); the config files are "
            "configs/*.py, run from the repository root")
  return f"--config={spec}: {path} cannot be loaded as a config file (it needs a get_config function)"


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
