"""The math reward (jaxrlvr/rewards/math.py): verdicts, the fast path's equivalence, hostile inputs, crashes."""
import logging
import os
import random
import signal
import threading
import time

import math_verify
import numpy as np
import pytest

from jaxrlvr.rewards import MathRewardPool, fast_verdict, math_reward, strip_think

logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # It logs every timeout with the whole input.

# (completion, gold, expected): what a careful grader would say, which is also math-verify's verdict.
ANSWER_TABLE = [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1),  # fraction vs decimal
    ("\\boxed{0.5}", "\\frac{1}{2}", 1),
    ("The answer is $\\dfrac{3}{4}$.", "0.75", 1),  # no box: math-verify's own extraction
    ("\\boxed{0.33}", "\\frac{1}{3}", 0),  # rounding is not equality (math-verify compares to 6 places)
    ("\\boxed{50\\%}", "0.5", 1),
    ("So $f(x) = \\boxed{2x+2}$", "2(x+1)", 1),  # equivalent expressions
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1),
    ("\\boxed{x^2+1}", "(x+1)^2", 0),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1),
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1),  # sets: order does not matter
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0),
    ("\\boxed{(1,2]}", "(1,2]", 1),  # intervals: the brackets matter
    ("\\boxed{[1,2)}", "(1,2]", 0),
    ("\\boxed{(-\\infty, 3) \\cup (5, \\infty)}", "(-\\infty,3)\\cup(5,\\infty)", 1),
    ("\\boxed{86}", "85", 0),  # wrong answer (fast path)
    ("I do not know.", "85", 0),  # no answer
    ("\\boxed{}", "85", 0),
    ("Adding: $\\boxed{85}$.", "85", 1),  # fast path
    ("so 85-21=\\boxed{64}", "64", 1),  # fast path, the embedded task's worked step
    ("so 85-21=\\boxed{63}", "64", 0),  # fast path
]

HOSTILE = [
    "\\boxed{9^{9^{9^{9^{9}}}}}",  # a power tower: sympy would compute it in C, where no alarm reaches
    "\\boxed{" + "{" * 20_000,  # 20,000 open brackets
    "$" + "\\left(" * 20_000 + "$",
    "1+" * 500_000,  # a 1 MB string that parses as one huge sum
    # 1 MB of noise over a LaTeX-ish alphabet (random bytes mapped onto it: fast to build).
    random.Random(0).randbytes(1_000_000).translate(bytes(b"abc $\\{}()^0123456789"[i % 21] for i in range(256)))
    .decode("ascii"),
]


@pytest.fixture(scope="module")
def pool():
  # Verdicts, not budgets, by default: sympy's first expansion of (x+1)^2 took over 2 s on a loaded 2-core machine a
  # quarter as fast as the development one (the answer table then read 0). The budget tests pass their own.
  with MathRewardPool(num_workers=2, timeout_s=30.0) as p:
    yield p


def test_answer_table(pool):
  completions, golds, expected = zip(*ANSWER_TABLE)
  rewards, info = pool.score(list(completions), list(golds))
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, np.array(expected, np.float32))
  assert info["fast_path"] == 4 and info["verified"] == len(ANSWER_TABLE) - 4  # the four marked "fast path"
  assert info["timeouts"] == info["crashes"] == 0


def _math_verify(completion: str, gold: str) -> float:
  return float(math_verify.verify(math_verify.parse("$" + gold + "$"), math_verify.parse(completion)))


NEAR_MISSES = [
    # (completion, gold, fast_verdict): None means "math-verify must decide"; others must equal math-verify.
    ("\\boxed{42}", "42", 1.0),
    ("\\boxed{42}.\n", "41", 0.0),
    ("Thus the final answer is $\\boxed{42}$.", "42", 1.0),
    ("**Final Answer**\n\\[\n\\boxed{-42}\n\\]", "-42", 1.0),
    ("so \\( \\boxed{0} \\)", "0", 1.0),
    ("$7$ and $\\boxed{42}$", "42", None),  # another $ on the line
    ("final answer is \\(7\\) or \\(\\boxed{42}\\)", "42", None),  # a chain: math-verify extracts {7, 42}
    ("\\[7\\] and \\[\\boxed{42}\\]", "42", None),  # a chain without the anchor is harmless, but refused
    ("The final answer is $7$. I hope it is correct. \\boxed{42}", "42", None),  # priority-0 anchor
    ("\\boxed{7} then \\boxed{42}", "42", None),  # two boxes
    ("\\boxed{042}", "42", None),  # not canonical
    ("\\boxed{42} and more", "42", None),  # text after the box
    ("$x = 3 \\boxed{42}$", "42", None),  # another $ on the box's line
    ("\\[ x \\] \\[ \\boxed{42} \\]", "42", 1.0),
    ("\\[ x \\[ \\boxed{42} \\]", "42", None),  # an unclosed \[ before ours
    ("\\boxed{42}", "42.0", None),  # gold not an integer
    ("\\boxed{42}%", "42", None),
]


@pytest.mark.parametrize("completion,gold,expected", NEAR_MISSES)
def test_fast_path_near_misses(completion, gold, expected):
  verdict = fast_verdict(completion, gold)
  assert verdict == expected
  if verdict is not None:
    assert verdict == _math_verify(completion, gold)


def test_fast_path_equals_math_verify_on_fuzzed_completions():
  """Random compositions of the pieces the proof worries about; every fast verdict must be math-verify's."""
  rng = random.Random(0)
  pieces = ["we get", "final answer", " is ", "Final Answer", "I hope", "$7$", "\\(7\\)", "\\[7\\]", "$", "$$", "\\[",
            "\\]", "\\(", "\\)", "\n", ",", " and ", " or ", "}", "{", ".", " ", "5", "\\$", "[", "]", "%", "=",
            "\\frac{1}{2}", "the final answer is \\(7\\) or ", "final answer is $7$, "]
  numbers = ["42", "-42", "0", "7", "42", "007", "-0", "+42", "12345678901234567890"]
  checked = 0
  for _ in range(3000):
    box = "\\boxed{%s}" % rng.choice(numbers)
    space = lambda: rng.choice(["", " ", "\n", "\t"])  # pylint: disable=cell-var-from-loop
    opening, closing = rng.choice([("", ""), ("$", "$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$$", "$$")])
    completion = ("".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) + opening + space() + box +
                  space() + closing + rng.choice(["", "", ".", "\n", " $", "}", " and $1$"]))
    gold = rng.choice(["42", "-42", "0", "7"])
    verdict = fast_verdict(completion, gold)
    if verdict is not None:
      checked += 1
      assert verdict == _math_verify(completion, gold), (completion, gold)
  assert checked > 400  # About 1 in 6 lands on the fast path; the generator must actually exercise the fast path.


def test_require_think(pool):
  completions = ["<think>43?</think> \\boxed{42}", "\\boxed{42}", "<think>x</think><think>y</think> \\boxed{42}",
                 "</think>\\boxed{42}<think>", "<think> 1/2 </think> so $\\frac{1}{2}$"]
  rewards, info = pool.score(completions, ["42", "42", "42", "42", "0.5"], require_think=True)
  # Only the first and the last have one <think> before one </think>; both answer correctly after it.
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 1])
  assert info["missing_think"] == 3
  assert strip_think("<think>a</think>b") == "b" and strip_think("a</think>b") is None


def test_literal_numbers(pool):
  """With literal_numbers, an expression math-verify extracts for a number scores 0 however it evaluates (the
  restated question), and nothing else changes."""
  cases = [  # (completion, gold, plain verdict, literal verdict)
      ("27 + 79 - 81 = \\boxed{27+79-81}", "25", 1, 0),
      ("So $27+79-81$", "25", 1, 0),
      ("\\boxed{25} then \\boxed{5^2}", "25", 1, 0),
      ("\\boxed{25}", "25", 1, 1),
      ("So it is $\\boxed{ 25 }$.", "25", 1, 1),
      ("The answer is 106.", "106", 1, 1),  # unboxed: math-verify's own extraction, a number
      ("\\boxed{1,024}", "1024", 1, 1),
      ("\\boxed{-3.5}", "-3.5", 1, 1),
      ("\\boxed{26}", "25", 0, 0),
      ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1, 1),  # gold is not a number: not restricted
  ]
  completions, golds, plain_expected, literal_expected = (list(x) for x in zip(*cases))
  plain, _ = pool.score(completions, golds)
  np.testing.assert_array_equal(plain, plain_expected)
  rewards, info = pool.score(completions, golds, literal_numbers=True)
  np.testing.assert_array_equal(rewards, literal_expected)
  assert info["not_literal"] == 3


def test_hostile_completions_score_zero_within_a_bound(pool):
  completions = HOSTILE + ["\\boxed{\\frac{2}{4}}"]
  start = time.monotonic()
  golds = [str(i) for i in range(len(HOSTILE))] + ["0.5"]  # Distinct golds spread them over both workers.
  rewards, info = pool.score(completions, golds, timeout_s=1.0)
  elapsed = time.monotonic() - start
  np.testing.assert_array_equal(rewards, [0] * len(HOSTILE) + [1])
  assert info["timeouts"] >= 1  # The power tower cannot finish in 1 s.
  # Bound: 5 hostile items x (1 s budget + a worker restart, a few seconds on a loaded 2-core machine),
  # spread over 2 workers. Without the parent's deadline the power tower alone never returns.
  assert elapsed < 30, f"hostile batch took {elapsed:.1f} s"
  # The pool is still healthy afterwards.
  rewards, _ = pool.score(["\\boxed{\\frac{3}{6}}"], ["0.5"])
  assert rewards[0] == 1


def test_killed_workers_are_replaced_and_their_items_scored_again(pool):
  """Both workers are killed while each chews on a power tower: replaced, they score the towers again (which then
  overrun the budget: 0, as timeouts), and the queued items behind them still score."""
  completions = ["\\boxed{9^{9^{9^{9^{9}}}}}"] * 2 + ["\\boxed{\\frac{%d}{%d}}" % (i, 2 * i) for i in range(1, 7)]
  golds = ["1", "2"] + ["0.5"] * 6  # Distinct golds: one tower per worker.
  pool.wait_ready()
  victims = pool.worker_pids()

  def kill_workers():
    time.sleep(0.5)
    for pid in victims:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  killer = threading.Thread(target=kill_workers)
  killer.start()
  rewards, info = pool.score(completions, golds, timeout_s=3.0)
  killer.join()
  np.testing.assert_array_equal(rewards, [0, 0] + [1] * 6)
  assert info["crashes"] == 0 and info["timeouts"] == 2 and info["worker_restarts"] == 4
  assert set(pool.worker_pids()).isdisjoint(victims)


def test_math_reward_api_and_errors(pool):
  rewards = math_reward(["\\boxed{\\frac{1}{2}}", "\\boxed{3}"], ["0.5", "4"])
  assert rewards.dtype == np.float32 and rewards.tolist() == [1.0, 0.0]
  with pytest.raises(ValueError, match="2 completions but 1 answers"):
    pool.score(["a", "b"], ["1"])
  with pytest.raises(TypeError, match="item 0"):
    pool.score([None], ["1"])
