"""Method comparison at an equal rollout budget: runs, resumes, results tables with confidence intervals, plots.

    python -m jaxrlvr.compare --preset=data_limited --outdir=/tmp/compare_limited
    python -m jaxrlvr.compare --methods=grpo,exgrpo,advantage_priority,bapo --seeds=3 --outdir=/tmp/compare

A preset is a regime (`fresh`, `data_limited`) with its default arms and seeds; an arm is a method config plus
overrides, so an ablation is a row (compare/arms.py lists both). `--arms=grpo,exgrpo-no_shaping,sft` picks the arms,
`--methods` names method configs as they are. Every arm x seed trains in `DIR/runs/<arm>-s<seed>` (the main job as a
subprocess, one CPU device each, up to `--parallel` at a time); rerunning the command skips finished runs and resumes
killed ones, because `train.run` continues from the checkpoints of its workdir. The `sft` arm runs the supervised
control (compare/sft_control.py) once the grpo run of its seed has finished, for as long as that run trained. Then
`DIR/results.md`, `DIR/results.csv`, `DIR/runs.csv` and the plots are written (compare/stats.py says what each
column is).

How the runs get an equal budget. Methods generate different numbers of tokens per step (an ExGRPO replay question
samples K-1 answers, not K; BAPO re-rolls hard questions; answers get shorter or longer as the policy changes), so
equal steps are not equal cost. The budget is counted in generated rollout tokens (`rollout/sampled_tokens`, summed
over steps; evaluation tokens do not count):
- with `--budget_tokens=N`, or a preset's own budget (`Preset.budget_tokens`, e.g. `replay_testbed`'s 96,000; a
  preset with `exact_budget` and no budget of its own requires the flag), the budget is known before the
  runs, and every run gets it as marks: `eval.token_marks` = N/4, N/2, 3N/4 and N (arms.budget_marks),
  so a run evaluates at the first step whose generated tokens reach each, besides its evaluations every
  `--eval_every` steps. A run that finishes its steps short of N is resumed with a larger `total_steps` (a change
  resumption allows; it only moves the last evaluation and is exact for the default constant learning rate, not for
  a cosine schedule, whose length it changes) until it has generated N tokens. Every arm is then read at its
  evaluation at the budget, within one step's tokens of N, and at the same marks along the way;
- without it every run trains the same number of steps (`--steps`, or the config's `total_steps`) and the common
  budget is the smallest total any run reached, known only afterwards: a run that did not evaluate at the step that
  reached it is read at its last evaluation at or below it (results.md names those runs).
compare/stats.py says how each figure is read at the budget (the AUC: the mean accuracy over [0, budget]). The
supervised control trains for the time its seed's grpo run took to the budget (with --budget_tokens; else its whole
run) and evaluates when it gets there.
"""
import concurrent.futures
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from jaxrlvr import outputs
from jaxrlvr.compare import arms as arms_lib
from jaxrlvr.compare import stats as stats_lib

CompareError = arms_lib.CompareError


# ------------------------------------------------------------------------------------------------ Running
@dataclasses.dataclass(frozen=True)
class RunSpec:
  arm: str
  seed: int
  workdir: str
  log_path: str
  method: str = ""  # the config file configs/<method>.py; empty: the arm's name
  overrides: tuple[str, ...] = ()  # this run's own (the arm's), after the comparison's
  kind: str = "rl"  # "rl" (the main job) or "sft" (compare/sft_control.py)
  after: str = ""  # the run whose end this one waits for (the sft control: the grpo run of its seed)
  flags: tuple[str, ...] = ()  # the control's own flags

  @property
  def name(self) -> str:
    return f"{self.arm}-s{self.seed}"

  @property
  def config_name(self) -> str:
    return self.method or self.arm


def check_workdir(spec: RunSpec, config) -> None:
  """Refuses a workdir that holds a run of another config (e.g. an older comparison in the same --outdir): a
  finished run is skipped without starting the main job, so nothing else would notice."""
  path = os.path.join(spec.workdir, "config.json")
  if not os.path.exists(path):
    return
  from jaxrlvr import checkpointing, models  # pylint: disable=g-import-not-at-top  (orbax and jax: only when needed)
  # The run saved its config after filling in a shipped model's weights directory; so does this one before comparing.
  config = models.resolve_paths(config)
  with open(path, encoding="utf-8") as f:
    changes = checkpointing.incompatible_changes(json.load(f), config.to_dict())
  if changes:
    raise CompareError(f"{spec.workdir} holds a run whose config differs from this comparison's: "
                       f"{'; '.join(changes)}. Use another --outdir, or the same flags and overrides as before.")


def finished_step(workdir: str) -> int:
  """The step of the run's latest complete checkpoint (orbax renames a step directory only once it is whole)."""
  directory = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
  return max(steps, default=0)


def sft_finished_wall(workdir: str) -> float:
  """The training seconds a finished control run was asked for; 0 when it has not finished."""
  path = os.path.join(workdir, outputs.SFT_FILE)
  if not os.path.exists(path):
    return 0.0
  with open(path, encoding="utf-8") as f:
    state = json.load(f)
  return float(state["target_wall_s"]) if state.get("finished") else 0.0


def run_env(threads: int) -> dict:
  """One CPU device and `threads` threads per run, so parallel runs do not fight over the cores; on a GPU, memory
  allocated as needed rather than 75% of it up front by each run, so that several small runs fit on one card."""
  env = dict(os.environ)
  xla = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  xla.append("--xla_force_host_platform_device_count=1")
  if threads == 1:
    xla.append("--xla_cpu_multi_thread_eigen=false")
  env["XLA_FLAGS"] = " ".join(xla)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # NPROC: the CPU client's thread pool (jaxrlvr/xla_cpu.py), the cores when unset.
  for var in ("NPROC", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
    env[var] = str(threads)
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _config_flags(spec: RunSpec, *, smoke: bool, cache_dir: str, overrides: Sequence[str], configs_dir: str,
                  model: str = ""):
  arg = arms_lib.config_arg(smoke=smoke, model=model)
  cmd = [f"--config={os.path.join(configs_dir, spec.config_name + '.py')}{':' + arg if arg else ''}",
         f"--workdir={spec.workdir}", f"--config.seed={spec.seed}", "--config.reward.num_workers=1"]
  if cache_dir:
    cmd.append(f"--config.warm_start.cache_dir={cache_dir}")
  return cmd + [o if o.startswith("--") else f"--config.{o}" for o in (*overrides, *spec.overrides)]


def train_command(spec: RunSpec, *, steps: int, eval_every: int, smoke: bool, cache_dir: str,
                  overrides: Sequence[str] = (), configs_dir: str = arms_lib.CONFIGS_DIR,
                  model: str = "") -> list[str]:
  flags = _config_flags(spec, smoke=smoke, cache_dir=cache_dir, overrides=overrides, configs_dir=configs_dir,
                        model=model)
  return [sys.executable, "-m", "jaxrlvr.main", *flags[:3], f"--config.total_steps={steps}", "--config.log_every=1",
          f"--config.eval_every={eval_every}", *flags[3:]]


def sft_command(spec: RunSpec, *, wall_s: float, evals: int, smoke: bool, cache_dir: str,
                overrides: Sequence[str] = (), configs_dir: str = arms_lib.CONFIGS_DIR,
                model: str = "") -> list[str]:
  flags = _config_flags(spec, smoke=smoke, cache_dir=cache_dir, overrides=overrides, configs_dir=configs_dir,
                        model=model)
  # Rounded up, so that the control's training time reaches the baseline's, where the results read it.
  return [sys.executable, "-m", "jaxrlvr.compare.sft_control", *flags, f"--wall_s={math.ceil(wall_s * 1e6) / 1e6:.6f}",
          f"--evals={evals}", *spec.flags]


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
    rows = outputs.read_rows(os.path.join(spec.workdir, "metrics.jsonl"))
    tokens = outputs.cumulative_tokens(rows, source=spec.workdir)
    done = max(tokens)
    if tokens[done] >= budget_tokens:
      return steps
    # Extend by the steps the remaining tokens need at this run's rate, plus 5% so one extension usually suffices.
    steps = done + max(1, math.ceil((budget_tokens - tokens[done]) / max(tokens[done] / max(done, 1), 1.0) * 1.05))
  raise RuntimeError(f"{spec.name}: still short of {budget_tokens:.0f} tokens after {max_extensions} extensions")


def run_sft(spec: RunSpec, *, baseline_workdir: str, launch_sft, budget_tokens: float | None = None) -> float:
  """The control run: as many training seconds as the baseline run took to the budget (its `time/step_s` summed up to
  the step that reached `budget_tokens`; without a budget, over every step it trained), so that its last evaluation is
  where the results read it. `launch_sft(spec, wall_s)` runs compare/sft_control.py and returns its exit code.
  Returns the seconds."""
  baseline = outputs.load_run(baseline_workdir)
  at = stats_lib.budget_step(baseline.tokens, budget_tokens) if budget_tokens else None
  wall_s = baseline.wall[max(baseline.rows) if at is None else at]
  if sft_finished_wall(spec.workdir) >= wall_s - 0.01:  # --wall_s passes it to the millisecond
    return wall_s
  code = launch_sft(spec, wall_s)
  if code != 0:
    raise RuntimeError(f"{spec.name}: the supervised control exited with {code}; its log is {spec.log_path}")
  return wall_s


def run_all(specs: Sequence[RunSpec], *, parallel: int, launch, steps: int, budget_tokens: float | None,
            launch_sft=None) -> dict:
  """Runs every spec, `parallel` at a time. The first run of each seed goes first and the others of that seed wait
  for its step-0 metrics, by which time its warm start is cached for them; a spec with `after` waits for that run to
  end (the control runs come last, so what they wait for has always started). Returns {name: error or None}."""
  by_name = {s.name: s for s in specs}
  missing = sorted({s.after for s in specs if s.after and s.after not in by_name})
  if missing:
    raise CompareError(f"runs {missing} are waited for but not part of the comparison")
  leaders = {}
  for s in specs:
    if s.kind == "rl":
      leaders.setdefault(s.seed, s)
  ordered = list(leaders.values()) + [s for s in specs if leaders.get(s.seed) is not s and s.kind == "rl"]
  ordered += [s for s in specs if s.kind != "rl"]
  finished = {s.name: False for s in ordered}
  errors: dict = {}

  def job(spec: RunSpec):
    leader = leaders.get(spec.seed, spec)
    while leader is not spec and not finished[leader.name] and not os.path.exists(
        os.path.join(leader.workdir, "metrics.jsonl")):
      time.sleep(1.0)
    while spec.after and not finished[spec.after]:
      time.sleep(1.0)
    try:
      if spec.after and errors.get(spec.after):
        raise RuntimeError(f"{spec.name}: {spec.after} failed, so there is no wall time to match")
      if spec.kind == "sft":
        run_sft(spec, baseline_workdir=by_name[spec.after].workdir, launch_sft=launch_sft,
                budget_tokens=budget_tokens)
      else:
        run_one(spec, steps=steps, budget_tokens=budget_tokens, launch=launch)
      return None
    except Exception as e:  # pylint: disable=broad-except  (one failed run must not stop the others)
      errors[spec.name] = f"{type(e).__name__}: {e}"
      return errors[spec.name]
    finally:
      finished[spec.name] = True

  # Workers take jobs in submission order, so a waiting run's leader has always started already.
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
    futures = {s.name: pool.submit(job, s) for s in ordered}
    return {name: f.result() for name, f in futures.items()}


def _logged_subprocess(spec: RunSpec, cmd: list[str], what: str, *, env: dict, cwd: str) -> int:
  os.makedirs(os.path.dirname(spec.log_path), exist_ok=True)
  print(f"compare: {spec.name}: {what} (log: {spec.log_path})", flush=True)
  t = time.time()
  with open(spec.log_path, "a", encoding="utf-8") as log:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    code = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
  print(f"compare: {spec.name}: exit {code} after {time.time() - t:.0f} s", flush=True)
  return code


def subprocess_launcher(*, eval_every: int, smoke: bool, cache_dir: str, threads: int, overrides: Sequence[str],
                        configs_dir: str, evals: int = 8, model: str = ""):
  """(launch(spec, steps), launch_sft(spec, wall_s)) for run_all: the main job and the supervised control as
  subprocesses, their output appended to the spec's log."""
  env, cwd = run_env(threads), os.path.dirname(os.path.abspath(configs_dir))

  def launch(spec: RunSpec, steps: int) -> int:
    cmd = train_command(spec, steps=steps, eval_every=eval_every, smoke=smoke, cache_dir=cache_dir,
                        overrides=overrides, configs_dir=configs_dir, model=model)
    return _logged_subprocess(spec, cmd, f"training to step {steps}", env=env, cwd=cwd)

  def launch_sft(spec: RunSpec, wall_s: float) -> int:
    cmd = sft_command(spec, wall_s=wall_s, evals=evals, smoke=smoke, cache_dir=cache_dir, overrides=overrides,
                      configs_dir=configs_dir, model=model)
    return _logged_subprocess(spec, cmd, f"supervised control for {wall_s:.0f} s of training", env=env, cwd=cwd)

  return launch, launch_sft


def make_specs(arms: Sequence[arms_lib.Arm], seeds: int, outdir: str) -> list[RunSpec]:
  """Every arm x seed, the control runs after the RL ones (run_all's order needs them last)."""
  specs = []
  for arm in sorted(arms, key=lambda a: a.kind != "rl"):
    for seed in range(seeds):
      name = f"{arm.name}-s{seed}"
      workdir, log_path = os.path.join(outdir, "runs", name), os.path.join(outdir, "logs", f"{name}.log")
      specs.append(RunSpec(arm.name, seed, workdir, log_path, method=arm.method, overrides=arm.overrides,
                           kind=arm.kind, flags=arm.flags,
                           after=f"{arms_lib.BASELINE}-s{seed}" if arm.kind == "sft" else ""))
  return specs


# ------------------------------------------------------------------------------------------------ Command line
def _arm_names(f, chosen_preset) -> list[str]:
  if f["arms"].present and f["methods"].present:
    raise CompareError("--arms and --methods name the same thing (--methods: arms without overrides); give one")
  if f["arms"].present:
    return list(f.arms)
  if f["methods"].present:
    return list(f.methods)
  return list(chosen_preset.arms if chosen_preset else arms_lib.METHODS)


def _setup_lines(chosen_preset, arms, overrides: Sequence[str], seeds: int, budget: float | None,
                 budget_source: str = "--budget_tokens") -> list[str]:
  lines = []
  if chosen_preset is not None:
    lines.append(f"Regime `{chosen_preset.name}`: {chosen_preset.doc}.")
  lines.append(f"Budget fixed before the runs: {budget:,.0f} tokens ({budget_source})." if budget else
               "Budget found after the runs: the smallest total any run generated (no --budget_tokens).")
  lines.append(f"{'Seed 0' if seeds == 1 else f'Seeds 0-{seeds - 1}'}; every run's overrides: "
               f"{', '.join(f'`{o}`' for o in overrides) or 'none'}.")
  lines += ["", "| arm | method | its overrides | what it changes |", "|---|---|---|---|"]
  lines += [f"| {a.name} | {a.method} | {', '.join(f'`{o}`' for o in a.overrides) or '-'} | "
            f"{a.doc or 'the method as its config has it'} |" for a in arms]
  return lines


def run_size(chosen, *, budget_tokens: float | None, steps: int | None, smoke: bool) -> tuple[float | None, int, str]:
  """(the budget in tokens or None, the steps or 0 for the configs', where the budget comes from): --budget_tokens
  and --steps, else the preset's own (arms.Preset), which are for its full-size runs and do not apply with --smoke."""
  if budget_tokens is not None and budget_tokens <= 0:
    raise CompareError(f"--budget_tokens must be > 0, got {budget_tokens}")
  own = chosen if chosen is not None and not smoke else None
  source = "--budget_tokens" if budget_tokens is not None else ""
  if budget_tokens is None and own is not None and own.budget_tokens:
    budget_tokens, source = float(own.budget_tokens), "the preset's own; --budget_tokens overrides it"
  if budget_tokens is None and chosen is not None and chosen.exact_budget:
    raise CompareError(f"--preset={chosen.name} reads every arm at a budget fixed before the runs: give "
                       "--budget_tokens=N (generated rollout tokens per run)")
  return budget_tokens, steps or (own.steps if own is not None else 0), source


def main(argv) -> int:
  """The command line; a user's mistake is one line on stderr and exit code 2."""
  try:
    return _main(argv)
  except CompareError as e:
    print(f"compare: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


def _main(argv) -> int:
  from absl import flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise CompareError(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  started = time.time()
  outdir = os.path.abspath(f.outdir)
  chosen = arms_lib.preset(f.preset) if f.preset else None
  seeds = f.seeds if f["seeds"].present or chosen is None else chosen.seeds
  if seeds < 1:
    raise CompareError(f"--seeds must be >= 1, got {seeds}")
  budget, preset_steps, budget_source = run_size(chosen, budget_tokens=f.budget_tokens, steps=f.steps, smoke=f.smoke)
  names = _arm_names(f, chosen)
  arms = arms_lib.resolve_arms(names, f.configs_dir)
  methods = dict.fromkeys(a.method for a in arms)
  model = f.model or (chosen.model if chosen else "")
  configs = {m: arms_lib.method_config(m, smoke=f.smoke, configs_dir=f.configs_dir, model=model) for m in methods}
  steps = preset_steps or max(c.total_steps for c in configs.values())
  eval_every = f.eval_every or min(min(c.eval_every for c in configs.values()), max(1, steps // 8))
  # The batch size every run trains with, the preset's and the command line's overrides applied: it sets how many
  # questions a preset's visits per question take (data.rl_train_size).
  given = [*(chosen.overrides if chosen else ()), *f.override]
  batch_size = max(arms_lib.arm_config(arms_lib.Arm(m, m), seed=0, overrides=given, smoke=f.smoke,
                                       configs_dir=f.configs_dir, model=model).rollout.batch_size for m in methods)
  overrides = [*(chosen.run_overrides(steps=steps, batch_size=batch_size) if chosen else ()), *f.override]
  if budget is not None:  # every run evaluates where its tokens reach each mark (arms.budget_marks)
    overrides.append(f"eval.token_marks={arms_lib.budget_marks(budget)}")
  specs = make_specs(arms, seeds, outdir)
  by_arm = {a.name: a for a in arms}
  for spec in specs:  # every arm's config checked now: a bad key or value stops here, before any run starts
    config = arms_lib.arm_config(by_arm[spec.arm], seed=spec.seed, overrides=overrides, smoke=f.smoke,
                                     configs_dir=f.configs_dir, model=model)
    if not f.summarize_only:
      check_workdir(spec, config)
  baseline = f.baseline or (arms_lib.BASELINE if arms_lib.BASELINE in names else names[0])
  if baseline not in names:
    raise CompareError(f"--baseline={baseline!r} is not one of the arms {names}")
  errors = {}
  if not f.summarize_only:
    threads = f.threads_per_run or max(1, (os.cpu_count() or 1) // max(1, f.parallel))
    launch, launch_sft = subprocess_launcher(eval_every=eval_every, smoke=f.smoke, cache_dir=f.warm_start_cache,
                                             threads=threads, overrides=overrides, configs_dir=f.configs_dir,
                                             evals=max(1, steps // eval_every), model=model)
    errors = {k: v for k, v in run_all(specs, parallel=f.parallel, launch=launch, steps=steps,
                                       budget_tokens=budget, launch_sft=launch_sft).items() if v}
    for name, error in errors.items():
      print(f"compare: {name} failed: {error}", file=sys.stderr)
  runs = [outputs.load_run(s.workdir, method=s.arm, seed=s.seed) for s in specs
          if s.name not in errors and os.path.exists(os.path.join(s.workdir, "metrics.jsonl"))
          and (s.kind == "rl" or sft_finished_wall(s.workdir))]
  missing = [s.name for s in specs if s.name not in {r.name for r in runs}]
  if not runs:
    raise RuntimeError(f"compare: no run in {outdir}/runs has metrics; failed: {sorted(errors)}")
  summary = stats_lib.summarize(runs, budget_tokens=budget, baseline=baseline, wall_reference=arms_lib.BASELINE)
  from jaxrlvr.compare import plots  # pylint: disable=g-import-not-at-top  (matplotlib only where figures are drawn)
  title = chosen.name if chosen else ""
  figures = plots.write_all(runs, summary.budget_tokens, outdir, regime=title, baseline=baseline)
  command = "python -m jaxrlvr.compare " + " ".join(a for a in sys.argv[1:])
  stats_lib.write_results(summary, outdir, command=command, wall_s=time.time() - started,
                plots=[os.path.basename(p) for p in figures], missing=missing, title=title,
                setup=_setup_lines(chosen, arms, overrides, seeds, budget, budget_source))
  with open(os.path.join(outdir, "results.md"), encoding="utf-8") as fh:
    print(fh.read())
  return 1 if errors else 0


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("preset", "", f"Regime: one of {sorted(arms_lib.PRESETS)} (compare/arms.py: its "
                      "overrides, arms and seeds); empty: the configs as they are.")
  flags.DEFINE_list("arms", None, "Arms to compare: method configs and their named variants (arms_lib.ARMS), "
                    "e.g. grpo,exgrpo,exgrpo-no_shaping,sft. Default: the preset's, else the four methods.")
  flags.DEFINE_list("methods", None, "Methods to compare: names of files in --configs_dir (arms without overrides).")
  flags.DEFINE_string("model", "", "Model preset of every run (the config arg `model=`, e.g. smollm2-135m; "
                      "default: the preset's, else the configs' own).")
  flags.DEFINE_integer("seeds", 3, "Seeds per arm: 0 .. N-1 (default: the preset's, else 3).")
  flags.DEFINE_string("outdir", None, "Runs, logs, results.md, results.csv and the plots go here.")
  flags.DEFINE_bool("smoke", False, "Use the configs' `:smoke` settings (seconds per run; for tests).")
  flags.DEFINE_float("budget_tokens", None, "Train every run until it has generated this many rollout tokens, "
                     "evaluating where it reaches it and its quarters, and read every arm there "
                     "(default: the preset's own, where it has one and not --smoke; else equal steps, cut at the "
                     "smallest total).")
  flags.DEFINE_integer("steps", None, "Steps per run (with a budget: the first guess). Default: the preset's own, "
                       "where it has one and not --smoke; else the config's.")
  flags.DEFINE_integer("parallel", 2, "Runs at a time.")
  flags.DEFINE_integer("eval_every", None, "Evaluation interval in steps. Default: the config's, at most steps / 8.")
  flags.DEFINE_integer("threads_per_run", None, "CPU threads per run. Default: cores / parallel.")
  flags.DEFINE_string("warm_start_cache", "", "Warm-start cache shared by the runs (default: the config's).")
  flags.DEFINE_multi_string("override", [], "Extra config override for every run, e.g. --override=optim.lr=3e-5.")
  flags.DEFINE_string("configs_dir", arms_lib.CONFIGS_DIR, "Where the method configs are.")
  flags.DEFINE_bool("summarize_only", False, "Skip training (and the check that DIR/runs holds runs of this config): "
                    "summarise and plot what DIR/runs holds.")
  flags.DEFINE_string("baseline", "", "Arm the paired differences are taken against (default: grpo when compared, "
                      "else the first).")
  flags.mark_flag_as_required("outdir")


def cli() -> None:
  """`python -m jaxrlvr.compare` (compare/__main__.py)."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from jaxrlvr import xla_cpu  # pylint: disable=g-import-not-at-top
  # Before anything here imports JAX: with libtpu installed and no TPU, runs started from this process printed
  # libtpu's errors now and then (a third of the replay testbed's calibration runs; never the main command started
  # alone). Set here, JAX_PLATFORMS=cpu holds in this process and every run from their first import.
  xla_cpu.skip_absent_accelerators()
  _define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
