"""Every test sees 8 fake CPU devices, so sharded code runs on a laptop and in CI."""
import os
import tempfile

from jaxrlvr import xla_cpu

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 devices on 2 cores would give XLA:CPU a pool of 8 threads, too few for an all-reduce over 8 devices once steps are
# queued ahead (a deadlock, then an abort after 40 s; see jaxrlvr/xla_cpu.py). Set before any test starts JAX, and
# inherited by the jobs tests run in subprocesses.
xla_cpu.size_thread_pool()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One warm-start cache for every end-to-end test of a session (train, compare, notebooks): the smoke warm start is
# the same for every method, and a cache entry is written atomically, so parallel workers can share it.
os.environ.setdefault("JAXRLVR_WARM_START_CACHE",
                      os.path.join(tempfile.gettempdir(), f"jaxrlvr-test-warm-start-{os.getuid()}"))
