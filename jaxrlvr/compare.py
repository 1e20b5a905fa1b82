"""Method comparison at an equal rollout budget: runs, resumes, a results table with confidence intervals, plots.

    python -m jaxrlvr.compare --methods=grpo,exgrpo,advantage_priority,bapo --seeds=3 --outdir=/tmp/compare

Every method x seed trains in `DIR/runs/<method>-s<seed>` (the main job as a subprocess, one CPU device each, up to
`--parallel` at a time); rerunning the command skips finished runs and resumes killed ones, because `train.run`
continues from the checkpoints of its workdir. Then `DIR/results.md`, `DIR/results.csv`, `DIR/runs.csv` and one PNG
per question are written.

How the runs get an equal budget. Methods generate different numbers of tokens per step (an ExGRPO replay question
samples K-1 answers, not K; BAPO re-rolls hard questions; answers get shorter or longer as the policy changes), so
equal steps are not equal cost. The budget is counted in generated rollout tokens (`rollout/sampled_tokens`, summed
over steps; evaluation tokens do not count):
- by default every run trains the same number of steps (`--steps`, or the config's `total_steps`) and the common
  budget is the smallest total any run reached; every curve is cut there;
- with `--budget_tokens=N` a run that finishes its steps short of N is resumed with a larger `total_steps` (a change
  resumption allows; it only moves the last evaluation and is exact for the default constant learning rate, not for
  a cosine schedule, whose length it changes) until it has generated N tokens; the curves are then cut at N.
Accuracy at the budget is the last held-out evaluation at or below it (evaluations run every `--eval_every` steps, so
a run may pass the budget a few steps after its last evaluation). The area under the accuracy-vs-budget curve joins
the evaluations with straight lines, holds the last value up to the budget and is divided by the budget: it is the
mean accuracy over the budget, in [0, 1].
"""
import concurrent.futures
import csv
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

from jaxrlvr import run_data

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("grpo", "exgrpo", "advantage_priority", "bapo")
TOKENS_KEY, ACCURACY_KEY = run_data.TOKENS_KEY, run_data.ACCURACY_KEY


# Reading runs and the interval over seeds live in run_data.py, which plots.py uses too (plots must not import this
# module, which draws with it); the names stay here, where the notebooks and users reach them.
RunData = run_data.RunData
read_rows = run_data.read_rows
cumulative_tokens = run_data.cumulative_tokens
load_run = run_data.load_run
confidence_interval = run_data.confidence_interval


# ------------------------------------------------------------------------------------------------ Statistics
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


@dataclasses.dataclass
class Summary:
  budget_tokens: float
  baseline: str  # the method the paired differences are taken against
  methods: list[dict]  # one row per method: means and 95% CI half-widths over seeds
  runs: list[dict]  # one row per run


def summarize(runs: Sequence[RunData], *, budget_tokens: float | None = None, baseline: str | None = None) -> Summary:
  """The results table. Budget: `budget_tokens`, or the smallest total any run generated (module docstring).

  Besides each metric's mean over seeds, the table has paired differences: a run's gain over its own step-0
  accuracy, and its accuracy and AUC minus those of the `baseline` method's run with the same seed (default: the
  first method). A seed fixes the warm start and the held-out questions, which move accuracy by more than the
  methods do, so differences within a seed have much narrower intervals than the means across seeds.
  """
  if not runs:
    raise ValueError("summarize: no runs")
  baseline = runs[0].method if baseline is None else baseline
  if baseline not in {r.method for r in runs}:
    methods = sorted({r.method for r in runs})
    raise ValueError(f"summarize: baseline method {baseline!r} has no runs; methods: {methods}")
  budget = min(r.total_tokens for r in runs) if budget_tokens is None else float(budget_tokens)
  short = [f"{r.name} ({r.total_tokens:.0f})" for r in runs if r.total_tokens < budget]
  if short:
    raise ValueError(f"runs that generated fewer tokens than the budget of {budget:.0f}: {', '.join(short)}")
  per_run = []
  for r in runs:
    _, eval_tokens, accuracy = r.series(ACCURACY_KEY)
    steps, step_tokens, step_times = r.series("time/step_s")
    within = step_tokens <= budget
    per_run.append({
        "run": r.name, "method": r.method, "seed": r.seed,
        "initial_accuracy": float(accuracy[0]) if len(accuracy) and eval_tokens[0] == 0 else float("nan"),
        "final_accuracy": accuracy_at(eval_tokens, accuracy, budget),
        "auc": area_under_curve(eval_tokens, accuracy, budget),
        # The median leaves out the first steps' compilation.
        "step_time_s": float(np.median(step_times[within])) if within.any() else float("nan"),
        "steps_at_budget": int(steps[within][-1]) if within.any() else 0,
        "tokens_per_step": float(r.tokens[int(steps[within][-1])] / steps[within][-1]) if within.any() else 0.0,
        "total_steps": int(max(r.rows)), "total_tokens": r.total_tokens,
    })
  base = {r["seed"]: r for r in per_run if r["method"] == baseline}
  for r in per_run:
    b = base.get(r["seed"])
    r["accuracy_gain"] = r["final_accuracy"] - r["initial_accuracy"]
    r["accuracy_vs_baseline"] = r["final_accuracy"] - b["final_accuracy"] if b else float("nan")
    r["auc_vs_baseline"] = r["auc"] - b["auc"] if b else float("nan")
  methods = []
  for method in dict.fromkeys(r["method"] for r in per_run):
    rows = [r for r in per_run if r["method"] == method]
    row = {"method": method, "seeds": len(rows), "budget_tokens": budget}
    for key in _STATS:
      mean, half = confidence_interval([r[key] for r in rows])
      row[f"{key}_mean"], row[f"{key}_ci95"] = float(mean), float(half)
    methods.append(row)
  return Summary(budget_tokens=budget, baseline=baseline, methods=methods, runs=per_run)


# ------------------------------------------------------------------------------------------------ Writing results
# (key, column title, digits); "{b}" is the baseline method.
_TABLE = (("final_accuracy", "held-out accuracy at budget", 3), ("accuracy_gain", "gain over step 0", 3),
          ("accuracy_vs_baseline", "accuracy - {b}", 3), ("auc", "AUC (normalised)", 3),
          ("auc_vs_baseline", "AUC - {b}", 3), ("initial_accuracy", "accuracy at step 0", 3),
          ("step_time_s", "step time (s)", 2), ("steps_at_budget", "steps to budget", 0),
          ("tokens_per_step", "tokens / step", 0))
_STATS = tuple(key for key, _, _ in _TABLE)


def _pm(mean: float, half: float, digits: int) -> str:
  if np.isnan(mean):
    return "n/a"
  return f"{mean:.{digits}f}" if np.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def write_results(summary: Summary, outdir: str, *, command: str = "", wall_s: float | None = None,
                  plots: Sequence[str] = (), missing: Sequence[str] = ()) -> None:
  """DIR/results.csv (per method), DIR/runs.csv (per run) and DIR/results.md (both tables, the plots, the setup)."""
  os.makedirs(outdir, exist_ok=True)
  for name, rows in (("results.csv", summary.methods), ("runs.csv", summary.runs)):
    with open(os.path.join(outdir, name), "w", newline="", encoding="utf-8") as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)
  lines = ["# Method comparison at an equal rollout budget", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  if wall_s is not None:
    lines += [f"Wall time of this invocation: {wall_s / 60:.1f} min (runs already finished are not re-run).", ""]
  lines += [f"Budget: {summary.budget_tokens:,.0f} generated rollout tokens per run. Accuracy is greedy held-out "
            "accuracy at the last evaluation at or below the budget; AUC is the mean accuracy over the budget "
            "(evaluations joined linearly); step time is the median over the run's steps, measured with the runs "
            "sharing the machine (--parallel), so compare it within this table. Entries are the mean ± the "
            "half-width of the 95% t-interval over seeds (none with one seed).", ""]
  lines += [f"Paired columns: the gain is each run's accuracy at the budget minus its own accuracy at step 0; "
            f"`- {summary.baseline}` is the difference to the {summary.baseline} run of the same seed (same warm "
            "start, same held-out questions), then averaged over seeds.", ""]
  lines += ["| method | seeds | " + " | ".join(t.format(b=summary.baseline) for _, t, _ in _TABLE) + " |",
            "|---|---|" + "---|" * len(_TABLE)]
  for m in summary.methods:
    cells = ["baseline" if "vs_baseline" in k and m["method"] == summary.baseline else
             _pm(m[f"{k}_mean"], m[f"{k}_ci95"], d) for k, _, d in _TABLE]
    lines.append(f"| {m['method']} | {m['seeds']} | " + " | ".join(cells) + " |")
  lines += ["", "## Runs", "",
            f"| run | accuracy at step 0 | accuracy at budget | gain | accuracy - {summary.baseline} "
            "| AUC | step time (s) | steps to budget | steps run | tokens generated |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for r in summary.runs:
    lines.append(f"| {r['run']} | {r['initial_accuracy']:.3f} | {r['final_accuracy']:.3f} | "
                 f"{r['accuracy_gain']:+.3f} | {r['accuracy_vs_baseline']:+.3f} | {r['auc']:.3f} | "
                 f"{r['step_time_s']:.2f} | {r['steps_at_budget']} | {r['total_steps']} | {r['total_tokens']:,.0f} |")
  if missing:
    lines += ["", f"Not included (no finished metrics): {', '.join(missing)}."]
  if plots:
    lines += ["", "## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
  with open(os.path.join(outdir, "results.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------ Running
@dataclasses.dataclass(frozen=True)
class RunSpec:
  method: str
  seed: int
  workdir: str
  log_path: str

  @property
  def name(self) -> str:
    return f"{self.method}-s{self.seed}"


def method_config(method: str, *, smoke: bool = False, configs_dir: str = os.path.join(REPO_ROOT, "configs")):
  """The method's config (to read total_steps and eval_every), imported the way the main job's flag does."""
  path = os.path.join(configs_dir, f"{method}.py")
  if not os.path.exists(path):
    known = sorted(f[:-3] for f in os.listdir(configs_dir) if f.endswith(".py") and f not in ("base.py", "__init__.py"))
    raise ValueError(f"--methods: no config {path} for method {method!r}; known: {known}")
  root = os.path.dirname(os.path.abspath(configs_dir))
  if root not in sys.path:
    sys.path.insert(0, root)
  return importlib.import_module(f"{os.path.basename(os.path.normpath(configs_dir))}.{method}").get_config(
      "smoke" if smoke else None)


def apply_override(config, override: str) -> None:
  """`key.sub=value` (as `--config.key.sub=value`) onto a config, the value cast to the type of the current one."""
  text = override[len("--config."):] if override.startswith("--config.") else override
  key, sep, value = text.partition("=")
  *parents, leaf = key.split(".")
  node = config
  try:
    for p in parents:
      node = node[p]
    current = node[leaf]
  except KeyError:
    raise ValueError(f"--override={override!r}: the config has no key {key!r}") from None
  if not sep:
    raise ValueError(f"--override={override!r}: expected key=value")
  if isinstance(current, bool):
    if value.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"--override={override!r}: {key} is a bool; got {value!r}")
    node[leaf] = value.lower() in ("true", "1")
  elif isinstance(current, (int, float, str)):
    node[leaf] = type(current)(value)
  else:
    raise ValueError(f"--override={override!r}: {key} holds a {type(current).__name__}; pass it to the main job")


def check_workdir(spec: RunSpec, config) -> None:
  """Refuses a workdir that holds a run of another config (e.g. an older comparison in the same --outdir): a
  finished run is skipped without starting the main job, so nothing else would notice."""
  path = os.path.join(spec.workdir, "config.json")
  if not os.path.exists(path):
    return
  from jaxrlvr import checkpointing  # pylint: disable=g-import-not-at-top  (orbax and jax: only when needed)
  with open(path, encoding="utf-8") as f:
    changes = checkpointing.incompatible_changes(json.load(f), config.to_dict())
  if changes:
    raise ValueError(f"{spec.workdir} holds a run whose config differs from this comparison's: {'; '.join(changes)}. "
                     "Use another --outdir, or the same flags and overrides as before.")


def finished_step(workdir: str) -> int:
  """The step of the run's latest complete checkpoint (orbax renames a step directory only once it is whole)."""
  directory = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
  return max(steps, default=0)


def run_env(threads: int) -> dict:
  """One CPU device and `threads` threads per run, so parallel runs do not fight over the cores; on a GPU, memory
  allocated as needed rather than 75% of it up front by each run, so that several small runs fit on one card."""
  env = dict(os.environ)
  xla = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  xla.append("--xla_force_host_platform_device_count=1")
  if threads == 1:
    xla += ["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]
  env["XLA_FLAGS"] = " ".join(xla)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
    env[var] = str(threads)
  env["PYTHONUNBUFFERED"] = "1"
  return env


def train_command(spec: RunSpec, *, steps: int, eval_every: int, smoke: bool, cache_dir: str,
                  overrides: Sequence[str] = (), configs_dir: str = os.path.join(REPO_ROOT, "configs")) -> list[str]:
  cmd = [sys.executable, "-m", "jaxrlvr.main",
         f"--config={os.path.join(configs_dir, spec.method + '.py')}{':smoke' if smoke else ''}",
         f"--workdir={spec.workdir}", f"--config.seed={spec.seed}", f"--config.total_steps={steps}",
         "--config.log_every=1", f"--config.eval_every={eval_every}", "--config.reward.num_workers=1"]
  if cache_dir:
    cmd.append(f"--config.warm_start.cache_dir={cache_dir}")
  return cmd + [o if o.startswith("--") else f"--config.{o}" for o in overrides]


def run_one(spec: RunSpec, *, steps: int, budget_tokens: float | None, launch, max_extensions: int = 20) -> int:
  """Trains (or resumes) one run to `steps`, then, with a token budget, extends it until it has generated that many.
  `launch(spec, steps)` runs the main job and returns its exit code. Returns the run's final total_steps."""
  for _ in range(max_extensions + 1):
    if finished_step(spec.workdir) < steps:
      code = launch(spec, steps)
      if code != 0:
        raise RuntimeError(f"{spec.name}: the main job exited with {code}; its log is {spec.log_path}")
    if budget_tokens is None:
      return steps
    rows = read_rows(os.path.join(spec.workdir, "metrics.jsonl"))
    tokens = cumulative_tokens(rows, source=spec.workdir)
    done = max(tokens)
    if tokens[done] >= budget_tokens:
      return steps
    # Extend by the steps the remaining tokens need at this run's rate, plus 5% so one extension usually suffices.
    steps = done + max(1, math.ceil((budget_tokens - tokens[done]) / max(tokens[done] / max(done, 1), 1.0) * 1.05))
  raise RuntimeError(f"{spec.name}: still short of {budget_tokens:.0f} tokens after {max_extensions} extensions")


def run_all(specs: Sequence[RunSpec], *, parallel: int, launch, steps: int, budget_tokens: float | None) -> dict:
  """Runs every spec, `parallel` at a time. The first run of each seed goes first and the others of that seed wait
  for its step-0 metrics, by which time its warm start is cached for them. Returns {name: error or None}."""
  leaders = {}
  for s in specs:
    leaders.setdefault(s.seed, s)
  ordered = list(leaders.values()) + [s for s in specs if leaders[s.seed] is not s]
  finished = {s.name: False for s in ordered}

  def job(spec: RunSpec):
    leader = leaders[spec.seed]
    while leader is not spec and not finished[leader.name] and not os.path.exists(
        os.path.join(leader.workdir, "metrics.jsonl")):
      time.sleep(1.0)
    try:
      run_one(spec, steps=steps, budget_tokens=budget_tokens, launch=launch)
      return None
    except Exception as e:  # pylint: disable=broad-except  (one failed run must not stop the others)
      return f"{type(e).__name__}: {e}"
    finally:
      finished[spec.name] = True

  # Workers take jobs in submission order, so a waiting run's leader has always started already.
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
    futures = {s.name: pool.submit(job, s) for s in ordered}
    return {name: f.result() for name, f in futures.items()}


def subprocess_launcher(*, eval_every: int, smoke: bool, cache_dir: str, threads: int, overrides: Sequence[str],
                        configs_dir: str):
  """`launch(spec, steps)` for run_one: the main job as a subprocess, its output appended to the spec's log."""
  env = run_env(threads)

  def launch(spec: RunSpec, steps: int) -> int:
    os.makedirs(os.path.dirname(spec.log_path), exist_ok=True)
    cmd = train_command(spec, steps=steps, eval_every=eval_every, smoke=smoke, cache_dir=cache_dir,
                        overrides=overrides, configs_dir=configs_dir)
    print(f"compare: {spec.name}: training to step {steps} (log: {spec.log_path})", flush=True)
    t = time.time()
    with open(spec.log_path, "a", encoding="utf-8") as log:
      log.write("$ " + " ".join(cmd) + "\n")
      log.flush()
      code = subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(configs_dir)), env=env, stdout=log,
                            stderr=subprocess.STDOUT, check=False).returncode
    print(f"compare: {spec.name}: exit {code} after {time.time() - t:.0f} s", flush=True)
    return code

  return launch


# ------------------------------------------------------------------------------------------------ Command line
def main(argv) -> int:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from jaxrlvr import plots  # pylint: disable=g-import-not-at-top  (matplotlib only where figures are drawn)
  if len(argv) > 1:
    raise ValueError(f"compare: unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  started = time.time()
  outdir = os.path.abspath(f.outdir)
  if f.seeds < 1:
    raise ValueError(f"--seeds must be >= 1, got {f.seeds}")
  if f.budget_tokens is not None and f.budget_tokens <= 0:
    raise ValueError(f"--budget_tokens must be > 0, got {f.budget_tokens}")
  configs = {m: method_config(m, smoke=f.smoke, configs_dir=f.configs_dir) for m in f.methods}
  steps = f.steps or max(c.total_steps for c in configs.values())
  eval_every = f.eval_every or min(min(c.eval_every for c in configs.values()), max(1, steps // 8))
  specs = [RunSpec(m, s, os.path.join(outdir, "runs", f"{m}-s{s}"), os.path.join(outdir, "logs", f"{m}-s{s}.log"))
           for m in f.methods for s in range(f.seeds)]
  errors = {}
  if not f.summarize_only:
    for spec in specs:
      config = method_config(spec.method, smoke=f.smoke, configs_dir=f.configs_dir)
      for override in [f"seed={spec.seed}", *f.override]:
        apply_override(config, override)
      check_workdir(spec, config)
    threads = f.threads_per_run or max(1, (os.cpu_count() or 1) // max(1, f.parallel))
    launch = subprocess_launcher(eval_every=eval_every, smoke=f.smoke, cache_dir=f.warm_start_cache,
                                 threads=threads, overrides=f.override, configs_dir=f.configs_dir)
    errors = {k: v for k, v in run_all(specs, parallel=f.parallel, launch=launch, steps=steps,
                                       budget_tokens=f.budget_tokens).items() if v}
    for name, error in errors.items():
      print(f"compare: {name} failed: {error}", file=sys.stderr)
  runs = [load_run(s.workdir, method=s.method, seed=s.seed) for s in specs
          if s.name not in errors and os.path.exists(os.path.join(s.workdir, "metrics.jsonl"))]
  missing = [s.name for s in specs if s.name not in {r.name for r in runs}]
  if not runs:
    raise RuntimeError(f"compare: no run in {outdir}/runs has metrics; failed: {sorted(errors)}")
  summary = summarize(runs, budget_tokens=f.budget_tokens, baseline=f.baseline or None)
  figures = plots.write_all(runs, summary.budget_tokens, outdir)
  command = "python -m jaxrlvr.compare " + " ".join(a for a in sys.argv[1:])
  write_results(summary, outdir, command=command, wall_s=time.time() - started,
                plots=[os.path.basename(p) for p in figures], missing=missing)
  with open(os.path.join(outdir, "results.md"), encoding="utf-8") as fh:
    print(fh.read())
  return 1 if errors else 0


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("methods", list(METHODS), "Methods to compare: names of files in --configs_dir.")
  flags.DEFINE_integer("seeds", 3, "Seeds per method: 0 .. N-1.")
  flags.DEFINE_string("outdir", None, "Runs, logs, results.md, results.csv and the plots go here.")
  flags.DEFINE_bool("smoke", False, "Use the configs' `:smoke` settings (seconds per run; for tests).")
  flags.DEFINE_float("budget_tokens", None, "Train every run until it has generated this many rollout tokens "
                     "(default: equal steps, cut at the smallest total).")
  flags.DEFINE_integer("steps", None, "Steps per run (with --budget_tokens: the first guess). Default: the config's.")
  flags.DEFINE_integer("parallel", 2, "Runs at a time.")
  flags.DEFINE_integer("eval_every", None, "Evaluation interval in steps. Default: the config's, at most steps / 8.")
  flags.DEFINE_integer("threads_per_run", None, "CPU threads per run. Default: cores / parallel.")
  flags.DEFINE_string("warm_start_cache", "", "Warm-start cache shared by the runs (default: the config's).")
  flags.DEFINE_multi_string("override", [], "Extra config override for every run, e.g. --override=optim.lr=3e-5.")
  flags.DEFINE_string("configs_dir", os.path.join(REPO_ROOT, "configs"), "Where the method configs are.")
  flags.DEFINE_bool("summarize_only", False, "Skip training (and the check that DIR/runs holds runs of this config): "
                    "summarise and plot what DIR/runs holds.")
  flags.DEFINE_string("baseline", "", "Method the paired differences are taken against (default: the first).")
  flags.mark_flag_as_required("outdir")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
