"""The testbed's calibration figures (jaxrlvr/compare/calibrate.py) on hand-made run directories: milliseconds."""
import json
import os

import pytest

from jaxrlvr import outputs
from jaxrlvr.compare import calibrate


def _write(workdir, *, seed, tokens, evals, questions, marks=(), levels="add1x2,add3",
           worked="add1x2=1,add3=0.5"):
  """A run: `tokens` a step, evaluations {step: (accuracy, add3's accuracy)} over 700 questions, questions.jsonl rows
  {step: [(qid, correct of 4)]}."""
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"method": "grpo", "seed": seed, "data": {"levels": levels, "worked_by_level": worked,
                                                       "worked_fraction": 0.4},
               "train": {"num_minibatches": 2}, "eval": {"token_marks": list(marks)}}, f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(len(tokens) + 1):
      row = {"step": step, **({"rollout/sampled_tokens": tokens[step - 1]} if step else {})}
      if step in evals:
        row.update({"eval/accuracy": evals[step][0], "eval/arithmetic/add3/accuracy": evals[step][1],
                    "eval/arithmetic/add1x2/accuracy": 1.0, "eval/questions": 700.0})
      f.write(json.dumps(row) + "\n")
  with open(os.path.join(workdir, outputs.QUESTIONS_FILE), "w") as f:
    for step, groups in questions.items():
      f.write(json.dumps({"step": step, "qid": [q for q, _ in groups], "kind": ["fresh"] * len(groups),
                          "correct": [c for _, c in groups], "samples": [4] * len(groups)}) + "\n")


def test_the_figures_by_hand(tmp_path, capsys):
  runs = tmp_path / "runs"
  # Seed 0: 100 tokens a step, budget 250 (its marks) -> reached at step 3, evaluated there: 0.5 -> 0.6.
  # First visits at steps 1-2 (first_steps=2): q0 4/4 (add1x2, constant), q1 2/4 (add3), q3 0/4 (add3, constant);
  # q0 again at step 2 is not a first visit; q2 at step 3 is past first_steps.
  _write(runs / "grpo-s0", seed=0, tokens=[100] * 4, marks=(125, 250),
         evals={0: (0.5, 0.4), 2: (0.55, 0.5), 3: (0.6, 0.5), 4: (0.9, 0.9)},
         questions={1: [(0, 4), (1, 2)], 2: [(3, 0), (0, 3)], 3: [(2, 4), (1, 1)]})
  # Seed 1: no marks: read at its last evaluation; add3 starts at 0.9, above the bound.
  _write(runs / "grpo-s1", seed=1, tokens=[100] * 2, evals={0: (0.3, 0.9), 2: (0.5, 0.8)},
         questions={1: [(0, 1), (1, 4)], 2: [(2, 1)]})
  _write(runs / "exgrpo-s0", seed=0, tokens=[100], evals={0: (0.0, 0.0)}, questions={})  # another arm: not read
  a = calibrate.seed_figures(str(runs / "grpo-s0"), first_steps=2)
  assert (a.budget, a.read_step, a.read_tokens, a.at_budget, a.evaluations) == (250, 3, 300, True, 3)
  assert (a.accuracy_0, a.accuracy_read, a.gain) == (0.5, 0.6, pytest.approx(0.1))
  assert a.between_0 == {"add3": 0.4}  # add1x2 is fully worked: not in between
  assert (a.constant_first, a.first_groups) == (pytest.approx(2 / 3), 3)
  assert a.constant_by_level == {"add1x2": 1.0, "add3": 0.5}  # qid % 2: 0 -> add1x2, 1 and 3 -> add3
  assert a.visits_mean == pytest.approx(6 / 4)  # q0 2, q1 2, q2 1, q3 1 up to step 3
  assert (a.minibatches, a.eval_questions) == (2, 700)
  b = calibrate.seed_figures(str(runs / "grpo-s1"), first_steps=2)
  assert (b.budget, b.read_step, b.gain, b.constant_first) == (200, 2, pytest.approx(0.2), pytest.approx(1 / 3))
  c = calibrate.seed_figures(str(runs / "grpo-s0"), first_steps=2, budget=150)  # reached at step 2, evaluated there
  assert (c.read_step, c.at_budget) == (2, True)
  c = calibrate.seed_figures(str(runs / "grpo-s0"), first_steps=2, budget=350)  # reached at step 4, evaluated at 4
  assert (c.read_step, c.at_budget, c.accuracy_read) == (4, True, 0.9)
  c = calibrate.seed_figures(str(runs / "grpo-s0"), first_steps=2, budget=50)  # reached at step 1: no evaluation
  assert (c.read_step, c.at_budget) == (0, False)  # its last one below the budget, as compare/stats.py reads it
  assert "0.500 (0, 0, its last evaluation below the budget) | +0.000 |" in calibrate.report([c], first_steps=2)
  s = calibrate.summary([a, b])
  assert s["gain_mean"] == pytest.approx(0.15) and (s["between_min"], s["between_max"]) == (0.4, 0.9)
  assert s["constant_mean"] == pytest.approx(0.5) and s["evaluations_min"] == 2
  assert calibrate.main(["calibrate", f"--outdir={tmp_path}", "--first_steps=2"]) == 0
  text = capsys.readouterr().out
  assert "| 0 | 0.500 | 0.600 (3, 300) | +0.100 | add3 0.400 | 0.667 (3) | add1x2 1.00, add3 0.50 | 1.50 |" in text
  assert "| GRPO's held-out gain over the run, mean over seeds | 0.150 | >= 0.08 | yes |" in text
  assert "highest | 0.900 | <= 0.85 | NO |" in text
  assert calibrate.main(["calibrate", f"--outdir={tmp_path}", "--arm=bapo"]) == 2
  assert calibrate.in_between_levels({"levels": "", "worked_fraction": 0.4, "worked_by_level": "add2=1"}) == [
      "add3", "addsub2", "mul1x2"]  # the embedded mix, its default fraction
