"""A benchmark's worker process that dies is named, with its exit status and the likely cause, and the harness exits
non-zero with one line instead of a traceback (benchmarks/workers.py). The workers here are a few lines of Python
that answer or kill themselves, so each check costs a process start, not a model."""
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCHMARKS = os.path.join(_REPO, "benchmarks")
sys.path.insert(0, _BENCHMARKS)
import peer_grpo  # pylint: disable=g-import-not-at-top,wrong-import-position  (from benchmarks/)
import workers  # pylint: disable=g-import-not-at-top,wrong-import-position

# A peer_grpo worker that answers every command as a step would, and one that dies at its first command: killed by
# the kernel (what memory pressure does to TRL's worker), or ended by an exception.
_ANSWERS = ("import json, sys, time\n"
            "for line in sys.stdin:\n"
            "  time.sleep(0.3)\n"
            "  print(json.dumps({'step_s': 0.3, 'qids': [0]}), flush=True)\n")
_DIES = {
    "killed": "import os, signal, sys; sys.stdin.readline(); os.kill(os.getpid(), signal.SIGKILL)",
    # Dead before the harness writes its first command (the jaxrlvr worker's step takes longer): a BrokenPipeError.
    "killed at start": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "exception": "import sys; sys.stdin.readline(); raise MemoryError('std::bad_alloc')",
}
_KILLED = ("the trl worker (asked for step 1) was killed by signal 9 (SIGKILL): usually the kernel's out-of-memory "
           "killer (`dmesg | grep -i oom` says so; try a smaller workload or fewer threads), or a `kill -9`; its log: "
           "{log}")
_SAYS = {
    "killed": _KILLED,
    "killed at start": _KILLED,
    "exception": ("the trl worker (asked for step 1) exited with status 1; its log: {log} (last line: MemoryError: "
                  "std::bad_alloc)"),
}


@pytest.mark.parametrize("returncode, words", [
    (-signal.SIGKILL, "was killed by signal 9 (SIGKILL): usually the kernel's out-of-memory killer"),
    (128 + signal.SIGKILL, "exited with status 137 (128 + signal 9, SIGKILL): usually the kernel's out-of-memory"),
    (-signal.SIGSEGV, "was killed by signal 11 (SIGSEGV): a crash in native code"),
    (1, "exited with status 1"),
])
def test_exit_status_names_the_signal_and_its_likely_cause(returncode, words):
  assert workers.exit_status(returncode).startswith(words)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a BrokenPipeError at clean-up
@pytest.mark.parametrize("how", sorted(_DIES))
def test_peer_grpo_names_the_worker_that_died(tmp_path, how):
  peers = {"jaxrlvr": peer_grpo.Worker("jaxrlvr", "", str(tmp_path / "jaxrlvr.log"),
                                       command=[sys.executable, "-c", _ANSWERS]),
           "trl": peer_grpo.Worker("trl", "", str(tmp_path / "trl.log"), command=[sys.executable, "-c", _DIES[how]])}
  with pytest.raises(workers.WorkerDied) as e:
    peer_grpo.interleave(peers, steps=2, eval_size=0)
  assert _SAYS[how].format(log=tmp_path / "trl.log") in str(e.value), str(e.value)
  assert all(w.proc.returncode is not None for w in peers.values())  # both closed: the live one was told to quit


@pytest.mark.parametrize("how", ["killed", "killed at start"])
def test_peer_grpo_harness_exits_non_zero_with_one_line(tmp_path, how):
  """The harness's main as it ends when a worker dies: the progress lines, then one error line, exit status 1, and
  nothing at interpreter exit (the unsent bytes of a dead worker's pipe once printed a BrokenPipeError)."""
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {_BENCHMARKS!r})
      import peer_grpo, workers
      @workers.one_line_on_death("peer_grpo")
      def main():
        peer_grpo.interleave({{
            "jaxrlvr": peer_grpo.Worker("jaxrlvr", "", {str(tmp_path / 'j.log')!r},
                                        command=[sys.executable, "-c", {_ANSWERS!r}]),
            "trl": peer_grpo.Worker("trl", "", {str(tmp_path / 't.log')!r},
                                    command=[sys.executable, "-c", {_DIES[how]!r}])}}, steps=3, eval_size=0)
      main()
      """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  lines = [line for line in result.stderr.splitlines() if not line.startswith("peer_grpo: step ")]
  assert result.returncode == 1 and len(lines) == 1, result.stderr
  assert lines[0] == "peer_grpo: error: " + _KILLED.format(log=tmp_path / "t.log"), result.stderr


def _kill_self(conn) -> None:
  del conn
  os.kill(os.getpid(), signal.SIGKILL)


def test_a_multiprocessing_worker_that_dies_is_named_not_waited_for():
  """sampler.py's and sampler_long_tail.py's transformers worker (a multiprocessing Process and Pipe)."""
  conn, process = workers.start(multiprocessing.get_context("spawn"), _kill_self, ())
  with pytest.raises(workers.WorkerDied, match=r"the transformers worker was killed by signal 9 \(SIGKILL\)"):
    workers.ask(conn, process, "transformers worker", 4)
  workers.stop(conn, process)  # as the harness's `finally` does: no BrokenPipeError
