"""What a comparison runs: regimes (`PRESETS`) and arms (`ARMS`: a method config plus overrides).

An arm is one row of the results: a method's config file (configs/<method>.py) with a few config overrides, so an
ablation is a row like any method, trained in DIR/runs/<arm>-s<seed>. Every config file in the configs directory is
also an arm of its own name without overrides (that is what `--methods` names). The arm `sft` is not RL: it is the
supervised control (compare/sft_control.py), continued supervised training from the same warm start for the wall time of
the `grpo` run of its seed.

A preset is a regime: the overrides every arm's runs get, the arms it compares by default and how many seeds. The
tiny model's presets measure pass@k (`eval.k=8` samples per held-out question at `eval.temperature=1.0`, the rollout
temperature) beside the greedy accuracy at every evaluation; they differ in the questions RL draws from and the task:
- `fresh`: the whole training set (20,000 question ids for the embedded task): 200 steps x 16 questions draw 3,200
  of them, so a question of the three addition levels never comes back unless a method brings it back (the setting
  of the first comparison). mul1x2 is the exception: its 5,000 ids wrap around its 592 train questions, so its
  ~800 draws land on ~456 distinct questions and ~43% of them are a question seen before.
- `data_limited`: RL draws from the first steps x B / 4 training questions (`data.rl_train_size`; 800 for 200
  steps of 16), so the data iterator hands out each question about 4 times (GRPO; a method that replays part of its
  batch draws fewer fresh ones), as in the replay papers' multi-epoch runs. The warm start still reads the whole
  training set, so both regimes start from the same weights. Its default arms add the ablations the papers lean on.
- `paper_shaped`: the regime where the ExGRPO paper says replay pays (Qwen2.5-Math-7B on OpenR1): a task and a warm
  start (`data.levels`, `data.worked_by_level`, below) after which most training questions are solved 0 or K times
  of K at their first visit and the rest in between, so on-policy groups often carry no signal; about two epochs of
  the RL train set (`data.rl_train_size` = steps x B / 2); 2 optimizer steps per rollout batch
  (`train.num_minibatches=2`), so fresh ratios leave 1 and the mixed phase's clip removal and f(w) act; and
  `train.replayed_grad_share` on, for the mechanism figures of results.md. Its warm start differs from the other
  regimes' (one per seed, cached). GRPO can hardly gain here, so this regime cannot show whether replay helps it
  learn: with worked fractions of exactly 0 or 1 the warm start leaves no choice between worked and bare answers
  (what RL learns on this task), the two easy sums (40% of the evaluation) start at 100%, and the one level in
  between can add about 6 points at most (GRPO gained +0.007 in 100 steps). `replay_testbed` is the regime for that.
- `replay_testbed`: a mix where GRPO learns and most groups are constant at their first visit (below), at a budget
  fixed before the runs (96,000 generated tokens, about 55 of its 60 steps), 10 seeds, the eight arms of the decisive
  comparison, ExGRPO's eq. 4 among them (`exgrpo-mixed_clip`). Calibrated on seeds 0-2 (docs/testbed.md; `python -m
  jaxrlvr.compare.calibrate`). It evaluates greedy accuracy only, its primary endpoint: pass@8 on its 768 held-out
  questions took ~150 s an evaluation against 3-6 s an RL step (docs/testbed.md), several times a run's training.

With a budget (--budget_tokens, or the preset's own) every run evaluates at the first step whose generated
tokens reach each of the budget's marks (`eval.token_marks`, compare/runner.py) and is read there. Without it the
runs train equal steps and the budget is found afterwards (the smallest total): a run that did not evaluate at the
step that reached it is read at its last evaluation at or below it.
"""
import ast
import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jaxrlvr/compare/ -> the repository
CONFIGS_DIR = os.path.join(REPO_ROOT, "configs")
METHODS = ("grpo", "exgrpo", "advantage_priority", "bapo")
BASELINE = "grpo"
SFT_ARM = "sft"


class CompareError(ValueError):
  """A mistake in the comparison's command line (an unknown arm, preset or key): one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  method: str  # the config file configs/<method>.py
  overrides: tuple[str, ...] = ()  # `key=value`, applied after the preset's and --override's
  kind: str = "rl"  # "rl": the main job; "sft": the supervised control (compare/sft_control.py)
  doc: str = ""
  flags: tuple[str, ...] = ()  # the control's own flags (compare/sft_control.py)


ARMS = {arm.name: arm for arm in (
    Arm("exgrpo-no_shaping", "exgrpo", ("loss.shaping_beta=0.0",),
        doc="replayed tokens take the plain loss -A * w instead of -A * f(w), f(w) = w / (w + beta): unclipped in "
        "the mixed phase, like the fresh tokens there (loss.mixed_clip=False)"),
    Arm("exgrpo-mixed_clip", "exgrpo", ("loss.mixed_clip=True",),
        doc="the paper's eq. 4: fresh tokens keep the PPO clip in the mixed phase (the released code drops it)"),
    Arm("exgrpo-no_delay", "exgrpo", ("replay.start_solve_rate=0.0",),
        doc="replay from the first step instead of once the batch solve rate passes 0.35"),
    Arm("exgrpo-bucket_accuracy", "exgrpo", ("replay.bucket_scale=accuracy",),
        doc="bucket weights N(k/K; 0.5, sigma) in accuracy units (paper text) instead of counts (released code)"),
    Arm("advantage_priority-pool", "advantage_priority", ("replay.composition=pool",),
        doc="fresh and stored rollouts drawn from one pool instead of all fresh plus a replayed share"),
    Arm("advantage_priority-group_std", "advantage_priority", ("replay.priority=group_std",),
        doc="query-level priority by the group's reward std instead of each rollout's |advantage|"),
    Arm("bapo-no_x2", "bapo", ("replay.reroll_every=0",),
        doc="no re-rolls of hard questions, so no X2 part of the batch (X1 and X3 only)"),
    Arm(SFT_ARM, "grpo", (), kind="sft",
        doc="continued supervised training on the teacher's solutions of the questions RL draws from, for the "
        "training time of the grpo run"),
    # Not in a preset's arms: in the data-limited regime the control above sees only the 800 questions RL sees
    # (the same data) and, at ~60 passes over them, memorises them; this one reads every solution, as the warm start.
    Arm("sft-all_questions", "grpo", (), kind="sft", flags=("--all_questions",),
        doc="the control on every training question's solution, not only those RL draws from"),
)}
ABLATIONS = tuple(name for name, arm in ARMS.items() if arm.kind == "rl")


# The paper-shaped regime's task and warm start: five levels, the teacher showing its work on the two easy sums (which
# the warm-started model then solves 8 of 8 times for 86% and 75% of their questions) and never on 3-digit sums (in
# between: 1..7 of 8 for 69%), the subtraction (0 of 8 for 64%) or 2-digit products (0 of 8 for 94%). Measured at the
# first visit of seed 0's warm start, 64 training questions a level x 8 samples at temperature 1: 70% of the groups
# all right or all wrong, where GRPO's groups on the embedded task's own mix are ~40%.
PAPER_SHAPED_LEVELS = "add1x2,add2,add3,addsub2,mul2x2"
PAPER_SHAPED_WORKED = "add1x2=1,add2=1,add3=0,addsub2=0,mul2x2=0"
# The real model's task. SmolLM2-135M-Instruct's solve rates on 32 training questions a level x 4 samples, measured
# at temperature 1.0 (the paper's rollout temperature) and 0.6: add1x2 1.6% / 3.1%, add2 3.1% / 8.6%, add3 0.0% /
# 2.3%, addsub2 2.3% / 0.8%, mul1x2 2.3% / 12.5%, mul2x2 3.1% / 4.7%. At 1.0, 91-100% of every level's groups are
# 0 of 4 and replay would have next to nothing to store; at 0.6 the two best levels leave 25% (add2) and 31%
# (mul1x2) of the groups with signal, and nothing is solved 4 of 4. So the preset samples at 0.6 on those two levels.
# The replay start: the batch solve rate starts near 0.1, where the paper's 0.35 is not reached within the run (the
# embedded preset's GRPO run never passed 0.19 in 40 steps); the paper starts its weak Llama-3.1-8B model's replay
# at once, and so does this preset (the exgrpo-no_delay arm).
SMOLLM2_LEVELS = "add2,mul1x2"
# The replay testbed's task and warm start (docs/testbed.md has the 10 mixes tried and each seed's figures). The teacher
# shows its work on the three sums, never on 2-digit products, and on 60% of addsub2's and 50% of mul1x2's questions,
# so the warm start leaves RL a choice there (worked or bare: greedy accuracy 41-78% at step 0 on seeds 0-2). Those two
# levels are named twice: RL draws them twice as often and they weigh twice in the held-out average, which is where
# GRPO's gain comes from (+0.064 to +0.109 at the budget). Rollouts at temperature 0.5 leave 55-69% of the
# first-visit groups all right or all wrong (64% on average; 56% at 0.7). 768 held-out questions = 8 slots x 96 of
# the 128 reserved a slot: one evaluation's standard error <= 0.02.
TESTBED_LEVELS = "add1x2,add2,add3,addsub2,addsub2,mul1x2,mul1x2,mul2x2"
TESTBED_WORKED = "add1x2=1,add2=1,add3=1,addsub2=0.6,mul1x2=0.5,mul2x2=0"
TESTBED_TEMPERATURE = 0.5
TESTBED_ARMS = ("grpo", "exgrpo", "exgrpo-mixed_clip", "exgrpo-bucket_accuracy", "exgrpo-no_shaping",
                "advantage_priority", "bapo", SFT_ARM)
MARKS_PER_BUDGET = 4  # a run evaluates at 1/4, 2/4, 3/4 and all of the budget: every arm's curve at the same points


@dataclasses.dataclass(frozen=True)
class Preset:
  name: str
  doc: str
  arms: tuple[str, ...]
  seeds: int = 5
  overrides: tuple[str, ...] = ("eval.k=8", "eval.temperature=1.0")
  visits_per_question: float = 0.0  # > 0: data.rl_train_size = steps x batch_size / this (see the module doc)
  model: str = ""  # the model preset of every run (the config arg `model=`); empty: the configs' default (tiny)
  exact_budget: bool = False  # True: reads every arm at a budget fixed before the runs (module doc)
  # The budget in generated rollout tokens (`budget_tokens`) and the steps (`steps`, the first guess toward it, which
  # also sets data.rl_train_size) its runs get unless --budget_tokens and --steps say otherwise; 0: none of its own
  # (an exact_budget preset then needs --budget_tokens). Full size only: with --smoke the configs' steps apply and an
  # exact_budget preset needs --budget_tokens.
  budget_tokens: float = 0.0
  steps: int = 0

  def run_overrides(self, *, steps: int, batch_size: int) -> list[str]:
    """The overrides of every run of this preset for a comparison of `steps` steps of `batch_size` questions."""
    out = list(self.overrides)
    if self.visits_per_question:
      out.append(f"data.rl_train_size={rl_train_size(steps, batch_size, self.visits_per_question)}")
    return out


def budget_marks(budget: float, marks: int = MARKS_PER_BUDGET) -> tuple[int, ...]:
  """The token counts a run of a comparison at `budget` evaluates at (`eval.token_marks`): `marks` equal parts of the
  budget, the last one the budget itself (rounded up, so that reaching a mark means reaching its share)."""
  return tuple(int(-(-budget * i // marks)) for i in range(1, marks + 1))


def rl_train_size(steps: int, batch_size: int, visits: float) -> int:
  """The number of questions that `steps` steps of `batch_size` fresh questions visit `visits` times each."""
  return max(batch_size, int(round(steps * batch_size / visits)))


PRESETS = {p.name: p for p in (
    Preset("fresh", "fresh questions never run out (the whole training set); pass@8 beside greedy accuracy",
           arms=(*METHODS, SFT_ARM)),
    Preset("data_limited", "each question comes back about 4 times (data.rl_train_size = steps x B / 4); pass@8 "
           "beside greedy accuracy; the ablations as rows", arms=(*METHODS, *ABLATIONS, SFT_ARM),
           visits_per_question=4.0),
    Preset("paper_shaped", "the regime the ExGRPO paper describes: most questions solved always or never at their "
           "first visit, about two epochs (data.rl_train_size = steps x B / 2), 2 optimizer steps per batch; the "
           "mechanism figures logged",
           arms=("grpo", "exgrpo", "exgrpo-bucket_accuracy", "exgrpo-no_shaping", "advantage_priority", "bapo",
                 SFT_ARM),
           overrides=("eval.k=8", "eval.temperature=1.0", f"data.levels={PAPER_SHAPED_LEVELS}",
                      f"data.worked_by_level={PAPER_SHAPED_WORKED}",
                      "train.num_minibatches=2", "train.replayed_grad_share=True"),
           visits_per_question=2.0),
    Preset("replay_testbed", "a mix where GRPO learns and most first-visit groups are constant: eight slots, the "
           "three sums fully worked, 2-digit products bare, addsub2 (worked fraction 0.6) and mul1x2 (0.5) in "
           "between and named twice; rollouts at temperature 0.5; B = 16, K = 8, 2 optimizer steps a batch, lr 3e-5, "
           "768 held-out questions evaluated greedily, about two epochs (data.rl_train_size = steps x B / 2); every "
           "arm read at 96,000 generated tokens, fixed before the runs (calibrated on 3 seeds: docs/testbed.md)",
           arms=TESTBED_ARMS, seeds=10, exact_budget=True, budget_tokens=96_000, steps=60,
           overrides=("eval.k=1", "eval.temperature=0.0", f"rollout.temperature={TESTBED_TEMPERATURE}",
                      f"data.levels={TESTBED_LEVELS}", f"data.worked_by_level={TESTBED_WORKED}",
                      "data.eval_size=768", "rollout.batch_size=16", "rollout.group_size=8",
                      "train.num_minibatches=2", "optim.lr=3e-5", "train.replayed_grad_share=True"),
           visits_per_question=2.0),
    Preset("smollm2", "the real pretrained model: RL from SmolLM2-135M-Instruct as it is (the smollm2-135m model "
           "preset) on the two levels it sometimes solves, rollouts and pass@4 at temperature 0.6, ExGRPO without "
           "the delayed start (the paper's setting for its weak Llama model), about two epochs, 2 optimizer steps "
           "per batch", arms=("grpo", "exgrpo-no_delay"), seeds=3, model="smollm2-135m",
           overrides=("eval.k=4", "eval.temperature=0.6", "rollout.temperature=0.6",
                      f"data.levels={SMOLLM2_LEVELS}", "data.eval_size=100", "train.num_minibatches=2"),
           visits_per_question=2.0),
)}


def preset(name: str) -> Preset:
  if name not in PRESETS:
    raise CompareError(f"--preset={name!r}: no such preset; known: {sorted(PRESETS)}")
  return PRESETS[name]


def known_methods(configs_dir: str = CONFIGS_DIR) -> list[str]:
  return sorted(f[:-3] for f in os.listdir(configs_dir) if f.endswith(".py") and f not in ("base.py", "__init__.py"))


def resolve_arm(name: str, configs_dir: str = CONFIGS_DIR) -> Arm:
  """The named arm of ARMS, or a method config file of that name without overrides."""
  if name in ARMS:
    return ARMS[name]
  if os.path.exists(os.path.join(configs_dir, f"{name}.py")) and name not in ("base", "__init__"):
    return Arm(name, name)
  raise CompareError(f"no arm {name!r} (--arms, --methods); known: the methods {known_methods(configs_dir)} and "
                     f"the variants {sorted(ARMS)}")


def resolve_arms(names: Sequence[str], configs_dir: str = CONFIGS_DIR) -> list[Arm]:
  arms = [resolve_arm(n, configs_dir) for n in names]
  repeated = sorted({n for n in names if list(names).count(n) > 1})
  if repeated:
    raise CompareError(f"--arms: {repeated} named more than once")
  if any(a.kind == "sft" for a in arms) and BASELINE not in names:
    raise CompareError(f"--arms: the {SFT_ARM!r} control trains for the wall time of the {BASELINE!r} run of its "
                       f"seed, so it needs the {BASELINE!r} arm too")
  return arms


def config_arg(*, smoke: bool = False, model: str = "") -> str:
  """The config arg of a run (`--config=configs/<method>.py:<arg>`): the model preset and the smoke settings."""
  return ",".join(filter(None, (f"model={model}" if model else "", "smoke" if smoke else "")))


def method_config(method: str, *, smoke: bool = False, configs_dir: str = CONFIGS_DIR, model: str = ""):
  """The method's config (to read total_steps and eval_every), imported the way the main job's flag does."""
  path = os.path.join(configs_dir, f"{method}.py")
  if not os.path.exists(path):
    raise CompareError(f"--methods: no config {path} for method {method!r}; known: {known_methods(configs_dir)}")
  root = os.path.dirname(os.path.abspath(configs_dir))
  if root not in sys.path:
    sys.path.insert(0, root)
  return importlib.import_module(f"{os.path.basename(os.path.normpath(configs_dir))}.{method}").get_config(
      config_arg(smoke=smoke, model=model) or None)


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
    raise CompareError(f"--override={override!r}: the config has no key {key!r}") from None
  if not sep:
    raise CompareError(f"--override={override!r}: expected key=value")
  try:
    if isinstance(current, tuple):  # e.g. eval.token_marks=(100, 200), as the main job's flag reads it
      node[leaf] = _literal_tuple(value)
    elif isinstance(current, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise CompareError(f"--override={override!r}: {key} is a bool; got {value!r}")
      node[leaf] = value.lower() in ("true", "1")
    elif isinstance(current, (int, float, str)):
      node[leaf] = type(current)(value)
    else:
      raise CompareError(f"--override={override!r}: {key} holds a {type(current).__name__}; pass it to the main job")
  except ValueError as e:
    if isinstance(e, CompareError):
      raise
    raise CompareError(f"--override={override!r}: {key} is a {type(current).__name__}; got {value!r}") from None


def _literal_tuple(value: str) -> tuple:
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    raise ValueError(value) from None
  if not isinstance(parsed, (tuple, list)):
    raise ValueError(value)
  return tuple(parsed)


def arm_config(arm: Arm, *, seed: int, overrides: Sequence[str] = (), smoke: bool = False,
               configs_dir: str = CONFIGS_DIR, model: str = ""):
  """The config an arm's run of `seed` trains with: the method's, then `overrides` (the preset's and the command
  line's), then the arm's own; checked as the main job checks it, so a bad value stops the comparison up front."""
  from jaxrlvr import config_lib  # pylint: disable=g-import-not-at-top  (keeps this module import-light)
  config = method_config(arm.method, smoke=smoke, configs_dir=configs_dir, model=model)
  for override in (f"seed={seed}", *overrides, *arm.overrides):
    try:
      apply_override(config, override)
    except CompareError as e:
      raise CompareError(f"arm {arm.name!r}: {e}") from None
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    raise CompareError(f"arm {arm.name!r}: {e}") from None
  return config
