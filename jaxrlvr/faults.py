"""What a run does when it is told to stop, or when a part of it keeps failing (docs/operations.md, "Preemption and
faults").

Preemption. Schedulers (SLURM, TPU pods, spot machines) stop a job with SIGTERM and kill it some seconds later; a
user stops one with Ctrl-C (SIGINT). Once the run is built (from the step-0 evaluation on), `StopSignals` turns the
first such signal into a request that the loop honours at one fixed point of every step: after the step's logging,
evaluation and periodic checkpoint. The step in flight thus finishes exactly as it would have, so metrics.jsonl
holds the uninterrupted run's rows up to it and the resumed run continues bit for bit (what a step computes never
depends on the signal).
With several processes the request is agreed there (`multihost.agree_any`, one tiny collective a step, at the same
point on every host), so every host saves the same step and none waits in a collective the others have left. The run
then writes the checkpoint of that step (unless the step just wrote one), closes its metrics, prints
`jaxrlvr: preempted at step N; the same command resumes` and exits 0 for SIGTERM (the scheduler asked for it; a
requeued job resumes) or 130 for SIGINT (the shell's convention for Ctrl-C).

A second signal ends the process at once, exit 128 + the signal's number: orbax writes a checkpoint into a temporary
directory and renames it when it is complete (checkpointing.py), so a save cut short leaves the last complete
checkpoint the latest. The same signal again within `DUPLICATE_S` is the same request, not a second one: a scheduler
that stops a job signals several of its processes (SLURM's srun forwards the SIGTERM its tasks also get). While the
run is built (data, model, warm start, compilation) a signal keeps its default effect: nothing is lost by dying there.

A start with nothing to learn from. `UnsolvableWatch` stops a run from step 0 whose policy answers none of the
held-out rows and (next to) none of its first steps' rollouts (`train.stop_if_unsolvable_steps`), with what to change.

Non-finite updates. step.py skips an optimizer step whose gradient norm is not finite, and counts it
(`optim/skipped`). A run that keeps producing them has diverged; `NonFiniteStreak` stops it once
`optim.max_nonfinite_steps` steps in a row had a non-finite loss or gradient norm, naming the step and the metric.
"""
import errno
import math
import os
import re
import signal
import sys
import threading
import time

import jax
from absl import logging

from jaxrlvr import config_lib
from jaxrlvr import logs
from jaxrlvr import multihost
from jaxrlvr import outputs
from jaxrlvr import replay
from jaxrlvr import warm_start

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_S = 1.0
_EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 128 + signal.SIGINT}  # 130: what a shell reports for Ctrl-C


class RunError(RuntimeError):
  """A run that cannot go on for a reason outside the code (a disk that refuses the checkpoint, a diverged loss):
  main.py prints it as one `jaxrlvr: error: ...` line and exits 2."""


# tensorstore's "...: File too large [os_error_code='27']", sometimes with more after it (source locations).
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# What a disk refuses a write with, found by its text where a message gives no code.
_DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)


def error_reason(error) -> str:
  """The system's reason when there is one ("No space left on device, errno 28"), from the error or the errors it
  was raised from, else `Type: first line` (orbax and tensorstore errors run over many lines)."""
  if not isinstance(error, BaseException):
    return str(error)
  seen, cause = set(), error
  while cause is not None and id(cause) not in seen:
    seen.add(id(cause))
    if isinstance(cause, OSError) and cause.strerror:
      return f"{cause.strerror}, errno {cause.errno}"
    if match := _OS_ERROR_CODE.search(str(cause)):
      return f"{os.strerror(int(match.group(1)))}, errno {match.group(1)}"
    if code := next((c for c in _DISK_ERRNOS if os.strerror(c) in str(cause)), None):
      return f"{os.strerror(code)}, errno {code}"
    cause = cause.__cause__ or cause.__context__
  text = str(error).strip().splitlines()
  first = text[0].split(" See full TensorStore details")[0][:300] if text else ""
  return f"{type(error).__name__}: {first}".rstrip(": ")


class Preempted(SystemExit):
  """Raised by `StopSignals.stop` once the step is saved: the process exits with `code` (0 for SIGTERM)."""

  def __init__(self, step: int, code: int):
    super().__init__(code)
    self.step = step


class StopSignals:
  """SIGTERM and SIGINT handlers that record a stop request, from construction until `stop` or `restore`.

  Off the main thread (a notebook's worker thread) Python cannot install signal handlers; the run then keeps the
  signals' default effect, and says so.
  """

  def __init__(self):
    self.received: int | None = None
    self._received_at = 0.0
    self._previous: dict[int, object] = {}
    if threading.current_thread() is not threading.main_thread():
      logging.info("stop signals keep their default effect: the run is not in the main thread")
      return
    for signum in STOP_SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame) -> None:  # pylint: disable=unused-argument
    name = signal.Signals(signum).name
    if self.received == signum and time.monotonic() - self._received_at < DUPLICATE_S:
      return
    if self.received is not None:
      # os.write and os._exit only: this may interrupt the checkpoint write, whose temporary directory is not the
      # latest checkpoint, and must not wait for anything the interrupted code holds.
      os.write(2, f"jaxrlvr: {name} again; stopping now (the last complete checkpoint stays the latest)\n".encode())
      os._exit(128 + signum)  # pylint: disable=protected-access
    self.received, self._received_at = signum, time.monotonic()
    os.write(2, f"jaxrlvr: {name} received; finishing the step in flight, then saving it (send it again to stop "
                "at once)\n".encode())

  def agreed(self) -> bool:
    """Whether any process received a stop signal. Every process calls this at the same point of every step."""
    return multihost.agree_any(self.received is not None)

  def stop(self, step: int, *, save, close) -> None:
    """Saves step `step` (`save`: None when the step's checkpoint was just written), calls each of `close` (the
    metric writer first: metrics.jsonl is complete), prints the line and raises `Preempted`."""
    if save is not None:
      save()
    for fn in close:
      fn()
    self.restore()
    logs.say(f"preempted at step {step}; the same command resumes")
    sys.stderr.flush()
    raise Preempted(step, _EXIT_CODES.get(self.received, 0))

  def restore(self) -> None:
    """The handlers that were there before (a run that finished hands the signals back)."""
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}


class NonFiniteStreak:
  """Counts the steps in a row whose loss or gradient norm is not finite; raises `RunError` at `limit` (0: never).

  The update metrics are global (replicated over hosts), so every process stops at the same step.
  """
  KEYS = ("loss/total", "optim/grad_norm")

  def __init__(self, limit: int, checkpoint_dir: str):
    self.limit = int(limit)
    self.checkpoint_dir = checkpoint_dir
    self.count = 0

  def check(self, step: int, update_metrics: dict) -> None:
    if not self.limit:
      return
    values = jax.device_get({k: update_metrics[k] for k in self.KEYS if k in update_metrics})
    bad = [f"{k}={float(v)}" for k, v in values.items() if not math.isfinite(float(v))]
    self.count = self.count + 1 if bad else 0
    if self.count >= self.limit:
      raise RunError(
          f"step {step}: {', '.join(bad)}; {self.count} steps in a row had a non-finite loss or gradient norm "
          f"(config optim.max_nonfinite_steps={self.limit}), so their updates were skipped (optim/skipped) and the "
          f"run stopped (the checkpoints in {self.checkpoint_dir} are as they were). Start again in a new --workdir "
          "with a lower optim.lr, or resume with a higher optim.max_nonfinite_steps (0: never stop)")


UNSOLVABLE_SOLVE_RATE = 0.01  # the share of correct rollouts under which a start counts as unsolvable (UnsolvableWatch)


class UnsolvableStart(config_lib.ConfigError):
  """A run stopped by `train.stop_if_unsolvable_steps`: its policy solves nothing, so RL cannot learn. A ConfigError,
  so `python -m jaxrlvr.main` ends with its one line and exit code 2, as for any setting that cannot work."""


class UnsolvableWatch:
  """Stops a run whose policy has nothing to learn from, after its first `train.stop_if_unsolvable_steps` steps.

  A group without a correct rollout has advantages 0, so a policy that answers none of the held-out rows at step 0
  and (next to) none of the rollouts of the first N steps gets (next to) no gradient from the verifier, and would
  train to the end at 0 accuracy: a preset at random initialisation, a model that cannot write the answers. "Next to
  none" is under `UNSOLVABLE_SOLVE_RATE` of them: a model at random initialisation hits an answer by chance (the
  tiny preset, 1 of the 1,024 rollouts of 8 steps on 60 rows of 2- and 3-digit arithmetic), and 200 steps from
  there stayed at 0 (issue #32). Only a run from step 0 is watched (a resumed one has trained, or was watched), and
  only one longer than N steps (a shorter one, a smoke config's, ends anyway). The hosts decide together: the
  evaluation is the same on every host, and the rollout counts are summed over hosts at step N (`host_mean`).
  """

  def __init__(self, config, *, start_step: int, num_eval: int, writer: outputs.MetricWriter | None = None):
    self.config, self.num_eval, self.writer = config, num_eval, writer
    self.steps = int(config.train.get("stop_if_unsolvable_steps", 0))  # absent from a config built by hand: off
    if self.steps < 0:
      raise config_lib.ConfigError(f"config.train.stop_if_unsolvable_steps={self.steps}: must be >= 0 (the first "
                                   "steps watched for a policy that solves nothing; 0: never stop)")
    self.active = bool(self.steps) and start_step == 0 and self.steps < config.total_steps
    self.eval_solved = False
    self.correct = self.rollouts = 0  # this host's, over the watched steps

  def evaluated(self, metrics: dict) -> dict:
    """Notes whether the step-0 evaluation answered any held-out row (greedy, or any of eval.k samples); returns
    `metrics` unchanged."""
    self.eval_solved = self.eval_solved or any(
        value > 0 for key, value in metrics.items() if key == "eval/accuracy" or key.startswith("eval/pass@"))
    return metrics

  def sampled(self, done: int, groups) -> None:
    """Counts the correct rollouts of step `done` (1-based); at step N raises UnsolvableStart on every host when the
    step-0 evaluation answered nothing and under UNSOLVABLE_SOLVE_RATE of the watched rollouts were correct."""
    if not self.active or done > self.steps:
      return
    rewards = [r.reward for g in groups for r in g.rollouts]
    self.correct += sum(reward >= replay.CORRECT_THRESHOLD for reward in rewards)
    self.rollouts += len(rewards)
    if done < self.steps:
      return
    self.active = False
    hosts = multihost.process_count()
    mean = multihost.host_mean({"correct": float(self.correct), "rollouts": float(self.rollouts)})
    correct, rollouts = round(mean["correct"] * hosts), round(mean["rollouts"] * hosts)
    if self.eval_solved or correct >= UNSOLVABLE_SOLVE_RATE * rollouts:
      return
    if self.writer is not None:  # the run ends here: its progress bar ends now, above the message, not after it
      self.writer.close()
    raise UnsolvableStart(self._message(done, correct, rollouts))

  def _message(self, done: int, correct: int, rollouts: int) -> str:
    c = self.config
    if c.model.path:
      start, remedy = f"model.path={c.model.path}", "another --config.model.path"
    else:
      start = f"the {c.model.preset!r} preset"
      remedies = [f"a pretrained preset (--config=configs/{c.method}.py:model=smollm2-135m)"]
      if not c.warm_start.steps:
        remedies.append("a warm start on the rows' solutions (--config.warm_start.steps, e.g. 1200)")
      else:
        remedies.append(f"a '{c.data.solution_field}' field (data.solution_field) in the rows of {c.data.source} to "
                        "warm-start on")
        if warm_start.embedded_model(c) and not warm_start.embedded_fallback(c):
          remedies.append("the embedded task's warm start (--config.warm_start.embedded_fallback=True)")
      remedy = ", ".join(remedies[:-1]) + ", or " + remedies[-1]
    held_out = f"{self.num_eval} held-out row{'' if self.num_eval == 1 else 's'}"
    if correct:
      hits = (f"{correct} of the {rollouts:,} rollouts of steps 1-{done} ({correct / rollouts:.1%}, under "
              f"{UNSOLVABLE_SOLVE_RATE:.0%}), so nearly every group's advantages are 0")
    else:
      hits = f"none of the {rollouts:,} rollouts of steps 1-{done}, so every group's advantages are 0"
    return (f"stopped after step {done} of {c.total_steps} (train.stop_if_unsolvable_steps={self.steps}): RL from "
            f"{start} answered none of the {held_out} at step 0 and {hits}: there is nothing to learn from. Start "
            f"from a model that solves some: {remedy}; or go on anyway with "
            "--config.train.stop_if_unsolvable_steps=0")
