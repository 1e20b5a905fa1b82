"""The replay interface shared by every strategy: registry, numpy-only import, protocol checks, state round trip."""
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from jaxrlvr import replay
from jaxrlvr.replay import Group, Rollout, simulate

STRATEGY_OVERRIDES = {
    "none": {},
    "exgrpo": {"start_solve_rate": 0.35},
    "advantage_priority": {"warmup_steps": 4, "tau_max": 5, "capacity": 200},
    "bapo": {"adaptive_bounds": True, "reroll_max": 3},
}


def make_test_config(name: str, **overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 3
  c.rollout = ml_collections.ConfigDict({"batch_size": 6, "group_size": 4})
  c.loss = ml_collections.ConfigDict({"scale_by_std": False})
  c.replay = ml_collections.ConfigDict({"name": name, "max_tokens": 0, **STRATEGY_OVERRIDES[name]})
  c.replay.update(overrides)
  return c


def test_replay_package_does_not_import_jax():
  code = ("import sys; import jaxrlvr.replay, jaxrlvr.replay.simulate; "
          "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.') or m.startswith('flax')]; "
          "assert not bad, bad")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr


def test_make_lists_strategies_and_rejects_unknown_names_and_keys():
  assert set(replay.STRATEGIES) == {"none", "exgrpo", "advantage_priority", "bapo"}
  with pytest.raises(ValueError, match="'exgrpo'"):
    replay.make("exgrp", make_test_config("exgrpo"))
  with pytest.raises(ValueError, match="rhoo"):
    replay.make("exgrpo", make_test_config("exgrpo", rhoo=0.5))
  s = replay.make("exgrpo", make_test_config("exgrpo", rho=0.25), seed=11)
  assert (s.rho, s.seed, s.batch_size, s.group_size) == (0.25, 11, 6, 4)


def test_none_strategy_is_on_policy_grpo():
  s = replay.make("none", make_test_config("none"))
  plan = s.plan(0, lambda n: list(range(n)))
  assert [tuple(r) for r in plan.requests] == [(q, 4, 0, "fresh") for q in range(6)]
  sampled = [Group(q, [Rollout(q, np.array([q, j], np.int32), np.zeros(2, np.float32), float(j == 0), 0)
                       for j in range(4)]) for q in range(6)]
  groups = s.compose(s.select(plan, []), sampled)
  s.observe(plan, sampled)
  # Rewards 1, 0, 0, 0 per group: r - mean = .75, -.25, -.25, -.25 (Dr.GRPO, no std).
  assert all([r.advantage for r in g.rollouts] == [0.75, -0.25, -0.25, -0.25] for g in groups)
  assert s.metrics()["replay/replayed_share"] == 0.0 and s.metrics()["replay/solve_rate"] == 0.25


def test_scale_by_std_gives_classic_grpo_advantages():
  c = make_test_config("none")
  c.loss.scale_by_std = True
  s = replay.make("none", c)
  plan = s.plan(0, lambda n: list(range(n)))
  sampled = [Group(q, [Rollout(q, np.array([j], np.int32), np.zeros(1, np.float32), float(j < 2), 0)
                       for j in range(4)]) for q in range(6)]
  # Rewards 1, 1, 0, 0: mean .5, sample std (ddof=1, as objectives.group_advantages) sqrt(4 x .25 / 3) = .57735
  # -> (r - .5) / (.57735 + 1e-6) = +-0.866024.
  adv = [r.advantage for r in s.compose(plan, sampled)[0].rollouts]
  np.testing.assert_allclose(adv, [0.866024, 0.866024, -0.866024, -0.866024], rtol=1e-6)


def test_sampled_groups_must_match_the_plan():
  s = replay.make("none", make_test_config("none"))
  plan = s.plan(0, lambda n: list(range(n)))
  good = [Group(q, [Rollout(q, np.array([1], np.int32), np.zeros(1, np.float32), 0.0, 0)] * 4) for q in range(6)]
  with pytest.raises(ValueError, match="5 sampled groups for 6 requests"):
    s.compose(plan, good[:5])
  with pytest.raises(ValueError, match="qid 9 with 4 rollouts; request 0 asked for qid 0"):
    s.compose(plan, [Group(9, good[0].rollouts)] + good[1:])
  with pytest.raises(ValueError, match="before compose"):
    s.observe(plan, good)


@pytest.mark.parametrize("name", sorted(STRATEGY_OVERRIDES))
def test_state_round_trip_next_20_plans_identical(name, tmp_path):
  config = make_test_config(name)
  original = replay.make(name, config)
  fresh = simulate.FreshIterator(60, seed=1)
  sampler = simulate.SyntheticSampler(60, seed=2)
  for step in range(15):
    simulate.run_step(original, sampler, fresh, step)
  path = str(tmp_path / "replay_state.npz")
  replay.save_state(path, original)
  fresh_state = fresh.state_dict()

  restored = replay.make(name, config)
  restored.load_state_dict(replay.load_state(path))
  fresh2 = simulate.FreshIterator(60, seed=1)
  fresh2.load_state_dict(fresh_state)
  replayed = 0
  for step in range(15, 35):
    plan_a, groups_a = simulate.run_step(original, sampler, fresh, step)
    plan_b, groups_b = simulate.run_step(restored, sampler, fresh2, step)
    assert simulate.describe(plan_a, groups_a) == simulate.describe(plan_b, groups_b), f"step {step}"
    assert original.metrics() == restored.metrics(), f"step {step}"
    replayed += sum(r.replayed for g in groups_a for r in g.rollouts)
  if name != "none":
    assert replayed > 0  # the comparison covered stored answers, not only fresh samples


@pytest.mark.parametrize("name", sorted(STRATEGY_OVERRIDES))
def test_metrics_are_floats_named_under_replay(name):
  s = replay.make(name, make_test_config(name))
  fresh, sampler = simulate.FreshIterator(60), simulate.SyntheticSampler(60)
  for step in range(6):
    simulate.run_step(s, sampler, fresh, step)
  m = s.metrics()
  assert m and all(k.startswith("replay/") and isinstance(v, float) for k, v in m.items())
  assert {"replay/replayed_share", "replay/mean_age", "replay/solve_rate"} <= set(m)
  if name != "none":
    assert {"replay/buffer_trajectories", "replay/buffer_questions", "replay/evicted_total"} <= set(m)


def test_state_dict_round_trips_through_orbax_also_when_empty(tmp_path):
  import orbax.checkpoint as ocp  # the trainer's checkpointer; imported here so the module stays jax-free
  checkpointer = ocp.StandardCheckpointer()
  for name in sorted(STRATEGY_OVERRIDES):
    config = make_test_config(name)
    for warm_steps in (0, 8):  # an empty buffer (zero-size arrays) and a filled one
      original = replay.make(name, config)
      fresh, sampler = simulate.FreshIterator(60, seed=1), simulate.SyntheticSampler(60, seed=2)
      for step in range(warm_steps):
        simulate.run_step(original, sampler, fresh, step)
      state = original.state_dict()
      assert all(isinstance(v, np.ndarray) and v.size > 0 for v in state.values())
      path = tmp_path / f"{name}_{warm_steps}"
      checkpointer.save(path, state)
      checkpointer.wait_until_finished()
      restored = replay.make(name, config)
      restored.load_state_dict(checkpointer.restore(path))
      fresh2 = simulate.FreshIterator(60, seed=1)
      fresh2.load_state_dict(fresh.state_dict())
      for step in range(warm_steps, warm_steps + 5):
        a = simulate.describe(*simulate.run_step(original, sampler, fresh, step))
        b = simulate.describe(*simulate.run_step(restored, sampler, fresh2, step))
        assert a == b, (name, warm_steps, step)
