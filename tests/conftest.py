"""Every test sees 8 fake CPU devices, so sharded code runs on a laptop and in CI."""
import gc
import json
import os
import resource
import shutil
import tempfile
import time

import pytest

# One directory per test run for what its xdist workers and the jobs tests start in subprocesses share: the
# controller (which loads this file first, from testpaths) picks it, the workers inherit it, and the controller
# removes it at the end. A new one each run, so a run never reads what an older jax or older code made.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_DIR = os.environ.setdefault("JAXRLVR_TEST_RUN_DIR", os.path.join(
    tempfile.gettempdir(), f"jaxrlvr-test-run-{os.getuid()}-{os.getpid()}"))
# In it, a persistent XLA compilation cache: most tests build the same tiny models and steps, so each function
# compiles once a run instead of once a test and process.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_RUN_DIR, "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the tiny models compile in under 1 s
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from jaxrlvr import xla_cpu  # pylint: disable=g-import-not-at-top,wrong-import-position  (after the cache settings)
import light_compile  # pylint: disable=g-import-not-at-top,wrong-import-position

# The test workers compile hundreds of small functions and run each a few times, so compiling is most of their time:
# tests/light_compile.py's flags halve it.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {light_compile.FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 devices on 2 cores would give XLA:CPU a pool of 8 threads, too few for an all-reduce over 8 devices once steps are
# queued ahead (a deadlock, then an abort after 40 s; see jaxrlvr/xla_cpu.py). Set before any test starts JAX; see
# pytest_configure for the jobs tests start.
_POOL_CHOSEN_BY_USER = "PJRT_NPROC" in os.environ
xla_cpu.setup_process()  # and on the CPU, a malloc that keeps freed memory, as the main job has
# Two workers share two cores, so a second thread for a PyTorch op (transformers, the peers' models) costs CPU time the
# other worker needed: transformers' greedy answers for the SmolLM2 export took 7.1 CPU-s with torch's two threads,
# 3.9 with one, in 3.7 against 4.0 s of wall alone. XLA:CPU does not read the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One warm-start cache for every end-to-end test of a test run (train, compare, notebooks): the smoke warm start is
# the same for every method, and a cache entry is written atomically, so parallel workers can share it.
os.environ.setdefault("JAXRLVR_WARM_START_CACHE",
                      os.path.join(tempfile.gettempdir(), f"jaxrlvr-test-warm-start-{os.getuid()}"))


def pytest_configure(config):
  """A process that runs tests starts its CPU client with the pool sized above; then the pool size leaves the
  environment, so the jobs tests start size their own for their devices, as a user's do (`main` calls
  `xla_cpu.setup_process`). Inherited, the 16 threads for this process's 8 devices made a one-device job on 2 cores
  up to 1.5x slower (the smoke warm start's steps: 290-340 ms against 190-260). The xdist controller runs no test and
  starts no client; its workers size their own pools."""
  if _POOL_CHOSEN_BY_USER:
    return
  if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
    import jax  # pylint: disable=g-import-not-at-top
    jax.devices()  # the client reads PJRT_NPROC now, once
  os.environ.pop("PJRT_NPROC", None)


def pytest_collection_finish(session):  # pylint: disable=unused-argument
  """What collection imported (jax, flax, transformers, torch, the test modules) lives until the process ends, so it
  leaves the cyclic GC, and the youngest generation is collected after 20,000 net allocations instead of 700, as
  the main command does (jaxrlvr/main.py, `_freeze_long_lived_objects`): tracing allocates millions of short-lived
  objects. test_step, test_engine and test_scoring in one process, their programs cached: 53.3-53.4 CPU-s, 6.6-6.9
  of them collecting, against 47.8-47.9 and 2.2."""
  gc.freeze()
  gc.set_threshold(20_000, 20, 20)


@pytest.fixture(scope="session")
def finished_smoke_run(tmp_path_factory):
  """(workdir, config) of a finished GRPO smoke run (4 steps, checkpoints 2 and 4, the run's own export DIR/hf),
  run in this process from the random initialisation: for tests of what a finished run leaves (export, faults), which
  check what is written, not what the warm start taught. Without a warm start the fast tier trains none. Once a
  worker, not once a module: test_export and test_faults, next to each other, mostly share a worker, and a module
  fixture ran it again for the second (test_faults' export test: 14.7 -> 2.9 CPU-s). What they add to it
  (test_export's hf-2, its export rewritten from checkpoint 4) leaves what the other checks as it was."""
  from configs import grpo  # pylint: disable=g-import-not-at-top
  from jaxrlvr import train  # pylint: disable=g-import-not-at-top
  config = grpo.get_config("smoke")
  with config.unlocked():
    config.warm_start.steps = 0
    config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]  # the embedded tokenizer's cache
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  train.run(config, workdir)
  return workdir, config


@pytest.fixture(scope="session")
def smoke_warm_start():
  """The warm-start cache directory the main commands of the tests name (JAXRLVR_WARM_START_CACHE): it holds the
  embedded tokenizer, built at first use. The smoke configs train no warm start (configs/base.py), so there is none
  to train first; the one test whose command trains one (tests/test_own_data.py, 600 steps) caches it here too."""
  cache = os.environ["JAXRLVR_WARM_START_CACHE"]
  os.makedirs(cache, exist_ok=True)
  return cache


def pytest_sessionfinish(session, exitstatus):  # pylint: disable=unused-argument
  if not os.environ.get("PYTEST_XDIST_WORKER") and _RUN_DIR.startswith(tempfile.gettempdir()):
    shutil.rmtree(_RUN_DIR, ignore_errors=True)


# JAXRLVR_TEST_CPU_LOG=FILE: one JSON line per test with the CPU seconds it cost, its worker's and those of the
# processes it started (and waited for), set-up included. Under `-n 2` on 2 cores a test's wall time depends on what
# the other worker runs; its CPU seconds do not, and their sum is what bounds the suite's wall time.
_CPU_LOG = os.environ.get("JAXRLVR_TEST_CPU_LOG", "")


def _cpu_seconds() -> tuple[float, float]:
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  if not _CPU_LOG:
    yield
    return
  (own, children), start = _cpu_seconds(), time.time()
  yield
  own_after, children_after = _cpu_seconds()
  with open(_CPU_LOG, "a", encoding="utf-8") as f:
    f.write(json.dumps({"test": item.nodeid, "cpu_s": round(own_after - own, 2),
                        "subprocess_cpu_s": round(children_after - children, 2),
                        "wall_s": round(time.time() - start, 2),
                        # When and where it ran: a worker idle while the other runs shows as gaps between its tests.
                        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "start": round(start, 2)}) + "\n")
