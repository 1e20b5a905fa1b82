"""The comparison's numbers: each run's figures at the common budget, their means and intervals over seeds, the
differences paired by seed against the baseline arm, and the primary endpoint tested with Holm's correction; written
as DIR/results.md, results.csv and runs.csv.

Where a run is read. The budget is a count of generated rollout tokens fixed before the runs (compare/runner.py), and
each run evaluates at the first step whose cumulative tokens reach it (`eval.token_marks`, jaxrlvr/train.py): that
evaluation is the run's reading, so every arm is read within one step's tokens of the budget, whatever its steps
cost. A run that did not evaluate there (made without the marks, or the default equal-steps comparison, whose budget
is known only afterwards) is read at its last evaluation at or below the budget, and results.md says so per run.

Per run:
- greedy accuracy at the budget (the reading above), its gain over step 0, the tokens it was read at; the AUC: mean
  accuracy over [0, budget], the same range for every arm (evaluations joined linearly, the value at the budget
  interpolated between the evaluations either side of it: the budget's own evaluation is at most one step past it);
- pass@k at the budget (`eval/pass@k`, k samples per question at eval.temperature; read as accuracy), where measured;
- stability: the largest drop of greedy accuracy between two consecutive evaluations up to the reading, and the
  standard deviation of the evaluations in the second half of the budget (the reading included);
- from DIR/questions.jsonl (outputs.visit_stats, steps up to the budget's): questions visited, mean visits, and of
  the questions with no correct answer at their first visit, the share solved (>= 1 of K) at a later visit;
- mechanism: groups with signal (a share of the groups, by count), and the share of loss tokens whose advantage is 0
  (`policy/zero_adv_frac`, a share of tokens, which long answers weigh more);
- cost: median step time, steps and training seconds up to the budget, tokens per step.
A supervised control run (kind "sft") generates no tokens: its budget is the training time the baseline run of its
seed took to reach the token budget (`time/step_s` summed; evaluations excluded from both), and it is read the same
way on that axis (it evaluates when its training time reaches its target); the token columns are n/a.

The primary endpoint, named before the runs: held-out greedy accuracy at the budget minus that of the baseline (GRPO)
run of the same seed, one per arm. Each arm's differences get a two-sided paired t-test over seeds; the p-values of
all arms are adjusted with Holm's step-down method (`holm`), and an arm's difference is called non-zero when its
adjusted p-value is below 0.05. The interval printed beside it is the t-interval at confidence 1 - the arm's Holm
step-down level (0.05 / m for the smallest of m p-values, 0.05 / (m - 1) for the next, ..., 0.05 for the largest),
which excludes 0 exactly when its raw p-value passes that level; the adjusted p-value also asks that every smaller
one passed its own, so it is what decides. Every other column is exploratory: plain 95% t-intervals, not adjusted for
the many columns and arms.
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


def budget_step(x: dict[int, float], budget: float) -> int | None:
  """The first step whose cumulative `x` (tokens; training seconds for the control) reaches the budget; None: none."""
  return next((s for s in sorted(x) if x[s] >= budget), None)


def reading(eval_x: np.ndarray, budget: float, *, reach: float | None) -> tuple[int, bool]:
  """(index of the evaluation a run is read at, whether it is at the budget). `eval_x`: the cumulative x of the run's
  evaluations; `reach`: x at the first step that reached the budget. The run is read at its evaluation there, within
  one step of the budget; a run that did not evaluate there, at its last evaluation at or below the budget (False)."""
  eval_x = np.asarray(eval_x, np.float64)
  if reach is not None:
    at = np.flatnonzero(eval_x == reach)
    if len(at):
      return int(at[0]), True
  inside = np.flatnonzero(eval_x <= budget)
  if not len(inside):
    raise ValueError(f"no evaluation at or below the budget of {budget:g}")
  return int(inside[-1]), False


def area_under_curve(tokens: np.ndarray, accuracy: np.ndarray, budget: float) -> float:
  """Mean accuracy over [0, budget], the same range for every run: evaluations joined linearly, the value at the budget
  interpolated between the evaluations either side of it (held from the last one when none is past it)."""
  if budget <= 0:
    raise ValueError(f"the budget must be > 0 tokens, got {budget}")
  tokens, accuracy = np.asarray(tokens, np.float64), np.asarray(accuracy, np.float64)
  keep = tokens <= budget
  if not keep.any() or tokens[keep][0] > 0:
    raise ValueError("the accuracy curve needs an evaluation at 0 tokens (step 0)")
  x = np.append(tokens[keep], budget)
  y = np.append(accuracy[keep], np.interp(budget, tokens, accuracy))
  return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / budget)


def largest_drop(accuracy: np.ndarray) -> float:
  """The largest fall between two consecutive evaluations (0 when accuracy never fell)."""
  accuracy = np.asarray(accuracy, np.float64)
  return float(max(0.0, np.max(accuracy[:-1] - accuracy[1:]))) if len(accuracy) > 1 else float("nan")


def late_std(x: np.ndarray, accuracy: np.ndarray, budget: float, *, until: float | None = None) -> float:
  """Sample std of the evaluations in the second half of the budget, (budget / 2, until] (`until`: the reading's x,
  default the budget); NaN with fewer than two there."""
  x, until = np.asarray(x), budget if until is None else until
  late = np.asarray(accuracy, np.float64)[(x > budget / 2) & (x <= until)]
  return float(np.std(late, ddof=1)) if len(late) > 1 else float("nan")


def paired_t(differences: Sequence[float]) -> float:
  """Two-sided p-value of the paired t-test that the mean of the per-seed `differences` is 0 (NaN below 2 seeds;
  0 or 1 when they do not vary)."""
  d = np.asarray(differences, np.float64)
  if len(d) < 2:
    return float("nan")
  if np.ptp(d) == 0:  # tested on the values: their float std need not be exactly 0
    return 1.0 if d[0] == 0 else 0.0
  from scipy import stats  # pylint: disable=g-import-not-at-top  (as outputs.confidence_interval)
  t = float(d.mean()) / (float(np.std(d, ddof=1)) / math.sqrt(len(d)))
  return float(2 * stats.t.sf(abs(t), len(d) - 1))


def holm(p_values: Sequence[float], alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
  """Holm-Bonferroni over a family of tests: (adjusted p-values, each test's step-down level). Sorted ascending, the
  i-th smallest of m p-values (i = 0..m-1) is tested at alpha / (m - i), and its adjusted p-value is the largest of
  min(1, (m - j) p_(j)) over j <= i, so the adjusted p-values keep the order of the raw ones and a test is rejected
  when its adjusted p-value is below alpha. NaN p-values (an arm without paired seeds) are not in the family: NaN."""
  p = np.asarray(p_values, np.float64)
  adjusted, levels = np.full_like(p, np.nan), np.full_like(p, np.nan)
  family = np.flatnonzero(~np.isnan(p))
  order = family[np.argsort(p[family], kind="stable")]
  m, running = len(order), 0.0
  for i, k in enumerate(order):
    running = max(running, min(1.0, (m - i) * p[k]))
    adjusted[k], levels[k] = running, alpha / (m - i)
  return adjusted, levels


def t_half_width(values: Sequence[float], level: float) -> float:
  """Half-width of the two-sided t-interval of the mean of `values` at confidence 1 - level (NaN below 2 values)."""
  v = np.asarray(values, np.float64)
  if len(v) < 2 or np.isnan(level):
    return float("nan")
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(stats.t.ppf(1 - level / 2, len(v) - 1) * np.std(v, ddof=1) / math.sqrt(len(v)))


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
  primary: list[dict] = dataclasses.field(default_factory=list)  # per arm but the baseline: the primary endpoint


def _run_row(r: outputs.RunData, *, x: dict, budget: float, pass_metric: str | None) -> dict:
  """One run's figures read at `budget` on the axis `x` ({step: position}: tokens, or training seconds for the
  control): at its evaluation at the first step that reached the budget (`reading`)."""
  steps, _, accuracy = r.series(ACCURACY_KEY)
  eval_x = np.asarray([x[s] for s in steps], np.float64)
  last = budget_step(x, budget)
  if last is None:
    raise ValueError(f"{r.name} did not reach the budget of {budget:g}")
  i, exact = reading(eval_x, budget, reach=x[last])
  time_steps, _, step_times = r.series(outputs.STEP_TIME_KEY)
  within = time_steps <= last
  row = {
      "run": r.name, "method": r.method, "seed": r.seed, "kind": r.kind,
      "initial_accuracy": float(accuracy[0]) if len(accuracy) and steps[0] == 0 else float("nan"),
      "final_accuracy": float(accuracy[i]), "read_step": int(steps[i]),
      "read_tokens": float(r.tokens[int(steps[i])]) if r.kind != "sft" else float("nan"),
      "read_wall_s": r.wall[int(steps[i])], "read_at_budget": exact,
      "max_drop": largest_drop(accuracy[:i + 1]), "late_std": late_std(eval_x, accuracy, budget, until=eval_x[i]),
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
    if (pass_x <= budget).any() or (pass_x == x[last]).any():
      row["pass_at_k"] = float(values[reading(pass_x, budget, reach=x[last])[0]])
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
  zero = [row[_ZERO_ADV] for step, row in r.rows.items() if 0 < step <= last and _ZERO_ADV in row]
  zero_adv_token_share = float(np.mean(zero)) if zero and r.kind != "sft" else nan
  if r.kind == "sft" or not r.questions:
    return dict(signal_share=nan, signal_share_first=nan, zero_adv_token_share=zero_adv_token_share,
                questions_trained=nan, replay_top_share=nan, replayed_grad_share=nan)
  m = outputs.mechanism_stats(r.questions, last_step=last)
  # The replayed rows' share of the gradient's norm, over the logged steps that trained replayed rows.
  shares = [row[_GRAD_SHARE] for step, row in r.rows.items() if step <= last and _GRAD_SHARE in row
            and row.get("policy/replayed/tokens", 0) > 0]
  return dict(signal_share=m.signal_share, signal_share_first=m.signal_share_first,
              zero_adv_token_share=zero_adv_token_share,
              questions_trained=m.questions_trained if m.questions_trained else nan,
              replay_top_share=m.replay_top_share, replayed_grad_share=float(np.mean(shares)) if shares else nan)


_ZERO_ADV = "policy/zero_adv_frac"
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
  return Summary(budget_tokens=budget, baseline=baseline, methods=methods, runs=per_run, pass_key=metric,
                 primary=primary_endpoint(per_run, baseline))


def primary_endpoint(per_run: Sequence[dict], baseline: str, alpha: float = 0.05) -> list[dict]:
  """Per arm but the baseline: its accuracy at the budget minus the baseline's, paired by seed; the paired t-test's
  p-value, Holm-adjusted over the arms, and the interval at the arm's Holm step-down level (module doc)."""
  arms = [m for m in dict.fromkeys(r["method"] for r in per_run) if m != baseline]
  diffs = {m: [r["accuracy_vs_baseline"] for r in per_run
               if r["method"] == m and not math.isnan(r["accuracy_vs_baseline"])] for m in arms}
  p = [paired_t(diffs[m]) for m in arms]
  adjusted, levels = holm(p, alpha)
  return [{"method": m, "pairs": len(diffs[m]), "mean": float(np.mean(diffs[m])) if diffs[m] else float("nan"),
           "half_width": t_half_width(diffs[m], levels[k]), "level": float(levels[k]), "p": p[k],
           "p_holm": float(adjusted[k])} for k, m in enumerate(arms)]


# ------------------------------------------------------------------------------------------------ Writing results
# (key, column title, digits); "{b}" is the baseline arm, "{p}" the pass@k name. All exploratory: the primary endpoint
# (accuracy - {b}) has its own table.
_TABLE = (("final_accuracy", "held-out accuracy at budget", 3), ("accuracy_gain", "gain over step 0", 3),
          ("auc", "AUC (normalised)", 3), ("auc_vs_baseline", "AUC - {b}", 3),
          ("initial_accuracy", "accuracy at step 0", 3), ("read_tokens", "tokens at reading", 0),
          ("step_time_s", "step time (s)", 2), ("steps_at_budget", "steps to budget", 0),
          ("train_wall_s", "training time to budget (s)", 0), ("tokens_per_step", "tokens / step", 0))
_CLAIMS = (("pass_at_k", "{p} at budget", 3), ("pass_at_k_vs_baseline", "{p} - {b}", 3),
           ("max_drop", "largest drop", 3), ("max_drop_vs_baseline", "largest drop - {b}", 3),
           ("late_std", "std of late evals", 3), ("hard_first", "questions 0/K at first visit", 0),
           ("hard_solved_share", "of those, solved later", 3),
           ("hard_solved_share_vs_baseline", "solved later - {b}", 3), ("visits_mean", "visits per question", 2))
_MECHANISM = (("signal_share", "groups with signal (share of groups)", 3),
              ("signal_share_first", "groups with signal, steps 1-20 (share of groups)", 3),
              ("zero_adv_token_share", "tokens with advantage 0 (share of tokens, policy/zero_adv_frac)", 3),
              ("questions_trained", "distinct questions trained", 0),
              ("replay_top_share", "replays to the 50 most replayed questions", 3),
              ("replayed_grad_share", "replayed rows' share of the gradient norm", 3))
# figure -> its difference to the baseline run of the same seed
_PAIRED = {"final_accuracy": "accuracy_vs_baseline", "auc": "auc_vs_baseline", "pass_at_k": "pass_at_k_vs_baseline",
           "max_drop": "max_drop_vs_baseline", "hard_solved_share": "hard_solved_share_vs_baseline"}
_STATS = tuple(dict.fromkeys(["accuracy_vs_baseline", *(key for key, _, _ in _TABLE + _CLAIMS + _MECHANISM)]))
_EXPLORATORY = ("Exploratory: mean ± the half-width of the 95% t-interval over seeds (none with one seed), each "
                "column on its own, not adjusted for the number of columns and arms: a description, not a test.")


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


def _primary_lines(summary: Summary) -> list[str]:
  b, m = summary.baseline, sum(not math.isnan(r["p"]) for r in summary.primary)
  family = f"the p-values of the {m} arms with paired seeds" if m else "no p-values (an arm needs 2 paired seeds)"
  lines = ["## Primary endpoint", "",
           f"Named before the runs: held-out greedy accuracy at the budget minus that of the {b} run of the same seed "
           f"(same warm start, same held-out questions), one per arm. Two-sided paired t-test over seeds; {family}, "
           f"adjusted with Holm's step-down method: an arm differs from {b} when its adjusted p-value is below 0.05. "
           "The interval is the t-interval at the arm's Holm level (interval level = 1 - 0.05 / (m - i + 1) for "
           "the i-th smallest of the m raw p-values), so it excludes 0 exactly when the raw p-value passes that "
           "level; the adjusted p-value also needs every smaller one to have passed.", "",
           f"| arm | seeds paired | accuracy at budget - {b} | interval level | raw p | Holm-adjusted p |",
           "|---|---|---|---|---|---|"]
  for r in summary.primary:
    level = "n/a" if math.isnan(r["level"]) else f"{100 * (1 - r['level']):.2f}%"
    lines.append(f"| {r['method']} | {r['pairs']} | {_pm(r['mean'], r['half_width'], 3)} | {level} | "
                 f"{_f(r['p'], '.4f')} | {_f(r['p_holm'], '.4f')} |")
  return lines


def write_results(summary: Summary, outdir: str, *, command: str = "", wall_s: float | None = None,
                  plots: Sequence[str] = (), missing: Sequence[str] = (), title: str = "",
                  setup: Sequence[str] = ()) -> None:
  """DIR/results.csv (per arm), DIR/runs.csv (per run) and DIR/results.md (the tables, the plots, the setup).
  `title`: the regime; `setup`: lines said before the tables (the preset, the arms and their overrides)."""
  os.makedirs(outdir, exist_ok=True)
  by_method = {r["method"]: r for r in summary.primary}
  methods = [{**m, **{f"primary_{k}": v for k, v in by_method.get(m["method"], {}).items() if k != "method"}}
             for m in summary.methods]
  for name, rows in (("results.csv", methods), ("runs.csv", summary.runs)):
    fields = list(dict.fromkeys(k for row in rows for k in row))  # the baseline's row has no primary_* keys
    with open(os.path.join(outdir, name), "w", newline="", encoding="utf-8") as f:
      writer = csv.DictWriter(f, fieldnames=fields, restval="")
      writer.writeheader()
      writer.writerows(rows)
  b = summary.baseline
  off = [r["run"] for r in summary.runs if not r["read_at_budget"]]
  lines = [f"# Method comparison at an equal rollout budget{': ' + title if title else ''}", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  if wall_s is not None:
    lines += [f"Wall time of this invocation: {wall_s / 60:.1f} min (runs already finished are not re-run).", ""]
  lines += list(setup) + ([""] if setup else [])
  lines += [f"Budget: {summary.budget_tokens:,.0f} generated rollout tokens per run. Each run is read at its "
            "evaluation at the first step whose tokens reached the budget (the runs evaluate there: "
            "eval.token_marks), so every arm is read within one step's tokens of the budget; the runs table gives "
            "the tokens each was read at. AUC is the mean accuracy over the same range, [0, budget], for every arm "
            "(evaluations joined linearly). Step time is the median over the run's steps, measured with the runs "
            "sharing the machine (--parallel), so compare it within this table; training time sums the step "
            "times (evaluations excluded). A supervised control (kind sft) is read at the training time its seed's "
            f"{b} run took to the budget.", ""]
  if off:
    lines += [f"Not read at the budget ({len(off)} of {len(summary.runs)} runs: {', '.join(off)}): they have no "
              "evaluation at the step that reached it (the budget was not known before the runs), so they are read "
              "at their last evaluation at or below it, up to an evaluation interval earlier.", ""]
  lines += _primary_lines(summary)
  lines += ["", "## Exploratory: accuracy, cost", "", _EXPLORATORY,
            f"The gain is each run's accuracy at the budget minus its own at step 0; `- {b}` is the difference to the "
            f"{b} run of the same seed, averaged over seeds.", ""]
  lines += _table(summary, _TABLE)
  lines += ["", "## Exploratory: what each method claims, measured", "", _EXPLORATORY,
            f"{_pass_name(summary)}{'' if summary.pass_key else ' (not measured)'}: the unbiased pass@k from k samples "
            "per held-out question at eval.temperature. Largest drop: the largest fall of greedy accuracy between "
            "two consecutive evaluations up to the budget; std of late evals: over the evaluations in the second "
            "half of the budget (both: lower is steadier). Visits are the groups sampled for a training question "
            "(fresh, replayed, re-rolled; DIR/questions.jsonl); 'solved later' is the share of the questions with "
            "no correct answer of K at their first visit that got at least one right at a later visit.", ""]
  lines += _table(summary, _CLAIMS)
  lines += ["", "## Exploratory: mechanism", "", _EXPLORATORY,
            "What replay is meant to change (DIR/questions.jsonl and metrics.jsonl, up to the budget). Groups with "
            "signal: the share of the groups (by count) the update trained on whose advantages are not all 0 (with "
            "K samples all right or all wrong, a group teaches nothing); a replayed ExGRPO group holds a stored "
            "correct answer beside K-1 fresh ones, so it has signal whenever one of those is wrong, by construction. "
            "Tokens with advantage 0: the same question by tokens (policy/zero_adv_frac, the mean over steps), "
            "which weighs long answers more. Distinct questions trained: fresh, re-rolled or "
            "replayed. Replays to the 50 most replayed questions: the share of replayed rollouts that went to "
            "them (1.0 when fewer than 50 were replayed). Share of the gradient norm: |grad of the replayed rows' "
            "policy loss| / |grad of the loss|, averaged over the logged steps that trained replayed rows "
            "(train.replayed_grad_share; n/a where it was off).", ""]
  lines += _table(summary, _MECHANISM)
  lines += ["", "## Runs", "",
            f"| run | read at step | read at tokens | at the budget | accuracy at step 0 | accuracy at budget | gain "
            f"| accuracy - {b} | {_pass_name(summary)} | AUC | largest drop | solved later | step time (s) "
            "| training time (s) | steps run | tokens generated |", "|" + "---|" * 16]
  for r in summary.runs:
    read = f"{r['read_wall_s']:.1f} s of training" if r["kind"] == "sft" else f"{r['read_tokens']:,.0f}"
    lines.append(f"| {r['run']} | {r['read_step']} | {read} | {'yes' if r['read_at_budget'] else 'no'} | "
                 f"{_f(r['initial_accuracy'], '.3f')} | {r['final_accuracy']:.3f} | "
                 f"{_f(r['accuracy_gain'], '+.3f')} | {_f(r['accuracy_vs_baseline'], '+.3f')} | "
                 f"{_f(r['pass_at_k'], '.3f')} | {_f(r['auc'], '.3f')} | {_f(r['max_drop'], '.3f')} | "
                 f"{_f(r['hard_solved_share'], '.3f')} | {_f(r['step_time_s'], '.2f')} | "
                 f"{r['train_wall_s']:.0f} | {r['total_steps']} | {r['total_tokens']:,.0f} |")
  if missing:
    lines += ["", f"Not included (no finished metrics): {', '.join(missing)}."]
  if plots:
    lines += ["", "## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
  with open(os.path.join(outdir, "results.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
