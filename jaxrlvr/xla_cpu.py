"""XLA:CPU's process settings: a thread pool sized so that collectives over several CPU devices of one process
cannot deadlock, and a malloc that keeps the memory XLA:CPU frees for the next step.

XLA:CPU's PjRt client runs two kinds of work on one pool of max(PJRT_NPROC or the cores, local CPU devices) threads:
the launch of each device's share of a program, which waits for a free slot while that device already has 32
programs queued (the client's per-device in-flight limit), and the shares themselves, where an all-reduce holds its
thread until the shares of every device have arrived. Code that dispatches without waiting (a training loop, a
`jax.tree.map(jnp.copy, params)` over many leaves) reaches the limit; a launch then holds a thread while it waits for
an older program whose all-reduce needs one thread per device. With the pool no larger than the device count (8 fake
devices on 2 cores), that all-reduce never completes, and XLA aborts the process after 40 s ("Termination timeout for
all reduce ... only 7 of them arrived"). A dispatching thread waits until its launches have their slots, so at most
one launch per device waits at a time: a pool of twice the device count always leaves the all-reduce its threads.

The client reads PJRT_NPROC once, when JAX creates it (the first `jax.devices()` or computation), so
`size_thread_pool` must run before that: tests/conftest.py and `main` call it first (`setup_process`).
"""
import ctypes
import glob
import importlib.util
import os
import re
from collections.abc import MutableMapping

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def local_cpu_devices(environ: MutableMapping[str, str]) -> int:
  """The CPU devices JAX will create in this process: JAX_NUM_CPU_DEVICES if set (JAX passes it to the client, which
  then ignores the XLA flag), else the last --xla_force_host_platform_device_count in XLA_FLAGS, else 1."""
  jax_count = environ.get("JAX_NUM_CPU_DEVICES", "")
  if jax_count.lstrip("-").isdigit() and int(jax_count) >= 0:
    return int(jax_count)
  flags = _DEVICE_COUNT_FLAG.findall(environ.get("XLA_FLAGS", ""))
  return int(flags[-1]) if flags else 1


def _default_pool_size(environ: MutableMapping[str, str]) -> int:
  """What the client would use without PJRT_NPROC: NPROC if set, else the cores this process may run on."""
  if environ.get("NPROC", "").isdigit():
    return int(environ["NPROC"])
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def size_thread_pool(environ: MutableMapping[str, str] | None = None) -> None:
  """Sets PJRT_NPROC to twice the local CPU device count where the default pool would be smaller; a PJRT_NPROC
  already set is the user's choice and stays. Call before JAX creates its CPU client."""
  environ = os.environ if environ is None else environ
  if "PJRT_NPROC" in environ:
    return
  needed = 2 * local_cpu_devices(environ)
  if needed > _default_pool_size(environ):
    environ["PJRT_NPROC"] = str(needed)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def runs_on_cpu(environ: MutableMapping[str, str] | None = None) -> bool:
  """Whether JAX will compute on the CPU, told without starting it: JAX_PLATFORMS names cpu first, or (unset) no
  accelerator plugin is installed."""
  environ = os.environ if environ is None else environ
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


# The device files each accelerator plugin drives: where none of an installed plugin's exist, JAX would only try the
# plugin, print its failure (libtpu: a screen of "could not determine TPU accelerator type") and fall back to the CPU.
_PLUGIN_DEVICES = {
    "libtpu": ("/dev/accel*", "/dev/vfio/[0-9]*"),  # TPU VMs: v4/v5p chips as accel devices, v5e/v6e through vfio
    "jax_cuda12_plugin": ("/dev/nvidia[0-9]*",), "jax_cuda13_plugin": ("/dev/nvidia[0-9]*",),
    "jax_rocm60_plugin": ("/dev/kfd",), "jax_rocm7_plugin": ("/dev/kfd",),
}


def skip_absent_accelerators(environ: MutableMapping[str, str] | None = None) -> bool:
  """Sets JAX_PLATFORMS=cpu where it is unset, accelerator plugins are installed and none of their devices is on
  this host (libtpu from `pip install -e '.[tpu]'`, for `jaxrlvr.plan --topology`, on a laptop). Returns whether it
  did. Without it such a run starts libtpu, which prints its failure to find a TPU, and, not known to be on the CPU,
  goes without `keep_freed_memory`. A JAX_PLATFORMS the user set stays."""
  environ = os.environ if environ is None else environ
  if environ.get("JAX_PLATFORMS", "").strip():
    return False
  installed = [name for name in _ACCELERATOR_PLUGINS if importlib.util.find_spec(name)]
  if not installed or any(glob.glob(pattern) for name in installed for pattern in _PLUGIN_DEVICES[name]):
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  return True


def keep_freed_memory() -> bool:
  """Makes glibc's malloc keep freed memory for reuse instead of handing it back to the OS. Returns whether it did
  (False where the C library is not glibc).

  XLA:CPU allocates a step's temporaries with malloc and frees them when the step ends. By default glibc returns
  large blocks to the OS (mmap'd blocks over 32 MB, the tops of the per-thread heaps), so the next step faults every
  page in again and the kernel zeroes it: on the smollm2-135m preset 1.5 million page faults a step, 7 s of system
  time, and a GRPO update of 10-12 s instead of about 6 s (docs/benchmarks.md). One arena, no mmap'd blocks and no
  trimming (-1: never; a finite threshold, an int, stops at 2 GB, less than one update frees) keep those pages in
  the process. The process's RSS stays at its peak, which it reaches in the first step anyway. Call it before JAX
  starts its threads: a thread that has already allocated keeps its own arena.
  """
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  (glibc's alone: another libc's mallopt differs)
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return all(mallopt(param, value) == 1 for param, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))


def setup_process(environ: MutableMapping[str, str] | None = None) -> None:
  """What a process needs before JAX starts: the CPU chosen where accelerator plugins have no device here
  (`skip_absent_accelerators`), the CPU client's thread pool sized, and on the CPU, freed memory kept for the next
  step (`keep_freed_memory`). The main job, the SFT control and the benchmarks' workers call it first."""
  skip_absent_accelerators(environ)
  size_thread_pool(environ)
  if runs_on_cpu(environ):
    keep_freed_memory()
