"""Rollout-level advantage-priority replay for GRPO.

The rules (docs/design.md, "Advantage-priority replay"):
- The buffer holds single rollouts (token ids, behaviour log-probs, advantage at birth, birth step), not groups.
- Zero-variance groups (all rewards equal) are dropped before training and before insertion.
- Age eviction: a rollout older than tau_max steps (age = step - birth step > tau_max) is evicted before the batch
  is composed. Capacity eviction: beyond `capacity` rollouts, the oldest go first. `replay.max_tokens` > 0 adds a
  token cap with the same oldest-first rule.
- No replay in the first `warmup_steps` steps (the buffer fills meanwhile).
- Priority: rollouts are drawn without replacement with probability proportional to (p + eps)^alpha, p = |A| at
  birth (`priority="abs_advantage"`, the paper), the group's reward std (`"group_std"`, the query-level ablation)
  or 1 (`"uniform"`). alpha = 0.5 comes from a third-party reimplementation, not the paper: it is configurable.
  Draws are successive sampling (each next pick proportional to the weights of the rollouts not yet picked),
  computed in one pass with Efraimidis-Spirakis keys u^(1/w).
- Composition: `"fresh_anchored"` (the paper's): every fresh rollout of the kept groups, plus
  round(replay_fraction x their count) replayed ones (round half up, at most the buffer size). `"pool"` (the
  ablation): the batch has as many rollouts as the kept fresh ones, drawn by priority from the buffer and this
  step's fresh rollouts together.
- Replayed rollouts keep their stored advantage (`advantage` is set, `replayed=True`); their ratio is taken
  against the stored behaviour log-probs. The loss settings (clip 0.2/0.28, dual clip 10, token-mean) live in the
  method's config, not here.
"""
import math
from typing import Sequence

import numpy as np

from jaxrlvr.replay import base
from jaxrlvr.replay.base import Group, Plan, Request
from jaxrlvr.replay.storage import RolloutStore

COMPOSITIONS = ("fresh_anchored", "pool")
PRIORITIES = ("abs_advantage", "group_std", "uniform")


def weighted_sample(rng: np.random.Generator, weights: np.ndarray, n: int) -> np.ndarray:
  """n indices without replacement, in draw order, each next draw proportional to the remaining weights.

  Efraimidis-Spirakis: key_i = log(u_i) / w_i; the n largest keys are a successive weighted sample.
  """
  w = np.asarray(weights, np.float64)
  if n > len(w) or n < 0:
    raise ValueError(f"replay/advantage_priority: cannot draw {n} of {len(w)} rollouts without replacement")
  if n == 0:
    return np.zeros(0, np.int64)
  with np.errstate(divide="ignore"):
    keys = np.log(rng.random(len(w))) / w
  top = np.argpartition(-keys, n - 1)[:n] if n < len(w) else np.arange(len(w))
  return top[np.argsort(-keys[top], kind="stable")]


class AdvantagePriority(base.Strategy):
  """Single-rollout replay with age eviction and |A| priority; see the module docstring for the rules."""

  name = "advantage_priority"

  def __init__(self, *, batch_size: int, group_size: int, seed: int = 0, scale_by_std: bool = False,
               max_tokens: int = 0, capacity: int = 30000, tau_max: int = 10, alpha: float = 0.5,
               priority_eps: float = 1e-6, warmup_steps: int = 20, replay_fraction: float = 0.5,
               composition: str = "fresh_anchored", priority: str = "abs_advantage", page_tokens: int = 1 << 22):
    super().__init__(batch_size=batch_size, group_size=group_size, seed=seed, scale_by_std=scale_by_std,
                     max_tokens=max_tokens)
    if composition not in COMPOSITIONS:
      raise ValueError(f"replay.composition must be one of {COMPOSITIONS}, got {composition!r}")
    if priority not in PRIORITIES:
      raise ValueError(f"replay.priority must be one of {PRIORITIES}, got {priority!r}")
    for key, value in (("capacity", capacity), ("tau_max", tau_max), ("warmup_steps", warmup_steps)):
      if value < 0:
        raise ValueError(f"replay.{key} must be >= 0, got {value}")
    if alpha < 0 or priority_eps < 0 or replay_fraction < 0:
      raise ValueError(f"replay.alpha ({alpha}), replay.priority_eps ({priority_eps}) and replay.replay_fraction "
                       f"({replay_fraction}) must be >= 0")
    self.capacity, self.tau_max, self.warmup_steps = int(capacity), int(tau_max), int(warmup_steps)
    self.alpha, self.priority_eps, self.replay_fraction = float(alpha), float(priority_eps), float(replay_fraction)
    self.composition, self.priority = composition, priority
    self.store = RolloutStore(page_tokens=page_tokens)
    self._totals = {"evicted_age": 0, "evicted_capacity": 0, "evicted_tokens": 0, "dropped_groups": 0}

  @classmethod
  def from_config(cls, config, **overrides) -> "AdvantagePriority":
    r = config.replay
    g = lambda k, d: base.config_get(r, k, d)
    kw = dict(batch_size=config.rollout.batch_size, group_size=config.rollout.group_size,
              seed=base.config_get(config, "seed", 0),
              scale_by_std=base.config_get(base.config_get(config, "loss", None), "scale_by_std", False),
              max_tokens=g("max_tokens", 0), capacity=g("capacity", 30000), tau_max=g("tau_max", 10),
              alpha=g("alpha", 0.5), priority_eps=g("priority_eps", 1e-6), warmup_steps=g("warmup_steps", 20),
              replay_fraction=g("replay_fraction", 0.5), composition=g("composition", "fresh_anchored"),
              priority=g("priority", "abs_advantage"))
    kw.update(overrides)
    return cls(**kw)

  def plan(self, step: int, next_fresh: base.NextFresh) -> Plan:
    qids = [int(q) for q in next_fresh(self.batch_size)]
    if len(qids) != self.batch_size:
      raise ValueError(f"replay/advantage_priority: next_fresh({self.batch_size}) returned {len(qids)} ids")
    return Plan(step=step, requests=[Request(q, self.group_size) for q in qids])

  def weights(self, signal: np.ndarray) -> np.ndarray:
    """Sampling weights (p + eps)^alpha of priority signals p (all ones for `uniform`)."""
    if self.priority == "uniform":
      return np.ones(len(signal))
    return (np.asarray(signal, np.float64) + self.priority_eps) ** self.alpha

  def _row_signal(self, rows: np.ndarray) -> np.ndarray:
    if self.priority == "group_std":
      return self.store.get("group_std", rows).astype(np.float64)
    return np.abs(self.store.get("advantage", rows).astype(np.float64))

  def compose(self, plan: Plan, sampled: Sequence[Group]) -> list:
    """Drop zero-variance groups, evict by age, then add replayed rollouts by priority (after warm-up)."""
    base.check_sampled(plan, sampled, "advantage_priority.compose")
    step = plan.step
    evicted_age = self._evict(lambda row: self.store.get("step", row) < step - self.tau_max, "evicted_age")
    fresh = [self._advantages(Group(g.qid, list(g.rollouts), "fresh")) for g in sampled]
    kept = [g for g in fresh if len({r.reward for r in g.rollouts}) > 1]
    plan.info["kept"] = kept
    n_fresh = sum(len(g.rollouts) for g in kept)
    rows = self.store.rows()
    replay_on = step >= self.warmup_steps and len(rows) > 0
    if not replay_on:
      groups = list(kept)
    elif self.composition == "fresh_anchored":
      n_replay = min(math.floor(self.replay_fraction * n_fresh + 0.5), len(rows))
      picked = rows[weighted_sample(self.rng, self.weights(self._row_signal(rows)), n_replay)]
      groups = kept + [self._replayed(int(row)) for row in picked]
    else:  # pool: one draw over the buffer and this step's fresh rollouts
      fresh_rollouts = [(g, r) for g in kept for r in g.rollouts]
      fresh_signal = [base.group_std([x.reward for x in g.rollouts]) if self.priority == "group_std"
                      else abs(r.advantage) for g, r in fresh_rollouts]
      w = np.concatenate([self.weights(self._row_signal(rows)), self.weights(np.asarray(fresh_signal))])
      groups = []
      for i in weighted_sample(self.rng, w, n_fresh):
        if i < len(rows):
          groups.append(self._replayed(int(rows[i])))
        else:
          g, r = fresh_rollouts[i - len(rows)]
          groups.append(Group(g.qid, [r], "fresh"))
    plan.composed = groups
    m = self._batch_metrics(groups, step)
    m.update({"replay/dropped_groups": float(len(fresh) - len(kept)), "replay/evicted_age": float(evicted_age),
              "replay/warmup": float(step < self.warmup_steps)})
    self._totals["dropped_groups"] += len(fresh) - len(kept)
    self._step_metrics = m
    return groups

  def _replayed(self, row: int) -> Group:
    r = self.store.rollout(row, advantage=float(self.store.get("advantage", row)))
    return Group(r.qid, [r], "replay")

  def observe(self, plan: Plan, sampled: Sequence[Group]) -> None:
    """Insert every rollout of the kept (non-zero-variance) fresh groups, then evict by capacity and tokens."""
    self._require_composed(plan, sampled)
    stds = [base.group_std([r.reward for r in g.rollouts]) for g in plan.info["kept"]]
    new = [(g, std, r) for g, std in zip(plan.info["kept"], stds) for r in g.rollouts]
    self.store.add_many([r.tokens for _, _, r in new], [r.logprobs for _, _, r in new],
                        qid=[g.qid for g, _, _ in new], step=[r.step for _, _, r in new],
                        reward=[r.reward for _, _, r in new], advantage=[r.advantage for _, _, r in new],
                        group_std=[std for _, std, _ in new], finished=[r.finished for _, _, r in new])
    over_capacity = lambda row: self.store.num_rows > self.capacity
    over_tokens = lambda row: self.max_tokens > 0 and self.store.live_tokens > self.max_tokens
    self._step_metrics["replay/evicted_capacity"] = float(self._evict(over_capacity, "evicted_capacity")
                                                          + self._evict(over_tokens, "evicted_capacity"))

  def _evict(self, should_evict, counter: str) -> int:
    """Evict oldest rows while `should_evict(oldest_row)`; returns how many."""
    n = 0
    row = self.store.oldest()
    while row >= 0 and should_evict(row):
      self._totals["evicted_tokens"] += int(self.store.get("length", row))
      self.store.delete(row)
      n += 1
      row = self.store.oldest()
    self._totals[counter] += n
    return n

  def metrics(self) -> dict:
    m = dict(self._step_metrics)
    m.update(self._store_metrics(self.store))
    rows = self.store.rows()
    m.update({
        "replay/buffer_questions": float(len(np.unique(self.store.get("qid", rows)))) if len(rows) else 0.0,
        "replay/evicted_total": float(self._totals["evicted_age"] + self._totals["evicted_capacity"]),
        "replay/dropped_groups_total": float(self._totals["dropped_groups"]),
    })
    return m

  def _state_dict(self) -> dict:
    d = super()._state_dict()
    d.update(self.store.state_dict("ap/store/"))
    d["ap/totals"] = np.asarray([self._totals[k] for k in sorted(self._totals)], np.int64)
    return d

  def _load_state_dict(self, d: dict) -> None:
    super()._load_state_dict(d)
    self.store.load_state_dict(d, "ap/store/")
    self._totals = dict(zip(sorted(self._totals), (int(x) for x in np.asarray(d["ap/totals"]))))
