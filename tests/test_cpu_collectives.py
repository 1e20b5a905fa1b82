"""XLA:CPU collectives over 8 fake devices with steps queued ahead: they finish with the pool xla_cpu.py sizes, and
deadlock with one pool thread per device (what 8 devices on 2 cores give without it).

The job is the smallest that hung the suite: a jitted data-parallel gradient step (an all-reduce of the gradients)
dispatched in a loop that never waits, so each device queues more programs than XLA:CPU's in-flight limit of 32.
"""
import os
import subprocess
import sys

from jaxrlvr import xla_cpu

_STEPS = 300
_JOB = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

assert jax.device_count() == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("data",))
keys = jax.random.split(jax.random.key(0), 6)
params = [jax.device_put(jax.random.normal(k, (256, 256)) / 256 ** 0.5, NamedSharding(mesh, P())) for k in keys]
x = jax.device_put(np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32), NamedSharding(mesh, P("data")))

def loss(params, x):
  for w in params:
    x = jnp.tanh(x @ w)
  return jnp.mean(x ** 2)

@jax.jit
def step(params, x):
  value, grads = jax.value_and_grad(loss)(params, x)  # grads: an all-reduce over the 8 devices
  return [w - 0.01 * g for w, g in zip(params, grads)], value

for _ in range(%d):
  params, value = step(params, x)  # never waits: steps queue up on every device
print("finished", float(value))
""" % _STEPS


def _env(xla_flags: str = "", **extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {xla_flags}", **extra)
  return env


def _run_job(env: dict[str, str]) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", _JOB], env=env, capture_output=True, text=True, timeout=300)


def test_steps_queued_ahead_finish_with_the_sized_pool():
  env = _env()
  xla_cpu.size_thread_pool(env)
  result = _run_job(env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "finished" in result.stdout


def test_steps_queued_ahead_deadlock_with_one_pool_thread_per_device():
  # The control: without it, the test above would pass on a job that never deadlocks.
  # A stuck all-reduce aborts the job after 5 s instead of 40 s.
  stuck_flags = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=2 "
                 "--xla_cpu_collective_call_terminate_timeout_seconds=5")
  result = _run_job(_env(stuck_flags, PJRT_NPROC="8"))
  assert result.returncode != 0 and "finished" not in result.stdout
  assert "Termination timeout for `all reduce" in result.stderr, result.stderr[-3000:]


def test_pool_is_twice_the_device_count_where_the_default_is_smaller():
  two_cores = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "2"}
  env = dict(two_cores)
  xla_cpu.size_thread_pool(env)
  assert env["PJRT_NPROC"] == "16"
  env = dict(two_cores, JAX_NUM_CPU_DEVICES="4")  # JAX's own device count wins over the XLA flag, as in JAX
  xla_cpu.size_thread_pool(env)
  assert env["PJRT_NPROC"] == "8"
  env = dict(two_cores, NPROC="64")  # enough cores: the default pool stays
  xla_cpu.size_thread_pool(env)
  assert "PJRT_NPROC" not in env
  env = dict(two_cores, PJRT_NPROC="4")  # the user's own setting stays
  xla_cpu.size_thread_pool(env)
  assert env["PJRT_NPROC"] == "4"
  env = {"NPROC": "1"}  # one device (no flag): two threads
  xla_cpu.size_thread_pool(env)
  assert env["PJRT_NPROC"] == "2"
