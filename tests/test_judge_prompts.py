"""Judge prompts and the verdict parser (jaxrlvr/rewards/judge_prompts.py)."""
import pytest

from jaxrlvr.rewards import judge_prompts
from jaxrlvr.rewards.judge_prompts import JudgeRequest


@pytest.mark.parametrize("reply, verdict", [
    ("The answer matches.\nSCORE: 4", 4),
    ("**Score**: 5", 5),
    ("Final score: **3**", 3),
    ("score = 2/5", 2),
    ("Score - [1]", 1),
    ("SCORE: 4.0", 4),
    ("I would give \\boxed{3}.", 3),
    ("Rating: [[2]]", 2),
    # The last stated verdict wins: the judge quotes the scale, then revises itself.
    ("A score: 5 would need a full proof. Score: 2", 2),
    # A verdict drafted while thinking is not the verdict.
    ("<think>maybe SCORE: 5</think>The second step is wrong. SCORE: 2", 2),
])
def test_parse_verdict_accepts(reply, verdict):
  assert judge_prompts.parse_verdict(reply) == verdict


@pytest.mark.parametrize("reply", [
    "",
    "Looks right to me.",
    "SCORE: 6",  # outside 1..5
    "SCORE: 0",
    "SCORE: 3.5",  # a fraction is not a verdict; it is not rounded
    "SCORE: <a whole number from 1 to 5>",  # the judge echoed the instruction
    "<think>SCORE: 4 ... still checking the second",  # cut off while thinking
])
def test_parse_verdict_rejects(reply):
  assert judge_prompts.parse_verdict(reply) is None
  assert judge_prompts.parse_score(reply) is None


def test_verdict_to_score_maps_one_to_five_onto_unit_interval():
  # (k - 1) / 4: 1 -> 0, 2 -> .25, 3 -> .5, 4 -> .75, 5 -> 1.
  assert [judge_prompts.verdict_to_score(k) for k in range(1, 6)] == [0.0, 0.25, 0.5, 0.75, 1.0]
  assert judge_prompts.parse_score("SCORE: 4") == 0.75


def test_prompts_hold_the_inputs_and_ask_to_verify_not_solve():
  outcome = judge_prompts.build_messages(JudgeRequest("What is 2+3?", "2+3=5", "It is 5."))
  process = judge_prompts.build_messages(JudgeRequest("What is 2+3?", "2+3=5", "so 5 ###", context="2+3 ###"))
  for messages in (outcome, process):
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert "What is 2+3?" in user and "2+3=5" in user
    assert "do not solve" in messages[0]["content"].lower() or "not solve" in user.lower()
    assert user.rstrip().endswith("SCORE: <a whole number from 1 to 5>")
  assert "It is 5." in outcome[1]["content"]
  assert "step to grade" in process[1]["content"] and "so 5 ###" in process[1]["content"]
  assert "2+3 ###" in process[1]["content"]
  first_step = judge_prompts.build_messages(JudgeRequest("q", "r", "step one", context=""))
  assert "this is the first step" in first_step[1]["content"]
