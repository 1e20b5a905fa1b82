"""Whether a run's numbers can be trusted and whether it is still learning: pure functions and a watch, no I/O.

Two things a run can get wrong without an error:
- A held-out set too small to measure anything. Accuracy on n questions has a standard error of sqrt(p (1 - p) / n):
  6 questions at 50% give +-20 points, so 0.500 -> 0.333 is noise. `held_out_note` says so once, at start, when the
  set has fewer than `SMALL_HELD_OUT` questions, with the flag that gives a larger or separate one.
- A run that stops learning or falls back. `Watch` reads each logged row and each evaluation and returns a warning
  (once per cause, again only after the cause has cleared) when:
    * held-out accuracy falls below its best so far by more than `health.accuracy_drop_se` standard errors and more
      than `health.accuracy_drop` (both: a drop within the noise of a small set is not a collapse, nor is a
      statistically clear drop of a point on a large one);
    * the batch solve rate has been 0 for `health.zero_solve_steps` steps after being above 0: every group's
      advantages are 0, so RL gets no gradient from the verifier and can only drift;
    * ExGRPO has retired (solved K of K, never drawn again) more than `health.retired_share` of the training questions
      while the rollouts of the last `RETIRED_ZERO_STEPS` steps solve none: what is left is what the policy cannot
      solve, and the run trains on nothing.
  The solve-rate and retirement causes are judged on the logged rows (every `log_every` steps: their metrics are the
  same on every host, so every host decides alike).
`train.stop_on_collapse` turns a warning into `Collapsed` (main.py: one line, exit 2), for sweeps.
"""
import dataclasses
import math

from jaxrlvr import config_lib

SMALL_HELD_OUT = 100  # held-out sets under this many questions get `held_out_note`
RETIRED_ZERO_STEPS = 3  # steps without a correct rollout that, after retirement, count as "solved by none"

ACCURACY_KEY = "eval/accuracy"
QUESTIONS_KEY = "eval/questions"  # evaluate.py: how many held-out questions the accuracy is over
SOLVE_KEY = "rollout/solve_rate"
RETIRED_KEY = "replay/retired"  # ExGRPO's retired questions so far


class Collapsed(RuntimeError):
  """A warning of `Watch` with `train.stop_on_collapse`: the run stops (main.py: one line, exit code 2)."""


def standard_error(accuracy: float, n: int) -> float:
  """The standard error of an accuracy measured on n questions, sqrt(p (1 - p) / n). At 0 or 1 the formula says 0,
  which no set of a few questions can claim: there p is taken as half a question from the edge, 0.5 / n."""
  if n <= 0:
    return float("nan")
  p = min(max(accuracy, 0.5 / n), 1 - 0.5 / n)
  return math.sqrt(p * (1 - p) / n)


def interval(accuracy: float, n: int) -> str:
  """"0.500±0.204", the accuracy and its standard error, for the progress bar and the evaluation line."""
  return f"{accuracy:.3f}±{standard_error(accuracy, n):.3f}"


def larger_held_out_flags(data, available: int) -> str:
  """The flags that give a larger or separate held-out set, from the run's `config.data` and the held-out questions
  `available` before data.eval_size takes the first of them: data.eval_size where it is what caps the set (the
  synthetic task makes as many as it asks for), data.eval_fraction where a source's own rows are held out,
  data.eval_source always."""
  separate = "--config.data.eval_source=jsonl:PATH (a separate held-out set)"
  eval_size = data.get("eval_size", 0)
  if eval_size and (eval_size < available or (data.eval_source or data.source).startswith("synthetic:")):
    return f"--config.data.eval_size (now {eval_size}) or {separate}"
  if not data.eval_source and not data.source.startswith("synthetic:"):
    fraction = data.get("eval_fraction", 0.1)
    return f"--config.data.eval_fraction (now {fraction:g}) or {separate}"
  return f"a larger {separate}"


def held_out_note(n: int, accuracy: float, data, available: int) -> str | None:
  """One line for a held-out set under `SMALL_HELD_OUT` questions (None otherwise): how many, the standard error
  at the step-0 accuracy, and the flags that give a larger or separate set (`larger_held_out_flags`)."""
  if n >= SMALL_HELD_OUT:
    return None
  se = standard_error(accuracy, n)
  return (f"the held-out set has {n} question{'' if n == 1 else 's'}: at the step-0 accuracy {accuracy:.3f} that is "
          f"a standard error of {se:.3f} ({100 * se:.0f} points), so changes under {200 * se:.0f} points are noise; "
          f"for a larger one set {larger_held_out_flags(data, available)}")


@dataclasses.dataclass(frozen=True)
class Thresholds:
  """The watch's settings (configs/base.py, `health.*`)."""
  accuracy_drop: float = 0.05  # held-out accuracy below its best by more than this (a fraction: 0.05 = 5 points)
  accuracy_drop_se: float = 2.0  # ... and by more than this many standard errors
  zero_solve_steps: int = 10  # batch solve rate 0 for this many steps after being above 0; 0: not watched
  retired_share: float = 0.5  # ExGRPO retired more than this share of the training questions; 1: not watched

  @classmethod
  def from_config(cls, config) -> "Thresholds":
    """From `config.health` (absent from a config built by hand: the defaults); a value out of range is a
    ConfigError (main.py: one line, exit code 2)."""
    health = config.get("health", None) or {}
    t = cls(**{f.name: type(f.default)(health[f.name]) for f in dataclasses.fields(cls) if f.name in health})
    for name, ok, what in (("accuracy_drop", 0 <= t.accuracy_drop <= 1, "a fraction of the questions, in [0, 1]"),
                           ("accuracy_drop_se", t.accuracy_drop_se >= 0, "standard errors, >= 0"),
                           ("zero_solve_steps", t.zero_solve_steps >= 0, "steps, >= 0 (0: not watched)"),
                           ("retired_share", 0 <= t.retired_share <= 1, "a share, in [0, 1] (1: not watched)")):
      if not ok:
        raise config_lib.ConfigError(f"config.health.{name}={getattr(t, name)!r}: must be {what}")
    return t


class Watch:
  """Reads a run's rows (`observe`) and returns the warnings the module docstring lists, each once per episode.

  `num_train` is how many training questions RL draws from (for the retired share). A resumed run's watch starts
  with no history: the best accuracy and the solve-rate streak are those since the resumption.
  """

  def __init__(self, thresholds: Thresholds, *, num_train: int):
    self.t, self.num_train = thresholds, num_train
    self.best: tuple[float, int, int] | None = None  # (accuracy, its step, its question count)
    self.last_solved: int | None = None  # the last logged step with a correct rollout
    self.zero_since: int | None = None  # the first logged step of the current run of zero solve rates
    self.active: set[str] = set()  # causes warned about and not yet cleared
    self.warnings = 0  # warnings so far
    self.latest: list[tuple[str, str]] = []  # the last `observe`'s warnings

  def observe(self, step: int, row: dict) -> list[tuple[str, str]]:
    """The (cause, message) warnings that step `step`'s row (logged metrics and/or an evaluation) raises now."""
    found = []
    if ACCURACY_KEY in row:
      found += self._accuracy(step, row[ACCURACY_KEY], int(row.get(QUESTIONS_KEY, 0)))
    if SOLVE_KEY in row:
      found += self._solve_rate(step, row[SOLVE_KEY], row.get(RETIRED_KEY))
    self.warnings += len(found)
    self.latest = found
    return found

  def _once(self, cause: str, firing: bool, message: str) -> list[tuple[str, str]]:
    """[(cause, message)] the first time `cause` fires; nothing while it stays; re-armed once it clears."""
    if not firing:
      self.active.discard(cause)
      return []
    if cause in self.active:
      return []
    self.active.add(cause)
    return [(cause, message)]

  def _accuracy(self, step: int, accuracy: float, n: int) -> list[tuple[str, str]]:
    if self.best is None or accuracy > self.best[0]:
      self.best = (accuracy, step, n)
    best, best_step, best_n = self.best
    se = standard_error(best, best_n or n) if (best_n or n) else 0.0
    drop = best - accuracy
    firing = drop > self.t.accuracy_drop and drop > self.t.accuracy_drop_se * se
    return self._once("accuracy_drop", firing, (
        f"held-out accuracy fell to {accuracy:.3f} at step {step}, from its best {best:.3f} at step {best_step} "
        f"({100 * drop:.0f} points, more than {self.t.accuracy_drop_se:g} standard errors of {se:.3f} on "
        f"{best_n or n} questions): the policy is getting worse. Look at DIR/samples.jsonl (what it answers now), the "
        "solve rate and optim/grad_norm in metrics.jsonl; a lower optim.lr, or the checkpoint of the best step"))

  def _solve_rate(self, step: int, solve_rate: float, retired) -> list[tuple[str, str]]:
    if solve_rate > 0:
      self.last_solved, self.zero_since = step, None
    elif self.zero_since is None:
      self.zero_since = step
    zero_steps = 0 if self.zero_since is None else step - self.zero_since + 1
    found = []
    if self.t.zero_solve_steps:
      found += self._once("zero_solve", self.last_solved is not None and zero_steps >= self.t.zero_solve_steps, (
          f"the batch solve rate has been 0 for {zero_steps} steps (since step {self.zero_since}; last above 0 at "
          f"step {self.last_solved}): every group's advantages are 0, so RL learns nothing from the verifier. Look "
          "at DIR/samples.jsonl and DIR/questions.jsonl (what it answers, which questions it gets), and at "
          "replay/retired for ExGRPO; easier or more questions (data.source), or a lower optim.lr"))
    if retired is not None and self.num_train and self.t.retired_share < 1:
      share = float(retired) / self.num_train
      found += self._once("retired", share > self.t.retired_share and zero_steps >= RETIRED_ZERO_STEPS, (
          f"ExGRPO has retired {int(retired)} of the {self.num_train} training questions ({share:.0%}: solved K of "
          f"K, never drawn again) and the rollouts of the last {zero_steps} steps solve none of the rest: the run "
          "trains on questions it cannot solve. Look at DIR/questions.jsonl (which questions are left); more or "
          "harder-but-reachable questions (data.source), or a larger rollout.group_size"))
    return found


def metrics(found: list[tuple[str, str]]) -> dict:
  """The `health/` metrics of a row: how many warnings it raised, and each cause that warned as 1. Counts of this
  row alone, not of the run so far, so that a resumed run (whose watch starts afresh) logs the rows it would have."""
  return {"health/warnings": float(len(found)), **{f"health/{cause}": 1.0 for cause, _ in found}}
