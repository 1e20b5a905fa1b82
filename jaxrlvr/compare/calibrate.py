"""A testbed's calibration figures, from the GRPO runs of a comparison (`python -m jaxrlvr.compare ... --arms=grpo`):

    python -m jaxrlvr.compare.calibrate --outdir=DIR    # DIR: the comparison's --outdir (its runs/grpo-s*)

Per seed, and their mean, the figures the replay testbed is calibrated on (compare/arms.py, `replay_testbed`):
- held-out greedy accuracy at step 0 and at the budget (the run's evaluation at the first step that reached it, as
  compare/stats.py reads it; the budget is the last of the run's `eval.token_marks`, else its total tokens), the gain;
- the step-0 accuracy on each in-between level: the levels whose warm start saw a worked fraction strictly between 0
  and 1 (`data.worked_by_level`, the rest `data.worked_fraction`), where the warm start leaves RL a choice between a
  worked and a bare answer;
- the share of first-visit groups all right or all wrong, by group count (not `policy/zero_adv_frac`, a token share):
  of the groups sampled at steps 1..`--first_steps` for a question not sampled before (DIR/questions.jsonl), those
  with 0 or K of K correct; also per level;
- mean visits per question up to the budget, optimizer steps per rollout batch, held-out questions, evaluations up to
  and including the budget's.
Then each target (`TARGETS`) with whether the runs meet it. Exit code 0 either way; this reads, it does not judge.
"""
import collections
import dataclasses
import json
import os
import re
import sys

import numpy as np

from jaxrlvr import data as data_lib
from jaxrlvr import outputs
from jaxrlvr.compare import stats as stats_lib

ACCURACY = outputs.ACCURACY_KEY
# (name, what is compared, bound): the calibration targets for the replay testbed.
TARGETS = (
    ("GRPO's held-out gain over the run, mean over seeds", "gain_mean", ">=", 0.08),
    ("every seed's step-0 accuracy on every in-between level, lowest", "between_min", ">=", 0.15),
    ("every seed's step-0 accuracy on every in-between level, highest", "between_max", "<=", 0.85),
    ("first-visit groups all right or all wrong (by count, steps 1-20), mean over seeds", "constant_mean", ">=", 0.60),
    ("visits per question up to the budget, mean over seeds (about 2)", "visits_mean", ">=", 1.7),
    ("optimizer steps per rollout batch", "minibatches_min", ">=", 2),
    ("held-out questions (one evaluation's standard error <= 0.02)", "eval_questions_min", ">=", 600),
    ("evaluations a run, up to the budget's (step 0 included)", "evaluations_min", ">=", 8),
)


@dataclasses.dataclass
class SeedFigures:
  run: str
  seed: int
  budget: float
  read_step: int
  read_tokens: float
  at_budget: bool  # read at its evaluation at the step that reached the budget (else its last one below it)
  accuracy_0: float
  accuracy_read: float
  between_0: dict[str, float]  # in-between level -> step-0 greedy accuracy
  constant_first: float  # share of first-visit groups (steps 1..first_steps) with 0 or K of K correct
  constant_by_level: dict[str, float]
  first_groups: int
  visits_mean: float
  minibatches: int
  eval_questions: int
  evaluations: int

  @property
  def gain(self) -> float:
    return self.accuracy_read - self.accuracy_0


def in_between_levels(data: dict) -> list[str]:
  """The levels of the task's mix whose warm-start worked fraction is strictly between 0 and 1."""
  fractions = data_lib.parse_worked_by_level(str(data.get("worked_by_level", "")),
                                             default=float(data.get("worked_fraction", 1.0)))
  return [lv for lv in dict.fromkeys(data_lib.parse_levels(str(data.get("levels", "")))) if 0.0 < fractions[lv] < 1.0]


def first_visit_constant(questions: dict[int, dict], *, first_steps: int, levels: list[str]):
  """(share of first-visit groups at steps 1..first_steps with 0 or all of their samples correct, that share per
  level (qid -> level: the mix's slot, qid % len(levels)), how many such groups)."""
  seen: set[int] = set()
  constant, total = collections.Counter(), collections.Counter()
  for step in sorted(questions):
    if step > first_steps:
      break
    row = questions[step]
    for qid, correct, samples in zip(row["qid"], row["correct"], row["samples"], strict=True):
      if qid in seen:
        continue
      seen.add(qid)
      level = levels[qid % len(levels)] if levels else "all"
      total[level] += 1
      constant[level] += int(correct in (0, samples))
  n = sum(total.values())
  share = sum(constant.values()) / n if n else float("nan")
  return share, {lv: constant[lv] / total[lv] for lv in levels if total[lv]}, n


def seed_figures(workdir: str, *, first_steps: int = 20, budget: float | None = None) -> SeedFigures:
  run = outputs.load_run(workdir)
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  marks = config.get("eval", {}).get("token_marks") or ()
  budget = float(budget or (marks[-1] if marks else run.total_tokens))
  last = stats_lib.budget_step(run.tokens, budget)
  if last is None:
    raise ValueError(f"{workdir}: generated {run.total_tokens:.0f} tokens, short of the budget of {budget:.0f}")
  steps, _, accuracy = run.series(ACCURACY)
  if not len(steps) or steps[0] != 0:
    raise ValueError(f"{workdir}: no evaluation at step 0")
  eval_x = np.asarray([run.tokens[s] for s in steps], np.float64)
  i, at_budget = stats_lib.reading(eval_x, budget, reach=run.tokens[last])
  data = config.get("data", {})
  between = in_between_levels(data)
  row0 = run.rows[0]
  mix = list(data_lib.parse_levels(str(data.get("levels", ""))))
  share, by_level, n = first_visit_constant(run.questions, first_steps=first_steps, levels=mix)
  visits = outputs.visit_stats(run.questions, last_step=last) if run.questions else None
  return SeedFigures(
      run=run.name, seed=run.seed, budget=budget, read_step=int(steps[i]), read_tokens=run.tokens[int(steps[i])],
      at_budget=at_budget,
      accuracy_0=float(accuracy[0]), accuracy_read=float(accuracy[i]),
      between_0={lv: float(row0.get(f"eval/arithmetic/{lv}/accuracy", float("nan"))) for lv in between},
      constant_first=share, constant_by_level=by_level, first_groups=n,
      visits_mean=visits.visits_mean if visits else float("nan"),
      minibatches=int(config.get("train", {}).get("num_minibatches", 1)),
      eval_questions=int(row0.get("eval/questions", 0)), evaluations=i + 1)


def summary(figures: list[SeedFigures]) -> dict:
  between = [v for f in figures for v in f.between_0.values()]
  return {
      "gain_mean": float(np.mean([f.gain for f in figures])),
      "between_min": min(between, default=float("nan")), "between_max": max(between, default=float("nan")),
      "constant_mean": float(np.mean([f.constant_first for f in figures])),
      "visits_mean": float(np.mean([f.visits_mean for f in figures])),
      "minibatches_min": min(f.minibatches for f in figures),
      "eval_questions_min": min(f.eval_questions for f in figures),
      "evaluations_min": min(f.evaluations for f in figures),
  }


def met(value: float, op: str, bound: float) -> bool:
  return bool(value >= bound if op == ">=" else value <= bound)


def report(figures: list[SeedFigures], *, first_steps: int = 20) -> str:
  lines = [f"| seed | step-0 accuracy | at the budget (step, tokens) | gain | step-0, in-between levels | "
           f"constant first-visit groups, steps 1-{first_steps} (groups) | by level | visits per question |",
           "|---|---|---|---|---|---|---|---|"]
  for f in figures:
    between = ", ".join(f"{lv} {v:.3f}" for lv, v in f.between_0.items()) or "-"
    by_level = ", ".join(f"{lv} {v:.2f}" for lv, v in f.constant_by_level.items())
    below = "" if f.at_budget else ", its last evaluation below the budget"
    lines.append(f"| {f.seed} | {f.accuracy_0:.3f} | {f.accuracy_read:.3f} ({f.read_step}, "
                 f"{f.read_tokens:,.0f}{below}) | {f.gain:+.3f} | {between} | {f.constant_first:.3f} "
                 f"({f.first_groups}) | {by_level} | {f.visits_mean:.2f} |")
  s = summary(figures)
  lines += ["", f"Budget {figures[0].budget:,.0f} tokens; {figures[0].eval_questions} held-out questions; "
            f"{figures[0].minibatches} optimizer steps a batch.", "", "| target | measured | bound | met |",
            "|---|---|---|---|"]
  for name, key, op, bound in TARGETS:
    lines.append(f"| {name} | {s[key]:.3f} | {op} {bound:g} | {'yes' if met(s[key], op, bound) else 'NO'} |")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m jaxrlvr.compare.calibrate", description=__doc__.split("\n")[0])
  parser.add_argument("--outdir", required=True, help="The comparison's --outdir (its runs/<arm>-s<seed>).")
  parser.add_argument("--arm", default="grpo", help="The arm whose runs are read (default: grpo).")
  parser.add_argument("--first_steps", type=int, default=20, help="First-visit groups of steps 1..N (default 20).")
  parser.add_argument("--budget_tokens", type=float, default=None,
                      help="Read at this budget (default: each run's last eval.token_marks, else its total).")
  args = parser.parse_args(argv[1:])
  runs_dir = os.path.join(args.outdir, "runs")
  names = sorted((d for d in os.listdir(runs_dir) if re.fullmatch(rf"{re.escape(args.arm)}-s\d+", d)),
                 key=lambda d: int(d.rsplit("-s", 1)[1])) if os.path.isdir(runs_dir) else []
  if not names:
    print(f"calibrate: no runs {args.arm}-s<seed> in {runs_dir}", file=sys.stderr)
    return 2
  figures, unread = [], []
  for name in names:  # a run not started, or short of the budget (still training), is named and left out
    try:
      figures.append(seed_figures(os.path.join(runs_dir, name), first_steps=args.first_steps,
                                  budget=args.budget_tokens))
    except (FileNotFoundError, ValueError) as e:
      unread.append(f"not read: {name}: {e}")
  if figures:
    print(report(figures, first_steps=args.first_steps))
  print("\n".join(unread), file=sys.stderr)
  return 0 if figures else 2


if __name__ == "__main__":
  sys.exit(main(sys.argv))
