"""The comparison's numbers: each run's figures at the common budget, their means and 95% intervals over seeds, and
the differences paired by seed against the baseline arm; written as DIR/results.md, results.csv and runs.csv.

Per run (compare/runner.py's module doc has the budget rule):
- greedy accuracy at the budget (the last evaluation at or below it), its gain over step 0, the AUC;
- pass@k at the budget (`eval/pass@k`, k samples per question at eval.temperature; the last evaluation with it at or
  below the budget), where the runs measured it;
- stability: the largest drop of greedy accuracy between two consecutive evaluations up to the budget, and the
  standard deviation of the evaluations in the second half of the budget;
- from DIR/questions.jsonl (outputs.visit_stats, steps up to the budget): questions visited, mean visits, and of
  the questions with no correct answer at their first visit, the share solved (>= 1 of K) at a later visit;
- cost: median step time, steps and training seconds up to the budget, tokens per step.
A supervised control run (kind "sft") generates no tokens: its budget is the training time the baseline run of its
seed took to reach the token budget (`time/step_s` summed; evaluations excluded from both), and its figures are
taken at that wall time; the token columns are n/a.
"""
import csv
import dataclasses
import math
import os
import re
from collections.abc import Sequence

import numpy as np

from jaxrlvr import outputs

ACCURACY_KEY = outputs.ACCURACY_KEY
_PASS_KEY = re.compile(r"^eval/pass@(\d+)$")


def accuracy_at(tokens: np.ndarray, accuracy: np.ndarray, budget: float) -> float:
  """The last evaluation at or below the budget."""
  inside = np.flatnonzero(np.asarray(tokens) <= budget)
  if not len(inside):
    raise ValueError(f"no evaluation at or below the budget of {budget:g} tokens")
  return float(np.asarray(accuracy)[inside[-1]])


def area_under_curve(tokens: np.ndarray, accuracy: np.ndarray, budget: float) -> float:
  """Mean accuracy over [0, budget]: evaluations joined linearly, the last one held to the budget (module doc)."""
  if budget <= 0:
    raise ValueError(f"the budget must be > 0 tokens, got {budget}")
  tokens, accuracy = np.asarray(tokens, np.float64), np.asarray(accuracy, np.float64)
  keep = tokens <= budget
  if not keep.any() or tokens[keep][0] > 0:
    raise ValueError("the accuracy curve needs an evaluation at 0 tokens (step 0)")
  x = np.append(tokens[keep], budget)
  y = np.append(accuracy[keep], accuracy[keep][-1])
  return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / budget)


def largest_drop(accuracy: np.ndarray) -> float:
  """The largest fall between two consecutive evaluations (0 when accuracy never fell)."""
  accuracy = np.asarray(accuracy, np.float64)
  return float(max(0.0, np.max(accuracy[:-1] - accuracy[1:]))) if len(accuracy) > 1 else float("nan")


def late_std(x: np.ndarray, accuracy: np.ndarray, budget: float) -> float:
  """Sample std of the evaluations in the second half of [0, budget] (NaN with fewer than two there)."""
  late = np.asarray(accuracy, np.float64)[(np.asarray(x) > budget / 2) & (np.asarray(x) <= budget)]
  return float(np.std(late, ddof=1)) if len(late) > 1 else float("nan")


def pass_key(runs: Sequence[outputs.RunData]) -> str | None:
  """The pass@k metric the runs logged (`eval/pass@8`), the largest k when they logged several; None: none."""
  ks = {int(m.group(1)) for r in runs for row in r.rows.values() for key in row if (m := _PASS_KEY.match(key))}
  return f"eval/pass@{max(ks)}" if ks else None


@dataclasses.dataclass
class Summary:
  budget_tokens: float
  baseline: str  # the arm the paired differences are taken against
  methods: list[dict]  # one row per arm: means and 95% CI half-widths over seeds
  runs: list[dict]  # one row per run
  pass_key: str | None = None  # e.g. "eval/pass@8"


def _run_row(r: outputs.RunData, *, x: dict, budget: float, pass_metric: str | None) -> dict:
  """One run's figures with `x` ({step: position}: tokens, or training seconds for the control) cut at `budget`."""
  steps, _, accuracy = r.series(ACCURACY_KEY)
  eval_x = np.asarray([x[s] for s in steps], np.float64)
  within_eval = eval_x <= budget
  time_steps, _, step_times = r.series(outputs.STEP_TIME_KEY)
  within = np.asarray([x[s] <= budget for s in time_steps], bool)
  last = int(time_steps[within][-1]) if within.any() else 0
  row = {
      "run": r.name, "method": r.method, "seed": r.seed, "kind": r.kind,
      "initial_accuracy": float(accuracy[0]) if len(accuracy) and steps[0] == 0 else float("nan"),
      "final_accuracy": accuracy_at(eval_x, accuracy, budget),
      "max_drop": largest_drop(accuracy[within_eval]), "late_std": late_std(eval_x, accuracy, budget),
      # The median leaves out the first steps' compilation.
      "step_time_s": float(np.median(step_times[within])) if within.any() else float("nan"),
      "steps_at_budget": last, "train_wall_s": r.wall[last],
      "total_steps": int(max(r.rows)), "total_tokens": r.total_tokens,
  }
  if r.kind == "sft":
    row.update(auc=float("nan"), tokens_per_step=float("nan"))
  else:
    row.update(auc=area_under_curve(eval_x, accuracy, budget),
               tokens_per_step=float(r.tokens[last] / last) if last else 0.0)
  row["pass_at_k"] = float("nan")
  if pass_metric is not None:
    pass_steps, _, values = r.series(pass_metric)
    pass_x = np.asarray([x[s] for s in pass_steps], np.float64)
    if (pass_x <= budget).any():
      row["pass_at_k"] = accuracy_at(pass_x, values, budget)
  if r.kind == "sft" or not r.questions:
    row.update(questions=float("nan"), visits_mean=float("nan"), hard_first=float("nan"),
               hard_solved_share=float("nan"))
  else:
    visits = outputs.visit_stats(r.questions, last_step=last)
    row.update(questions=visits.questions, visits_mean=visits.visits_mean, hard_first=visits.hard_first,
               hard_solved_share=visits.hard_solved_share)
  row.update(_mechanism(r, last))
  return row


def _mechanism(r: outputs.RunData, last: int) -> dict:
  """The mechanism figures of a run up to step `last` (NaN for the control, or where a run did not log them)."""
  nan = float("nan")
  if r.kind == "sft" or not r.questions:
    return dict(signal_share=nan, signal_share_first=nan, questions_trained=nan, replay_top_share=nan,
                replayed_grad_share=nan)
  m = outputs.mechanism_stats(r.questions, last_step=last)
  # The replayed rows' share of the gradient's norm, over the logged steps that trained replayed rows.
  shares = [row[_GRAD_SHARE] for step, row in r.rows.items() if step <= last and _GRAD_SHARE in row
            and row.get("policy/replayed/tokens", 0) > 0]
  return dict(signal_share=m.signal_share, signal_share_first=m.signal_share_first,
              questions_trained=m.questions_trained if m.questions_trained else nan,
              replay_top_share=m.replay_top_share, replayed_grad_share=float(np.mean(shares)) if shares else nan)


_GRAD_SHARE = "policy/replayed_grad_share"


def summarize(runs: Sequence[outputs.RunData], *, budget_tokens: float | None = None,
              baseline: str | None = None, wall_reference: str = "grpo") -> Summary:
  """The results tables. Budget: `budget_tokens`, or the smallest total any RL run generated (compare/runner.py's doc).

  Besides each figure's mean over seeds, the tables have paired differences: a run's gain over its own step-0
  accuracy, and its figures minus those of the `baseline` arm's run with the same seed (default: the first arm). A
  seed fixes the warm start and the held-out questions, which move accuracy by more than the methods do, so
  differences within a seed have much narrower intervals than the means across seeds. A control run (kind "sft")
  is read at the training time the `wall_reference` run of its seed took to the budget.
  """
  if not runs:
    raise ValueError("summarize: no runs")
  baseline = runs[0].method if baseline is None else baseline
  if baseline not in {r.method for r in runs}:
    methods = sorted({r.method for r in runs})
    raise ValueError(f"summarize: baseline method {baseline!r} has no runs; methods: {methods}")
  rl = [r for r in runs if r.kind != "sft"]
  if not rl:
    raise ValueError("summarize: only supervised control runs; the budget comes from the RL runs")
  budget = min(r.total_tokens for r in rl) if budget_tokens is None else float(budget_tokens)
  short = [f"{r.name} ({r.total_tokens:.0f})" for r in rl if r.total_tokens < budget]
  if short:
    raise ValueError(f"runs that generated fewer tokens than the budget of {budget:.0f}: {', '.join(short)}")
  metric = pass_key(runs)
  per_run = [_run_row(r, x=r.tokens, budget=budget, pass_metric=metric) for r in rl]
  reference = {r["seed"]: r["train_wall_s"] for r in per_run if r["method"] == wall_reference}
  for r in (r for r in runs if r.kind == "sft"):
    if r.seed not in reference:
      raise ValueError(f"summarize: control run {r.name} has no {wall_reference} run of seed {r.seed} to take its "
                       "training time from")
    per_run.append(_run_row(r, x=r.wall, budget=reference[r.seed], pass_metric=metric))
  base = {r["seed"]: r for r in per_run if r["method"] == baseline}
  for r in per_run:
    b = base.get(r["seed"])
    r["accuracy_gain"] = r["final_accuracy"] - r["initial_accuracy"]
    for key, paired in _PAIRED.items():
      r[paired] = r[key] - b[key] if b else float("nan")
  methods = []
  for method in dict.fromkeys(r.method for r in runs):  # the arms in the order given
    rows = [r for r in per_run if r["method"] == method]
    row = {"method": method, "seeds": len(rows), "budget_tokens": budget}
    for key in _STATS:
      mean, half = outputs.confidence_interval([r[key] for r in rows])
      row[f"{key}_mean"], row[f"{key}_ci95"] = float(mean), float(half)
    methods.append(row)
  return Summary(budget_tokens=budget, baseline=baseline, methods=methods, runs=per_run, pass_key=metric)


# ------------------------------------------------------------------------------------------------ Writing results
# (key, column title, digits); "{b}" is the baseline arm, "{p}" the pass@k name.
_TABLE = (("final_accuracy", "held-out accuracy at budget", 3), ("accuracy_gain", "gain over step 0", 3),
          ("accuracy_vs_baseline", "accuracy - {b}", 3), ("auc", "AUC (normalised)", 3),
          ("auc_vs_baseline", "AUC - {b}", 3), ("initial_accuracy", "accuracy at step 0", 3),
          ("step_time_s", "step time (s)", 2), ("steps_at_budget", "steps to budget", 0),
          ("train_wall_s", "training time to budget (s)", 0), ("tokens_per_step", "tokens / step", 0))
_CLAIMS = (("pass_at_k", "{p} at budget", 3), ("pass_at_k_vs_baseline", "{p} - {b}", 3),
           ("max_drop", "largest drop", 3), ("max_drop_vs_baseline", "largest drop - {b}", 3),
           ("late_std", "std of late evals", 3), ("hard_first", "questions 0/K at first visit", 0),
           ("hard_solved_share", "of those, solved later", 3),
           ("hard_solved_share_vs_baseline", "solved later - {b}", 3), ("visits_mean", "visits per question", 2))
_MECHANISM = (("signal_share", "groups with signal", 3), ("signal_share_first", "groups with signal, steps 1-20", 3),
              ("questions_trained", "distinct questions trained", 0),
              ("replay_top_share", "replays to the 50 most replayed questions", 3),
              ("replayed_grad_share", "replayed rows' share of the gradient norm", 3))
# figure -> its difference to the baseline run of the same seed
_PAIRED = {"final_accuracy": "accuracy_vs_baseline", "auc": "auc_vs_baseline", "pass_at_k": "pass_at_k_vs_baseline",
           "max_drop": "max_drop_vs_baseline", "hard_solved_share": "hard_solved_share_vs_baseline"}
_STATS = tuple(dict.fromkeys(key for key, _, _ in _TABLE + _CLAIMS + _MECHANISM))


def _pm(mean: float, half: float, digits: int) -> str:
  if np.isnan(mean):
    return "n/a"
  return f"{mean:.{digits}f}" if np.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def _pass_name(summary: Summary) -> str:
  return summary.pass_key[len("eval/"):] if summary.pass_key else "pass@k"


def _table(summary: Summary, columns) -> list[str]:
  names = {"b": summary.baseline, "p": _pass_name(summary)}
  lines = ["| arm | seeds | " + " | ".join(t.format(**names) for _, t, _ in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
  for m in summary.methods:
    cells = ["baseline" if "vs_baseline" in k and m["method"] == summary.baseline else
             _pm(m[f"{k}_mean"], m[f"{k}_ci95"], d) for k, _, d in columns]
    lines.append(f"| {m['method']} | {m['seeds']} | " + " | ".join(cells) + " |")
  return lines


def _f(value: float, spec: str) -> str:
  return "n/a" if isinstance(value, float) and math.isnan(value) else format(value, spec)


def write_results(summary: Summary, outdir: str, *, command: str = "", wall_s: float | None = None,
                  plots: Sequence[str] = (), missing: Sequence[str] = (), title: str = "",
                  setup: Sequence[str] = ()) -> None:
  """DIR/results.csv (per arm), DIR/runs.csv (per run) and DIR/results.md (the tables, the plots, the setup).
  `title`: the regime; `setup`: lines said before the tables (the preset, the arms and their overrides)."""
  os.makedirs(outdir, exist_ok=True)
  for name, rows in (("results.csv", summary.methods), ("runs.csv", summary.runs)):
    with open(os.path.join(outdir, name), "w", newline="", encoding="utf-8") as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)
  b = summary.baseline
  lines = [f"# Method comparison at an equal rollout budget{': ' + title if title else ''}", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  if wall_s is not None:
    lines += [f"Wall time of this invocation: {wall_s / 60:.1f} min (runs already finished are not re-run).", ""]
  lines += list(setup) + ([""] if setup else [])
  lines += [f"Budget: {summary.budget_tokens:,.0f} generated rollout tokens per run. Accuracy is greedy held-out "
            "accuracy at the last evaluation at or below the budget; AUC is the mean accuracy over the budget "
            "(evaluations joined linearly); step time is the median over the run's steps, measured with the runs "
            "sharing the machine (--parallel), so compare it within this table; training time sums the step "
            "times (evaluations excluded). Entries are the mean ± the half-width of the 95% t-interval over seeds "
            "(none with one seed). A supervised control (kind sft) is read at the training time its seed's "
            f"{b} run took to the budget.", ""]
  lines += [f"Paired columns: the gain is each run's accuracy at the budget minus its own accuracy at step 0; "
            f"`- {b}` is the difference to the {b} run of the same seed (same warm start, same held-out questions), "
            "then averaged over seeds.", ""]
  lines += _table(summary, _TABLE)
  lines += ["", "## What each method claims, measured", "",
            f"{_pass_name(summary)}{'' if summary.pass_key else ' (not measured)'}: the unbiased pass@k from k samples "
            "per held-out question at eval.temperature. Largest drop: the largest fall of greedy accuracy between "
            "two consecutive evaluations up to the budget; std of late evals: over the evaluations in the second "
            "half of the budget (both: lower is steadier). Visits are the groups sampled for a training question "
            "(fresh, replayed, re-rolled; DIR/questions.jsonl); 'solved later' is the share of the questions with "
            "no correct answer of K at their first visit that got at least one right at a later visit.", ""]
  lines += _table(summary, _CLAIMS)
  lines += ["", "## Mechanism", "",
            "What replay is meant to change (DIR/questions.jsonl and metrics.jsonl, up to the budget). Groups with "
            "signal: the share of the groups the update trained on whose advantages are not all 0 (with K samples "
            "all right or all wrong, a group teaches nothing). Distinct questions trained: fresh, re-rolled or "
            "replayed. Replays to the 50 most replayed questions: the share of replayed rollouts that went to "
            "them (1.0 when fewer than 50 were replayed). Share of the gradient norm: |grad of the replayed rows' "
            "policy loss| / |grad of the loss|, averaged over the logged steps that trained replayed rows "
            "(train.replayed_grad_share; n/a where it was off).", ""]
  lines += _table(summary, _MECHANISM)
  lines += ["", "## Runs", "",
            f"| run | accuracy at step 0 | accuracy at budget | gain | accuracy - {b} | {_pass_name(summary)} "
            "| AUC | largest drop | solved later | step time (s) | steps to budget | training time (s) | steps run "
            "| tokens generated |", "|" + "---|" * 14]
  for r in summary.runs:
    lines.append(f"| {r['run']} | {_f(r['initial_accuracy'], '.3f')} | {r['final_accuracy']:.3f} | "
                 f"{_f(r['accuracy_gain'], '+.3f')} | {_f(r['accuracy_vs_baseline'], '+.3f')} | "
                 f"{_f(r['pass_at_k'], '.3f')} | {_f(r['auc'], '.3f')} | {_f(r['max_drop'], '.3f')} | "
                 f"{_f(r['hard_solved_share'], '.3f')} | {_f(r['step_time_s'], '.2f')} | {r['steps_at_budget']} | "
                 f"{r['train_wall_s']:.0f} | {r['total_steps']} | {r['total_tokens']:,.0f} |")
  if missing:
    lines += ["", f"Not included (no finished metrics): {', '.join(missing)}."]
  if plots:
    lines += ["", "## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
  with open(os.path.join(outdir, "results.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
