"""BAPO batch-composition rules (docs/design.md, "BAPO"), one test per rule."""
import ml_collections
import numpy as np
import pytest

from jaxrlvr import replay
from jaxrlvr.replay import Group, Rollout

K = 8


def make_test_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.rollout = ml_collections.ConfigDict({"batch_size": overrides.pop("batch_size", 4), "group_size": K})
  c.loss = ml_collections.ConfigDict({"scale_by_std": False})
  c.replay = ml_collections.ConfigDict({
      "name": "bapo", "max_tokens": 0, "c1": 0.125, "c2": 0.125, "c3": 0.25, "adaptive_bounds": False,
      "hard_capacity": 0, "reroll_every": 2, "reroll_max": 32, "window": 3, "policy_delay": 2})
  c.replay.update(overrides)
  return c


def correct(k):
  return [1] * k + [0] * (K - k)


def run_step(s, step, fresh, correct_of):
  """One protocol step; fresh: this step's question ids; correct_of[qid]: correct samples out of K (default 0)."""
  plan = s.plan(step, lambda n: fresh[:n])
  sampled = []
  for i, r in enumerate(plan.requests):
    rewards = correct(correct_of.get(r.qid, 0))
    sampled.append(Group(r.qid, [Rollout(r.qid, np.array([r.qid, step, j, i], np.int32),
                                         np.full(4, -0.1 * (i + 1), np.float32), float(x), step)
                                 for j, x in enumerate(rewards)]))
  groups = s.compose(s.select(plan, []), sampled)
  s.observe(plan, sampled)
  return plan, groups


def test_x1_keeps_fresh_groups_with_accuracy_between_1_over_k_and_k_minus_1_over_k():
  s = replay.make("bapo", make_test_config())
  _, groups = run_step(s, 1, [1, 2, 3, 4], {1: 0, 2: 1, 3: 7, 4: 8})
  assert [(g.qid, g.source) for g in groups] == [(2, "fresh"), (3, "fresh")]
  assert s.metrics()["replay/x1_groups"] == 2.0


def test_fresh_requests_use_the_delayed_policy_and_rerolls_the_current_one():
  s = replay.make("bapo", make_test_config(policy_delay=2))
  run_step(s, 1, [1, 2, 3, 4], {})  # all four wrong: hard
  plan = s.plan(2, lambda n: [5, 6, 7, 8][:n])
  assert plan.policy_delay == 2
  assert [(r.qid, r.policy_delay, r.kind) for r in plan.requests] == (
      [(q, 2, "fresh") for q in (5, 6, 7, 8)] + [(q, 0, "reroll") for q in (1, 2, 3, 4)])


def test_hard_fifo_reroll_cadence_and_limits():
  s = replay.make("bapo", make_test_config(reroll_every=3, reroll_max=2, hard_capacity=3))
  run_step(s, 1, [1, 2, 3, 4], {2: 1})  # accuracy <= c1 = 1/8: 1, 2 (1/8), 3, 4 -> FIFO keeps the last 3
  assert s.hard_questions == [2, 3, 4]
  assert not any(r.kind == "reroll" for r in s.plan(2, lambda n: [9] * n).requests)  # 2 % 3 != 0
  plan, _ = run_step(s, 3, [5, 6, 7, 8], {5: 4, 6: 4, 7: 4, 8: 4})
  assert [r.qid for r in plan.requests if r.kind == "reroll"] == [2, 3]  # the first reroll_max of the FIFO


def test_x2_taken_when_new_accuracy_is_in_c1_1_and_leaves_the_fifo():
  s = replay.make("bapo", make_test_config(hard_capacity=8))
  run_step(s, 1, [1, 2, 3, 4], {})  # all hard
  # Re-rolls: 1 -> 3/8 (X2), 2 -> 8/8 (solved: not X2, leaves), 3 -> 1/8 (still hard), 4 -> 0/8 (still hard).
  plan, groups = run_step(s, 2, [5, 6, 7, 8], {1: 3, 2: 8, 3: 1, 4: 0, 5: 4})
  assert [(g.qid, g.source) for g in groups][:2] == [(5, "fresh"), (1, "reroll")]
  assert s.hard_questions == [6, 7, 8, 3, 4]  # fresh hard ones appended, still-hard re-rolls moved to the back
  assert s.metrics()["replay/x2_groups"] == 1.0


def test_fill_order_x1_then_x2_then_x3_up_to_batch_capacity():
  s = replay.make("bapo", make_test_config(batch_size=2))
  run_step(s, 1, [1, 2], {})  # both hard
  _, groups = run_step(s, 2, [5, 6], {5: 2, 1: 4, 2: 4})  # X1: 5; X2: 1 and 2 qualify, one slot is left
  assert [(g.qid, g.source) for g in groups] == [(5, "fresh"), (1, "reroll")]
  _, groups = run_step(s, 3, [7, 8], {7: 2})  # X1: 7; no re-roll (odd step); X3 fills the last slot: group 5
  assert [(g.qid, g.source) for g in groups] == [(7, "fresh"), (5, "stored")]


def test_x3_draws_in_band_groups_of_the_last_window_steps_without_replacement():
  s = replay.make("bapo", make_test_config(batch_size=4, reroll_every=0, window=3))
  run_step(s, 0, [1, 2, 3, 4], {1: 1, 2: 2, 3: 3, 4: 1})  # in [1/8, 2/8]: 1, 2, 4; 3/8 is not
  run_step(s, 1, [5, 6, 7, 8], {5: 2})
  _, groups = run_step(s, 2, [9, 10, 11, 12], {})  # no X1: four slots, four candidates (1, 2, 4, 5)
  assert sorted(g.qid for g in groups) == [1, 2, 4, 5] and all(g.source == "stored" for g in groups)
  _, groups = run_step(s, 3, [13, 14, 15, 16], {})  # the window of step 3 is steps 0, 1, 2: step 0 stays
  assert sorted(g.qid for g in groups) == [1, 2, 4, 5]
  _, groups = run_step(s, 4, [17, 18, 19, 20], {})  # now step 0 (4 steps ago) is out of the window
  assert sorted(g.qid for g in groups) == [5]


def test_x3_rows_keep_stored_logprobs_and_advantages_are_recomputed_per_group():
  s = replay.make("bapo", make_test_config(batch_size=1, reroll_every=0))
  run_step(s, 0, [1], {1: 2})
  _, [g] = run_step(s, 1, [2], {})
  assert g.source == "stored" and all(r.replayed and r.step == 0 for r in g.rollouts)
  np.testing.assert_allclose(g.rollouts[0].logprobs, np.float16(-0.1))  # stored in float16
  # Rewards 1, 1, 0 x6: mean .25, advantages .75, .75, -.25 x6.
  assert [r.advantage for r in g.rollouts] == [0.75, 0.75] + [-0.25] * 6


def test_adaptive_bounds_move_with_mean_accuracy():
  s = replay.make("bapo", make_test_config(adaptive_bounds=True, reroll_every=0))
  assert s.bounds() == (0.125, 0.25)  # nothing observed yet: the fixed bounds
  # Mean fresh accuracy (6+6+6+8)/32 = .8125 -> centre 1 - .8125 = .1875, width .125 -> [.125, .25].
  run_step(s, 0, [1, 2, 3, 4], {1: 6, 2: 6, 3: 6, 4: 8})
  assert s.bounds() == pytest.approx((0.125, 0.25))
  # Mean accuracy (26 + 2 + 2 + 2 + 2)/64 = .53125 -> centre .46875 -> [.40625, .53125]: 3/8 and 4/8 groups.
  _, groups = run_step(s, 1, [5, 6, 7, 8], {q: 2 for q in (5, 6, 7, 8)})
  assert s.bounds() == pytest.approx((0.40625, 0.53125))
  # Low accuracy moves the band to easy groups: all-wrong steps 3, 4, 5 (the window of step 6) -> mean 0 ->
  # centre 1 -> [.9375, 1.0625], shifted inside [1/8, 7/8] with its width kept: [.75, .875].
  run_step(s, 2, [9, 10, 11, 12], {})
  run_step(s, 3, [13, 14, 15, 16], {})
  run_step(s, 4, [17, 18, 19, 20], {})
  run_step(s, 5, [21, 22, 23, 24], {})
  assert s.bounds() == pytest.approx((0.75, 0.875))


def test_bapo_memory_cap_evicts_oldest_groups():
  s = replay.make("bapo", make_test_config(batch_size=1, reroll_every=0, max_tokens=40))
  run_step(s, 0, [1], {1: 2})  # 8 rollouts x 4 tokens = 32
  run_step(s, 1, [2], {2: 2})  # 64 > 40: step 0's group goes
  assert s.store.live_tokens == 32 and s.metrics()["replay/evicted"] == 1.0
