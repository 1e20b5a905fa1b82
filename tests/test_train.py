"""The main job end to end on the `:smoke` configs: every method runs, resumes exactly after SIGKILL, and refuses a
config change that would break resumption."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import light_compile
import shared_runs
from jaxrlvr import outputs

pytestmark = pytest.mark.slow  # every test here runs whole main commands

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 600


def _command(method: str, workdir: str, cache: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", "jaxrlvr.main", f"--config=configs/{method}.py:smoke", f"--workdir={workdir}",
          f"--config.warm_start.cache_dir={cache}", *extra]


def _env(method: str) -> dict:
  """Compiled light (tests/light_compile.py), but for ExpRL: its judge decodes every step, so its job mostly runs
  (its smoke run: 31.4 CPU-s compiled light against 25.4 at XLA's defaults, 2026-12-06)."""
  return light_compile.job_env(light=method != "exprl")


def _run(method, workdir, cache, *extra):
  result = subprocess.run(_command(method, workdir, cache, *extra), cwd=_REPO, env=_env(method),
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-4000:]
  return result


def _by_step(workdir):
  """The last row logged for each step, without wall-clock fields (they differ between runs)."""
  rows = {}
  for row in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl")):
    rows[row["step"]] = {k: v for k, v in row.items() if k != "time" and not k.startswith("time/")}
  return rows


@pytest.mark.parametrize("method", ["grpo", "advantage_priority", "bapo", "exprl"])
def test_smoke_runs_every_method(method, tmp_path, smoke_warm_start):
  workdir = str(tmp_path / method)
  if method == "grpo":  # the command tests/test_run_outputs.py reads too: run once a test run (tests/shared_runs.py)
    shared, returncode, _, stderr = shared_runs.grpo_smoke(smoke_warm_start)
    assert returncode == 0, stderr.decode()[-4000:]
    shutil.copytree(shared, workdir)  # the second command below runs on this test's own copy
  else:
    _run(method, workdir, smoke_warm_start)
  rows = _by_step(workdir)
  assert sorted(rows) == [0, 1, 2, 3, 4]
  for key in ("rollout/solve_rate", "rollout/response_length", "loss/policy", "loss/entropy", "optim/grad_norm",
              "optim/skipped", "policy/fresh/ratio_mean", "time/step_s"):
    assert key in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[-1], key
  assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[4]
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["replay"]["name"] == ("none" if method in ("grpo", "exprl") else method)
  if method == "exprl":  # the judge ran on every finished rollout (the tiny policy as judge cannot parse: removed)
    last = outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[-1]
    assert last["judge/requests"] + last["judge/clipped_rollouts"] > 0
    assert last["judge/removed_rollouts"] == last["judge/parse_failures"] + last["judge/request_failures"]
  assert any(name.startswith("events") for name in os.listdir(os.path.join(workdir, "tensorboard")))
  # Started again on a finished workdir, the job says so and exits 0.
  again = _run(method, workdir, smoke_warm_start)
  assert "is finished" in again.stdout


def test_sigkill_after_first_checkpoint_resumes_exactly(tmp_path, smoke_warm_start):
  # The uninterrupted run is tests/test_faults.py's reference (4 held-out questions), made once a test run
  # (tests/shared_runs.py); the killed run and its resumption use the same flags.
  reference, returncode, _, stderr = shared_runs.exgrpo_smoke_reference(smoke_warm_start)
  assert returncode == 0, stderr.decode()[-4000:]
  eval_size = "--config.data.eval_size=4"
  killed = str(tmp_path / "killed")
  proc = subprocess.Popen(_command("exgrpo", killed, smoke_warm_start, eval_size), cwd=_REPO, env=_env("exgrpo"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  first = os.path.join(killed, "checkpoints", "2")
  deadline = time.time() + _TIMEOUT_S
  while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert os.path.isdir(first), "the run ended before its first checkpoint"
  _run("exgrpo", killed, smoke_warm_start, eval_size)
  expected, resumed = _by_step(reference), _by_step(killed)
  assert sorted(resumed) == sorted(expected) == [0, 1, 2, 3, 4]
  assert resumed[4]["replay/replayed_rollouts"] > 0 or expected[4]["replay/buffer_trajectories"] == 0
  for step in (3, 4):
    assert resumed[step] == expected[step], step


def test_resume_refuses_a_config_change_that_breaks_it(tmp_path, smoke_warm_start):
  workdir = str(tmp_path / "run")
  _run("grpo", workdir, smoke_warm_start, "--config.total_steps=2")
  result = subprocess.run(_command("grpo", workdir, smoke_warm_start, "--config.rollout.group_size=8"), cwd=_REPO,
                          env=_env("grpo"), capture_output=True, text=True, timeout=_TIMEOUT_S)
  assert result.returncode != 0
  assert "rollout.group_size: 4 -> 8" in result.stderr
