"""The sampler benchmark runs end to end at toy sizes: two CPU devices with the batch sharded, transformers in its
own process, and a greedy check that the same weights give the same tokens. Speed itself is not asserted here (the
figures are measured by hand and kept in the README); this guards the code that measures them."""
import os
import re
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sampler_benchmark_runs_on_two_cpu_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the benchmark sets the CPU device count itself
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "sampler.py"), "--models=tiny", "--batch=4",
             "--prompt_len=8", "--new_tokens=4", "--repeats=1", "--cpu_devices=2"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "jaxrlvr on 2 CPU device(s)" in result.stdout, result.stdout
  row = next(line for line in result.stdout.splitlines() if line.startswith("tiny "))
  # model, params, prompts, transformers, threads, ours, ratio, ours on 1 device, ratio, no cache, cache gain,
  # engine, ratio, greedy==HF
  fields = row.split()
  assert len(fields) == 14, row
  assert fields[2] == "4x8", row
  assert fields[-1] == "True", f"greedy tokens differ from transformers: {row}"
  assert all(re.fullmatch(r"[\d.]+x", f) for f in (fields[6], fields[8], fields[10], fields[12])), row
  assert "GPU section skipped" in result.stdout


def test_main_command_benchmark_reruns_the_readme_commands():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "main_command.py"), "--methods=grpo", "--smoke",
             f"--cache={os.environ['JAXRLVR_WARM_START_CACHE']}"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert any(line.startswith("grpo") and "eval/accuracy at step 0" in line for line in lines), result.stdout
  assert any(line.startswith("grpo") and "wall clock (s)" in line for line in lines), result.stdout
  assert any(line.startswith("versions: Python") and "jax 0." in line for line in lines), result.stdout
