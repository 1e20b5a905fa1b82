"""tests/conftest.py's JAXRLVR_TEST_CPU_LOG: what each test cost in CPU seconds, its own and its subprocesses'."""
import json
import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TESTS = '''
import subprocess, sys

SPIN = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"

def test_spins_in_a_subprocess():
  subprocess.run([sys.executable, "-c", SPIN], check=True)

def test_does_nothing():
  pass
'''


def test_each_test_gets_a_line_with_its_own_and_its_subprocesses_cpu(tmp_path):
  for name in ("conftest.py", "light_compile.py"):  # tests/conftest.py and the module it imports
    (tmp_path / name).write_text(open(os.path.join(_REPO, "tests", name), encoding="utf-8").read())
  (tmp_path / "test_spin.py").write_text(_TESTS)
  log = tmp_path / "cpu.jsonl"
  ours = os.environ["JAXRLVR_TEST_RUN_DIR"]
  os.makedirs(ours, exist_ok=True)
  env = dict(os.environ, JAXRLVR_TEST_CPU_LOG=str(log), PYTHONPATH=_REPO)
  # A run of its own: its own run directory (which it removes at the end) and compilation cache, not this run's.
  for name in ("PYTEST_XDIST_WORKER", "JAXRLVR_TEST_RUN_DIR", "JAX_COMPILATION_CACHE_DIR"):
    env.pop(name, None)
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  rows = {row["test"].rsplit("::", 1)[-1]: row for row in map(json.loads, log.read_text().splitlines())}
  assert sorted(rows) == ["test_does_nothing", "test_spins_in_a_subprocess"]
  assert rows["test_spins_in_a_subprocess"]["subprocess_cpu_s"] >= 0.5
  assert rows["test_does_nothing"]["subprocess_cpu_s"] == 0 and rows["test_does_nothing"]["cpu_s"] < 0.5
  assert os.path.isdir(ours)  # the inner run removed its own directory, not this run's
