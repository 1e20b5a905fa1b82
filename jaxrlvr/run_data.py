"""A run's metrics read back from its workdir, and the interval over seeds: what the comparison's table (compare.py)
and its figures (plots.py) share, so that neither needs the other to read a run.
"""
import dataclasses
import json
import math
import os

import numpy as np

TOKENS_KEY = "rollout/sampled_tokens"
ACCURACY_KEY = "eval/accuracy"


@dataclasses.dataclass
class RunData:
  """One run's metrics: the last row logged for each step (a resumed run logs the steps after its checkpoint twice)
  and the cumulative generated tokens at each step (step 0 -> 0)."""
  name: str
  method: str
  seed: int
  rows: dict[int, dict]
  tokens: dict[int, float]

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
  return RunData(name=os.path.basename(os.path.normpath(workdir)), method=method, seed=seed, rows=rows,
                 tokens=cumulative_tokens(rows, source=path))


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
