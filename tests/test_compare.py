"""The comparison runner: summary statistics on hand-made metrics.jsonl files, the budget rule, resumption and the
scheduler with a fake launcher, the figures, and one end-to-end CLI run on the smoke configs."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import light_compile
from jaxrlvr import compare
from jaxrlvr import outputs
from jaxrlvr.compare import plots

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The end-to-end run's budget: its smoke steps generate ~190 tokens each (4 questions x 4 samples), so every arm
# reaches it in its 4 steps, and its quarters at different steps.
_SMOKE_BUDGET = 450


def _write_run(workdir, *, method, seed, tokens_per_step, evals, step_s=1.0, extra=None, duplicate_from=None):
  """A metrics.jsonl like the main job's: one row per step with sampled tokens, evals at the given steps.
  `duplicate_from=s` appends the rows from step s again (what a run resumed from a checkpoint at s-1 writes)."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"method": method, "seed": seed}, f)
  rows = [{"step": 0, "eval/accuracy": evals[0]}]
  for step, tokens in enumerate(tokens_per_step, 1):
    row = {"step": step, "rollout/sampled_tokens": tokens, "time/step_s": step_s, "rollout/solve_rate": 0.5,
           "rollout/response_length": 8.0, "policy/fresh/ratio_mean": 1.0, "policy/fresh/ratio_std": 0.1,
           "policy/fresh/ratio_max": 1.5, "policy/fresh/ratio_min": 0.7, "policy/fresh/tokens": 100.0,
           "policy/replayed/tokens": 0.0, "replay/replayed_share": 0.0, **(extra or {})}
    if step in evals:
      row["eval/accuracy"] = evals[step]
    rows.append(row)
  if duplicate_from is not None:
    rows += rows[duplicate_from:]
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_confidence_interval_by_hand():
  mean, half = outputs.confidence_interval([1.0, 2.0, 3.0])
  # mean 2, sample std 1, sem 1/sqrt(3) = 0.57735; t(0.975, df=2) = 4.302653 -> 4.302653 * 0.57735 = 2.48414.
  assert mean == pytest.approx(2.0)
  assert half == pytest.approx(2.48414, abs=1e-5)
  mean, half = outputs.confidence_interval([[0.0, 1.0], [2.0, 1.0]])  # per column: [0, 2] and [1, 1]
  # column 0: sem = sqrt(2)/sqrt(2) = 1, t(0.975, 1) = 12.7062; column 1: no spread.
  np.testing.assert_allclose(mean, [1.0, 1.0])
  np.testing.assert_allclose(half, [12.7062, 0.0], atol=1e-4)
  mean, half = outputs.confidence_interval([0.4])
  assert mean == pytest.approx(0.4) and np.isnan(half)


def test_holm_adjustment_and_the_primary_endpoint_by_hand():
  # p = 0.01, 0.04, 0.03, 0.005 and an arm without pairs. Sorted: 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 gives
  # 0.02, 0.03, 0.06, 0.04; the running maximum keeps the order: 0.02, 0.03, 0.06, 0.06. Levels 0.05 / 4, / 3, / 2, / 1.
  adjusted, levels = compare.holm([0.01, 0.04, 0.03, 0.005, float("nan")])
  np.testing.assert_allclose(adjusted[:4], [0.03, 0.06, 0.06, 0.02])
  np.testing.assert_allclose(levels[:4], [0.05 / 3, 0.05, 0.025, 0.0125])
  assert np.isnan(adjusted[4]) and np.isnan(levels[4])
  np.testing.assert_allclose(compare.holm([0.5, 0.6])[0], [1.0, 1.0])  # 2 x 0.5 capped at 1; 0.6 keeps the order
  # Paired t, differences 0.1, 0.2, 0.3: t = 0.2 / (0.1 / sqrt 3) = sqrt 12 with 2 degrees of freedom, whose two-sided
  # p-value is 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14) = 0.0741799.
  assert compare.paired_t([0.1, 0.2, 0.3]) == pytest.approx(0.0741799, abs=1e-7)
  assert compare.paired_t([0.2, 0.2]) == 0.0 and compare.paired_t([0.0, 0.0]) == 1.0
  assert np.isnan(compare.paired_t([0.1]))
  # Three arms against grpo over 3 seeds: a (0.1, 0.2, 0.3): p 0.0741799; b (all 0): p 1; c (all 0.2): p 0. Holm:
  # c 3 x 0 = 0 at 0.05 / 3; a 2 x 0.0741799 = 0.1483598 at 0.025; b 1 at 0.05. a's interval at 97.5%: the t quantile
  # with 2 degrees of freedom at 1 - 0.025 / 2 = 0.9875 is (2q - 1) / sqrt(2q(1 - q)) = 0.975 / sqrt(0.0246875)
  # = 6.205353, times the standard error 0.1 / sqrt 3 -> 0.358266.
  runs = [{"method": m, "accuracy_vs_baseline": d} for m, ds in
          (("grpo", (0, 0, 0)), ("a", (0.1, 0.2, 0.3)), ("b", (0, 0, 0)), ("c", (0.2, 0.2, 0.2))) for d in ds]
  primary = {r["method"]: r for r in compare.stats.primary_endpoint(runs, "grpo")}
  assert sorted(primary) == ["a", "b", "c"]
  assert primary["a"]["p_holm"] == pytest.approx(0.1483598, abs=1e-7) and primary["a"]["level"] == 0.025
  assert primary["a"]["mean"] == pytest.approx(0.2) and primary["a"]["half_width"] == pytest.approx(0.358266, abs=1e-6)
  assert (primary["b"]["p_holm"], primary["b"]["level"]) == (1.0, 0.05)
  assert primary["c"]["p_holm"] == 0.0 and primary["c"]["level"] == pytest.approx(0.05 / 3)


def test_area_under_curve_and_the_reading_by_hand():
  tokens, acc = np.array([0, 100, 300, 500]), np.array([0.1, 0.3, 0.5, 0.9])
  # Budget 400: 100 x (0.1 + 0.3) / 2 = 20, 200 x (0.3 + 0.5) / 2 = 80, then up to the budget's value, interpolated
  # between the evals at 300 and 500: 0.7, so 100 x (0.5 + 0.7) / 2 = 60 -> 160 / 400 = 0.4.
  assert compare.area_under_curve(tokens, acc, 400) == pytest.approx(0.4)
  # Budget 250: 20 + 150 x (0.3 + 0.45) / 2 = 76.25 -> 0.305; past the last eval (600) its value is held:
  # 20 + 80 + 200 x (0.5 + 0.9) / 2 + 100 x 0.9 = 330 -> 0.55.
  assert compare.area_under_curve(tokens, acc, 250) == pytest.approx(0.305)
  assert compare.area_under_curve(tokens, acc, 600) == pytest.approx(0.55)
  with pytest.raises(ValueError, match="0 tokens"):
    compare.area_under_curve(tokens[1:], acc[1:], 400)
  # A run whose step that reached 250 tokens ended at 300 and evaluated there is read there; one that reached it at
  # 280 without evaluating falls back to its last evaluation at or below 250 (the one at 100).
  assert compare.reading(tokens, 250, reach=300) == (2, True)
  assert compare.reading(tokens, 250, reach=280) == (1, False)
  assert compare.budget_step({0: 0.0, 1: 120.0, 2: 260.0, 3: 390.0}, 250) == 2
  assert compare.budget_step({0: 0.0, 1: 120.0}, 250) is None


def test_arms_with_different_step_costs_are_read_at_the_same_budget(tmp_path):
  """Two runs given the budget's marks (eval.token_marks), as the trainer writes them: grpo 100 tokens a step, bapo
  130, both evaluating every 5 steps and at the first step that reached each quarter of the 1,000-token budget. Each
  is read at its evaluation at the budget, within one step's tokens of it, and so of each other; the old reading (the
  last evaluation at or below the budget) read bapo at step 6, 780 tokens, 220 short: more than a step."""
  budget, marks = 1000, compare.arms.budget_marks(1000)
  assert marks == (250, 500, 750, 1000)

  def evals(cost, steps=10):  # every 5 steps, the last step, and where the cumulative tokens first reach a mark
    at_marks = {next(s for s in range(1, steps + 1) if s * cost >= m) for m in marks}
    return {s: 0.3 + 0.01 * s for s in {0, *range(5, steps + 1, 5), steps, *at_marks}}

  _write_run(str(tmp_path / "grpo-s0"), method="grpo", seed=0, tokens_per_step=[100] * 10, evals=evals(100))
  _write_run(str(tmp_path / "bapo-s0"), method="bapo", seed=0, tokens_per_step=[130] * 10, evals=evals(130))
  runs = [outputs.load_run(str(tmp_path / n)) for n in ("grpo-s0", "bapo-s0")]
  summary = compare.summarize(runs, budget_tokens=budget)
  by_run = {r["run"]: r for r in summary.runs}
  for run, cost in (("grpo-s0", 100), ("bapo-s0", 130)):
    r = by_run[run]
    assert r["read_at_budget"] and budget <= r["read_tokens"] < budget + cost, r
  assert abs(by_run["grpo-s0"]["read_tokens"] - by_run["bapo-s0"]["read_tokens"]) <= 130
  # bapo reached 1,000 tokens at step 8 (1,040) and is read there: 0.38; grpo at step 10 (1,000): 0.40.
  assert (by_run["bapo-s0"]["read_step"], by_run["bapo-s0"]["final_accuracy"]) == (8, pytest.approx(0.38))
  assert (by_run["grpo-s0"]["read_step"], by_run["grpo-s0"]["final_accuracy"]) == (10, pytest.approx(0.40))
  out = str(tmp_path / "out")
  compare.write_results(summary, out)
  with open(os.path.join(out, "results.md")) as f:
    text = f.read()
  assert "| bapo-s0 | 8 | 1,040 | yes |" in text and "| grpo-s0 | 10 | 1,000 | yes |" in text


def test_resumed_rows_are_deduplicated_and_a_gap_is_an_error(tmp_path):
  run = str(tmp_path / "r")
  _write_run(run, method="grpo", seed=0, tokens_per_step=[10, 20, 30], evals={0: 0.0, 3: 0.5}, duplicate_from=2)
  with open(os.path.join(run, "metrics.jsonl"), "a") as f:
    f.write('{"step": 4, "rollout/sampl')  # killed mid-write
  data = outputs.load_run(run)
  assert (data.method, data.seed, sorted(data.rows)) == ("grpo", 0, [0, 1, 2, 3])
  assert data.tokens == {0: 0.0, 1: 10.0, 2: 30.0, 3: 60.0}  # steps 2 and 3 counted once
  rows = {0: {"step": 0}, 1: {"rollout/sampled_tokens": 5}, 3: {"rollout/sampled_tokens": 5}}
  with pytest.raises(ValueError, match=r"steps \[2\].*log_every=1"):
    outputs.cumulative_tokens(rows, source="x")


def _two_methods(tmp_path):
  # grpo generates 100 tokens a step, exgrpo 80 (replay questions sample K-1): 5 steps -> 500 and 400 tokens.
  _write_run(str(tmp_path / "grpo-s0"), method="grpo", seed=0, tokens_per_step=[100] * 5,
             evals={0: 0.2, 2: 0.3, 4: 0.4, 5: 0.5}, step_s=1.0)
  _write_run(str(tmp_path / "grpo-s1"), method="grpo", seed=1, tokens_per_step=[100] * 5,
             evals={0: 0.2, 2: 0.5, 4: 0.6, 5: 0.7}, step_s=3.0)
  extra = {"replay/bucket_1": 2.0, "replay/bucket_2": 5.0, "replay/bucket_3": 1.0, "replay/replayed_share": 0.2,
           "policy/replayed/tokens": 20.0, "policy/replayed/ratio_mean": 1.1, "policy/replayed/ratio_std": 0.2,
           "policy/replayed/ratio_max": 2.0, "policy/replayed/ratio_min": 0.5}
  for seed, final in ((0, 0.6), (1, 0.8)):
    _write_run(str(tmp_path / f"exgrpo-s{seed}"), method="exgrpo", seed=seed, tokens_per_step=[80] * 5,
               evals={0: 0.2, 2: 0.4, 4: 0.5, 5: final}, step_s=2.0, extra=extra)
  return [outputs.load_run(str(tmp_path / n)) for n in ("grpo-s0", "grpo-s1", "exgrpo-s0", "exgrpo-s1")]


def test_summarize_cuts_every_curve_at_the_common_budget(tmp_path):
  runs = _two_methods(tmp_path)
  summary = compare.summarize(runs)
  assert summary.budget_tokens == 400  # the smallest total: exgrpo's 5 x 80
  by_run = {r["run"]: r for r in summary.runs}
  # grpo-s0: evals at 0, 200, 400 tokens (steps 0, 2, 4) -> accuracy at 400 is the step-4 eval, 0.4.
  # AUC: 200 x (0.2 + 0.3) / 2 + 200 x (0.3 + 0.4) / 2 = 50 + 70 = 120 -> 120 / 400 = 0.3.
  assert by_run["grpo-s0"]["final_accuracy"] == pytest.approx(0.4)
  assert by_run["grpo-s0"]["auc"] == pytest.approx(0.3)
  assert by_run["grpo-s0"]["steps_at_budget"] == 4
  # grpo-s1: 0.6 at the budget; AUC (200 x 0.7 / 2 + 200 x 1.1 / 2) / 400 = (70 + 110) / 400 = 0.45.
  assert by_run["grpo-s1"]["auc"] == pytest.approx(0.45)
  # exgrpo-s0: evals at 0, 160, 320, 400 tokens: 160 x 0.6 / 2 + 160 x 0.9 / 2 + 80 x 1.1 / 2 = 48 + 72 + 44
  # = 164 -> 0.41; accuracy at the budget is the step-5 eval, 0.6.
  assert by_run["exgrpo-s0"]["final_accuracy"] == pytest.approx(0.6)
  assert by_run["exgrpo-s0"]["auc"] == pytest.approx(0.41)
  methods = {m["method"]: m for m in summary.methods}
  # grpo final accuracy over seeds: [0.4, 0.6] -> mean 0.5, sem 0.1, half-width 12.7062 x 0.1 = 1.27062.
  assert methods["grpo"]["final_accuracy_mean"] == pytest.approx(0.5)
  assert methods["grpo"]["final_accuracy_ci95"] == pytest.approx(1.27062, abs=1e-4)
  assert methods["grpo"]["step_time_s_mean"] == pytest.approx(2.0)  # medians 1 and 3
  assert methods["exgrpo"]["seeds"] == 2 and methods["exgrpo"]["final_accuracy_mean"] == pytest.approx(0.7)
  assert methods["exgrpo"]["tokens_per_step_mean"] == pytest.approx(80.0)
  # Paired by seed against grpo (the first method): accuracy 0.6 - 0.4 and 0.8 - 0.6 -> +0.2 with no spread.
  assert methods["exgrpo"]["accuracy_vs_baseline_mean"] == pytest.approx(0.2)
  assert methods["exgrpo"]["accuracy_vs_baseline_ci95"] == pytest.approx(0.0, abs=1e-9)
  # AUC: exgrpo-s1 is (48 + 72 + 80 x (0.5 + 0.8) / 2) / 400 = 172 / 400 = 0.43, so the differences are
  # 0.41 - 0.30 = 0.11 and 0.43 - 0.45 = -0.02 -> mean 0.045.
  assert methods["exgrpo"]["auc_vs_baseline_mean"] == pytest.approx(0.045)
  # Gain over step 0: grpo 0.4 - 0.2 and 0.6 - 0.2 -> mean 0.3.
  assert methods["grpo"]["accuracy_gain_mean"] == pytest.approx(0.3)
  assert compare.summarize(runs, baseline="exgrpo").methods[0]["accuracy_vs_baseline_mean"] == pytest.approx(-0.2)
  with pytest.raises(ValueError, match="baseline method 'bapo'"):
    compare.summarize(runs, baseline="bapo")
  # An explicit budget that a run did not reach is an error, not a silently shorter curve.
  with pytest.raises(ValueError, match="exgrpo-s0 \\(400\\)"):
    compare.summarize(runs, budget_tokens=450)


def test_results_files_and_figures(tmp_path):
  runs = _two_methods(tmp_path / "runs")
  summary = compare.summarize(runs)
  out = str(tmp_path / "out")
  figures = plots.write_all(runs, summary.budget_tokens, out)
  assert sorted(os.path.basename(p) for p in figures) == sorted(
      ["accuracy_vs_budget.png", "accuracy_minus_grpo_vs_budget.png", "accuracy_vs_training_time.png",
       "solve_rate.png", "response_length.png", "exgrpo_buckets.png", "replayed_share.png", "ratio_stats.png"])
  for path in figures:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
  compare.write_results(summary, out, command="python -m jaxrlvr.compare ...", wall_s=60.0,
                        plots=[os.path.basename(p) for p in figures], missing=["bapo-s0"])
  with open(os.path.join(out, "results.csv")) as f:
    table = list(csv.DictReader(f))
  assert [r["method"] for r in table] == ["grpo", "exgrpo"]
  assert float(table[1]["auc_mean"]) == pytest.approx(float(np.mean(
      [r["auc"] for r in summary.runs if r["method"] == "exgrpo"])))
  with open(os.path.join(out, "results.md")) as f:
    text = f.read()
  assert "| grpo | 2 | 0.500 ± 1.271 | 0.300 ± 1.271 | 0.375 ± 0.953 | baseline |" in text  # accuracy, gain, AUC
  # The primary endpoint: exgrpo - grpo is +0.2 on both seeds (no spread: p 0), one arm, so Holm's level is 0.05.
  assert "| exgrpo | 2 | 0.200 ± 0.000 | 95.00% | 0.0000 | 0.0000 |" in text
  assert text.index("## Primary endpoint") < text.index("## Exploratory") and "**" not in text
  assert "groups with signal (share of groups)" in text and "share of tokens, policy/zero_adv_frac" in text
  assert "![accuracy_vs_budget](accuracy_vs_budget.png)" in text and "bapo-s0" in text
  # Without ExGRPO runs there is no bucket heatmap, and the other figures are still drawn.
  assert plots.bucket_heatmap(runs[:2], str(tmp_path / "none.png")) is None


def test_budget_extension_and_resumption_with_a_fake_launcher(tmp_path):
  """run_one resumes to `steps`, then extends total_steps until the run has generated the budget."""
  launches = []

  def launch(spec, steps):  # a run that generates 100 tokens a step and checkpoints at its end
    launches.append(steps)
    _write_run(spec.workdir, method=spec.method, seed=spec.seed, tokens_per_step=[100] * steps, evals={0: 0.0})
    os.makedirs(os.path.join(spec.workdir, "checkpoints", str(steps)), exist_ok=True)
    return 0

  spec = compare.RunSpec("grpo", 0, str(tmp_path / "grpo-s0"), str(tmp_path / "log"))
  compare.run_one(spec, steps=4, budget_tokens=1000, launch=launch)
  # 4 steps give 400 tokens; 600 more at 100 a step, plus 5%: ceil(6.3) = 7 more steps -> 11 (1,100 tokens).
  assert launches == [4, 11]
  compare.run_one(spec, steps=4, budget_tokens=1000, launch=launch)  # rerun: finished and over budget
  assert launches == [4, 11]
  assert compare.finished_step(spec.workdir) == 11


def test_run_all_starts_each_seeds_first_run_first_and_survives_a_failure(tmp_path):
  order = []

  def launch(spec, steps):
    order.append(spec.name)
    if spec.name == "exgrpo-s1":
      return 3
    _write_run(spec.workdir, method=spec.method, seed=spec.seed, tokens_per_step=[10] * steps, evals={0: 0.0})
    os.makedirs(os.path.join(spec.workdir, "checkpoints", str(steps)), exist_ok=True)
    return 0

  specs = [compare.RunSpec(m, s, str(tmp_path / f"{m}-s{s}"), str(tmp_path / f"{m}-s{s}.log"))
           for m in ("grpo", "exgrpo") for s in (0, 1)]
  errors = compare.run_all(specs, parallel=1, launch=launch, steps=2, budget_tokens=None)
  assert order == ["grpo-s0", "grpo-s1", "exgrpo-s0", "exgrpo-s1"]
  assert errors["exgrpo-s1"].startswith("RuntimeError: exgrpo-s1: the main job exited with 3")
  assert [k for k, v in errors.items() if v] == ["exgrpo-s1"]


def test_train_command_runs_one_device_per_run():
  spec = compare.RunSpec("exgrpo", 2, "/w/exgrpo-s2", "/w/log")
  cmd = compare.train_command(spec, steps=7, eval_every=3, smoke=True, cache_dir="/c", overrides=["optim.lr=1e-5"])
  assert cmd[1:3] == ["-m", "jaxrlvr.main"] and cmd[3].endswith("configs/exgrpo.py:smoke")
  for flag in ("--config.seed=2", "--config.total_steps=7", "--config.log_every=1", "--config.eval_every=3",
               "--config.warm_start.cache_dir=/c", "--config.optim.lr=1e-5"):
    assert flag in cmd
  pretrained = compare.train_command(spec, steps=7, eval_every=3, smoke=False, cache_dir="", model="smollm2-135m")
  assert pretrained[3].endswith("configs/exgrpo.py:model=smollm2-135m")
  env = compare.run_env(threads=1)
  assert "--xla_force_host_platform_device_count=1" in env["XLA_FLAGS"].split()
  assert "--xla_force_host_platform_device_count=8" not in env["XLA_FLAGS"]
  # XLA reads a first entry without "--" as a file of flags and ignores a later one: every entry is a flag.
  assert all(flag.startswith("--") for flag in env["XLA_FLAGS"].split()), env["XLA_FLAGS"]
  assert env["NPROC"] == "1"
  with pytest.raises(ValueError, match="no_such_method"):
    compare.method_config("no_such_method")


def test_overrides_and_the_workdir_config_check(tmp_path):
  config = compare.method_config("grpo", smoke=True)
  compare.apply_override(config, "optim.lr=3e-5")
  compare.apply_override(config, "--config.loss.clip=false")
  compare.apply_override(config, "seed=2")
  assert (config.optim.lr, config.loss.clip, config.seed) == (3e-5, False, 2)
  with pytest.raises(ValueError, match="no key 'optim.nope'"):
    compare.apply_override(config, "optim.nope=1")
  spec = compare.RunSpec("grpo", 2, str(tmp_path / "grpo-s2"), str(tmp_path / "log"))
  compare.check_workdir(spec, config)  # no run there yet
  os.makedirs(spec.workdir)
  saved = config.to_dict()
  saved["total_steps"] = 999  # a change resumption allows (the budget extension makes it)
  with open(os.path.join(spec.workdir, "config.json"), "w") as f:
    json.dump(saved, f)
  compare.check_workdir(spec, config)
  compare.apply_override(config, "optim.lr=1e-4")
  with pytest.raises(ValueError, match=r"optim.lr: 3e-05 -> 0.0001"):
    compare.check_workdir(spec, config)


def test_the_workdir_config_check_resolves_a_shipped_models_path(tmp_path, monkeypatch):
  # A run of a model preset with shipped weights saves the converted directory as model.path; the comparison's
  # config still has it empty, and rerunning the command must resume that run, not refuse it.
  from jaxrlvr.models import pretrained  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(pretrained, "checkpoint_dir", lambda preset, cache_dir=None: f"/cache/{preset}-converted")
  config = compare.method_config("grpo", smoke=True)
  config.model.preset = "smollm2-135m"
  spec = compare.RunSpec("grpo", 0, str(tmp_path / "grpo-s0"), str(tmp_path / "log"))
  os.makedirs(spec.workdir)
  saved = pretrained.resolve_paths(config).to_dict()
  assert saved["model"]["path"] == "/cache/smollm2-135m-converted" and not config.model.path
  with open(os.path.join(spec.workdir, "config.json"), "w") as f:
    json.dump(saved, f)
  compare.check_workdir(spec, config)
  saved["model"]["path"] = "/elsewhere"
  with open(os.path.join(spec.workdir, "config.json"), "w") as f:
    json.dump(saved, f)
  with pytest.raises(ValueError, match=r"model.path: '/elsewhere' -> '/cache/smollm2-135m-converted'"):
    compare.check_workdir(spec, config)


def test_presets_make_their_overrides():
  # data_limited: 200 steps x 16 questions over 800 questions (4 visits each); paper_shaped: 1,600 (2 visits).
  limited = compare.arms.preset("data_limited").run_overrides(steps=200, batch_size=16)
  assert limited == ["eval.k=8", "eval.temperature=1.0", "data.rl_train_size=800"]
  shaped = compare.arms.preset("paper_shaped").run_overrides(steps=200, batch_size=16)
  assert shaped[-1] == "data.rl_train_size=1600" and "train.num_minibatches=2" in shaped
  assert compare.arms.preset("fresh").run_overrides(steps=200, batch_size=16) == ["eval.k=8",
                                                                                         "eval.temperature=1.0"]


def test_mechanism_figures_by_hand():
  # Two steps: 3 of 4 groups with signal, then 1 of 4; the first step alone is "the first 20" when first_steps=1.
  # Replayed rollouts: question 7 three times, 8 once, so the top-1 question has 3 of the 4 replays.
  questions = {1: {"step": 1, "qid": [1, 2, 3, 4], "groups": 4, "signal": 3, "replayed_qids": [7, 7]},
               2: {"step": 2, "qid": [5, 6], "groups": 4, "signal": 1, "replayed_qids": [7, 8]}}
  m = outputs.mechanism_stats(questions, first_steps=1, top=1)
  assert (m.signal_share, m.signal_share_first, m.questions_trained, m.replayed) == (0.5, 0.75, 8, 4)
  assert m.replay_top_share == 0.75
  assert outputs.mechanism_stats(questions, last_step=1, top=1).replay_top_share == 1.0
  assert np.isnan(outputs.mechanism_stats({1: {"step": 1, "qid": [1]}}).signal_share)  # an older run's file


@pytest.mark.slow
def test_cli_end_to_end_on_smoke_configs(tmp_path):
  """The replay testbed on the smoke configs at a budget fixed before the runs, one seed, ExGRPO with eq. 4's clip
  and the supervised control: runs, every arm evaluated at the budget and read there, results, figures, questions
  that come back, pass@8, 2 optimizer steps a batch, the mechanism figures, the control's wall time and warm start; a
  second invocation trains nothing. (The other presets differ in their overrides only:
  test_presets_make_their_overrides.)"""
  outdir = str(tmp_path / "compare")
  # Smoke size: 4 questions x 4 samples a step (not the preset's 16 x 8) and 16 held-out questions (not 768);
  # evaluations at step 4 and at the budget's marks only, so the marks' own evaluations are seen.
  cmd = [sys.executable, "-m", "jaxrlvr.compare", "--smoke", "--preset=replay_testbed", "--seeds=1",
         f"--budget_tokens={_SMOKE_BUDGET}", "--eval_every=4", "--arms=grpo,exgrpo-mixed_clip,sft",
         f"--outdir={outdir}", f"--warm_start_cache={os.environ['JAXRLVR_WARM_START_CACHE']}", "--parallel=2",
         "--override=warm_start.steps=30", "--override=rollout.batch_size=4", "--override=rollout.group_size=4",
         "--override=data.eval_size=16", "--override=eval.k=8", "--override=eval.temperature=1.0"]
  # The testbed evaluates greedy accuracy only; pass@8, as the other presets evaluate, so that its columns are seen.
  # One CPU device, compiled light (tests/light_compile.py; the tool passes the flags on to its arms): each arm runs
  # a few steps of programs no other test compiles, so compiling is most of its cost, and nothing here reads a
  # timing or a figure the flags change (81 -> 64 CPU-s for this command on 2 cores). The arms train the preset's own
  # warm start first (its data differ from the smoke configs'): 30 steps instead of the smoke configs' 300, since
  # nothing here reads how well it answers (the 300 took 28-82 s of this test's time on 2 cores).
  env = light_compile.job_env()
  first = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-4000:]
  assert "compare: grpo-s0: training to step 4" in first.stdout
  assert "compare: sft-s0: supervised control for" in first.stdout
  with open(os.path.join(outdir, "results.csv")) as f:
    table = {r["method"]: r for r in csv.DictReader(f)}
  assert list(table) == ["grpo", "exgrpo-mixed_clip", "sft"]
  assert float(table["grpo"]["budget_tokens"]) == _SMOKE_BUDGET
  runs = {n: outputs.load_run(os.path.join(outdir, "runs", f"{n}-s0"), method=n, seed=0)
          for n in ("grpo", "exgrpo-mixed_clip", "sft")}
  # Each RL run evaluated at step 0, at its last step and at the first step whose tokens reached each quarter of the
  # budget (--eval_every=4 adds none), and is read at the one that reached the budget.
  marks = compare.arms.budget_marks(_SMOKE_BUDGET)
  with open(os.path.join(outdir, "runs.csv")) as f:
    read = {r["run"]: r for r in csv.DictReader(f)}
  for name in ("grpo", "exgrpo-mixed_clip"):
    run = runs[name]
    assert run.total_tokens >= _SMOKE_BUDGET and max(run.rows) == 4, (name, run.total_tokens)
    at_marks = {compare.budget_step(run.tokens, m) for m in marks}
    assert set(run.series(outputs.ACCURACY_KEY)[0]) == {0, 4} | at_marks, name
    at_budget = compare.budget_step(run.tokens, _SMOKE_BUDGET)
    row = read[f"{name}-s0"]
    assert (int(row["read_step"]), float(row["read_tokens"]), row["read_at_budget"]) == (
        at_budget, run.tokens[at_budget], "True")
  # The preset: 4 smoke steps x 4 questions over data.rl_train_size = 16 / 2 = 8 questions, so GRPO sampled each
  # of them 2 times; pass@8 at every evaluation (the override); 2 optimizer steps a batch; the arm's override and
  # the marks on top.
  with open(os.path.join(outdir, "runs", "exgrpo-mixed_clip-s0", "config.json")) as f:
    config = json.load(f)
  assert (config["data"]["rl_train_size"], config["eval"]["k"], config["loss"]["mixed_clip"]) == (8, 8, True)
  assert (config["train"]["num_minibatches"], config["data"]["levels"]) == (2, compare.arms.TESTBED_LEVELS)
  assert config["eval"]["token_marks"] == list(marks)
  visits = outputs.visit_stats(runs["grpo"].questions)
  assert (visits.questions, visits.visits_mean, visits.visits_max) == (8, 2.0, 2)
  # The mechanism figures: every step's composed groups in questions.jsonl, the gradient share in metrics.jsonl.
  for name in ("grpo", "exgrpo-mixed_clip"):
    assert all(row["groups"] == 4 and 0 <= row["signal"] <= 4 for row in runs[name].questions.values())
    steps = [row for step, row in runs[name].rows.items() if step > 0]
    assert all(0 <= row["policy/replayed_grad_share"] <= 1 for row in steps)
  mechanism = outputs.mechanism_stats(runs["grpo"].questions)
  assert mechanism.questions_trained == 8 and mechanism.replayed == 0 and 0 <= mechanism.signal_share <= 1
  assert 0 <= float(table["grpo"]["signal_share_mean"]) <= 1
  assert sorted(runs["grpo"].questions) == [1, 2, 3, 4]
  assert all("eval/pass@8" in row for row in runs["grpo"].rows.values() if "eval/accuracy" in row)
  assert 0 <= float(table["grpo"]["pass_at_k_mean"]) <= 1  # a number, where runs without pass@8 give nan
  # The control: no rollouts, trained for the grpo run's training time to the budget, read at its last evaluation
  # (where its training time reached that), and started from the same warm start with the same evaluator: its step-0
  # evaluation is the grpo run's, metric for metric.
  sft = runs["sft"]
  assert sft.kind == "sft" and sft.total_tokens == 0 and not sft.questions
  with open(os.path.join(outdir, "runs", "sft-s0", outputs.SFT_FILE)) as f:
    state = json.load(f)
  grpo_wall = runs["grpo"].wall[compare.budget_step(runs["grpo"].tokens, _SMOKE_BUDGET)]
  assert state["finished"] and state["target_wall_s"] == pytest.approx(grpo_wall, abs=1e-6)
  assert sft.wall[max(sft.rows)] >= grpo_wall
  assert (int(read["sft-s0"]["read_step"]), read["sft-s0"]["read_at_budget"]) == (max(sft.rows), "True")
  evals0 = {k: v for k, v in runs["grpo"].rows[0].items() if k.startswith("eval/")}
  assert {k: sft.rows[0][k] for k in evals0} == evals0
  with open(os.path.join(outdir, "results.md")) as f:
    text = f.read()
  assert "Regime `replay_testbed`" in text and "calibrated on 3 seeds" in text
  assert "| exgrpo-mixed_clip | exgrpo | `loss.mixed_clip=True` |" in text
  assert f"Budget fixed before the runs: {_SMOKE_BUDGET:,} tokens" in text and "Not read at the budget" not in text
  assert "## Primary endpoint" in text and "## Exploratory: what each method claims, measured" in text
  assert "pass@8 - grpo" in text and "**" not in text
  assert "## Exploratory: mechanism" in text and "groups with signal" in text and "share of the gradient norm" in text
  for name in ("accuracy_vs_budget.png", "pass_at_8_vs_budget.png", "accuracy_vs_training_time.png",
               "ratio_stats.png", "runs.csv"):
    assert os.path.exists(os.path.join(outdir, name)), name
  again = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-4000:]
  assert "training to step" not in again.stdout and "supervised control for" not in again.stdout
