"""Preemption and faults, each injected for real (docs/operations.md, "Preemption and faults"; jaxrlvr/faults.py): a
signal sent to a running job, a disk that refuses the checkpoint (a file-size limit set on the running process: the kernel
fails the write with EFBIG, as a full disk fails it with ENOSPC; root ignores a read-only directory), a truncated
checkpoint file, a run whose loss turns NaN, a killed math-verify worker, a judge server that is down. Each test
asserts what was kept: the checkpoint loads, the resumed metrics equal an uninterrupted run's, the rewards are all
computed.

The end-to-end runs are ExGRPO's smoke config (the SIGKILL test of tests/test_train.py, with 4 held-out questions)
on one CPU device; one uninterrupted run per test run is the reference (tests/shared_runs.py). The export test
exports a run made in this process (conftest's `finished_smoke_run`).
"""
import glob
import http.server
import os
import random
import re
import resource
import shutil
import socket
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import light_compile
import shared_runs
from jaxrlvr import faults
from jaxrlvr import outputs
from jaxrlvr.rewards import judge as judge_lib
from jaxrlvr.rewards import math as math_lib
from jaxrlvr.rewards.judge_prompts import JudgeRequest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 600
_OVERRIDES = ("--config.data.eval_size=4",)
_PREEMPTED = re.compile(r"^jaxrlvr: preempted at step (\d+); the same command resumes$", re.M)


def _command(workdir, *extra):
  return [sys.executable, "-m", "jaxrlvr.main", "--config=configs/exgrpo.py:smoke", f"--workdir={workdir}",
          f"--config.warm_start.cache_dir={os.environ['JAXRLVR_WARM_START_CACHE']}", *_OVERRIDES, *extra]


def _run(workdir, *extra):
  return subprocess.run(_command(workdir, *extra), cwd=_REPO, env=light_compile.job_env(), capture_output=True,
                        text=True, timeout=_TIMEOUT_S)


def _start(workdir, *extra):
  return subprocess.Popen(_command(workdir, *extra), cwd=_REPO, env=light_compile.job_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(workdir):
  """Every row of metrics.jsonl without wall-clock fields, in order."""
  return [{k: v for k, v in row.items() if k != "time" and not k.startswith("time/")}
          for row in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _by_step(workdir):
  return {row["step"]: row for row in _rows(workdir)}


def _checkpoints(workdir):
  return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


def _wait_for(condition, proc, what):
  deadline = time.time() + _TIMEOUT_S
  while not condition():
    assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
    assert time.time() < deadline, f"no {what} after {_TIMEOUT_S} s"
    time.sleep(0.02)


def _logged(workdir, step):
  path = os.path.join(workdir, "metrics.jsonl")
  return lambda: os.path.exists(path) and any(r["step"] == step for r in outputs.read_jsonl(path))


@pytest.fixture(scope="module")
def reference(smoke_warm_start):
  """The uninterrupted run: checkpoints at steps 2 and 4."""
  # The test run's one (tests/shared_runs.py), test_train.py's SIGKILL test's reference too: `_command`'s flags.
  workdir, returncode, _, stderr = shared_runs.exgrpo_smoke_reference(smoke_warm_start)
  assert returncode == 0, stderr.decode()[-4000:]
  assert _OVERRIDES == ("--config.data.eval_size=4",)  # what the shared run adds to the smoke config
  return workdir


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_the_same_command_resumes_exactly(tmp_path, reference):
  workdir = str(tmp_path / "run")
  after = random.Random().choice([0, 1, 2])  # the signal lands in a step after row `after`, or in its tail
  print(f"SIGTERM after row {after}")
  # No periodic checkpoint: the one the run resumes from is the preemption's. total_steps=100 so that the run cannot
  # finish before the signal lands (a warm smoke step takes 0.1 s); the constant learning rate makes its first steps
  # the reference's, and total_steps is a change a resumption accepts.
  proc = _start(workdir, "--config.checkpoint_every=100", "--config.total_steps=100")
  _wait_for(_logged(workdir, after), proc, f"row {after}")
  time.sleep(random.Random().uniform(0, 0.05))
  proc.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  stdout, stderr = proc.communicate(timeout=_TIMEOUT_S)
  assert proc.returncode == 0, stderr[-4000:]
  assert time.monotonic() - sent < 60  # a step and a checkpoint of the smoke model (0.1-0.5 s each unloaded)
  [step] = [int(s) for s in _PREEMPTED.findall(stdout)]
  # The step in flight when the signal came, not the end of the run: the next one, or `after` itself when the signal
  # landed in its tail (after its row was written, before its stop check). Row 0 comes before the first step.
  assert max(after, 1) <= step <= 4, (after, step)
  assert _checkpoints(workdir) == [str(step)]
  # Every row up to the saved step, each once and complete: the step in flight finished its logging and evaluation.
  expected = _by_step(reference)
  assert _rows(workdir) == [expected[s] for s in range(step + 1)]

  result = _run(workdir, "--config.checkpoint_every=100")
  assert result.returncode == 0, result.stderr[-4000:]
  assert f"resumed from {os.path.join(workdir, 'checkpoints')} at step {step}" in result.stderr
  assert _rows(workdir) == [expected[s] for s in range(5)]  # bit for bit, and no step logged twice


_SIGNAL_SCRIPT = textwrap.dedent("""
  import sys, time
  from jaxrlvr import faults
  stop = faults.StopSignals()
  print("ready", flush=True)
  while stop.received is None:
    time.sleep(0.01)
  print("requested", flush=True)
  stop.stop(7, save=lambda: time.sleep(float(sys.argv[1])), close=())
""")


def _signal_script(tmp_path, save_s):
  script = tmp_path / "stop.py"
  script.write_text(_SIGNAL_SCRIPT)
  proc = subprocess.Popen([sys.executable, str(script), str(save_s)], cwd=_REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == "ready\n"
  return proc


@pytest.mark.slow  # a whole main command
def test_sigint_exits_130_and_a_second_signal_ends_the_save_at_once(tmp_path):
  proc = _signal_script(tmp_path, 0.0)
  proc.send_signal(signal.SIGINT)
  stdout, _ = proc.communicate(timeout=60)
  assert proc.returncode == 130
  assert _PREEMPTED.findall(stdout) == ["7"]
  # A save that would take a minute: the same signal again at once is the same request (a scheduler signals several
  # processes of a job); a second one later ends the process now, without the line.
  proc = _signal_script(tmp_path, 60.0)
  proc.send_signal(signal.SIGTERM)
  assert proc.stdout.readline() == "requested\n"
  proc.send_signal(signal.SIGTERM)
  time.sleep(1.5)
  assert proc.poll() is None
  proc.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  stdout, stderr = proc.communicate(timeout=30)
  assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - sent < 5
  assert "SIGTERM again; stopping now" in stderr and not _PREEMPTED.findall(stdout)


def _limited_after_the_first_checkpoint(workdir):
  """The run started and, once its checkpoint of step 2 is written, limited so that the kernel refuses to grow any of
  its files past 1 MB: the next checkpoint (5 MB of arrays) fails half-written, while metrics.jsonl and the summary
  figure stay below the limit. The run is stopped (SIGSTOP) while the limit is set; if it had already finished the
  checkpoint of step 4 by then (its steps take ~0.2 s, and this process may wait that long for a core), it is
  killed and started again, at most 3 times."""
  directory = os.path.join(workdir, "checkpoints")
  for _ in range(3):
    shutil.rmtree(workdir, ignore_errors=True)
    proc = _start(workdir)
    _wait_for(lambda: os.path.isdir(os.path.join(directory, "2")), proc, "the checkpoint of step 2")
    os.kill(proc.pid, signal.SIGSTOP)
    with open(f"/proc/{proc.pid}/stat", encoding="utf-8") as f:
      while f.read().rsplit(")", 1)[1].split()[0] != "T":  # the state field: stopped
        f.seek(0)
    if not os.path.isdir(os.path.join(directory, "4")):
      resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
      os.kill(proc.pid, signal.SIGCONT)
      return proc
    proc.kill()
    proc.communicate()
  pytest.fail("the run wrote its checkpoint of step 4 before the test could limit it, 3 times")


@pytest.mark.slow  # a whole main command
def test_a_checkpoint_the_disk_refuses_stops_the_run_and_keeps_the_previous_one(tmp_path, reference):
  workdir = str(tmp_path / "run")
  proc = _limited_after_the_first_checkpoint(workdir)
  _, stderr = proc.communicate(timeout=_TIMEOUT_S)
  assert proc.returncode == 2, stderr[-4000:]
  directory = os.path.join(workdir, "checkpoints")
  errors = re.findall(r"jaxrlvr: error: .*", stderr)
  assert len(errors) == 1 and errors[0].startswith(f"jaxrlvr: error: cannot write the checkpoint of step 4 in "
                                                   f"{directory} ("), errors
  assert "File too large" in errors[0] and "the checkpoint of step 2 is intact" in errors[0]
  assert _checkpoints(workdir) == ["2"]  # the half-written step 4 is gone, not taken as the latest
  result = _run(workdir)  # the kept checkpoint loads, and the run ends as the uninterrupted one
  assert result.returncode == 0, result.stderr[-4000:]
  assert _by_step(workdir) == _by_step(reference)


def test_the_disks_reason_is_found_in_whatever_orbax_and_tensorstore_wrap_it_in():
  """The reason a write failed, as the one-line errors name it: an OSError's own; tensorstore's os_error_code, at the
  end of its message or before more text, or a disk error's text, in the error or in one it was raised from; else the
  error's first line. (CI once got the zarr metadata's failed write, whose reason the earlier pattern missed.)"""
  assert faults.error_reason(OSError(28, "No space left on device")) == "No space left on device, errno 28"
  written = ValueError("OUT_OF_RANGE: Error writing \"x/0.0\" in OCDBT database at local file \"/c/\": Failed to "
                       "write 502462 bytes to file 20: File too large [os_error_code='27']")
  assert faults.error_reason(written) == "File too large, errno 27"
  opened = ValueError("OUT_OF_RANGE: Error opening \"zarr\" driver: Error writing \"a/.zarray\": File too large "
                      "[os_error_code=27] [source locations='tensorstore/kvstore/file/file_key_value_store.cc:527']")
  assert faults.error_reason(opened) == "File too large, errno 27"
  no_code = ValueError("OUT_OF_RANGE: Error opening \"zarr\" driver: Failed writing: \"/c/d/1\": No space left on device")
  assert faults.error_reason(no_code) == "No space left on device, errno 28"
  try:
    try:
      raise OSError(27, "File too large")
    except OSError as e:
      raise RuntimeError("the save of step 4 failed") from e
  except RuntimeError as wrapped:
    assert faults.error_reason(wrapped) == "File too large, errno 27"
  assert faults.error_reason(ValueError("first line\nsecond")) == "ValueError: first line"


def test_an_export_the_disk_refuses_is_one_line_and_leaves_nothing_half_written(tmp_path, finished_smoke_run):
  """`python -m jaxrlvr.export` of a finished run under a 1 MB file-size limit: its model.safetensors (4 MB) fails
  with EFBIG. One line, exit 2; no export and no staging directory left; the run's export (DIR/hf) untouched. The
  run is conftest's `finished_smoke_run`, not the reference: that one warm-starts, which the fast tier would train
  for this test alone (~150 of its ~530 CPU-s)."""
  finished_run, _ = finished_smoke_run
  out = tmp_path / "export"
  hf = os.path.join(finished_run, "hf")
  modified = lambda: {name: os.path.getmtime(os.path.join(hf, name)) for name in os.listdir(hf)}  # the run's export
  before, listing = modified(), os.listdir(finished_run)
  limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY));"
             " sys.argv[0] = 'export'; runpy.run_module('jaxrlvr.export', run_name='__main__')")
  result = subprocess.run([sys.executable, "-c", limited, f"--workdir={finished_run}", f"--out={out}"], cwd=_REPO,
                          env=light_compile.job_env(), capture_output=True, text=True, timeout=_TIMEOUT_S)
  assert result.returncode == 2, result.stderr[-4000:]
  assert "Traceback" not in result.stderr, result.stderr[-4000:]
  line = result.stderr.strip().splitlines()[-1]
  assert line == (f"jaxrlvr.export: cannot write the export {out} (File too large, errno 27); an earlier export "
                  "there, if any, is unchanged"), line
  assert os.listdir(tmp_path) == [] and os.listdir(finished_run) == listing
  assert modified() == before


def test_a_refused_export_at_the_end_of_a_run_says_how_to_write_it_later(monkeypatch, tmp_path):
  """The run's own export (`train.Trainer.export`, after the final checkpoint) adds what is kept and what writes it."""
  import types  # pylint: disable=g-import-not-at-top
  from jaxrlvr import export as export_lib  # pylint: disable=g-import-not-at-top
  from jaxrlvr import train  # pylint: disable=g-import-not-at-top

  def refuse(model, model_config, tokenizer, out_dir, *, dtype=None):  # as export_hf says a refused write
    del model, model_config, tokenizer, dtype
    raise export_lib.ExportError(f"cannot write the export {out_dir} (No space left on device, errno 28); an earlier "
                                 "export there, if any, is unchanged")

  monkeypatch.setattr(export_lib, "export_hf", refuse)
  trainer = types.SimpleNamespace(policy=lambda params: None, state=types.SimpleNamespace(params=None),
                                  model_config=None, data=types.SimpleNamespace(tokenizer=None), workdir=str(tmp_path),
                                  config=types.SimpleNamespace(model=types.SimpleNamespace(path="")))
  with pytest.raises(export_lib.ExportError) as raised:
    train.Trainer.export(trainer, 40)
  assert str(raised.value) == (
      f"cannot write the export {tmp_path / 'hf'} (No space left on device, errno 28); an earlier export there, if "
      "any, is unchanged. The run's checkpoint of step 40 is kept: once there is room, the same command writes the "
      f"missing export (or python -m jaxrlvr.export --workdir={tmp_path})")


@pytest.mark.slow
def test_an_unreadable_latest_checkpoint_is_set_aside_and_the_one_before_resumes(tmp_path, reference):
  workdir = str(tmp_path / "run")
  shutil.copytree(reference, workdir)
  data = max(glob.glob(os.path.join(workdir, "checkpoints", "4", "train", "ocdbt.process_0", "d", "*")),
             key=os.path.getsize)
  os.truncate(data, 1000)  # the largest array file of step 4, cut short
  result = _run(workdir, "--config.total_steps=5")  # extended: the run must read step 4's arrays
  assert result.returncode == 0, result.stderr[-4000:]
  assert f"jaxrlvr: the checkpoint of step 4 in {os.path.join(workdir, 'checkpoints')} cannot be read" in result.stdout
  assert os.listdir(os.path.join(workdir, "checkpoints-unreadable")) == ["4"]  # kept aside, not deleted
  rows, expected = _by_step(workdir), _by_step(reference)
  assert sorted(rows) == [0, 1, 2, 3, 4, 5]
  for step in (3, 4):  # redone from step 2, as the uninterrupted run did them
    assert rows[step] == expected[step], step


def test_checkpoints_that_cannot_be_read_fall_back_then_stop(tmp_path):
  """In-process, on a tiny state: a half-written save (orbax's temporary directory) is never the latest and is
  removed; truncated metadata moves a step aside; with none left the run stops instead of starting over."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxrlvr import checkpointing  # pylint: disable=g-import-not-at-top
  state = {"w": jnp.arange(4.0)}
  checkpointer = checkpointing.Checkpointer(str(tmp_path))
  for step in (1, 2):
    checkpointer.save(step, state, {"replay": {}}, {"step": step})
  checkpointer.close()
  partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
  (partial / "train").mkdir(parents=True)
  checkpointer = checkpointing.Checkpointer(str(tmp_path))
  assert checkpointer.latest_readable_step() == 2
  for meta in glob.glob(str(tmp_path / "checkpoints" / "2" / "meta" / "*")):
    os.truncate(meta, 3)
  assert checkpointer.latest_readable_step() == 1
  assert sorted(os.listdir(tmp_path / "checkpoints-unreadable")) == ["2"]
  for meta in glob.glob(str(tmp_path / "checkpoints" / "1" / "meta" / "*")):
    os.truncate(meta, 3)
  with pytest.raises(checkpointing.CheckpointError, match=r"no readable checkpoint is left in .*steps \[2, 1\]"):
    checkpointer.latest_readable_step()
  checkpointer.close()
  assert not partial.exists()


@pytest.mark.slow
@pytest.mark.usefixtures("smoke_warm_start")
def test_a_run_whose_loss_stays_nonfinite_stops_naming_the_step_and_metric(tmp_path):
  workdir = str(tmp_path / "run")
  # A learning rate no float32 survives: the first update makes the parameters huge, every later loss is NaN. The
  # smoke model solves nothing (its advantages are 0), so the entropy bonus gives that first update its gradient.
  result = _run(workdir, "--config.optim.lr=1e38", "--config.optim.max_nonfinite_steps=2",
                "--config.loss.entropy_coef=0.01")
  assert result.returncode == 2, result.stderr[-4000:]
  [error] = re.findall(r"jaxrlvr: error: .*", result.stderr)
  assert error.startswith("jaxrlvr: error: step 3: loss/total=nan, optim/grad_norm=nan; 2 steps in a row"), error
  assert "optim.max_nonfinite_steps=2" in error
  rows = _by_step(workdir)
  assert sorted(rows) == [0, 1, 2, 3]  # the bad steps were logged before the run stopped
  assert [rows[s]["optim/skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
  assert _checkpoints(workdir) == ["2"]


def test_a_killed_math_verify_worker_is_replaced_and_every_reward_computed():
  # Distinct fractions: each goes to math-verify (no fast path) and none is cached, so the batch lasts long enough.
  completions = [f"\\boxed{{\\frac{{{i}}}{{{2 * i + i % 3}}}}}" for i in range(1, 121)]
  golds = ["0.5"] * len(completions)
  with math_lib.MathRewardPool(num_workers=1) as pool:
    expected, _ = pool.score(completions, golds)
    assert 0 < expected.sum() < len(expected)
    [worker] = pool._workers  # pylint: disable=protected-access
    killed = []

    def kill_mid_batch():
      while not worker.inflight:
        time.sleep(0.001)
      os.kill(worker.proc.pid, signal.SIGKILL)
      killed.append(worker.proc.pid)

    killer = threading.Thread(target=kill_mid_batch)
    killer.start()
    rewards, info = pool.score(completions, golds)
    killer.join()
  np.testing.assert_array_equal(rewards, expected)  # the item it was on was scored again, not set to 0
  assert killed and info["worker_restarts"] == 1 and info["crashes"] == 0


class _DownServer:
  """A judge endpoint that answers every request 503 and counts them."""

  def __init__(self):
    self.hits = 0
    state = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def log_message(self, *args):
        pass

      def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        state.hits += 1
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def test_a_judge_that_is_down_costs_one_round_of_retries_then_skips_or_stops():
  server = _DownServer()
  requests = [JudgeRequest(question="What is 2+3?", reference="2+3=5", answer=str(i)) for i in range(24)]
  kwargs = {"timeout_s": 5.0, "max_retries": 2, "max_concurrency": 4, "backoff_s": 0.05}
  try:
    results = judge_lib.HttpJudge(server.url, "judge", **kwargs).score(requests)
    assert all(r.score is None and r.error.startswith("http 503") for r in results)  # each becomes a failed result
    # The first requests try 3 times; once one has, the rest get one try each: at most 4 x 3 + 20, not 24 x 3.
    assert len(requests) <= server.hits <= 4 * 3 + 20, server.hits
    assert sum(r.attempts == 1 for r in results) >= 16
    server.hits = 0
    with pytest.raises(judge_lib.JudgeError, match=re.escape(f"{server.url}/v1/chat/completions failed 24 of 24")):
      judge_lib.HttpJudge(server.url, "judge", on_failure="error", **kwargs).score(requests)
  finally:
    server.close()
  with pytest.raises(ValueError, match="on_failure='retry'"):
    judge_lib.HttpJudge(server.url, "judge", on_failure="retry")


# ---------------------------------------------------------------------------------------------------------------
# One process of a multi-process run dies


_PEER_SCRIPT = textwrap.dedent("""
    import sys, time
    from jaxrlvr import main, multihost, parallel
    parallel.initialize_distributed(sys.argv[2], 2, int(sys.argv[1]), heartbeat_timeout_s=10)
    try:
      for step in range(10_000):  # the loop's per-step agreement (faults.StopSignals.agreed) and little else
        multihost.agree_any(False)
        print("STEP", step, flush=True)
        time.sleep(0.1)
    except Exception as e:
      main.exit_if_peer_lost(e)
      raise
""")


def _two_processes(path, script: str) -> list[subprocess.Popen]:
  """`script` (argv: process id, coordinator address) started as processes 0 and 1 of one JAX distributed job."""
  path.write_text(script)
  with socket.socket() as s:
    s.bind(("localhost", 0))
    address = f"localhost:{s.getsockname()[1]}"
  env = light_compile.job_env(light=False, PYTHONPATH=_REPO)
  return [subprocess.Popen([sys.executable, str(path), str(i), address], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in range(2)]


@pytest.mark.slow  # two processes
def test_a_dead_process_stops_the_others_with_one_line_not_a_hang(tmp_path):
  # Two real processes (JAX's distributed runtime, gloo collectives on CPU) agree every step, as the loop does; one
  # is killed with SIGKILL. The other must stop within seconds, exit 2, with one line that says what happened, and
  # without the shutdown barrier's abort (a "Check failure" stack dump after the heartbeat timeout).
  procs = _two_processes(tmp_path / "peer.py", _PEER_SCRIPT)
  try:
    for line in procs[0].stdout:  # both are in the loop once process 0 has agreed a few times
      if line.startswith("STEP 5"):
        break
    procs[1].kill()
    killed = time.monotonic()
    _, stderr = procs[0].communicate(timeout=60)
  finally:
    for p in procs:
      p.kill()
  assert time.monotonic() - killed < 30, "the survivor waited for the dead process"
  assert procs[0].returncode == 2, stderr[-3000:]
  last = stderr.strip().splitlines()[-1]
  assert last.startswith("jaxrlvr: error: process 0 of 2: a collective with the other processes failed"), last
  assert "has most likely stopped" in last and "resumes from the last checkpoint" in last
  assert "Check failure" not in stderr


_AGREE_SCRIPT = textwrap.dedent("""
    import sys, time
    from jaxrlvr import faults, multihost, parallel
    parallel.initialize_distributed(sys.argv[2], 2, int(sys.argv[1]), heartbeat_timeout_s=10)
    signals = faults.StopSignals()
    for step in range(10_000):
      time.sleep(0.05 if sys.argv[1] == "0" else 0.2)  # the hosts run at different speeds
      print("STEP", step, flush=True)
      if signals.agreed():  # the loop's one agreement point a step
        print("STOP AT", step, flush=True)
        break
    multihost.agree_any(False)  # both still in step: a host that had left would leave this one waiting
""")


@pytest.mark.slow  # two processes
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(tmp_path):
  # SIGTERM reaches process 1 only (a scheduler that signals one task): both processes leave the loop after the same
  # step, so they save the same checkpoint and neither waits in a collective the other has left.
  procs = _two_processes(tmp_path / "agree.py", _AGREE_SCRIPT)
  try:
    for line in procs[1].stdout:
      if line.startswith(f"STEP {random.randint(3, 8)}"):
        break
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=60) for p in procs]
  finally:
    for p in procs:
      p.kill()
  stops = []
  for p, (stdout, stderr) in zip(procs, outs):
    assert p.returncode == 0, stderr[-3000:]
    stops.append([line for line in stdout.splitlines() if line.startswith("STOP AT")])
  assert stops[0] == stops[1] and len(stops[0]) == 1, stops
  assert "SIGTERM received" in outs[1][1] and "SIGTERM received" not in outs[0][1]
