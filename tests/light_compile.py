"""XLA flags for test processes that compile much and run little: the test workers (tests/conftest.py) and the jobs
tests start (`job_env`), whose figures are not what a test checks.

- LLVM's optimisation level 0 compiles about a third faster and runs the code about 2x slower (the tiny model's
  warm-start step: 133 ms -> 300 ms on one core, jax 0.10.2), a net gain of ~10% on the suite;
- XLA:CPU's older LLVM emitters in place of its MLIR fusion emitters (`xla_cpu_use_fusion_emitters=false`): at level
  0 they compile the same functions in about half the CPU time (tests/test_step.py: 143 -> 57 CPU-s; the fast tier
  779 -> 561; the benchmarks' harness tests 158 -> 87, 2026-12-05). At XLA's default level they compile 2x slower
  instead, so the main job keeps XLA's defaults.

A smoke main command whose programs are not yet in the test run's compilation cache: 21.3 CPU-s at XLA's defaults,
11.6-12.2 with these flags (grpo; exgrpo 22.2 against 12.1); one whose programs are cached: 7.5 against 8.0-8.3
(2026-12-06). Jobs that mostly run keep XLA's defaults: ExpRL's smoke run (its judge decodes every step), the
smollm2-135m RL run and own data's 30-step learning run; and benchmarks/main_command.py runs the README's commands as
a user runs them.
"""
import os

FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def job_env(devices: int = 1, *, light: bool = True, **extra: str) -> dict:
  """The environment of a job a test starts (a main command, a benchmark's harness): this process's, on `devices`
  CPU devices, compiled light, or at XLA's defaults as a user's job compiles (`light=False`)."""
  flags = f"--xla_force_host_platform_device_count={devices}" + (f" {FLAGS}" if light else "")
  return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
