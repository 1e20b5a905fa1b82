"""BAPO (Wan et al., ICLR 2026): batches adapted from fresh, re-rolled hard, and recent high-quality groups.

The rules (docs/design.md, "BAPO"; accuracy = correct / rollouts of a group; B = rollout.batch_size):
- Rollouts of fresh questions come from a policy delayed by v = `policy_delay` steps (Request.policy_delay).
- The batch is filled in order up to B groups:
  X1: fresh groups with 1/K <= accuracy <= (K-1)/K;
  X2: hard questions re-rolled with the CURRENT policy, taken when their new accuracy is in (c1, 1);
  X3: groups from the last `window` steps with c2 <= accuracy <= c3, drawn at random without replacement.
- Hard questions: a fresh group with accuracy <= c1 puts its question at the back of a FIFO (capacity
  `hard_capacity`, 0 = B; oldest out). Every `reroll_every` steps the first `reroll_max` questions of the FIFO are
  re-rolled. A re-rolled question whose accuracy rises above c1 leaves the FIFO (X2 when below 1); one still at or
  below c1 goes to the back, so the next re-roll reaches the others.
- X3 rows keep their stored behaviour log-probs (`replayed=True`); the loss applies truncated importance weights
  (cap 3, in the method's config). Advantages are recomputed over every final group.
- Bounds of X3: fixed [c2, c3] (released code: [1/8, 2/8], default), or with `adaptive_bounds=True` (paper: "the
  high-quality threshold shifts from easier to harder instances according to global average performance") a band
  of the same width centred at 1 - mu, mu = mean accuracy of the fresh groups of the last `window` steps, kept
  inside [1/K, (K-1)/K]. The paper gives the direction, not the formula: this one is ours, and at mu = 13/16 it
  is the released [1/8, 2/8].
- The window stores the groups of the last `window` steps with 0 < accuracy < 1 (fresh and re-rolled), so either
  bound rule can draw from it; `replay.max_tokens` > 0 evicts its oldest groups first.
"""
from typing import Sequence

import numpy as np

from jaxrlvr.replay import base
from jaxrlvr.replay.base import Group, Plan, Request
from jaxrlvr.replay.storage import RolloutStore

_TOL = 1e-9  # accuracies are multiples of 1/K; compare bounds with a little slack


class BAPO(base.Strategy):
  """X1 / X2 / X3 batch composition with a hard-question FIFO and a delayed rollout policy."""

  name = "bapo"

  def __init__(self, *, batch_size: int, group_size: int, seed: int = 0, scale_by_std: bool = False,
               max_tokens: int = 0, c1: float = 0.125, c2: float = 0.125, c3: float = 0.25,
               adaptive_bounds: bool = False, hard_capacity: int = 0, reroll_every: int = 2, reroll_max: int = 32,
               window: int = 3, policy_delay: int = 2, page_tokens: int = 1 << 22):
    super().__init__(batch_size=batch_size, group_size=group_size, seed=seed, scale_by_std=scale_by_std,
                     max_tokens=max_tokens)
    if not (0.0 <= c1 < 1.0 and 0.0 <= c2 <= c3 <= 1.0):
      raise ValueError(f"replay: BAPO needs 0 <= c1 < 1 and 0 <= c2 <= c3 <= 1, got c1={c1}, c2={c2}, c3={c3}")
    for key, value in (("hard_capacity", hard_capacity), ("reroll_every", reroll_every),
                       ("reroll_max", reroll_max), ("window", window), ("policy_delay", policy_delay)):
      if value < 0:
        raise ValueError(f"replay.{key} must be >= 0, got {value}")
    self.c1, self.c2, self.c3 = float(c1), float(c2), float(c3)
    self.adaptive_bounds = bool(adaptive_bounds)
    self.hard_capacity = int(hard_capacity) or self.batch_size
    self.reroll_every, self.reroll_max = int(reroll_every), int(reroll_max)
    self.window, self.policy_delay = int(window), int(policy_delay)
    self.store = RolloutStore(page_tokens=page_tokens)
    self._fifo: list = []  # hard question ids, front = oldest
    self._groups: dict = {}  # group id -> [qid, step, correct, n, rows], in insertion (= step) order
    self._next_gid = 0
    self._acc_hist: list = []  # [step, sum of fresh accuracies, fresh groups] of recent steps
    self._totals = {"evicted_groups": 0, "evicted_tokens": 0}

  @classmethod
  def from_config(cls, config, **overrides) -> "BAPO":
    r = config.replay
    g = lambda k, d: base.config_get(r, k, d)
    kw = dict(batch_size=config.rollout.batch_size, group_size=config.rollout.group_size,
              seed=base.config_get(config, "seed", 0),
              scale_by_std=base.config_get(base.config_get(config, "loss", None), "scale_by_std", False),
              max_tokens=g("max_tokens", 0), c1=g("c1", 0.125), c2=g("c2", 0.125), c3=g("c3", 0.25),
              adaptive_bounds=g("adaptive_bounds", False), hard_capacity=g("hard_capacity", 0),
              reroll_every=g("reroll_every", 2), reroll_max=g("reroll_max", 32), window=g("window", 3),
              policy_delay=g("policy_delay", 2))
    kw.update(overrides)
    return cls(**kw)

  # --- plan --------------------------------------------------------------------------------------------------------
  def plan(self, step: int, next_fresh: base.NextFresh) -> Plan:
    """B fresh questions from the delayed policy; on re-roll steps, the FIFO's first questions from the current."""
    qids = [int(q) for q in next_fresh(self.batch_size)]
    if len(qids) != self.batch_size:
      raise ValueError(f"replay/bapo: next_fresh({self.batch_size}) returned {len(qids)} question ids")
    requests = [Request(q, self.group_size, self.policy_delay, "fresh") for q in qids]
    if self.reroll_every > 0 and step % self.reroll_every == 0:
      requests += [Request(q, self.group_size, 0, "reroll") for q in self._fifo[:self.reroll_max]]
    return Plan(step=step, requests=requests, policy_delay=self.policy_delay)

  def bounds(self) -> tuple:
    """The X3 accuracy band [lo, hi] in force now (fixed, or adaptive; see the module docstring)."""
    n = sum(h[2] for h in self._acc_hist)
    if not self.adaptive_bounds or n == 0:
      return self.c2, self.c3
    mu = sum(h[1] for h in self._acc_hist) / n
    K, width = self.group_size, self.c3 - self.c2
    lo, hi = 1.0 - mu - width / 2, 1.0 - mu + width / 2
    if lo < 1 / K:
      lo, hi = 1 / K, hi + (1 / K - lo)
    if hi > (K - 1) / K:
      lo, hi = max(1 / K, lo - (hi - (K - 1) / K)), (K - 1) / K
    return lo, hi

  # --- compose -----------------------------------------------------------------------------------------------------
  def compose(self, plan: Plan, sampled: Sequence[Group]) -> list:
    base.check_sampled(plan, sampled, "bapo.compose")
    step = plan.step
    self._forget_before(step - self.window)
    x1, x2 = [], []
    for req, g in zip(plan.requests, sampled):
      k, n = base.num_correct(g), len(g.rollouts)
      if req.kind == "fresh" and 1 <= k <= n - 1:
        x1.append(Group(g.qid, list(g.rollouts), "fresh"))
      elif req.kind == "reroll" and self.c1 + _TOL < k / n < 1.0:
        x2.append(Group(g.qid, list(g.rollouts), "reroll"))
    batch = x1[:self.batch_size]
    batch += x2[:self.batch_size - len(batch)]
    lo, hi = self.bounds()
    candidates = [gid for gid, (_, _, k, n, _) in self._groups.items() if lo - _TOL <= k / n <= hi + _TOL]
    room = min(self.batch_size - len(batch), len(candidates))
    x3 = []
    if room > 0:
      for i in self.rng.choice(len(candidates), size=room, replace=False):
        qid, _, _, _, rows = self._groups[candidates[int(i)]]
        x3.append(Group(qid, [self.store.rollout(r) for r in rows], "stored"))
    groups = [self._advantages(g) for g in batch + x3]
    plan.composed = groups
    m = self._batch_metrics(groups, step)
    m.update({"replay/x1_groups": float(sum(g.source == "fresh" for g in batch)),
              "replay/x2_groups": float(sum(g.source == "reroll" for g in batch)), "replay/x3_groups": float(len(x3)),
              "replay/x3_candidates": float(len(candidates)), "replay/x3_lo": lo, "replay/x3_hi": hi,
              "replay/rerolled": float(sum(r.kind == "reroll" for r in plan.requests)),
              "replay/policy_delay": float(plan.policy_delay)})
    self._step_metrics = m
    return groups

  # --- observe -----------------------------------------------------------------------------------------------------
  def observe(self, plan: Plan, sampled: Sequence[Group]) -> None:
    """Update the hard FIFO, record fresh accuracies, keep this step's informative groups for X3."""
    self._require_composed(plan, sampled)
    acc_sum, n_fresh, keep = 0.0, 0, []
    for req, g in zip(plan.requests, sampled):
      k, n = base.num_correct(g), len(g.rollouts)
      acc = k / n
      if req.kind == "fresh":
        acc_sum, n_fresh = acc_sum + acc, n_fresh + 1
        if acc <= self.c1 + _TOL:
          self._to_back(g.qid)
      elif acc <= self.c1 + _TOL:
        self._to_back(g.qid)  # still hard: back of the queue, so the next re-roll reaches the others
      elif g.qid in self._fifo:
        self._fifo.remove(g.qid)
      if 1 <= k <= n - 1:
        keep.append((g, k, n))
    new = [(gid, g, r) for gid, (g, _, _) in enumerate(keep, start=self._next_gid) for r in g.rollouts]
    rows = self.store.add_many([r.tokens for _, _, r in new], [r.logprobs for _, _, r in new],
                               qid=[g.qid for _, g, _ in new], step=[r.step for _, _, r in new],
                               reward=[r.reward for _, _, r in new], finished=[r.finished for _, _, r in new],
                               group=[gid for gid, _, _ in new])
    start = 0
    for g, k, n in keep:
      self._groups[self._next_gid] = [g.qid, plan.step, k, n, [int(r) for r in rows[start:start + n]]]
      self._next_gid += 1
      start += n
    del self._fifo[:max(0, len(self._fifo) - self.hard_capacity)]
    self._acc_hist.append([plan.step, acc_sum, n_fresh])
    self._forget_before(plan.step + 1 - self.window)  # keep what the next step's window holds
    evicted = self._evict_tokens()
    self._step_metrics.update({"replay/evicted": float(evicted)})

  def _to_back(self, qid: int) -> None:
    if qid in self._fifo:
      self._fifo.remove(qid)
    self._fifo.append(qid)

  def _drop_group(self, gid: int) -> None:
    for row in self._groups.pop(gid)[4]:
      self.store.delete(row)

  def _forget_before(self, first_step: int) -> None:
    """Drop groups and accuracy records born before `first_step`: X3 draws from the last `window` steps only."""
    while self._groups:
      gid = next(iter(self._groups))
      if self._groups[gid][1] >= first_step:
        break
      self._drop_group(gid)
    self._acc_hist = [h for h in self._acc_hist if h[0] >= first_step]

  def _evict_tokens(self) -> int:
    n = 0
    while self.max_tokens and self.store.live_tokens > self.max_tokens and self._groups:
      gid = next(iter(self._groups))
      self._totals["evicted_tokens"] += sum(int(self.store.get("length", r)) for r in self._groups[gid][4])
      self._drop_group(gid)
      n += 1
    self._totals["evicted_groups"] += n
    return n

  # --- introspection, metrics, state ---------------------------------------------------------------------------------
  @property
  def hard_questions(self) -> list:
    return list(self._fifo)

  def metrics(self) -> dict:
    m = dict(self._step_metrics)
    m.update(self._store_metrics(self.store))
    m.update({
        "replay/hard_fifo": float(len(self._fifo)),
        "replay/buffer_groups": float(len(self._groups)),
        "replay/buffer_questions": float(len({v[0] for v in self._groups.values()})),
        "replay/evicted_total": float(self._totals["evicted_groups"]),
    })
    return m

  def _state_dict(self) -> dict:
    d = super()._state_dict()
    d.update(self.store.state_dict("bapo/store/"))
    gids = list(self._groups)
    d.update({
        "bapo/fifo": np.asarray(self._fifo, np.int64),
        "bapo/group_ids": np.asarray(gids, np.int64),
        "bapo/group_meta": np.asarray([self._groups[i][:4] for i in gids], np.int64).reshape(-1, 4),
        "bapo/group_rows": np.asarray([r for i in gids for r in self._groups[i][4]], np.int64),
        "bapo/acc_hist": np.asarray(self._acc_hist, np.float64).reshape(-1, 3),
        "bapo/scalars": np.asarray([self._next_gid, self._totals["evicted_groups"], self._totals["evicted_tokens"]],
                                   np.int64),
    })
    return d

  def _load_state_dict(self, d: dict) -> None:
    super()._load_state_dict(d)
    self.store.load_state_dict(d, "bapo/store/")
    self._fifo = [int(q) for q in np.asarray(d["bapo/fifo"], np.int64)]
    meta = np.asarray(d["bapo/group_meta"], np.int64).reshape(-1, 4)
    rows = [int(r) for r in np.asarray(d["bapo/group_rows"], np.int64)]
    self._groups, start = {}, 0
    for gid, (qid, step, k, n) in zip(np.asarray(d["bapo/group_ids"], np.int64), meta):
      self._groups[int(gid)] = [int(qid), int(step), int(k), int(n), rows[start:start + int(n)]]
      start += int(n)
    self._acc_hist = [[int(s), float(a), int(c)] for s, a, c in np.asarray(d["bapo/acc_hist"]).reshape(-1, 3)]
    self._next_gid, ev_groups, ev_tokens = (int(x) for x in np.asarray(d["bapo/scalars"]))
    self._totals = {"evicted_groups": ev_groups, "evicted_tokens": ev_tokens}
