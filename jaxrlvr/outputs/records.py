"""A run's metrics read back from its workdir, and the interval over seeds: what the comparison's table
(compare/stats.py) and its figures (compare/plots.py) share, so that neither needs the other to read a run.

Besides metrics.jsonl a run writes DIR/questions.jsonl (`append_questions`, called by the trainer at every step):
each sampled group's question id, kind ('fresh', 'replay', 'reroll'), correct answers and samples, and of the groups
the update trains on, how many carry signal and which questions their replayed rollouts belong to, one line a step.
It is what the share of questions "0 of K at the first visit, solved at a later one" (`visit_stats`) is computed
from: every method gets it, so BAPO's claim can be set against GRPO's. A few hundred bytes a step; with several
processes host 0 writes its own groups only (a random part of the questions). A supervised control run
(compare/sft_control.py) writes DIR/sft_control.json, which marks its RunData as kind 'sft'.
"""
import collections
import dataclasses
import functools
import json
import math
import os

import numpy as np

TOKENS_KEY = "rollout/sampled_tokens"
ACCURACY_KEY = "eval/accuracy"
STEP_TIME_KEY = "time/step_s"
QUESTIONS_FILE = "questions.jsonl"
SFT_FILE = "sft_control.json"


@dataclasses.dataclass
class RunData:
  """One run's metrics: the last row logged for each step (a resumed run logs the steps after its checkpoint twice)
  and the cumulative generated tokens at each step (step 0 -> 0)."""
  name: str
  method: str  # the arm: a method config, or a named variant of one (compare/arms.py)
  seed: int
  rows: dict[int, dict]
  tokens: dict[int, float]
  questions: dict[int, dict] = dataclasses.field(default_factory=dict)  # DIR/questions.jsonl by step; {}: none
  kind: str = "rl"  # "rl", or "sft" for the supervised control (it generates no tokens: compare it by wall time)

  @functools.cached_property
  def wall(self) -> dict[int, float]:
    """{step: training seconds up to and including that step}: `time/step_s` summed (evaluations excluded, as they
    are from the step time); the x axis on which a run that generates no tokens is compared."""
    out, total = {0: 0.0}, 0.0
    for s in sorted(self.rows):
      total += float(self.rows[s].get(STEP_TIME_KEY, 0.0))
      out[s] = total
    return out

  def series(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, cumulative tokens, values) of the rows that hold `key`, in step order."""
    steps = [s for s in sorted(self.rows) if key in self.rows[s]]
    return (np.asarray(steps, np.int64), np.asarray([self.tokens[s] for s in steps], np.float64),
            np.asarray([self.rows[s][key] for s in steps], np.float64))

  @property
  def total_tokens(self) -> float:
    return self.tokens[max(self.tokens)]


def read_rows(path: str) -> dict[int, dict]:
  """metrics.jsonl -> {step: row}, the last row of each step winning."""
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.strip()]
  rows: dict[int, dict] = {}
  for number, line in enumerate(lines, 1):
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if number == len(lines):  # a run killed mid-write leaves a partial last line; it logs that step again
        break
      raise ValueError(f"{path}: line {number} is not JSON ({e})") from e
    rows[int(row["step"])] = row
  return rows


def cumulative_tokens(rows: dict[int, dict], *, source: str = "metrics") -> dict[int, float]:
  """{step: generated tokens up to and including that step}. Needs a `rollout/sampled_tokens` row for every step:
  the comparison runs log every step (`log_every=1`); a gap would make the budget a guess, so it is an error."""
  trained = sorted(s for s, row in rows.items() if TOKENS_KEY in row)
  missing = sorted(set(range(1, (trained[-1] if trained else 0) + 1)) - set(trained))
  if missing:
    raise ValueError(f"{source}: no {TOKENS_KEY!r} at steps {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                     "the rollout budget needs every step logged (run with --config.log_every=1)")
  out, total = {0: 0.0}, 0.0
  for s in trained:
    total += float(rows[s][TOKENS_KEY])
    out[s] = total
  for s in rows:  # rows past the last trained step (none in practice) get the total so far
    out.setdefault(s, total)
  return out


def load_run(workdir: str, *, method: str | None = None, seed: int | None = None) -> RunData:
  """A run directory written by the main job; method and seed default to those in its config.json."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no metrics (the run has not started)")
  if method is None or seed is None:
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      config = json.load(f)
    method = config["method"] if method is None else method
    seed = int(config["seed"]) if seed is None else seed
  rows = read_rows(path)
  questions_path = os.path.join(workdir, QUESTIONS_FILE)
  return RunData(name=os.path.basename(os.path.normpath(workdir)), method=method, seed=seed, rows=rows,
                 tokens=cumulative_tokens(rows, source=path),
                 questions=read_rows(questions_path) if os.path.exists(questions_path) else {},
                 kind="sft" if os.path.exists(os.path.join(workdir, SFT_FILE)) else "rl")


# ------------------------------------------------------------------------------------------------ Question visits
def append_questions(workdir: str, step: int, requests, sampled, *, threshold: float, composed=None) -> None:
  """Appends step `step`'s sampled groups to DIR/questions.jsonl: for each request (a replay.Request) and its sampled
  group (a replay.Group), the qid, the request's kind, the answers at or above `threshold` and the samples. With the
  `composed` groups the update trains on (advantages set), also how many of them carry signal (an advantage that
  is not 0) and the question of every replayed rollout among them. A resumed run writes the steps after its
  checkpoint again; `read_rows` keeps the last line of each step."""
  row = {"step": int(step), "qid": [int(r.qid) for r in requests], "kind": [str(r.kind) for r in requests],
         "correct": [sum(1 for x in g.rollouts if x.reward >= threshold) for g in sampled],
         "samples": [len(g.rollouts) for g in sampled]}
  if composed is not None:
    row.update(groups=len(composed), signal=sum(any(r.advantage for r in g.rollouts) for g in composed),
               replayed_qids=[int(r.qid) for g in composed for r in g.rollouts if r.replayed])
  with open(os.path.join(workdir, QUESTIONS_FILE), "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")


@dataclasses.dataclass
class VisitStats:
  """How often questions came back, and what became of those the policy could not solve at first.

  A visit is any group sampled for the question (fresh, ExGRPO's replay question, BAPO's re-roll). `hard_first`
  counts the questions with no correct answer at their first visit, `hard_revisited` those of them visited again,
  `hard_solved_later` those with at least one correct answer at a later visit."""
  questions: int
  visits_mean: float
  visits_max: int
  revisited: int  # questions visited more than once
  hard_first: int
  hard_revisited: int
  hard_solved_later: int

  @property
  def hard_solved_share(self) -> float:
    """Of the questions 0 of K at their first visit, the share solved (>= 1 correct) at a later one."""
    return self.hard_solved_later / self.hard_first if self.hard_first else float("nan")


def visit_stats(questions: dict[int, dict], *, last_step: int | None = None) -> VisitStats:
  """VisitStats over the steps of DIR/questions.jsonl (`RunData.questions`) up to `last_step` (all: None)."""
  first_correct: dict[int, int] = {}
  visits: dict[int, int] = {}
  solved_later: set[int] = set()
  for step in sorted(questions):
    if last_step is not None and step > last_step:
      break
    row = questions[step]
    for qid, correct in zip(row["qid"], row["correct"], strict=True):
      if qid not in first_correct:
        first_correct[qid] = int(correct)
      elif correct > 0:
        solved_later.add(qid)
      visits[qid] = visits.get(qid, 0) + 1
  hard = [q for q, c in first_correct.items() if c == 0]
  counts = np.asarray(list(visits.values()), np.float64)
  return VisitStats(questions=len(visits), visits_mean=float(counts.mean()) if len(counts) else float("nan"),
                    visits_max=int(counts.max()) if len(counts) else 0, revisited=int(np.sum(counts > 1)),
                    hard_first=len(hard), hard_revisited=sum(visits[q] > 1 for q in hard),
                    hard_solved_later=sum(q in solved_later for q in hard))


@dataclasses.dataclass
class MechanismStats:
  """What replay is meant to change, from DIR/questions.jsonl's composed-batch fields: the share of trained groups
  with signal (all steps, and the first `first_steps`), the distinct questions trained on (sampled or replayed), and
  how concentrated replay is (the share of replayed rollouts that went to the `top` most replayed questions)."""
  signal_share: float
  signal_share_first: float
  questions_trained: int
  replayed: int
  replay_top_share: float


def mechanism_stats(questions: dict[int, dict], *, last_step: int | None = None, first_steps: int = 20,
                    top: int = 50) -> MechanismStats:
  """MechanismStats over the steps of DIR/questions.jsonl up to `last_step` (all: None); NaN where a run's file has
  no composed-batch fields (written before they existed)."""
  rows = [questions[s] for s in sorted(questions) if (last_step is None or s <= last_step) and "signal" in questions[s]]
  if not rows:
    return MechanismStats(float("nan"), float("nan"), 0, 0, float("nan"))
  share = lambda rs: sum(r["signal"] for r in rs) / max(sum(r["groups"] for r in rs), 1)
  trained = {q for r in rows for q in r["qid"]} | {q for r in rows for q in r["replayed_qids"]}
  counts = np.asarray(sorted(collections.Counter(q for r in rows for q in r["replayed_qids"]).values(), reverse=True))
  return MechanismStats(
      signal_share=share(rows), signal_share_first=share([r for r in rows if r["step"] <= first_steps]),
      questions_trained=len(trained), replayed=int(counts.sum()),
      replay_top_share=float(counts[:top].sum() / counts.sum()) if len(counts) else float("nan"))


def confidence_interval(values, confidence: float = 0.95, axis: int = 0):
  """(mean, half-width) of the two-sided t-interval over `axis` (seeds). One value has no interval: NaN."""
  values = np.asarray(values, np.float64)
  n = values.shape[axis]
  if n == 0:
    raise ValueError("confidence_interval: no values")
  mean = values.mean(axis=axis)
  if n < 2:
    return mean, np.full_like(mean, np.nan)
  from scipy import stats  # pylint: disable=g-import-not-at-top  (half a second; the trainer reads runs without it)
  sem = values.std(axis=axis, ddof=1) / math.sqrt(n)
  return mean, stats.t.ppf(0.5 + confidence / 2, n - 1) * sem


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (shorter at the start) that skips NaNs; a window of 1 returns the values."""
  values = np.asarray(values, np.float64)
  if window <= 1 or len(values) == 0:
    return values
  ok = ~np.isnan(values)
  sums = np.cumsum(np.where(ok, values, 0.0))
  counts = np.cumsum(ok)
  lag = lambda a: np.concatenate([np.zeros(window), a[:-window]]) if len(a) > window else np.zeros_like(a)
  n = counts - lag(counts)
  return np.where(n > 0, (sums - lag(sums)) / np.maximum(n, 1), np.nan)
