"""On the CPU, the memory a step frees stays in the process for the next one (xla_cpu.keep_freed_memory): with
glibc's defaults every large block freed goes back to the OS and is faulted in, and zeroed, again on its next use."""
import platform
import subprocess
import sys

import pytest

from jaxrlvr import xla_cpu

_REUSE = """
import ctypes, resource, sys
from jaxrlvr import xla_cpu
if sys.argv[1] == "keep":
  assert xla_cpu.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
faults = []
for i in range(4):  # 256 MB taken, written and freed again, as a step's temporaries are (XLA:CPU mallocs them)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  block = libc.malloc(256 * 2**20)
  ctypes.memset(block, 1, 256 * 2**20)
  libc.free(block)
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[1:]))  # the first use of the memory faults it in either way
"""


def _faults_after_the_first_use(mode: str) -> int:
  result = subprocess.run([sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  return int(result.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc is what is tuned; this C library is not glibc")
def test_freed_memory_is_reused_without_page_faults():
  default, keep = _faults_after_the_first_use("default"), _faults_after_the_first_use("keep")
  # glibc hands the block back, so every page faults again (4 KB pages; 2 MB ones where the kernel gives huge pages).
  assert default >= 256 * 2**20 // 2**21, (default, keep)
  assert keep * 20 < default, (default, keep)


@pytest.mark.parametrize("environ, expected", [
    ({"JAX_PLATFORMS": "cpu"}, True),
    ({"JAX_PLATFORMS": "cuda,cpu"}, False),
    ({"JAX_PLATFORMS": "tpu"}, False),
])
def test_runs_on_cpu_reads_jax_platforms(environ, expected):
  assert xla_cpu.runs_on_cpu(environ) is expected


def test_without_jax_platforms_the_cpu_is_where_no_accelerator_plugin_is_installed(monkeypatch):
  monkeypatch.setattr(xla_cpu.importlib.util, "find_spec", lambda name: None)
  assert xla_cpu.runs_on_cpu({})
  monkeypatch.setattr(xla_cpu.importlib.util, "find_spec", lambda name: name == "jax_cuda12_plugin" or None)
  assert not xla_cpu.runs_on_cpu({})


def test_installed_plugins_without_their_devices_leave_the_run_on_the_cpu(monkeypatch):
  # libtpu installed (the tpu extra), no TPU here: the CPU, as JAX would end up with after libtpu's failure.
  monkeypatch.setattr(xla_cpu.importlib.util, "find_spec", lambda name: name == "libtpu" or None)
  monkeypatch.setattr(xla_cpu.glob, "glob", lambda pattern: [])
  environ = {}
  assert xla_cpu.skip_absent_accelerators(environ) and environ == {"JAX_PLATFORMS": "cpu"}
  assert xla_cpu.runs_on_cpu(environ)
  # On a TPU VM (its chips as /dev/accel*), or where the user chose the platforms, nothing changes.
  monkeypatch.setattr(xla_cpu.glob, "glob", lambda pattern: ["/dev/accel0"] if pattern == "/dev/accel*" else [])
  environ = {}
  assert not xla_cpu.skip_absent_accelerators(environ) and environ == {}
  environ = {"JAX_PLATFORMS": "tpu"}
  assert not xla_cpu.skip_absent_accelerators(environ) and environ == {"JAX_PLATFORMS": "tpu"}
