"""A run that goes wrong says so (jaxrlvr/health.py): the held-out set's size and standard error at start, and one
warning when held-out accuracy falls back, the rollouts stop solving, or ExGRPO retires what it can solve and solves
none of the rest. The watch on hand-made rows; then issue #63's newcomer run in miniature, end to end in this
process: a small own-data file whose easy questions retire while no one solves the rest."""
import json
import os

import numpy as np
import pytest

from configs import exgrpo
from jaxrlvr import config_lib
from jaxrlvr import health
from jaxrlvr import outputs
from jaxrlvr import train
from jaxrlvr.rewards import math as math_rewards


def test_standard_error_and_interval():
  assert health.standard_error(0.5, 6) == pytest.approx(0.2041, abs=1e-4)
  assert health.standard_error(0.5, 400) == pytest.approx(0.025)
  # At 0 or 1 a small set claims no certainty: half a question from the edge.
  edge = pytest.approx(np.sqrt(1 / 12 * 11 / 12 / 6))
  assert health.standard_error(0.0, 6) == edge and health.standard_error(1.0, 6) == edge
  assert health.interval(0.5, 6) == "0.500±0.204"


def test_held_out_note_names_the_size_the_error_and_the_flag():
  own = config_lib.ml_collections.ConfigDict({"source": "jsonl:/q.jsonl", "eval_source": "", "eval_fraction": 0.1,
                                               "eval_size": 200})
  note = health.held_out_note(6, 0.5, own, available=6)
  assert note == ("the held-out set has 6 questions: at the step-0 accuracy 0.500 that is a standard error of 0.204 "
                  "(20 points), so changes under 41 points are noise; for a larger one set "
                  "--config.data.eval_fraction (now 0.1) or --config.data.eval_source=jsonl:PATH (a separate held-out "
                  "set)")
  assert health.held_out_note(100, 0.5, own, available=100) is None
  synthetic = config_lib.ml_collections.ConfigDict({"source": "synthetic:arithmetic", "eval_source": "",
                                                     "eval_size": 16})
  assert "--config.data.eval_size (now 16)" in health.held_out_note(16, 0.0, synthetic, available=16)
  capped = config_lib.ml_collections.ConfigDict({"source": "parquet:/t.parquet", "eval_source": "parquet:/v.parquet",
                                                  "eval_size": 50})
  assert "--config.data.eval_size (now 50)" in health.held_out_note(50, 0.2, capped, available=500)
  assert health.larger_held_out_flags(capped, available=50).startswith("a larger --config.data.eval_source")


def _watch(**thresholds):
  return health.Watch(health.Thresholds(**thresholds), num_train=20)


def test_accuracy_drop_needs_both_points_and_standard_errors():
  # 6 questions: 0.5 -> 0.167 is 33 points but under 2 standard errors (2 x 0.204): noise, no warning.
  watch = _watch()
  for step, accuracy in ((0, 0.5), (10, 0.333), (20, 0.167)):
    assert watch.observe(step, {"eval/accuracy": accuracy, "eval/questions": 6}) == []
  # 400 questions: 0.50 -> 0.44 is 6 points and 2.4 standard errors: a warning, once, until it recovers.
  watch = _watch()
  assert watch.observe(0, {"eval/accuracy": 0.50, "eval/questions": 400}) == []
  assert watch.observe(50, {"eval/accuracy": 0.47, "eval/questions": 400}) == []  # 3 points: within both
  (cause, message), = watch.observe(100, {"eval/accuracy": 0.44, "eval/questions": 400})
  assert cause == "accuracy_drop" and message.startswith(
      "held-out accuracy fell to 0.440 at step 100, from its best 0.500 at step 0 (6 points, more than 2 standard "
      "errors of 0.025 on 400 questions)")
  assert watch.observe(150, {"eval/accuracy": 0.43, "eval/questions": 400}) == []  # said already
  assert watch.observe(200, {"eval/accuracy": 0.49, "eval/questions": 400}) == []  # recovered: re-armed
  assert [c for c, _ in watch.observe(250, {"eval/accuracy": 0.40, "eval/questions": 400})] == ["accuracy_drop"]
  assert watch.warnings == 2
  # A large set and a drop of 3 points at 6 standard errors (10,000 questions): under the 5 points, no warning.
  watch = _watch()
  watch.observe(0, {"eval/accuracy": 0.5, "eval/questions": 10_000})
  assert watch.observe(1, {"eval/accuracy": 0.47, "eval/questions": 10_000}) == []


def test_zero_solve_rate_after_solving_warns_after_n_steps():
  watch = _watch(zero_solve_steps=4)
  assert all(watch.observe(s, {"rollout/solve_rate": 0.0}) == [] for s in range(1, 10))  # never solved: not this
  assert watch.observe(10, {"rollout/solve_rate": 0.25}) == []
  assert all(watch.observe(s, {"rollout/solve_rate": 0.0}) == [] for s in (11, 12, 13))
  (cause, message), = watch.observe(14, {"rollout/solve_rate": 0.0})
  assert cause == "zero_solve" and message.startswith(
      "the batch solve rate has been 0 for 4 steps (since step 11; last above 0 at step 10)")
  assert health.metrics([(cause, message)]) == {"health/zero_solve": 1.0, "health/warnings": 1.0}
  assert health.metrics([]) == {"health/warnings": 0.0}
  assert watch.observe(15, {"rollout/solve_rate": 0.0}) == []
  assert _watch(zero_solve_steps=0).observe(1, {"rollout/solve_rate": 0.0}) == []


def test_retired_share_with_nothing_solved_warns():
  watch = _watch(retired_share=0.5, zero_solve_steps=100)
  watch.observe(1, {"rollout/solve_rate": 0.5, "replay/retired": 4.0})
  watch.observe(2, {"rollout/solve_rate": 0.0, "replay/retired": 11.0})
  assert watch.observe(3, {"rollout/solve_rate": 0.0, "replay/retired": 11.0}) == []  # 2 steps without a solve
  (cause, message), = watch.observe(4, {"rollout/solve_rate": 0.0, "replay/retired": 11.0})
  assert cause == "retired" and message.startswith(
      "ExGRPO has retired 11 of the 20 training questions (55%: solved K of K, never drawn again) and the rollouts of "
      "the last 3 steps solve none of the rest")
  # Half retired but the rest still solved sometimes: learning, no warning.
  watch = _watch(retired_share=0.5)
  assert all(watch.observe(s, {"rollout/solve_rate": 0.1 * (s % 2), "replay/retired": 15.0}) == []
             for s in range(1, 20))


def test_thresholds_from_the_config_and_their_ranges():
  config = exgrpo.get_config("smoke")
  assert health.Thresholds.from_config(config) == health.Thresholds()  # base.py's defaults are the class's
  assert config.train.stop_on_collapse is False
  config.health.retired_share = 1.5
  with pytest.raises(config_lib.ConfigError, match=r"^config.health.retired_share=1.5: must be a share, in \[0, 1\]"):
    health.Thresholds.from_config(config)


# Issue #63's newcomer in miniature: own rows, the easy ones (sums under 10) always answered right and the rest
# never, whatever the policy writes (the verifier replaced, as tests/test_train_replay.py replaces it by a coin).
_EASY = {str(a + b) for a in range(1, 5) for b in range(1, 5)}


def _easy_only_score(self, completions, answers, **kwargs):
  rewards = np.asarray([float(a in _EASY) for a in answers], np.float32)
  return rewards, dict(fast_path=len(completions), verified=0, timeouts=0, crashes=0, missing_think=0, seconds=0.0)


def test_newcomer_run_warns_when_retirement_leaves_only_unsolved_questions(tmp_path, monkeypatch, caplog):
  # 13 easy rows of 20 (two held out): once ExGRPO has seen each (4 questions a step), more than half of the
  # training questions are retired and the 7 hard ones are all it draws.
  easy = [(a, b) for a in range(1, 5) for b in range(1, 5)][:13]
  hard = [(37 + 7 * i, 48 + 5 * i) for i in range(7)]
  rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a, b in easy + hard]
  path = tmp_path / "own.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.setattr(math_rewards.MathRewardPool, "score", _easy_only_score)
  config = exgrpo.get_config("smoke")
  with config.unlocked():
    config.data.source = f"jsonl:{path}"
    config.data.eval_fraction = 0.1  # 2 held-out rows, as a newcomer's default leaves a few
    config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]  # the embedded tokenizer's cache
    config.warm_start.embedded_fallback = False  # the rewards are the stub's: no warm start needed
    config.total_steps = 10
    config.eval_every = 10
    config.checkpoint_every = 10
  workdir = str(tmp_path / "run")
  with caplog.at_level("INFO"):
    train.run(config, workdir)

  logged = [r.getMessage() for r in caplog.records]
  note = next(i for i, m in enumerate(logged) if m.startswith("the held-out set has 2 questions"))
  assert "--config.data.eval_fraction (now 0.1)" in logged[note]
  warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.getMessage().startswith("ExGRPO has retired")]
  assert len(warnings) == 1, logged
  assert logged.index(warnings[0].getMessage()) > note  # the size line comes at start, the warning within the run
  rows = outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  warned = [r["step"] for r in rows if r.get("health/retired")]
  assert len(warned) == 1 and warned[0] < config.total_steps, rows
  assert sum(r["health/warnings"] for r in rows) == 1  # the one warning, in its step's row
  assert rows[-1]["replay/retired"] >= 5  # the easy training rows, retired

  # train.stop_on_collapse: a step whose row warned ends the run, its metrics closed first (main.py: one line, exit
  # code 2); without it, or without a warning, nothing stops.
  closed = []
  writer = type("Writer", (), {"close": lambda self: closed.append(True)})()
  watch = _watch()
  watch.latest = [("retired", "ExGRPO has retired 12 of the 18 training questions ...")]
  train._stop_if_collapsed(watch, config, 6, writer)  # pylint: disable=protected-access
  with config.unlocked():
    config.train.stop_on_collapse = True
  with pytest.raises(health.Collapsed, match=r"^stopped at step 6 of 10 \(train.stop_on_collapse=True\): ExGRPO has "
                                             r"retired 12 of the 18"):
    train._stop_if_collapsed(watch, config, 6, writer)  # pylint: disable=protected-access
  assert closed == [True]
  watch.latest = []
  train._stop_if_collapsed(watch, config, 7, writer)  # pylint: disable=protected-access
