"""XLA flags for test processes that compile much and run little: the test workers (tests/conftest.py), and the jobs
tests start where their figures are not what is checked (several processes on localhost, the benchmarks' harness).

- LLVM's optimisation level 0 compiles about a third faster and runs the code about 2x slower (the tiny model's
  warm-start step: 133 ms -> 300 ms on one core, jax 0.10.2), a net gain of ~10% on the suite;
- XLA:CPU's older LLVM emitters in place of its MLIR fusion emitters (`xla_cpu_use_fusion_emitters=false`): at level
  0 they compile the same functions in about half the CPU time (tests/test_step.py: 143 -> 57 CPU-s; the fast tier
  779 -> 561; the benchmarks' harness tests 158 -> 87, 2026-12-05). At XLA's default level they compile 2x slower
  instead, so the main job keeps XLA's defaults.

Jobs a test starts as a user runs them (the main command's smoke runs) set only their device count: there these flags
save little (tests/test_train.py: 268 CPU-s with them, 267 without; five files of such jobs 357 against 375, where
ExpRL's smoke job, whose judge decodes, took 35 against 27), and a job that trains the shared warm start would run
its 600 steps twice as slowly. The comparison's CLI test passes them: its arms run a few steps of programs no other
test compiles (81 -> 64 CPU-s).
"""
FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
