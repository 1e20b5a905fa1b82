"""ExGRPO replay rules (docs/design.md, "ExGRPO"), one test per rule, plus the bucket-draw chi-square test."""
import ml_collections
import numpy as np
import pytest
from scipy import stats

from jaxrlvr import replay
from jaxrlvr.replay import Group, Rollout, simulate

K = 4


def make_test_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.rollout = ml_collections.ConfigDict({"batch_size": overrides.pop("batch_size", 4),
                                         "group_size": overrides.pop("group_size", K)})
  c.loss = ml_collections.ConfigDict({"scale_by_std": False})
  # start_solve_rate=2: replay stays off unless a test turns it on; store_before_start: the storage rules are tested
  # on their own, before the delayed start (which, as in the released code, stores nothing unless this is set).
  c.replay = ml_collections.ConfigDict({"name": "exgrpo", "max_tokens": 0, "rho": 0.5, "bucket_sigma": 1.0,
                                        "bucket_scale": "count", "start_solve_rate": 2.0, "store_before_start": True})
  c.replay.update(overrides)
  return c


def fresh_from(qids):
  it = iter(qids)
  return lambda n: [next(it) for _ in range(n)]


def rollouts(qid, rewards, step, tokens=None):
  if tokens is None:
    tokens = [[qid + 1, step + 1, j + 1] for j in range(len(rewards))]
  return [Rollout(qid, np.asarray(t, np.int32), np.full(len(t), -0.5, np.float32), float(r), step)
          for t, r in zip(tokens, rewards)]


def run_step(s, step, qids, rewards, tokens=None, entropies=None):
  """One protocol step; rewards[qid] / tokens[qid] script each question's samples (first n used; default 0s)."""
  plan = s.plan(step, fresh_from(qids))
  sampled = [Group(r.qid, rollouts(r.qid, rewards.get(r.qid, [0] * K)[:r.n_samples], step,
                                   None if tokens is None or r.qid not in tokens else tokens[r.qid][:r.n_samples]))
             for r in plan.requests]
  ent = entropies(plan) if entropies else simulate.SyntheticSampler.mean_entropies(plan)
  plan = s.select(plan, ent)
  groups = s.compose(plan, sampled)
  s.observe(plan, sampled)
  return plan, groups


def test_bucket_weights_gaussian_count_and_accuracy_scales():
  # Count scale, K=8, sigma=1: exp(-(k-4)^2/2) = 1, .6065, .1353, .0111 for |k-4| = 0..3; the sum over k=1..7 is
  # 1 + 2 (.6065 + .1353 + .0111) = 2.5059, so k=4 -> .399, 3,5 -> .242, 2,6 -> .054, 1,7 -> .0044.
  w = replay.bucket_weights(8, sigma=1.0, scale="count")
  np.testing.assert_allclose(w, [0, .00443, .05399, .24203, .39905, .24203, .05399, .00443, 0], atol=2e-5)
  # Accuracy scale, K=8, sigma=1: exp(-(k/8-.5)^2/2) = 1, .99222, .96923, .93210 for |k-4| = 0..3; the sum is
  # 1 + 2 (.99222 + .96923 + .93210) = 6.78711, so k=4 -> .14734, 3,5 -> .14619, 2,6 -> .14280, 1,7 -> .13733.
  w = replay.bucket_weights(8, sigma=1.0, scale="accuracy")
  np.testing.assert_allclose(w, [0, .13733, .14280, .14619, .14734, .14619, .14280, .13733, 0], atol=2e-5)
  with pytest.raises(ValueError, match="bucket_scale"):
    replay.bucket_weights(8, scale="percent")


def test_buffer_stores_each_new_correct_answer_for_partially_solved_questions():
  s = replay.make("exgrpo", make_test_config())
  run_step(s, 0, [10, 11, 12, 13], {10: [1, 1, 0, 0], 11: [0, 0, 0, 0], 12: [1, 0, 0, 0], 13: [1, 1, 1, 0]})
  assert [len(s.answers_of(q)) for q in (10, 11, 12, 13)] == [2, 0, 1, 3]
  np.testing.assert_array_equal(s.answers_of(10)[0], [11, 1, 1])  # tokens [qid+1, step+1, j+1] of sample 0
  assert s.num_questions == 3


def test_deduplicate_answers_by_token_ids():
  s = replay.make("exgrpo", make_test_config())
  same = [[7, 7, 7], [7, 7, 7], [8, 8], [9]]
  run_step(s, 0, [1, 2, 3, 4], {q: [1, 1, 1, 0] for q in (1, 2, 3, 4)}, tokens={1: same})
  assert len(s.answers_of(1)) == 2  # [7,7,7] twice and [8,8]: two distinct answers
  run_step(s, 1, [1, 5, 6, 7], {q: [1, 1, 0, 0] for q in (1, 5, 6, 7)}, tokens={1: [[8, 8], [6], [5], [5]]})
  assert [a.tolist() for a in s.answers_of(1)] == [[7, 7, 7], [8, 8], [6]]


def test_bucket_is_latest_correct_count():
  s = replay.make("exgrpo", make_test_config())
  run_step(s, 0, [1, 2, 3, 4], {1: [1, 0, 0, 0], 2: [1, 1, 1, 0], 3: [0] * 4, 4: [0] * 4})
  assert (s.bucket_of(1), s.bucket_of(2), s.bucket_of(3)) == (1, 3, -1)
  run_step(s, 1, [1, 5, 6, 7], {1: [1, 1, 0, 0], 5: [0] * 4, 6: [0] * 4, 7: [0] * 4})
  assert s.bucket_of(1) == 2
  assert s.metrics()["replay/bucket_2"] == 1.0 and s.metrics()["replay/bucket_1"] == 0.0


def test_zero_correct_leaves_the_entry_as_it_is():
  s = replay.make("exgrpo", make_test_config())  # never starts: all questions fresh
  run_step(s, 0, [1, 2, 3, 4], {1: [1, 1, 0, 0], 2: [0] * 4, 3: [0] * 4, 4: [0] * 4})
  before = [a.tolist() for a in s.answers_of(1)]
  run_step(s, 1, [1, 2, 3, 4], {q: [0] * 4 for q in (1, 2, 3, 4)})
  assert s.bucket_of(1) == 2 and [a.tolist() for a in s.answers_of(1)] == before


def test_retire_all_correct_from_step_zero_and_never_draw_again():
  # start_solve_rate=2 keeps replay off: retirement must apply before replay starts.
  s = replay.make("exgrpo", make_test_config())
  run_step(s, 0, [1, 2, 3, 4], {1: [1, 0, 0, 0], 2: [1, 1, 1, 1], 3: [0] * 4, 4: [0] * 4})
  assert s.is_retired(2) and s.bucket_of(2) == -1
  plan, _ = run_step(s, 1, [1, 2, 3, 4, 5], {1: [1, 1, 1, 1]})
  assert [r.qid for r in plan.requests] == [1, 3, 4, 5]  # 2 is retired: skipped, the iterator asked once more
  assert s.is_retired(1) and s.num_questions == 0 and s.store.num_rows == 0  # its stored answer is gone too
  # The iterator serves 1, 2 (retired, skipped) then 3..6: the plan asks for 3..6.
  plan = s.plan(2, fresh_from([1, 2, 3, 4, 5, 6]))
  assert [r.qid for r in plan.requests] == [3, 4, 5, 6]
  assert s.metrics()["replay/retired"] == 2.0


def test_a_data_source_whose_every_question_is_retired_is_a_clear_error():
  # Four questions, all solved 4/4 at step 0: the iterator then serves only retired ones, so no fresh question is
  # left; the error says why and what to change (main.py prints it as one line, exit code 2).
  s = replay.make("exgrpo", make_test_config())
  run_step(s, 0, [1, 2, 3, 4], {q: [1] * 4 for q in (1, 2, 3, 4)})
  cycle = iter([1, 2, 3, 4] * 10)
  with pytest.raises(replay.QuestionsExhausted, match="solved 4 of 4.*give harder or more questions"):
    s.plan(1, lambda n: [next(cycle) for _ in range(n)])


def test_n_replay_is_min_of_floor_rho_b_and_buffer_size():
  s = replay.make("exgrpo", make_test_config(batch_size=7, rho=0.5, start_solve_rate=0.0))
  run_step(s, 0, list(range(7)), {q: [1, 0, 0, 0] if q < 2 else [0] * 4 for q in range(7)})
  plan = s.plan(1, fresh_from(range(100, 200)))
  assert sum(r.kind == "replay" for r in plan.requests) == 2  # min(floor(3.5) = 3, buffer 2)
  run_step(s, 1, list(range(10, 17)), {q: [1, 0, 0, 0] for q in range(10, 17)})
  plan = s.plan(2, fresh_from(range(100, 200)))
  assert sum(r.kind == "replay" for r in plan.requests) == 3  # min(floor(3.5) = 3, buffer 9)


def test_exactly_b_minus_n_replay_fresh_questions_none_skipped():
  s = replay.make("exgrpo", make_test_config(batch_size=6, start_solve_rate=0.0))
  run_step(s, 0, list(range(6)), {0: [1, 1, 1, 1], 1: [1, 1, 1, 1], 2: [1, 0, 0, 0], 3: [1, 0, 0, 0],
                                  4: [1, 0, 0, 0], 5: [0] * 4})
  served = []
  def next_fresh(n):
    out = [[0, 7, 1, 8, 9, 10, 11][len(served) + i] for i in range(n)]
    served.extend(out)
    return out
  plan = s.plan(1, next_fresh)
  fresh = [r.qid for r in plan.requests if r.kind == "fresh"]
  assert len(fresh) == 6 - 3  # B - n_replay, n_replay = min(3, 3)
  assert fresh == [7, 8, 9] and served == [0, 7, 1, 8, 9]  # retired 0 and 1 skipped, nothing else consumed


def test_replay_question_gets_k_minus_1_samples_and_stored_answer_as_kth():
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.0))
  run_step(s, 0, [1, 2], {1: [0, 1, 0, 0], 2: [0] * 4})
  plan = s.plan(1, fresh_from([3]))
  assert [tuple(r)[:2] + (r.kind,) for r in plan.requests] == [(1, K - 1, "replay"), (3, K, "fresh")]
  sampled = [Group(1, rollouts(1, [0, 0, 1], 1)), Group(3, rollouts(3, [0] * 4, 1))]
  groups = s.compose(s.select(plan, []), sampled)
  g = groups[0]
  assert len(g.rollouts) == K and g.source == "replay" and g.rollouts[-1].replayed
  np.testing.assert_array_equal(g.rollouts[-1].tokens, [2, 1, 2])  # stored at step 0 from sample j=1
  np.testing.assert_allclose(g.rollouts[-1].logprobs, -0.5)  # the recorded behaviour log-probs
  # Advantages over the whole group of K: rewards 0, 0, 1 (new) + 1 (stored), mean .5 -> -.5, -.5, .5, .5.
  assert [r.advantage for r in g.rollouts] == [-0.5, -0.5, 0.5, 0.5]


def test_lowest_mean_entropy_answer_selected_and_only_sampled_questions_scored():
  s = replay.make("exgrpo", make_test_config(batch_size=4, start_solve_rate=0.0))
  # Buffer: question 1 with 3 answers, 2 with 1, 3 with 2 (6 answers); n_replay = min(floor(.5 x 4), 3) = 2.
  run_step(s, 0, [1, 2, 3, 4], {1: [1, 1, 1, 0], 2: [1, 0, 0, 0], 3: [1, 1, 0, 0], 4: [0] * 4})
  plan = s.plan(1, fresh_from([5, 6]))
  drawn = [r.qid for r in plan.requests if r.kind == "replay"]
  n_answers = {1: 3, 2: 1, 3: 2}
  assert [sr.qid for sr in plan.score_requests] == [q for q in drawn if n_answers[q] > 1]
  assert sum(len(sr.tokens) for sr in plan.score_requests) == sum(n_answers[q] for q in drawn if n_answers[q] > 1)
  for i, q in enumerate(drawn):
    if n_answers[q] == 1:  # a single stored answer is chosen without scoring
      np.testing.assert_array_equal(plan.stored[i].tokens, [3, 1, 1])
  # Entropies [.7, .2, .2] pick answer 1 (a tie with answer 2 goes to the older); [.5, .5] picks answer 0.
  ent = {3: np.array([0.7, 0.2, 0.2]), 2: np.array([0.5, 0.5])}
  plan = s.select(plan, [ent[len(sr.tokens)] for sr in plan.score_requests])
  for sr in plan.score_requests:
    np.testing.assert_array_equal(plan.stored[sr.request_index].tokens, sr.tokens[1 if len(sr.tokens) == 3 else 0])


def test_lowest_entropy_selection_for_every_replayed_question():
  s = replay.make("exgrpo", make_test_config(batch_size=8, rho=0.5, start_solve_rate=0.0))
  run_step(s, 0, list(range(8)), {q: [1, 1, 1, 0] for q in range(8)})  # 8 questions, 3 answers each
  plan = s.plan(1, fresh_from(range(100, 200)))
  assert len(plan.score_requests) == 4 and sum(len(x.tokens) for x in plan.score_requests) == 12
  ent = [np.array([3.0, 1.0, 2.0]) for _ in plan.score_requests]
  plan = s.select(plan, ent)
  for sr in plan.score_requests:
    np.testing.assert_array_equal(plan.stored[sr.request_index].tokens, sr.tokens[1])
  with pytest.raises(ValueError, match="finite"):
    s.select(s.plan(2, fresh_from(range(200, 300))), [np.array([np.nan, 0.0, 0.0])] * 4)


def test_compose_before_select_is_an_error():
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.0))
  run_step(s, 0, [1, 2], {1: [1, 1, 0, 0], 2: [0] * 4})
  plan = s.plan(1, fresh_from([3]))
  sampled = [Group(1, rollouts(1, [0] * 3, 1)), Group(3, rollouts(3, [0] * 4, 1))]
  with pytest.raises(ValueError, match="before select"):
    s.compose(plan, sampled)


def test_delayed_start_is_one_way_at_batch_solve_rate():
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.35))
  # Solve rate 2/8 = .25 <= .35: still on-policy (no replay question even with a non-empty buffer).
  run_step(s, 0, [1, 2], {1: [1, 1, 0, 0], 2: [0] * 4})
  assert not s.active and all(r.kind == "fresh" for r in s.plan(1, fresh_from([5, 6])).requests)
  # 3/8 = .375 > .35: replay switches on after this step.
  run_step(s, 1, [3, 4], {3: [1, 1, 1, 0], 4: [0] * 4})
  assert s.active and s.metrics()["replay/phase"] == 1.0
  # 0/8: stays on.
  run_step(s, 2, [7], {q: [0] * 4 for q in range(1, 20)})
  assert s.active
  assert replay.make("exgrpo", make_test_config(start_solve_rate=0.0)).active  # 0 starts at once


def test_nothing_is_stored_or_bucketed_before_the_delayed_start_unless_asked():
  # Released code (replay.store_before_start=False): before replay turns on no answer is stored and no bucket moves;
  # retirement still applies. The batch whose solve rate turns replay on is the first one stored.
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.35, store_before_start=False))
  run_step(s, 0, [1, 2], {1: [1, 1, 0, 0], 2: [1, 1, 1, 1]})  # 6/8 > .35: turns replay on, stored
  assert s.active and s.answers_of(1) and s.bucket_of(1) == 2 and s.is_retired(2)
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.35, store_before_start=False))
  run_step(s, 0, [1, 2], {1: [1, 0, 0, 0], 2: [0] * 4})  # 1/8 <= .35: on-policy, nothing stored
  run_step(s, 1, [3, 4], {3: [1, 1, 1, 1], 4: [0] * 4})  # 4/8 > .35, and 3 is solved 4/4
  assert not s.answers_of(1) and s.bucket_of(1) == -1 and s.is_retired(3)
  assert s.active and s.num_questions == 0 and s.metrics()["replay/stored"] == 0.0
  # store_before_start=True (this codebase's earlier behaviour): the buffer fills from step 0.
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.35, store_before_start=True))
  run_step(s, 0, [1, 2], {1: [1, 0, 0, 0], 2: [0] * 4})
  assert not s.active and len(s.answers_of(1)) == 1 and s.bucket_of(1) == 1


def test_replayed_answer_without_recorded_logprobs_is_an_error():
  s = replay.make("exgrpo", make_test_config(batch_size=2))
  plan = s.plan(0, fresh_from([1, 2]))
  sampled = [Group(1, rollouts(1, [1, 0, 0, 0], 0)), Group(2, rollouts(2, [0] * 4, 0))]
  sampled[0].rollouts[0].logprobs = None
  with pytest.raises(ValueError, match="log-probs"):
    s.compose(s.select(plan, []), sampled)
  with pytest.raises(ValueError, match="log-probs"):
    s.store.add(np.array([1, 2], np.int32), None, qid=1, step=0)


def test_question_draws_are_without_replacement():
  s = replay.make("exgrpo", make_test_config(batch_size=20, rho=0.5, start_solve_rate=0.0))
  run_step(s, 0, list(range(20)), {q: [1, 0, 0, 0] if q < 10 else [0] * 4 for q in range(20)})
  for step in range(1, 6):
    plan = s.plan(step, fresh_from(range(100, 200)))
    assert sorted(r.qid for r in plan.requests if r.kind == "replay") == list(range(10))  # all 10, once each


def test_bucket_draw_frequencies_follow_weights_chi_square():
  # K=8, 40 questions in each bucket 1..7; plans with n_replay=1 (B=2, rho=.5) draw one question each.
  s = replay.make("exgrpo", make_test_config(batch_size=2, group_size=8, start_solve_rate=2.0))
  step = 0
  for k in range(1, 8):
    for q in range(40):
      qid = 1000 * k + q
      run_step(s, step, [qid, 99999], {qid: [1] * k + [0] * (8 - k), 99999: [0] * 8})
      step += 1
  s.active = True
  counts = np.zeros(9)
  within = np.zeros(40)
  n = 4000
  for i in range(n):
    qid = s.plan(step + i, lambda m: [99999] * m).requests[0].qid
    counts[qid // 1000] += 1
    within[qid % 1000] += qid // 1000 == 4
  expected = n * replay.bucket_weights(8, sigma=1.0)
  # Buckets 1 and 7 expect 4000 x .0044 = 17.7 draws, enough for the chi-square approximation (> 5).
  assert stats.chisquare(counts[1:8], expected[1:8]).pvalue > 1e-3
  assert stats.chisquare(counts[1:8], np.full(7, n / 7)).pvalue < 1e-10  # a uniform sampler would fail
  assert stats.chisquare(within).pvalue > 1e-3  # uniform inside a bucket


def test_accuracy_scale_draws_are_nearly_uniform():
  s = replay.make("exgrpo", make_test_config(batch_size=2, group_size=8, bucket_scale="accuracy",
                                             start_solve_rate=2.0))
  for k in range(1, 8):
    run_step(s, k, [k, 99], {k: [1] * k + [0] * (8 - k), 99: [0] * 8})
  s.active = True
  counts = np.bincount([s.plan(10 + i, lambda m: [99] * m).requests[0].qid for i in range(2000)], minlength=8)
  assert stats.chisquare(counts[1:8], 2000 * replay.bucket_weights(8, scale="accuracy")[1:8]).pvalue > 1e-3


def test_memory_cap_evicts_oldest_answers_and_counts_them():
  s = replay.make("exgrpo", make_test_config(batch_size=2, max_tokens=12))
  run_step(s, 0, [1, 2], {1: [1, 1, 0, 0], 2: [1, 0, 0, 0]})  # 3 answers x 3 tokens = 9 tokens
  run_step(s, 1, [3, 4], {3: [1, 1, 0, 0], 4: [0] * 4})  # +6 = 15 > 12: the oldest (question 1's first) goes
  assert s.store.live_tokens == 12 and s.metrics()["replay/evicted"] == 1.0
  assert [a.tolist() for a in s.answers_of(1)] == [[2, 1, 2]]
  run_step(s, 2, [5, 6], {5: [1, 1, 0, 0], 6: [0] * 4})  # +6: question 1's last and question 2's answers go
  assert s.bucket_of(1) == -1 and s.bucket_of(2) == -1 and s.num_questions == 2
  assert s.metrics()["replay/evicted_total"] == 3.0 and not s.is_retired(1)


def test_stored_answers_keep_their_birth_step_for_mean_age():
  s = replay.make("exgrpo", make_test_config(batch_size=2, start_solve_rate=0.0))
  run_step(s, 0, [1, 2], {1: [1, 0, 0, 0], 2: [0] * 4})
  run_step(s, 5, [3], {1: [0, 0, 0], 3: [0] * 4})
  assert s.metrics()["replay/mean_age"] == 5.0 and s.metrics()["replay/replayed_share"] == 1 / 8
