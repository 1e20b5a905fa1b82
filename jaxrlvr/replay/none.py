"""On-policy GRPO / Dr.GRPO: no replay. B fresh questions, K samples each, every group trained as sampled."""
from typing import Sequence

from jaxrlvr.replay import base
from jaxrlvr.replay.base import Group, Plan, Request


class NoReplay(base.Strategy):
  """The baseline behind the same interface, so the trainer has one code path for every method."""

  name = "none"

  @classmethod
  def from_config(cls, config, **overrides) -> "NoReplay":
    kw = dict(batch_size=config.rollout.batch_size, group_size=config.rollout.group_size,
              seed=base.config_get(config, "seed", 0),
              scale_by_std=base.config_get(base.config_get(config, "loss", None), "scale_by_std", False))
    kw.update(overrides)
    return cls(**kw)

  def plan(self, step: int, next_fresh: base.NextFresh) -> Plan:
    qids = [int(q) for q in next_fresh(self.batch_size)]
    if len(qids) != self.batch_size:
      raise ValueError(f"replay/none: next_fresh({self.batch_size}) returned {len(qids)} question ids")
    return Plan(step=step, requests=[Request(q, self.group_size) for q in qids])

  def compose(self, plan: Plan, sampled: Sequence[Group]) -> list:
    base.check_sampled(plan, sampled, "none.compose")
    groups = [self._advantages(Group(g.qid, list(g.rollouts), "fresh")) for g in sampled]
    plan.composed = groups
    self._step_metrics = self._batch_metrics(groups, plan.step)
    return groups

  def observe(self, plan: Plan, sampled: Sequence[Group]) -> None:
    self._require_composed(plan, sampled)
