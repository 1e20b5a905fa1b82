"""What tests of different modules, or of one module split over both xdist workers, would each make the same way,
made once per test run: a module or session fixture runs once per worker and module, so the same main command
(or compile) ran 2-3 times a test run."""
import json
import os
import shutil
import subprocess
import sys

import light_compile
from jaxrlvr import file_lock
from jaxrlvr import logs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def once_per_test_run(name: str, make) -> str:
  """The directory NAME in the test run's directory (tests/conftest.py), made by `make(path)` in the first process
  of the run that asks for it; the others wait for it (file_lock.one_writer) and read it. `make` writes into the
  directory's final place (a main command's workdir keeps the path it ran at); `.done`, written after it, marks it
  whole."""
  path = os.path.join(os.environ["JAXRLVR_TEST_RUN_DIR"], "once", name)
  done = os.path.join(path, ".done")
  with file_lock.one_writer(path, name):
    if not os.path.exists(done):
      shutil.rmtree(path, ignore_errors=True)  # a make that failed part-way
      os.makedirs(path)
      make(path)
      open(done, "w").close()  # pylint: disable=consider-using-with
  return path


def main_run(name: str, args: list[str], env: dict) -> tuple[str, int, bytes, bytes]:
  """(workdir, return code, stdout, stderr) of `python -m jaxrlvr.main ARGS --workdir=WORKDIR`, run once per test
  run for the tests that run this command on a fresh workdir and then only read it (a test that writes to it works
  on a copy). The output is bytes, as the command wrote it (the progress bar's carriage returns included)."""
  command = json.dumps([args, env.get("XLA_FLAGS")]).encode()

  def make(path):
    result = subprocess.run([sys.executable, "-m", "jaxrlvr.main", *args, f"--workdir={os.path.join(path, 'run')}"],
                            cwd=_REPO, env=env, capture_output=True, timeout=600, check=False)
    for part, value in (("stdout", result.stdout), ("stderr", result.stderr), ("rc", str(result.returncode).encode()),
                        ("command", command)):
      with open(os.path.join(path, part), "wb") as f:
        f.write(value)

  path = once_per_test_run(name, make)

  def read(part):
    with open(os.path.join(path, part), "rb") as f:
      return f.read()
  assert read("command") == command, f"{name}: two commands under one name"
  return os.path.join(path, "run"), int(read("rc")), read("stdout"), read("stderr")


def grpo_smoke(cache: str) -> tuple[str, int, bytes, bytes]:
  """`--config=configs/grpo.py:smoke` as a user starts it (no verbose or sharding-table setting in its environment),
  compiled light: tests/test_run_outputs.py reads what it said and wrote, test_train.py's smoke test of every method
  its metrics, test_main_errors.py's finished-run tests copy it (the latter's GRPO case: 13.1 -> 1.6 CPU-s,
  2026-12-07)."""
  env = {k: v for k, v in light_compile.job_env().items() if k not in (logs.VERBOSE_ENV, logs.SHARDING_ENV)}
  return main_run("grpo-smoke", ["--config=configs/grpo.py:smoke", f"--config.warm_start.cache_dir={cache}"], env)


def exgrpo_smoke_reference(cache: str) -> tuple[str, int, bytes, bytes]:
  """ExGRPO's smoke run with 4 held-out questions, uninterrupted (checkpoints at steps 2 and 4), compiled light: the
  reference that tests/test_faults.py's interrupted runs and test_train.py's SIGKILLed run resume to (one smoke main
  command fewer a test run)."""
  args = ["--config=configs/exgrpo.py:smoke", f"--config.warm_start.cache_dir={cache}", "--config.data.eval_size=4"]
  return main_run("exgrpo-smoke-reference", args, light_compile.job_env())
