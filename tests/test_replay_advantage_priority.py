"""Rollout-level advantage-priority replay rules (docs/design.md), one test per rule, and priority draws."""
import itertools

import ml_collections
import numpy as np
import pytest
from scipy import stats

from jaxrlvr import replay
from jaxrlvr.replay import Group, Rollout
from jaxrlvr.replay.advantage_priority import weighted_sample

K = 4


def make_test_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.rollout = ml_collections.ConfigDict({"batch_size": overrides.pop("batch_size", 1), "group_size": K})
  c.loss = ml_collections.ConfigDict({"scale_by_std": False})
  c.replay = ml_collections.ConfigDict({
      "name": "advantage_priority", "max_tokens": 0, "capacity": 30000, "tau_max": 10, "alpha": 0.5,
      "priority_eps": 1e-6, "warmup_steps": 0, "replay_fraction": 0.5, "composition": "fresh_anchored",
      "priority": "abs_advantage"})
  c.replay.update(overrides)
  return c


def run_step(s, step, rewards):
  """One protocol step; rewards: one reward list per question (question ids 100*step + i)."""
  qids = [100 * step + i for i in range(len(rewards))]
  plan = s.plan(step, lambda n: qids[:n])
  sampled = [Group(q, [Rollout(q, np.array([q, j], np.int32), np.full(2, -0.25, np.float32), float(r), step)
                       for j, r in enumerate(rw)]) for q, rw in zip(qids, rewards)]
  groups = s.compose(s.select(plan, []), sampled)
  s.observe(plan, sampled)
  return groups


def test_zero_variance_groups_dropped_before_training_and_insertion():
  s = replay.make("advantage_priority", make_test_config(batch_size=2, warmup_steps=5))
  groups = run_step(s, 0, [[1, 1, 1, 1], [1, 0, 0, 0]])
  assert [g.qid for g in groups] == [1]  # question 0 (all correct) is gone from the batch
  assert s.store.num_rows == K and set(s.store.get("qid", s.store.rows())) == {1}  # and from the buffer
  assert s.metrics()["replay/dropped_groups"] == 1.0


def test_stores_single_rollouts_with_advantage_at_birth_and_birth_step():
  s = replay.make("advantage_priority", make_test_config(batch_size=2, warmup_steps=5))
  run_step(s, 3, [[1, 0, 0, 0], [0, 0, 0, 0]])
  rows = s.store.rows()
  # Rewards 1, 0, 0, 0: mean .25, advantages .75, -.25, -.25, -.25; reward sample std (ddof=1)
  # sqrt((.5625 + 3 x .0625) / 3) = .5.
  np.testing.assert_allclose(s.store.get("advantage", rows), [0.75, -0.25, -0.25, -0.25])
  np.testing.assert_allclose(s.store.get("group_std", rows), 0.5, rtol=1e-6)
  assert (s.store.get("step", rows) == 3).all()


def test_age_eviction_beyond_tau_max():
  s = replay.make("advantage_priority", make_test_config(tau_max=2, warmup_steps=100))
  for step in range(4):
    run_step(s, step, [[1, 0, 0, 0]])
  # Composing step 3 evicted births 0 (age 3 > 2); composing step 4 evicts births 1 (age 3); births 2 and 3
  # (ages 2 and 1) stay.
  run_step(s, 4, [[1, 1, 1, 1]])
  assert sorted(set(s.store.get("step", s.store.rows()))) == [2, 3]
  assert s.metrics()["replay/evicted_age"] == K and s.metrics()["replay/evicted_total"] == 2 * K


def test_capacity_eviction_oldest_first():
  s = replay.make("advantage_priority", make_test_config(capacity=6, warmup_steps=100))
  run_step(s, 0, [[1, 0, 0, 0]])
  run_step(s, 1, [[0, 1, 0, 0]])
  rows = s.store.rows()
  assert len(rows) == 6 and sorted(s.store.get("step", rows)) == [0, 0, 1, 1, 1, 1]
  assert s.metrics()["replay/evicted_capacity"] == 2.0


def test_memory_cap_in_tokens_evicts_oldest():
  s = replay.make("advantage_priority", make_test_config(max_tokens=10, warmup_steps=100))
  run_step(s, 0, [[1, 0, 0, 0]])
  run_step(s, 1, [[0, 1, 0, 0]])  # 8 rollouts x 2 tokens = 16 > 10: the 3 oldest go
  assert s.store.live_tokens == 10 and s.metrics()["replay/evicted_capacity"] == 3.0


def test_no_replay_during_warmup_steps():
  s = replay.make("advantage_priority", make_test_config(batch_size=2, warmup_steps=3))
  for step in range(3):
    groups = run_step(s, step, [[1, 0, 0, 0], [1, 1, 0, 0]])
    assert not any(r.replayed for g in groups for r in g.rollouts)
  groups = run_step(s, 3, [[1, 0, 0, 0], [1, 1, 0, 0]])
  assert sum(r.replayed for g in groups for r in g.rollouts) == 4  # round(.5 x 8)


def test_fresh_anchored_adds_rounded_replay_fraction_of_fresh_rollouts():
  s = replay.make("advantage_priority", make_test_config(batch_size=3, replay_fraction=0.5))
  run_step(s, 0, [[1, 0, 0, 0]] * 3)  # 12 rows in the buffer
  groups = run_step(s, 1, [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
  fresh = [g for g in groups if g.source == "fresh"]
  replayed = [g for g in groups if g.source == "replay"]
  assert len(fresh) == 1 and len(fresh[0].rollouts) == K  # every kept fresh rollout stays
  assert len(replayed) == 2 and all(len(g.rollouts) == 1 for g in replayed)  # round(.5 x 4) = 2
  groups = run_step(s, 2, [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1]])
  assert sum(g.source == "replay" for g in groups) == 6  # round(.5 x 12) = 6
  s2 = replay.make("advantage_priority", make_test_config(batch_size=3, replay_fraction=0.375))
  run_step(s2, 0, [[1, 0, 0, 0]] * 3)
  assert sum(g.source == "replay" for g in run_step(s2, 1, [[1, 0, 0, 0]] * 3)) == 5  # .375 x 12 = 4.5 -> 5


def test_replayed_rollouts_keep_stored_advantage_and_logprobs():
  s = replay.make("advantage_priority", make_test_config(batch_size=1, replay_fraction=1.0))
  run_step(s, 0, [[1, 0, 0, 0]])
  groups = run_step(s, 1, [[1, 1, 0, 0]])
  replayed = [g.rollouts[0] for g in groups if g.source == "replay"]
  assert len(replayed) == K
  # Stored at step 0 with rewards 1, 0, 0, 0: advantages .75 (token [0, 0]) and -.25 (the others).
  for r in replayed:
    assert r.replayed and r.step == 0 and r.advantage == (0.75 if r.tokens[1] == 0 else -0.25)
    np.testing.assert_allclose(r.logprobs, -0.25)
  assert all(r.advantage == 0.5 * (1 if r.reward else -1) for g in groups if g.source == "fresh" for r in g.rollouts)


def test_pool_composition_draws_as_many_rollouts_as_fresh_from_buffer_and_fresh_together():
  s = replay.make("advantage_priority", make_test_config(batch_size=2, composition="pool"))
  run_step(s, 0, [[1, 0, 0, 0], [1, 1, 0, 0]])
  n_replayed = n_fresh = 0
  for step in range(1, 11):
    groups = run_step(s, step, [[0, 0, 0, 1], [0, 0, 0, 0]])  # one kept fresh group: the batch holds 4 rollouts
    assert len(groups) == K and all(len(g.rollouts) == 1 for g in groups)
    assert all(r.replayed == (g.source == "replay") and (r.step < step) == r.replayed
               for g in groups for r in g.rollouts)
    n_replayed += sum(g.source == "replay" for g in groups)
    n_fresh += sum(g.source == "fresh" for g in groups)
  assert n_replayed > 0 and n_fresh > 0  # one draw over the buffer and this step's rollouts, not fresh + extra
  assert n_replayed + n_fresh == 10 * K


def test_priority_draws_follow_abs_advantage_power_alpha_chi_square():
  # Buffer: rewards 1,0,0,0 (advantages .75, -.25 x3) and 1,1,0,0 (+-.5 x4). Each composed step keeps one fresh
  # group of 4 and replays round(.25 x 4) = 1 row; compose without observe leaves the buffer as it is.
  s = replay.make("advantage_priority", make_test_config(batch_size=1, tau_max=10 ** 6, replay_fraction=0.25))
  run_step(s, 10, [[1, 0, 0, 0]])
  run_step(s, 11, [[1, 1, 0, 0]])
  rows = s.store.rows()
  index = {tuple(s.store.tokens(r)): i for i, r in enumerate(rows)}
  counts = np.zeros(len(rows))
  n = 3000
  for i in range(n):
    plan = s.plan(12 + i, lambda m: [7])
    sampled = [Group(7, [Rollout(7, np.array([1], np.int32), np.zeros(1, np.float32), float(r), 12 + i)
                         for r in (0, 1, 0, 0)])]
    [replayed] = [g.rollouts[0] for g in s.compose(plan, sampled) if g.source == "replay"]
    counts[index[tuple(replayed.tokens)]] += 1
  # (|A| + 1e-6)^.5: .866 for .75, .5 for -.25 (x3), .7071 for +-.5 (x4); the sum is .866 + 1.5 + 2.828 = 5.194.
  w = (np.abs(s.store.get("advantage", rows).astype(np.float64)) + 1e-6) ** 0.5
  assert abs(w.sum() - 5.1944) < 1e-3
  assert stats.chisquare(counts, n * w / w.sum()).pvalue > 1e-3
  assert stats.chisquare(counts, np.full(len(rows), n / len(rows))).pvalue < 1e-6  # uniform would be rejected


def test_weighted_sample_without_replacement_inclusion_probabilities():
  # Successive sampling of 2 out of weights w: P(first i, then j) = w_i/W x w_j/(W - w_i); sum over ordered pairs.
  w = np.array([1.0, 2.0, 3.0, 4.0])
  W = w.sum()
  p = np.zeros(4)
  for i, j in itertools.permutations(range(4), 2):
    p[[i, j]] += w[i] / W * w[j] / (W - w[i])
  # By hand for item 0: .1 (first) + .2 x 1/8 + .3 x 1/7 + .4 x 1/6 (second) = .1 + .025 + .04286 + .06667 = .23452.
  assert abs(p[0] - 0.23452) < 1e-4
  rng = np.random.default_rng(0)
  n = 20000
  hits = np.zeros(4)
  firsts = np.zeros(4)
  for _ in range(n):
    pick = weighted_sample(rng, w, 2)
    assert pick[0] != pick[1]
    hits[pick] += 1
    firsts[pick[0]] += 1
  np.testing.assert_allclose(hits / n, p, atol=4 * np.sqrt(0.25 / n))
  assert stats.chisquare(firsts, n * w / W).pvalue > 1e-3  # the first draw is proportional to w


def test_group_std_and_uniform_priorities():
  s = replay.make("advantage_priority", make_test_config(batch_size=2, priority="group_std"))
  run_step(s, 0, [[1, 0, 0, 0], [1, 1, 0, 0]])
  rows = s.store.rows()
  # group_std: the query-level signal, shared by a group's rollouts; sample std (ddof=1) .5 (1 of 4 correct) and
  # sqrt(4 x .25 / 3) = .57735 (2 of 4); weights (std + 1e-6)^0.5.
  np.testing.assert_allclose(s.weights(s._row_signal(rows)), np.sqrt(np.repeat([0.500001, 0.577351], 4)),
                             rtol=1e-5)
  u = replay.make("advantage_priority", make_test_config(priority="uniform"))
  np.testing.assert_array_equal(u.weights(np.array([0.0, 0.3, 5.0])), [1.0, 1.0, 1.0])
  with pytest.raises(ValueError, match="priority"):
    replay.make("advantage_priority", make_test_config(priority="td_error"))
  with pytest.raises(ValueError, match="composition"):
    replay.make("advantage_priority", make_test_config(composition="mixed"))
