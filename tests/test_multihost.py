"""The main job as 2 CPU processes on localhost (launch/local.sh), 4 fake devices each, one global mesh of 8: both
finish, agree on the global metrics, write one checkpoint together, resume from it, and refuse to resume with a
different process count.

Every process logs the global metrics row it computed ("host I global metrics at step N: {json}", train.py), so
the test compares what each host computed; metrics.jsonl is host 0's.
"""
import json
import os
import re
import subprocess
import sys

import pytest

import light_compile
from jaxrlvr import outputs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 600
_ROW = re.compile(r"host (\d) global metrics at step (\d+): (\{.*\})$")
# ExGRPO's smoke config with the least work: 8 held-out questions, evaluations at step 0 and at the end only.
_OVERRIDES = ("--config.eval_every=100", "--config.checkpoint_every=100", "--config.data.eval_size=8")


def _command(workdir: str, cache: str, *extra: str, processes: int = 2) -> list[str]:
  job = [sys.executable, "-m", "jaxrlvr.main", "--config=configs/exgrpo.py:smoke", f"--workdir={workdir}",
         f"--config.warm_start.cache_dir={cache}", *_OVERRIDES, *extra]
  return [os.path.join(_REPO, "launch", "local.sh"), str(processes), "--", *job]


def _run(workdir: str, cache: str, *extra: str, processes: int = 2, devices: int = 4) -> subprocess.CompletedProcess:
  # Compiled light (tests/light_compile.py): a few smoke steps are mostly compiling (the smoke config trains no warm
  # start).
  return subprocess.run(_command(workdir, cache, *extra, processes=processes), cwd=_REPO,
                        env=light_compile.job_env(devices), capture_output=True, text=True, timeout=_TIMEOUT_S)


def _host_rows(output: str) -> dict[int, dict[int, dict]]:
  """host -> step -> the global metrics row that host logged."""
  rows: dict[int, dict[int, dict]] = {0: {}, 1: {}}
  for line in output.splitlines():  # host 0's progress bar may share a line: search, not match
    match = _ROW.search(line)
    if match:
      host, step, row = match.groups()
      rows[int(host)][int(step)] = json.loads(row)
  return rows


def _checkpoints(workdir: str) -> list[int]:
  return sorted(int(name) for name in os.listdir(os.path.join(workdir, "checkpoints")) if name.isdigit())


@pytest.mark.slow
def test_two_processes_agree_checkpoint_and_resume(tmp_path, smoke_warm_start):
  workdir = str(tmp_path / "run")
  first = _run(workdir, smoke_warm_start, "--config.total_steps=2")
  assert first.returncode == 0, first.stdout[-6000:]
  rows = _host_rows(first.stdout)
  assert sorted(rows[0]) == sorted(rows[1]) == [1, 2], first.stdout[-3000:]
  for step in (1, 2):  # every value, timings included (host-side metrics are averaged over hosts)
    assert rows[0][step] == rows[1][step], step
  # metrics.jsonl is host 0's alone: step 0's evaluation, then the same rows the hosts logged.
  logged = {r["step"]: r for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))}
  assert sorted(logged) == [0, 1, 2]
  assert {k: v for k, v in logged[2].items() if k not in ("step", "time")} == rows[0][2]
  for key in ("rollout/solve_rate", "replay/phase", "replay/batch_rollouts", "loss/policy", "eval/accuracy"):
    assert key in logged[2], key
  # Each host composed B / P = 2 groups of K = 4: the per-host mean of its batch rollouts is 8.
  assert logged[2]["replay/batch_rollouts"] == 8
  assert _checkpoints(workdir) == [2]  # one checkpoint, written by both processes, at the final step

  second = _run(workdir, smoke_warm_start, "--config.total_steps=3")
  assert second.returncode == 0, second.stdout[-6000:]
  assert len(re.findall(r"resumed from \S+ at step 2$", second.stdout, re.M)) == 2  # one line per process
  rows = _host_rows(second.stdout)
  assert sorted(rows[0]) == sorted(rows[1]) == [3] and rows[0][3] == rows[1][3]
  steps = [r["step"] for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]
  assert steps == [0, 1, 2, 3]  # continued from the checkpoint: no second step-0 evaluation, no step redone
  assert _checkpoints(workdir) == [2, 3]

  # One process cannot take over two processes' replay buffers and data positions.
  single = _run(workdir, smoke_warm_start, "--config.total_steps=4", processes=1, devices=8)
  assert single.returncode != 0
  assert "written by 2 process(es)" in single.stdout and "this run has 1" in single.stdout


def test_phase_switch_follows_the_global_solve_rate():
  from jaxrlvr import multihost  # pylint: disable=g-import-not-at-top
  # Host 0 solved 6/8 (switched on alone), host 1 1/8: global 7/16 = 0.4375 > 0.35, both on.
  assert multihost.global_phase([[6, 8, 1], [1, 8, 0]], 0.35)
  # Host 0 solved 3/8 = 0.375 (switched on alone), host 1 2/8: global 5/16 = 0.3125 <= 0.35, host 0 goes back off.
  assert not multihost.global_phase([[3, 8, 1], [2, 8, 0]], 0.35)
  # Both on with a global rate of 2/16 = 0.125: they switched together at an earlier step and stay on (one-way).
  assert multihost.global_phase([[1, 8, 1], [1, 8, 1]], 0.35)


def test_batch_rows_are_per_host_rows_times_hosts():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxrlvr import config_lib, run_setup  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict({"rollout": {"batch_size": 6, "group_size": 4}, "replay": {"name": "exgrpo"},
                                      "train": {"num_minibatches": 1, "num_microbatches": 2}})
  # One host, 8 batch shards: 6 x 4 = 24 rollouts, rounded up to a multiple of 2 x 8 = 16: 32.
  assert run_setup.batch_rows(config, 8) == 32
  # Two hosts: each has 3 x 4 = 12 rollouts, rounded up to a multiple of 2 x (8 / 2) = 8: 16; 2 x 16 = 32 in all.
  assert run_setup.batch_rows(config, 8, 2) == 32
  # Three hosts cannot share 8 batch shards; four hosts cannot share 6 questions.
  with pytest.raises(config_lib.ConfigError, match="not a multiple of the 3 processes"):
    run_setup.batch_rows(config, 8, 3)
  with pytest.raises(config_lib.ConfigError, match=r"rollout.batch_size=6: must be divisible by the number of "
                                                   r"processes \(4\)"):
    run_setup.batch_rows(config, 8, 4)
