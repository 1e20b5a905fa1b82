"""Evaluation metrics and the driver (jaxrlvr/evaluate.py)."""
import math

import numpy as np
import pytest

from jaxrlvr import evaluate as ev
from jaxrlvr.data import Example


def test_pass_at_k_hand_cases():
  assert ev.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # k=1 is the fraction correct: 2/5
  assert ev.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
  assert ev.pass_at_k(10, 3, 5) == pytest.approx(11 / 12)  # 1 - C(7,5)/C(10,5) = 1 - 21/252
  assert ev.pass_at_k(4, 0, 2) == 0.0 and ev.pass_at_k(4, 4, 2) == 1.0
  assert ev.pass_at_k(8, 6, 3) == 1.0  # n - c = 2 < k = 3: every 3-subset holds a correct sample
  # Large n stays finite: C(999,10)/C(1000,10) = 990/1000, so pass@10 = 0.01 with one correct in 1,000.
  assert ev.pass_at_k(1000, 1, 10) == pytest.approx(0.01)
  with pytest.raises(ValueError, match=r"1 <= k \(6\) <= n"):
    ev.pass_at_k(5, 1, 6)


def test_pass_at_k_equals_the_closed_form():
  for n in range(1, 13):
    for c in range(n + 1):
      for k in range(1, n + 1):
        closed = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert ev.pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12), (n, c, k)


def test_avg_and_per_source():
  correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
  assert ev.avg_at_k(correct) == pytest.approx((0.5 + 0 + 1) / 3)
  # pass@2 per question: 1 - C(2,2)/C(4,2) = 5/6; 0; 1.
  assert ev.mean_pass_at_k(correct, 2) == pytest.approx((5 / 6 + 0 + 1) / 3)
  assert ev.by_source([1, 0, 1, 1], ["b", "a", "b", "a"]) == {"a": 0.5, "b": 1.0}
  assert ev.mean_length([3, 5, 10]) == pytest.approx(6.0)


def _examples() -> list[Example]:
  return [Example(qid=i, question=f"{i}+{i}", answer=str(2 * i), data_source=source)
          for i, source in enumerate(["aime", "aime", "math500", "math500"])]


def test_evaluate_driver():
  """A scripted sampler: greedy gets questions 0 and 2 right; sampling (k=4) gets 1, 0, 4, 2 of 4 right."""
  sampled_correct = [1, 0, 4, 2]
  calls = []

  def generate_fn(prompts, temperature, n):
    calls.append((temperature, n))
    completions, lengths = [], []
    for i, prompt in enumerate(prompts):
      assert prompt == f"Q: {i}+{i}\nA: "
      for j in range(n):
        right = (i in (0, 2)) if temperature == 0 else j < sampled_correct[i]
        completions.append(f"\\boxed{{{2 * i}}}" if right else f"{2 * i + 1}")  # wrong answers come unboxed
        lengths.append(4 + i)
    return completions, lengths

  def reward_fn(completions, answers):
    return np.array([c == f"\\boxed{{{a}}}" for c, a in zip(completions, answers)], np.float32)

  metrics = ev.evaluate(generate_fn, _examples(), k=4, temperature=0.6, reward_fn=reward_fn)
  assert calls == [(0.0, 1), (0.6, 4)]
  assert metrics["eval/accuracy"] == pytest.approx(0.5)  # 2 of 4 greedy
  assert metrics["eval/aime/accuracy"] == 0.5 and metrics["eval/math500/accuracy"] == 0.5
  assert metrics["eval/response_length"] == pytest.approx((4 + 5 + 6 + 7) / 4)
  # pass@4 with n = k = 4 is 1 when any sample is right: questions 0, 2, 3 -> 3/4.
  assert metrics["eval/pass@4"] == pytest.approx(0.75)
  assert metrics["eval/aime/pass@4"] == 0.5 and metrics["eval/math500/pass@4"] == 1.0
  # avg@4: (1/4 + 0 + 4/4 + 2/4) / 4 = 1.75 / 4.
  assert metrics["eval/avg@4"] == pytest.approx(0.4375)
  assert metrics["eval/math500/avg@4"] == pytest.approx((1 + 0.5) / 2)

  greedy_only = ev.evaluate(generate_fn, _examples(), reward_fn=reward_fn)
  assert greedy_only["eval/boxed"] == pytest.approx(0.5)  # the two right answers are the boxed ones
  assert set(greedy_only) == {"eval/accuracy", "eval/questions", "eval/response_length", "eval/boxed",
                              "eval/aime/accuracy", "eval/math500/accuracy"}
  with pytest.raises(ValueError, match="k=4 samples at temperature 0.0 would all be the greedy answer"):
    ev.evaluate(generate_fn, _examples(), k=4, temperature=0.0, reward_fn=reward_fn)
  with pytest.raises(ValueError, match="returned 3 completions and 3 lengths for 4 prompts x n=1"):
    ev.evaluate(lambda p, t, n: (["x"] * 3, [1] * 3), _examples(), reward_fn=reward_fn)
