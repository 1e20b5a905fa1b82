"""Every test sees 8 fake CPU devices, so sharded code runs on a laptop and in CI."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One warm-start cache for every end-to-end test of a session (train, compare, notebooks): the smoke warm start is
# the same for every method, and a cache entry is written atomically, so parallel workers can share it.
os.environ.setdefault("JAXRLVR_WARM_START_CACHE",
                      os.path.join(tempfile.gettempdir(), f"jaxrlvr-test-warm-start-{os.getuid()}"))
