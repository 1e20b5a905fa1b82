"""Host-side experience replay, numpy only (this package never imports jax).

Four strategies behind one interface, chosen by `config.replay.name`:
  'none' (on-policy GRPO), 'exgrpo', 'advantage_priority', 'bapo'.

  strategy = replay.make(config.replay.name, config)
  for step in ...:
    plan = strategy.plan(step, next_fresh)           # next_fresh(n) -> n question ids from the data iterator
    sampled = [one Group per plan.requests[i], same order, rewards set; sample with Request.policy_delay]
    ent = [mean per-token entropy of each answer in s.tokens under the current policy for s in plan.score_requests]
    plan = strategy.select(plan, ent)                 # ExGRPO picks the lowest-entropy stored answer; others no-op
    groups = strategy.compose(plan, sampled)          # final groups; every Rollout.advantage is set
    strategy.observe(plan, sampled)                   # store / bucket / retire / evict / phase switch
    log(strategy.metrics())                           # {'replay/...': float}

`state_dict()` is a flat dict of non-empty numpy arrays (no pickled objects, empty arrays saved as their shape):
it round-trips through `np.savez` / `np.load` (see `save_state` / `load_state`) and through orbax's
StandardCheckpointer (tested). A strategy restored with `load_state_dict` plans exactly what the original would
have (same buffer, buckets, retired set, FIFO, phase, RNG, row ids) and reports the same metrics. The data
iterator's position is the trainer's to checkpoint. At ExGRPO's scale (200k trajectories of 1k tokens) the state
is ~1.3 GB of arrays.

Details of each method are in the module docstrings: base.py (the protocol), storage.py (memory layout and
precision), exgrpo.py, advantage_priority.py, bapo.py, none.py; simulate.py drives a strategy without a model.
"""
from typing import Any

import numpy as np

from jaxrlvr.replay import advantage_priority, bapo, exgrpo, none
from jaxrlvr.replay.base import (CORRECT_THRESHOLD, Group, Plan, QuestionsExhausted, Request, Rollout, ScoreRequest,
                                 Strategy, group_advantages_np)
from jaxrlvr.replay.exgrpo import bucket_weights
from jaxrlvr.replay.storage import RolloutStore

STRATEGIES = {
    "none": none.NoReplay,
    "exgrpo": exgrpo.ExGRPO,
    "advantage_priority": advantage_priority.AdvantagePriority,
    "bapo": bapo.BAPO,
}

# config.replay keys each strategy reads (besides `name`); a key no strategy knows is a typo and an error.
CONFIG_KEYS = {
    "none": ("max_tokens",),
    # behaviour_logprobs: read by the loop, which records the trainer's log-probs before the strategy stores them
    "exgrpo": ("max_tokens", "rho", "bucket_sigma", "bucket_scale", "start_solve_rate", "store_before_start",
               "behaviour_logprobs"),
    "advantage_priority": ("max_tokens", "capacity", "tau_max", "alpha", "priority_eps", "warmup_steps",
                           "replay_fraction", "composition", "priority"),
    "bapo": ("max_tokens", "c1", "c2", "c3", "adaptive_bounds", "hard_capacity", "reroll_every", "reroll_max",
             "window", "policy_delay"),
}


def make(name: str, config: Any, **overrides) -> Strategy:
  """The strategy `name`, configured from `config.replay.*`, `config.rollout.{batch_size,group_size}`,
  `config.seed` and `config.loss.scale_by_std`. Keyword overrides win (e.g. a per-host `seed`)."""
  if name not in STRATEGIES:
    raise ValueError(f"replay.name must be one of {sorted(STRATEGIES)}, got {name!r}")
  section = getattr(config, "replay", None)
  known = {"name"}.union(*CONFIG_KEYS.values())
  unknown = sorted(set(section.keys()) - known) if section is not None and hasattr(section, "keys") else []
  if unknown:
    raise ValueError(f"config.replay has unknown key(s) {unknown}; known keys: {sorted(known)}")
  return STRATEGIES[name].from_config(config, **overrides)


def save_state(path: str, strategy: Strategy) -> None:
  """Write `strategy.state_dict()` to an .npz file (no pickling)."""
  np.savez(path, **strategy.state_dict())


def load_state(path: str) -> dict:
  """Read a state written by `save_state`, ready for `load_state_dict`."""
  with np.load(path, allow_pickle=False) as f:
    return {k: f[k] for k in f.files}


__all__ = ["CORRECT_THRESHOLD", "CONFIG_KEYS", "Group", "Plan", "QuestionsExhausted", "Request", "Rollout",
           "STRATEGIES", "ScoreRequest", "Strategy", "bucket_weights", "group_advantages_np", "load_state",
           "make", "save_state"]
