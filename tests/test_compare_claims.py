"""The comparison's regimes, arms and claim metrics: presets and their overrides, arms and their errors, the question
visits and the share solved later, pass@k, stability, the supervised control read at the baseline's training time,
and the scheduler with a control run. Hand-made run directories and fake launchers: seconds."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrlvr import compare
from jaxrlvr import outputs
from jaxrlvr import run_setup
from jaxrlvr import train
from jaxrlvr.compare import arms as compare_arms
from jaxrlvr.compare import stats as compare_stats
from jaxrlvr.data import iterator
from jaxrlvr.replay import base as replay_base

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_presets_set_the_regime_pass_at_8_and_the_seeds():
  fresh, limited = compare_arms.PRESETS["fresh"], compare_arms.PRESETS["data_limited"]
  # 200 steps x 16 questions, each visited 4 times: 800 questions; the fresh regime keeps all of them.
  assert limited.run_overrides(steps=200, batch_size=16) == ["eval.k=8", "eval.temperature=1.0",
                                                             "data.rl_train_size=800"]
  assert fresh.run_overrides(steps=200, batch_size=16) == ["eval.k=8", "eval.temperature=1.0"]
  assert compare_arms.rl_train_size(4, 4, 4.0) == 4 and compare_arms.rl_train_size(1, 16, 4.0) == 16  # >= B
  assert fresh.seeds == limited.seeds == 5
  assert fresh.arms == ("grpo", "exgrpo", "advantage_priority", "bapo", "sft")
  assert set(compare_arms.ABLATIONS) <= set(limited.arms) and "sft" in limited.arms
  with pytest.raises(compare_arms.CompareError,
                     match="no such preset; known: \\['data_limited', 'fresh', 'paper_shaped', 'replay_testbed', "
                           "'smollm2'\\]"):
    compare_arms.preset("tiny")


def test_the_smollm2_preset_runs_the_pretrained_model_on_its_spread_levels():
  smol = compare_arms.PRESETS["smollm2"]
  overrides = smol.run_overrides(steps=60, batch_size=4)
  assert smol.model == "smollm2-135m" and smol.seeds == 3 and smol.arms == ("grpo", "exgrpo-no_delay")
  assert "data.rl_train_size=120" in overrides  # 60 steps x 4 questions, two visits each
  assert compare_arms.config_arg(model=smol.model, smoke=True) == "model=smollm2-135m,smoke"
  assert compare_arms.config_arg() == ""
  configs = {arm: compare_arms.arm_config(compare_arms.resolve_arm(arm), seed=1, overrides=overrides,
                                          model=smol.model) for arm in smol.arms}
  for config in configs.values():
    assert config.model.preset == "smollm2-135m" and config.reward.literal_numbers
    assert config.data.levels == "add2,mul1x2" and config.rollout.temperature == config.eval.temperature == 0.6
    assert config.train.num_minibatches == 2 and config.seed == 1
  assert configs["exgrpo-no_delay"].replay.name == "exgrpo"
  assert configs["exgrpo-no_delay"].replay.start_solve_rate == 0.0
  assert configs["grpo"].replay.name == "none"


@pytest.mark.parametrize("arm, key, value", [
    ("exgrpo-no_shaping", "loss.shaping_beta", 0.0), ("exgrpo-no_delay", "replay.start_solve_rate", 0.0),
    ("exgrpo-bucket_accuracy", "replay.bucket_scale", "accuracy"),
    ("advantage_priority-pool", "replay.composition", "pool"),
    ("advantage_priority-group_std", "replay.priority", "group_std"), ("bapo-no_x2", "replay.reroll_every", 0)])
def test_every_ablation_arm_changes_its_key_and_nothing_else(arm, key, value):
  spec = compare_arms.resolve_arm(arm)
  overrides = compare_arms.PRESETS["data_limited"].run_overrides(steps=200, batch_size=16)
  config = compare_arms.arm_config(spec, seed=3, overrides=overrides)
  plain = compare_arms.arm_config(compare_arms.resolve_arm(spec.method), seed=3, overrides=overrides)
  section, leaf = key.split(".")
  assert config[section][leaf] == value and plain[section][leaf] != value  # the default is something else
  assert (config.seed, config.data.rl_train_size, config.eval.k) == (3, 800, 8)
  flat = lambda c: {f"{s}.{k}": v for s, d in c.to_dict().items() if isinstance(d, dict) for k, v in d.items()}
  assert {k for k, v in flat(config).items() if flat(plain)[k] != v} == {key}


def test_arm_mistakes_are_errors_that_name_them():
  with pytest.raises(compare_arms.CompareError, match="no arm 'exgrpo-nope'"):
    compare_arms.resolve_arms(["grpo", "exgrpo-nope"])
  with pytest.raises(compare_arms.CompareError, match="needs the 'grpo' arm"):
    compare_arms.resolve_arms(["exgrpo", "sft"])
  with pytest.raises(compare_arms.CompareError, match="named more than once"):
    compare_arms.resolve_arms(["grpo", "grpo"])
  grpo = compare_arms.resolve_arm("grpo")
  with pytest.raises(compare_arms.CompareError, match="arm 'grpo'.*no key 'loss.nope'"):
    compare_arms.arm_config(grpo, seed=0, overrides=["loss.nope=1"])
  bad = compare_arms.Arm("exgrpo-bad", "exgrpo", ("replay.bucket_scale=log",))
  with pytest.raises(compare_arms.CompareError, match="arm 'exgrpo-bad'.*replay.bucket_scale='log'"):
    compare_arms.arm_config(bad, seed=0)
  with pytest.raises(compare_arms.CompareError, match="optim.lr is a float; got 'fast'"):
    compare_arms.arm_config(grpo, seed=0, overrides=["optim.lr=fast"])


def test_cli_names_an_unknown_arm_in_one_line(tmp_path):
  for flag, needle in (("--arms=grpo,exgrpo-nope", "no arm 'exgrpo-nope'"),
                       ("--preset=huge", "--preset='huge': no such preset"),
                       ("--preset=replay_testbed --smoke", "give --budget_tokens=N")):
    out = subprocess.run([sys.executable, "-m", "jaxrlvr.compare", *flag.split(), f"--outdir={tmp_path}"], cwd=_REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().count("\n") == 0 and needle in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "runs")


def test_the_trainer_draws_from_the_first_rl_train_size_questions():
  config = compare_arms.arm_config(compare_arms.resolve_arm("grpo"), seed=0, overrides=["data.rl_train_size=6"],
                                   smoke=True)
  train_set = range(100)
  questions = iterator.QuestionIterator(range(run_setup.rl_train_size(config, train_set)), seed=0)
  drawn = questions.next(18)
  assert sorted(set(drawn)) == [0, 1, 2, 3, 4, 5] and all(drawn.count(q) == 3 for q in range(6))  # 3 epochs
  config.data.rl_train_size = 0
  assert run_setup.rl_train_size(config, train_set) == 100
  config.data.rl_train_size = 101
  with pytest.raises(ValueError, match="rl_train_size=101: must be in \\[0, 100\\]"):
    run_setup.rl_train_size(config, train_set)


def _group(qid, rewards):
  return replay_base.Group(qid, [replay_base.Rollout(qid, np.zeros(1, np.int32), None, r, 0) for r in rewards])


def test_questions_log_and_the_share_solved_later(tmp_path):
  Request = replay_base.Request
  steps = [  # (requests, rewards of each group)
      ([Request(1, 4), Request(2, 4), Request(3, 4)], [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]),
      ([Request(4, 4), Request(1, 4, 0, "reroll")], [[0, 0, 0, 0], [0, 1, 0, 0]]),  # q1 solved at its 2nd visit
      ([Request(3, 4), Request(2, 3, 0, "replay")], [[0, 0, 0, 0], [0, 0, 0]]),  # q3 again 0/4; q2 was not hard
  ]
  for step, (requests, rewards) in enumerate(steps, 1):
    outputs.append_questions(str(tmp_path), step, requests, [_group(r.qid, w) for r, w in zip(requests, rewards)],
                             threshold=replay_base.CORRECT_THRESHOLD)
  # A resumed run logs step 3 again (the same line); the last one of a step counts.
  requests, rewards = steps[2]
  outputs.append_questions(str(tmp_path), 3, requests, [_group(r.qid, w) for r, w in zip(requests, rewards)],
                           threshold=replay_base.CORRECT_THRESHOLD)
  rows = outputs.read_rows(str(tmp_path / outputs.QUESTIONS_FILE))
  assert sorted(rows) == [1, 2, 3]
  assert rows[2] == {"step": 2, "qid": [4, 1], "kind": ["fresh", "reroll"], "correct": [0, 1], "samples": [4, 4]}
  stats = outputs.visit_stats(rows)
  # 4 questions; visits q1 2, q2 2, q3 2, q4 1 -> mean 7/4; hard at first: q1, q3, q4; revisited q1, q3; solved q1.
  assert (stats.questions, stats.visits_mean, stats.visits_max, stats.revisited) == (4, 1.75, 2, 3)
  assert (stats.hard_first, stats.hard_revisited, stats.hard_solved_later) == (3, 2, 1)
  assert stats.hard_solved_share == pytest.approx(1 / 3)
  early = outputs.visit_stats(rows, last_step=1)  # up to the budget's step
  assert (early.hard_first, early.hard_solved_later) == (2, 0) and early.hard_solved_share == 0.0
  assert np.isnan(outputs.visit_stats({}).hard_solved_share)


def _write(workdir, *, seed, tokens, evals, step_s=1.0, questions=(), sft=None):
  """A run directory: per-step rows with tokens and step times, evaluations {step: (accuracy, pass@8)}."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"method": "grpo", "seed": seed}, f)
  rows = []
  for step in range(len(tokens) + 1):
    row = {"step": step}
    if step:
      row.update({"rollout/sampled_tokens": tokens[step - 1], "time/step_s": step_s})
    if step in evals:
      row["eval/accuracy"], row["eval/pass@8"] = evals[step]
    rows.append(row)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  if questions:
    with open(os.path.join(workdir, outputs.QUESTIONS_FILE), "w") as f:
      f.writelines(json.dumps(q) + "\n" for q in questions)
  if sft is not None:
    with open(os.path.join(workdir, outputs.SFT_FILE), "w") as f:
      json.dump({"target_wall_s": sft, "finished": True}, f)


def test_claims_stability_pass_at_k_and_the_control_by_hand(tmp_path):
  # grpo: 100 tokens and 2 s a step, evals at steps 0, 2, 4, 6 -> tokens 0, 200, 400, 600.
  q_grpo = [{"step": 1, "qid": [1, 2], "correct": [0, 0]}, {"step": 2, "qid": [1], "correct": [2]},
            {"step": 5, "qid": [2], "correct": [1]}]  # q2 solved at step 5: past the budget's step 4
  _write(str(tmp_path / "grpo-s0"), seed=0, tokens=[100] * 6, step_s=2.0, questions=q_grpo,
         evals={0: (0.4, 0.7), 2: (0.6, 0.8), 4: (0.5, 0.9), 6: (0.7, 0.95)})
  # bapo: 125 tokens a step: budget 400 is reached at step 4 (500 tokens), whose evaluation is its reading.
  q_bapo = [{"step": 1, "qid": [1, 2], "correct": [0, 0]}, {"step": 2, "qid": [1, 2], "correct": [1, 3]}]
  _write(str(tmp_path / "bapo-s0"), seed=0, tokens=[125] * 4, questions=q_bapo,
         evals={0: (0.4, 0.7), 2: (0.7, 0.85), 3: (0.65, 0.8), 4: (0.75, 0.9)})
  # The control: no tokens, 1 s a step, evals at 0, 3, 8, 9 s; grpo trained 8 s to the budget (4 steps x 2 s).
  _write(str(tmp_path / "sft-s0"), seed=0, tokens=[0] * 9, questions=(), sft=12.0,
         evals={0: (0.4, 0.7), 3: (0.45, 0.72), 8: (0.5, 0.75), 9: (0.9, 0.99)})
  runs = [outputs.load_run(str(tmp_path / f"{arm}-s0"), method=arm, seed=0) for arm in ("grpo", "bapo", "sft")]
  assert [r.kind for r in runs] == ["rl", "rl", "sft"]
  summary = compare.summarize(runs, budget_tokens=400, baseline="grpo")
  assert summary.pass_key == "eval/pass@8"
  by = {r["run"]: r for r in summary.runs}
  g, b, s = by["grpo-s0"], by["bapo-s0"], by["sft-s0"]
  assert (g["final_accuracy"], g["pass_at_k"], g["steps_at_budget"], g["train_wall_s"]) == (0.5, 0.9, 4, 8.0)
  # Stability up to the budget: grpo 0.4 -> 0.6 -> 0.5, largest drop 0.1; late (tokens > 200): the eval at 400 alone.
  assert g["max_drop"] == pytest.approx(0.1) and np.isnan(g["late_std"])
  # bapo: 0.4, 0.7, 0.65, 0.75 up to its reading: drop 0.05; late evals at 250, 375 and 500 tokens.
  assert b["max_drop"] == pytest.approx(0.05) and b["late_std"] == pytest.approx(np.std([0.7, 0.65, 0.75], ddof=1))
  assert (b["final_accuracy"], b["pass_at_k"], b["steps_at_budget"], b["read_tokens"]) == (0.75, 0.9, 4, 500)
  # Solved later, up to the budget's step: grpo q1 (step 2) of q1, q2 -> 1/2; bapo both -> 1.
  assert (g["hard_first"], g["hard_solved_share"], b["hard_solved_share"]) == (2, 0.5, 1.0)
  assert b["hard_solved_share_vs_baseline"] == pytest.approx(0.5)
  assert b["accuracy_vs_baseline"] == pytest.approx(0.25) and b["pass_at_k_vs_baseline"] == pytest.approx(0.0)
  # The control at grpo's 8 s: the eval at 8 s (0.5, pass@8 0.75), not the one at 9 s; no tokens, no visits.
  assert (s["final_accuracy"], s["pass_at_k"], s["steps_at_budget"], s["train_wall_s"]) == (0.5, 0.75, 8, 8.0)
  assert s["accuracy_vs_baseline"] == pytest.approx(0.0) and s["max_drop"] == 0.0
  assert np.isnan(s["auc"]) and np.isnan(s["hard_solved_share"]) and np.isnan(s["tokens_per_step"])
  out = str(tmp_path / "out")
  compare.write_results(summary, out, title="data_limited", setup=["Regime `data_limited`: test."])
  with open(os.path.join(out, "results.md")) as f:
    text = f.read()
  assert text.startswith("# Method comparison at an equal rollout budget: data_limited")
  # Claims table, bapo row: pass@8 0.900, 0; drop 0.050, -0.050; late std; 2 questions; 1.000, +0.500.
  assert "| bapo | 1 | 0.900 | 0.000 | 0.050 | -0.050 | 0.050 | 2 | 1.000 | 0.500 | 2.00 |" in text
  # The control: drop 0 (0.4, 0.45, 0.5 up to 8 s) and one late evaluation (in (4, 8] s): no std; no visits.
  assert "| sft | 1 | 0.750 | -0.150 | 0.000 | -0.100 | n/a | n/a | n/a | n/a | n/a |" in text
  with open(os.path.join(out, "runs.csv")) as f:
    assert [r["kind"] for r in csv.DictReader(f)] == ["rl", "rl", "sft"]
  # The control's training time comes from the grpo run of its seed whatever the baseline of the differences.
  assert compare.summarize(runs, budget_tokens=400, baseline="bapo").runs[2]["train_wall_s"] == 8.0
  with pytest.raises(ValueError, match="control run sft-s0 has no grpo run of seed 0"):
    compare.summarize([runs[1], runs[2]], budget_tokens=400, baseline="bapo")


def test_largest_drop_and_late_std_by_hand():
  assert compare_stats.largest_drop(np.array([0.5, 0.7, 0.4, 0.6, 0.55])) == pytest.approx(0.3)
  assert compare_stats.largest_drop(np.array([0.1, 0.2])) == 0.0 and np.isnan(compare_stats.largest_drop([0.3]))
  x, acc = np.array([0, 100, 200, 300, 400]), np.array([0.1, 0.2, 0.6, 0.4, 0.9])
  assert compare_stats.late_std(x, acc, 300) == pytest.approx(np.std([0.6, 0.4], ddof=1))  # x in (150, 300]


def test_run_all_runs_the_control_after_its_grpo_run_for_its_training_time(tmp_path):
  order, walls = [], []

  def launch(spec, steps):
    order.append(spec.name)
    _write(spec.workdir, seed=spec.seed, tokens=[10] * steps, step_s=1.5, evals={0: (0.1, 0.2)})
    os.makedirs(os.path.join(spec.workdir, "checkpoints", str(steps)), exist_ok=True)
    return 0

  def launch_sft(spec, wall_s):
    order.append(spec.name)
    walls.append(wall_s)
    _write(spec.workdir, seed=spec.seed, tokens=[0] * 3, evals={0: (0.1, 0.2)}, sft=wall_s)
    return 0

  arms = compare_arms.resolve_arms(["sft", "grpo", "exgrpo"])
  specs = compare.make_specs(arms, 1, str(tmp_path))
  assert [(s.name, s.kind, s.after, s.method) for s in specs] == [
      ("grpo-s0", "rl", "", "grpo"), ("exgrpo-s0", "rl", "", "exgrpo"), ("sft-s0", "sft", "grpo-s0", "grpo")]
  errors = compare.run_all(specs, parallel=2, launch=launch, steps=4, budget_tokens=None, launch_sft=launch_sft)
  assert not any(errors.values()) and order.index("sft-s0") > order.index("grpo-s0")
  assert walls == [6.0]  # the grpo run's 4 steps x 1.5 s
  compare.run_all(specs, parallel=2, launch=launch, steps=4, budget_tokens=None, launch_sft=launch_sft)
  assert order.count("sft-s0") == 1  # finished with that wall time: not run again
  # A failed grpo run leaves its control nothing to match.
  failing = lambda spec, steps: 3 if spec.arm == "grpo" else launch(spec, steps)
  errors = compare.run_all(compare.make_specs(arms, 1, str(tmp_path / "b")), parallel=1, launch=failing, steps=2,
                           budget_tokens=None, launch_sft=launch_sft)
  assert errors["grpo-s0"].startswith("RuntimeError") and "grpo-s0 failed" in errors["sft-s0"]
  cmd = compare.sft_command(specs[2], wall_s=6.0, evals=8, smoke=True, cache_dir="/c", overrides=["eval.k=8"])
  assert cmd[1:3] == ["-m", "jaxrlvr.compare.sft_control"] and cmd[3].endswith("configs/grpo.py:smoke")
  for flag in ("--config.seed=0", "--config.eval.k=8", "--wall_s=6.000000", "--evals=8"):
    assert flag in cmd
  assert "--all_questions" not in cmd
  every = compare.make_specs(compare_arms.resolve_arms(["grpo", "sft-all_questions"]), 1, str(tmp_path))[1]
  assert compare.sft_command(every, wall_s=1.0, evals=2, smoke=True, cache_dir="")[-1] == "--all_questions"


def test_the_trainer_evaluates_where_its_tokens_reach_each_mark(tmp_path):
  config = compare_arms.arm_config(compare_arms.resolve_arm("grpo"), seed=0, smoke=True,
                                   overrides=[f"eval.token_marks={compare_arms.budget_marks(500, marks=2)}"])
  assert tuple(config.eval.token_marks) == (250, 500)
  marks = train.TokenMarks(config, str(tmp_path), start_step=0)
  # Steps of 100, 200, 100, 100, 1000 tokens: totals 100, 300, 400, 500, 1500 -> marks reached at steps 2 and 4.
  assert [marks.reached(t) for t in (100, 200, 100, 100, 1000)] == [False, True, False, True, False]
  # Resumed from step 2's checkpoint: 300 tokens so far from metrics.jsonl (the step-3 row after the checkpoint is
  # logged again), so 250 is behind it and the step that brings 500 evaluates.
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in ({"step": 0}, {"step": 1, "rollout/sampled_tokens": 100},
                                                 {"step": 2, "rollout/sampled_tokens": 200},
                                                 {"step": 3, "rollout/sampled_tokens": 999}))
  resumed = train.TokenMarks(config, str(tmp_path), start_step=2)
  assert (resumed.tokens, resumed.passed) == (300, 1)
  assert [resumed.reached(t) for t in (150, 100)] == [False, True]
  config.eval.token_marks = ()
  assert not train.TokenMarks(config, str(tmp_path), start_step=2).reached(1e9)  # off: no marks


def test_token_marks_mistakes_name_the_key():
  grpo = compare_arms.resolve_arm("grpo")
  with pytest.raises(compare_arms.CompareError, match=r"config.eval.token_marks=\(0, 100\): cumulative"):
    compare_arms.arm_config(grpo, seed=0, overrides=["eval.token_marks=(0, 100)"])
  with pytest.raises(compare_arms.CompareError, match="eval.token_marks is a tuple; got '100k'"):
    compare_arms.arm_config(grpo, seed=0, overrides=["eval.token_marks=100k"])
  assert compare_arms.budget_marks(1001) == (251, 501, 751, 1001)  # rounded up: reaching a mark reaches its share


def test_the_replay_testbed_preset():
  testbed = compare_arms.preset("replay_testbed")
  assert testbed.exact_budget and testbed.seeds == 10 and testbed.arms == (
      "grpo", "exgrpo", "exgrpo-mixed_clip", "exgrpo-bucket_accuracy", "exgrpo-no_shaping", "advantage_priority",
      "bapo", "sft")
  # Calibrated and frozen (docs/testbed.md): its own budget and steps, read without --budget_tokens.
  assert (testbed.budget_tokens, testbed.steps) == (96_000, 60)
  overrides = testbed.run_overrides(steps=testbed.steps, batch_size=16)
  assert "data.rl_train_size=480" in overrides  # 60 steps x 16 questions, two visits each
  config = compare_arms.arm_config(compare_arms.resolve_arm("exgrpo-mixed_clip"), seed=0, overrides=overrides)
  assert (config.rollout.batch_size, config.rollout.group_size, config.train.num_minibatches) == (16, 8, 2)
  assert (config.optim.lr, config.data.eval_size, config.loss.mixed_clip) == (3e-5, 768, True)
  assert (config.rollout.temperature, config.eval.k, config.eval.temperature) == (0.5, 1, 0.0)
  assert config.data.levels == "add1x2,add2,add3,addsub2,addsub2,mul1x2,mul1x2,mul2x2"
  assert config.data.worked_by_level == "add1x2=1,add2=1,add3=1,addsub2=0.6,mul1x2=0.5,mul2x2=0"
  assert "calibrated on 3 seeds" in testbed.doc and "Not yet calibrated" not in compare_arms.__doc__
  assert compare.runner.run_size(testbed, budget_tokens=None, steps=None, smoke=False)[:2] == (96_000, 60)


def test_a_presets_own_budget_and_steps_apply_at_full_size_only():
  run_size = compare.runner.run_size
  own = compare_arms.Preset("x", "a regime", arms=("grpo",), exact_budget=True, budget_tokens=5e4, steps=60)
  assert run_size(own, budget_tokens=None, steps=None, smoke=False) == (
      5e4, 60, "the preset's own; --budget_tokens overrides it")
  assert run_size(own, budget_tokens=1e3, steps=7, smoke=False) == (1e3, 7, "--budget_tokens")
  assert run_size(own, budget_tokens=450, steps=None, smoke=True) == (450, 0, "--budget_tokens")  # the configs' steps
  with pytest.raises(compare_arms.CompareError, match="give --budget_tokens=N"):
    run_size(own, budget_tokens=None, steps=None, smoke=True)  # its budget is for its full-size runs
  assert run_size(compare_arms.preset("fresh"), budget_tokens=None, steps=None, smoke=False) == (None, 0, "")
  with pytest.raises(compare_arms.CompareError, match="--budget_tokens must be > 0"):
    run_size(None, budget_tokens=0.0, steps=None, smoke=False)
