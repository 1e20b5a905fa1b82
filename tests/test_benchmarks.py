"""The sampler benchmark runs end to end at toy sizes: two CPU devices with the batch sharded, transformers in its
own process, and a greedy check that the same weights give the same tokens. Speed itself is not asserted here (the
figures are measured by hand and kept in the README); this guards the code that measures them, the GPU section's
included."""
import os
import re
import subprocess
import sys

import pytest

import light_compile

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _harness_env(xla_flags: str = "") -> dict:
  """The environment of a benchmark whose harness is checked, not its figures: tests/light_compile.py's flags, and
  `xla_flags` for the benchmarks that do not set their own device count."""
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{xla_flags} {light_compile.FLAGS}".strip())


def _table_rows(stdout: str, header: str, name_width: int) -> dict[str, list[str]]:
  """A benchmark's table after its header line (the line that starts with `header`): {row name: its fields}, the
  name being the first `name_width` characters of the row."""
  lines = stdout.splitlines()
  table = lines[next(i for i, line in enumerate(lines) if line.startswith(header)) + 1:]
  return {line[:name_width].strip(): line[name_width:].split() for line in table}


@pytest.mark.slow
def test_sampler_benchmark_runs_on_two_cpu_devices():
  env = _harness_env()
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


@pytest.mark.slow  # the benchmark script end to end
def test_gpu_section_runs_its_code_on_cpu():
  """The GPU section (the static sampler's bandwidth table, then the engine on long-tailed answers) at toy sizes on
  CPU, so that a machine with a GPU runs code that has run before; no figure is asserted."""
  env = _harness_env()
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "sampler.py"), "--gpu_section_on_cpu",
             "--gpu_preset=tiny", "--gpu_batches=4", "--gpu_prompt_len=8", "--gpu_new_tokens=8",
             "--gpu_long_prompt_len=8", "--gpu_long_cap=32", "--gpu_long_mean_tokens=16", "--repeats=1",
             "--cpu_devices=1"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "tiny random bf16 weights" in result.stdout and "GPU engine:" in result.stdout, result.stdout
  engine_row = result.stdout.strip().splitlines()[-1].split()
  assert engine_row[0] == "4" and engine_row[3].endswith("%"), result.stdout  # rows, tok/s, mean len, useful share


@pytest.mark.slow
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


@pytest.mark.slow
def test_update_split_benchmark_reports_every_part_against_the_matmul_peak():
  env = _harness_env()
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "update_split.py"), "--model=tiny", "--rows=64",
             "--prompt=8", "--completion=8", "--minibatches=2", "--repeats=1"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "train.num_minibatches=2" in result.stdout, result.stdout
  assert "prompts shared by groups of 8" in result.stdout, result.stdout  # the tiny preset's 8 samples a question
  rows = _table_rows(result.stdout, header="part", name_width=24)
  assert list(rows) == ["matmul", "update", "score", "body forward", "body forward+backward",
                        "head forward+backward", "update, prompt per row"], result.stdout
  assert rows["matmul"][-1] == "100%", result.stdout
  for name, fields in rows.items():  # best s, median s, GFLOP, GFLOP/s, share of the matmul's
    assert len(fields) == 5 and all(float(f) > 0 for f in fields[:2]) and fields[-1].endswith("%"), (name, fields)


@pytest.mark.slow
def test_update_step_benchmark_times_both_mlp_backward_passes_with_the_same_gradient():
  env = _harness_env()
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "update_step.py"), "--repeats=1", "--microbatches=2"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = _table_rows(result.stdout, header="variant", name_width=32)
  assert list(rows) == ["autodiff, 2 micro-batches", "hand, 2 micro-batches"], result.stdout
  best, median, speedup, norm = zip(*rows.values())  # ms, ms, "1.00x", the gradient norm of the first call
  assert all(float(t) > 0 for t in best + median) and speedup[0] == "1.00x", result.stdout
  assert abs(float(norm[0]) - float(norm[1])) <= 1e-5 * float(norm[0]), result.stdout


@pytest.mark.slow
def test_peer_grpo_benchmark_checks_parity_interleaves_and_reports_both_systems(tmp_path):
  pytest.importorskip("trl", reason="TRL is the peer: pip install -e '.[peers]' (CI installs it)")
  env = _harness_env()
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "peer_grpo.py"), "--model=tiny", "--steps=2",
             "--eval_size=4", "--trl_threads=1", f"--workdir={tmp_path}"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  # The steps ran alternately, each system in its own process.
  steps = [line.rsplit(":", 1)[0] for line in result.stderr.splitlines() if line.startswith("peer_grpo: step ")]
  assert steps == ["peer_grpo: step 1 jaxrlvr", "peer_grpo: step 1 trl", "peer_grpo: step 2 jaxrlvr",
                   "peer_grpo: step 2 trl"], result.stderr[-3000:]
  rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in (["jaxrlvr"], ["trl"])}
  # parity, steady s, first s, generation, reward, scoring, update, tok/s, peak GB
  assert set(rows) == {"jaxrlvr", "trl"} and all(len(r) == 9 for r in rows.values()), result.stdout
  assert float(rows["trl"][0]) <= 1e-4, result.stdout  # TRL computes the model jaxrlvr does
  assert all(float(x) > 0 for r in rows.values() for x in (r[1], r[2], r[7], r[8])), result.stdout
  assert float(rows["jaxrlvr"][5]) == 0 and float(rows["trl"][5]) == 0, result.stdout  # one optimizer step: no pass
  assert any(re.fullmatch(r"steady step jaxrlvr / trl: \d+\.\d\d", line) for line in lines), result.stdout
  assert any(re.fullmatch(r"jaxrlvr's update: \d+ GFLOP \(median step\) at \d+ GFLOP/s, \d+% of its process's "
                          r"2048\^2 float32 matmul \(\d+ GFLOP/s, the best after any step\)", line)
             for line in lines), result.stdout
  assert any(re.fullmatch(r"jaxrlvr's update rows after packing the answers \(train.pack_completions\): \d+% of the "
                          r"batch's on average, \d+ of \d+ steady steps packed", line) for line in lines), result.stdout
  for system in ("jaxrlvr", "trl"):
    assert any(line.startswith(f"{system}: held-out greedy accuracy") and "(4 questions)" in line
               for line in lines), result.stdout
  assert any(line.startswith("versions: jax 0.") and "trl 1.16.0" in line for line in lines), result.stdout
  # TRL's arithmetic is jaxrlvr's (float32, no activation checkpointing), not its GRPOConfig defaults.
  assert lines[0].endswith("TRL with 1 torch threads, float32, without gradient checkpointing"), result.stdout


@pytest.mark.slow
def test_preset_rollout_benchmark_times_both_samplers_on_the_same_rows():
  env = _harness_env("--xla_force_host_platform_device_count=1")
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "preset_rollout.py"),
             "--config=configs/exgrpo.py:smoke", "--calls=2",
             f"--warm_start_cache={os.environ['JAXRLVR_WARM_START_CACHE']}"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  rows = {line.split()[0]: line.split()[1:] for line in lines[-3:-1]}
  assert list(rows) == ["static", "continuous"], result.stdout
  assert all(len(fields) == 5 and float(fields[0]) > 0 for fields in rows.values()), result.stdout
  assert lines[-1].startswith("rows with the same tokens: 100%;"), result.stdout  # the tiny model: no flipped draw


@pytest.mark.slow
def test_decode_floor_benchmark_reports_every_part_against_the_weights_read():
  env = _harness_env("--xla_force_host_platform_device_count=1")
  command = [sys.executable, os.path.join(_REPO, "benchmarks", "decode_floor.py"), "--model=tiny", "--rows=4",
             "--steps=4", "--prompt=8", "--repeats=2"]
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "tiny: 1.0M float32 weights" in result.stdout and "engine steps from 4 and 8 new tokens" in result.stdout
  rows = _table_rows(result.stdout, header="part", name_width=24)
  assert list(rows) == ["read", "matmuls", "head", "head, vocabulary-major", "engine step"], result.stdout
  assert rows["read"][3:] == ["-", "1.00"], result.stdout  # the floor is the unit
  for name, fields in rows.items():  # best ms, median ms, GB/s, GFLOP/s, x read
    assert len(fields) == 5 and all(re.fullmatch(r"-?[\d.]+|-", f) for f in fields), (name, fields)
    # The engine's step is a difference of two timings: at toy sizes noise can outweigh it, so only its sign is free.
    assert name == "engine step" or float(fields[0]) > 0, (name, fields)
