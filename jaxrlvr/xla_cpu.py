"""XLA:CPU's thread pool, sized so that collectives over several CPU devices of one process cannot deadlock.

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
`size_thread_pool` must run before that: tests/conftest.py and `main` call it first.
"""
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
