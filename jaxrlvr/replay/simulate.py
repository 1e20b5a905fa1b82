"""A synthetic stand-in for the data iterator, the sampler and the verifier, to drive a strategy without a model.

Tests, `benchmarks/replay.py` and notebooks use it to run the replay protocol end to end on the host:

  fresh = FreshIterator(num_questions=1000, seed=0)
  sampler = SyntheticSampler(num_questions=1000, seed=0)
  for step in range(n):
    plan, groups = run_step(strategy, sampler, fresh, step)

Question q is solved with a fixed probability `solve_probs[q]`; completions are random token ids with random
behaviour log-probs. Every draw is seeded by (seed, step, request index), so two strategies that make the same
plan get the same samples: a restored strategy can be compared step by step with the one it was saved from.
"""
from typing import Optional, Sequence

import numpy as np

from jaxrlvr.replay.base import Group, Plan, Rollout, Strategy


class FreshIterator:
  """Question ids 0..n-1, a new permutation every epoch; `position` (epoch, index) is all its state."""

  def __init__(self, num_questions: int, *, seed: int = 0):
    self.num_questions, self.seed = int(num_questions), int(seed)
    self.epoch, self.index = 0, 0
    self._order = self._permutation(0)
    self.served = 0

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_questions)

  def __call__(self, n: int) -> list:
    out = []
    while len(out) < n:
      take = self._order[self.index:self.index + n - len(out)]
      out.extend(int(q) for q in take)
      self.index += len(take)
      if self.index == self.num_questions:
        self.epoch, self.index = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
    self.served += n
    return out

  def state_dict(self) -> dict:
    return {"epoch": self.epoch, "index": self.index, "served": self.served}

  def load_state_dict(self, d: dict) -> None:
    self.epoch, self.index, self.served = int(d["epoch"]), int(d["index"]), int(d["served"])
    self._order = self._permutation(self.epoch)


class SyntheticSampler:
  """Fakes sampling (tokens, behaviour log-probs), verification (0/1 rewards) and entropy scoring.

  Completion lengths are uniform in [min_len, max_len]; with `pool_tokens` > 0 the token ids are slices of one
  pre-drawn random pool (fast enough to fill a 200k-trajectory buffer in a benchmark), else fresh draws.
  """

  def __init__(self, num_questions: int, *, seed: int = 0, vocab: int = 50, min_len: int = 4, max_len: int = 12,
               solve_probs: Optional[np.ndarray] = None, pool_tokens: int = 0):
    self.seed, self.vocab, self.min_len, self.max_len = int(seed), int(vocab), int(min_len), int(max_len)
    rng = np.random.default_rng([self.seed, 1 << 20])
    self.solve_probs = (rng.uniform(0.0, 1.0, num_questions) if solve_probs is None
                        else np.asarray(solve_probs, np.float64))
    self._pool = rng.integers(1, vocab, pool_tokens, dtype=np.int32) if pool_tokens else None
    self._pool_lp = (-rng.exponential(0.5, min(pool_tokens, 1 << 20))).astype(np.float32) if pool_tokens else None

  def rollouts(self, qid: int, n: int, step: int, salt: int) -> list:
    rng = np.random.default_rng([self.seed, step, salt, qid])
    out = []
    for _ in range(n):
      length = int(rng.integers(self.min_len, self.max_len + 1))
      if self._pool is not None:
        start = int(rng.integers(0, len(self._pool) - length))
        tokens = self._pool[start:start + length]
        lp_start = start % (len(self._pool_lp) - length)
        logprobs = self._pool_lp[lp_start:lp_start + length]
      else:
        tokens = rng.integers(1, self.vocab, length, dtype=np.int32)
        logprobs = (-rng.exponential(0.5, length)).astype(np.float32)
      reward = float(rng.random() < self.solve_probs[qid])
      out.append(Rollout(qid=qid, tokens=tokens, logprobs=logprobs, reward=reward, step=step,
                         finished=bool(rng.random() < 0.9)))
    return out

  def sample(self, plan: Plan) -> list:
    """One Group per request of `plan`, in order."""
    return [Group(req.qid, self.rollouts(req.qid, req.n_samples, plan.step, i)) for i, req in
            enumerate(plan.requests)]

  @staticmethod
  def mean_entropies(plan: Plan) -> list:
    """A deterministic stand-in for the policy's mean per-token entropy of each stored answer."""
    return [np.array([(int(np.sum(t, dtype=np.int64)) * 2654435761 % 1000) / 1000.0 for t in sr.tokens])
            for sr in plan.score_requests]


def run_step(strategy: Strategy, sampler: SyntheticSampler, fresh, step: int):
  """One step of the protocol: plan, sample, score, select, compose, observe. Returns (plan, final groups)."""
  plan = strategy.plan(step, fresh)
  sampled = sampler.sample(plan)
  plan = strategy.select(plan, sampler.mean_entropies(plan))
  groups = strategy.compose(plan, sampled)
  strategy.observe(plan, sampled)
  return plan, groups


def describe(plan: Plan, groups: Sequence[Group]) -> tuple:
  """A hashable, exact summary of a step (requests, stored answers, final groups) for equality checks."""
  reqs = tuple(tuple(r) for r in plan.requests)
  stored = tuple(sorted((i, r.qid, r.step, r.tokens.tobytes(), r.logprobs.tobytes()) for i, r in plan.stored.items()))
  scored = tuple((s.request_index, s.qid, tuple(t.tobytes() for t in s.tokens)) for s in plan.score_requests)
  final = tuple((g.qid, g.source, tuple((r.qid, r.step, r.replayed, r.reward, r.advantage, r.tokens.tobytes(),
                                         np.asarray(r.logprobs, np.float32).tobytes()) for r in g.rollouts))
                for g in groups)
  return reqs, stored, scored, plan.policy_delay, final
