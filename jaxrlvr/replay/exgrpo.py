"""ExGRPO (Zhan et al., 2025): replay of correct answers, bucketed by how often the question is solved.

The rules (docs/design.md, "ExGRPO"; where the paper and its released code differ, the switch is named):
- Buffer: for a question with 1 <= k <= K-1 correct out of its K, every new correct answer is stored (token ids,
  behaviour log-probs, birth step), deduplicated by token ids; the question's bucket becomes k. k = 0 leaves the
  entry as it is. k counts the whole final group, the replayed answer included (released code).
- Retired set: a question with K/K correct leaves the buffer for good and is never drawn fresh again, from step 0.
- Question sampling: a bucket with weight N(k; mean, sigma) over the non-empty buckets, then a question uniformly
  inside it, without replacement. `bucket_scale="count"` (released code, default: mean K/2, sigma in counts) or
  `"accuracy"` (paper text: k/K, mean 0.5, sigma in accuracy units).
- Answer selection: the stored answer with the lowest mean per-token entropy under the current policy. The plan
  asks the trainer to score only the stored answers of this step's replay questions (`plan.score_requests`); a
  question with a single stored answer needs no scoring. Ties go to the oldest answer.
- Mixed batch: n_replay = min(floor(rho * B), questions in the buffer); a replay question gets K-1 new samples and
  its stored answer as the K-th member; exactly B - n_replay fresh questions are drawn (retired ones skipped, so
  the data iterator is asked again for the shortfall and no live question is lost).
- Delayed start: on-policy until the batch solve rate (correct / all rollouts of the final batch) exceeds
  `start_solve_rate`; then replay stays on. 0 starts at once. Before the start no answer is stored and no bucket
  moves (released code; the batch whose solve rate starts replay is the first one stored); `store_before_start`
  fills the buffer from step 0 instead. Retirement applies from step 0 either way.
- A replayed answer always carries its recorded log-probs; storing a rollout without them is an error.
- Memory cap (`replay.max_tokens` > 0): after each step the oldest stored answers are evicted until the buffer
  holds at most that many tokens; a question left without answers leaves the buffer (not retired).
  `replay/evicted*` count them.
"""
import math
from typing import Sequence

import numpy as np

from jaxrlvr.replay import base
from jaxrlvr.replay.base import Group, Plan, Request, ScoreRequest
from jaxrlvr.replay.storage import RolloutStore

BUCKET_SCALES = ("count", "accuracy")


def _log_bucket_weights(K: int, sigma: float, scale: str) -> np.ndarray:
  if scale not in BUCKET_SCALES:
    raise ValueError(f"replay.bucket_scale must be one of {BUCKET_SCALES}, got {scale!r}")
  if not sigma > 0:
    raise ValueError(f"replay.bucket_sigma must be > 0, got {sigma}")
  k = np.arange(K + 1, dtype=np.float64)
  x, mean = (k, K / 2) if scale == "count" else (k / K, 0.5)
  logw = -((x - mean) ** 2) / (2 * sigma ** 2)
  logw[0] = logw[K] = -np.inf  # k = 0 keeps no answers, k = K is retired
  return logw


def bucket_weights(K: int, *, sigma: float = 1.0, scale: str = "count") -> np.ndarray:
  """Gaussian bucket weights [K+1], normalised over buckets 1..K-1, 0 for k = 0 and k = K.

  With K=8, count scale, sigma=1: k=1,7 -> .0044; 2,6 -> .054; 3,5 -> .242; 4 -> .399.
  """
  if K < 2:
    raise ValueError(f"replay: ExGRPO buckets need rollout.group_size >= 2, got {K}")
  w = np.exp(_log_bucket_weights(K, sigma, scale))
  return w / w.sum()


class ExGRPO(base.Strategy):
  """The ExGRPO buffer, question sampler and batch mixer; see the module docstring for the rules."""

  name = "exgrpo"

  def __init__(self, *, batch_size: int, group_size: int, seed: int = 0, scale_by_std: bool = False,
               max_tokens: int = 0, rho: float = 0.5, bucket_sigma: float = 1.0, bucket_scale: str = "count",
               start_solve_rate: float = 0.35, store_before_start: bool = False, page_tokens: int = 1 << 22):
    super().__init__(batch_size=batch_size, group_size=group_size, seed=seed, scale_by_std=scale_by_std,
                     max_tokens=max_tokens)
    if not 0.0 <= rho <= 1.0:
      raise ValueError(f"replay.rho must be in [0, 1], got {rho}")
    self.rho = float(rho)
    self.K = self.group_size
    if self.K < 2:
      raise ValueError(f"replay: ExGRPO needs rollout.group_size >= 2 (buckets 1..K-1), got {self.K}")
    self._log_w_list = [float(x) for x in _log_bucket_weights(self.K, float(bucket_sigma), bucket_scale)]
    self.bucket_sigma, self.bucket_scale = float(bucket_sigma), bucket_scale
    self.start_solve_rate = float(start_solve_rate)
    self.store_before_start = bool(store_before_start)
    self.store = RolloutStore(page_tokens=page_tokens)
    self._answers: dict = {}  # qid -> [row ids], oldest first
    self._bucket: dict = {}  # qid -> k, its latest correct count
    self._members = [[] for _ in range(self.K + 1)]  # bucket k -> qids (order matters for sampling)
    self._pos: dict = {}  # qid -> index in its bucket's list
    self._retired: set = set()
    self.active = self.start_solve_rate <= 0.0
    self._totals = {"evicted_rows": 0, "evicted_tokens": 0, "skipped_retired": 0, "stored": 0}

  @classmethod
  def from_config(cls, config, **overrides) -> "ExGRPO":
    r = config.replay
    kw = dict(batch_size=config.rollout.batch_size, group_size=config.rollout.group_size,
              seed=base.config_get(config, "seed", 0),
              scale_by_std=base.config_get(base.config_get(config, "loss", None), "scale_by_std", False),
              max_tokens=base.config_get(r, "max_tokens", 0), rho=base.config_get(r, "rho", 0.5),
              bucket_sigma=base.config_get(r, "bucket_sigma", 1.0),
              bucket_scale=base.config_get(r, "bucket_scale", "count"),
              start_solve_rate=base.config_get(r, "start_solve_rate", 0.35),
              store_before_start=base.config_get(r, "store_before_start", False))
    kw.update(overrides)
    return cls(**kw)

  # --- plan ------------------------------------------------------------------------------------------------------
  def plan(self, step: int, next_fresh: base.NextFresh) -> Plan:
    B, K = self.batch_size, self.K
    n_replay = min(math.floor(self.rho * B + 1e-9), len(self._answers)) if self.active else 0
    replay = self._draw_questions(n_replay)
    fresh = self._draw_fresh(B - n_replay, next_fresh)
    requests = [Request(q, K - 1, 0, "replay") for q in replay] + [Request(q, K, 0, "fresh") for q in fresh]
    plan = Plan(step=step, requests=requests, mixed_phase=self.active)
    for i, q in enumerate(replay):
      rows = list(self._answers[q])
      plan.candidates[i] = rows
      if len(rows) == 1:
        plan.stored[i] = self.store.rollout(rows[0])
      else:
        plan.score_requests.append(ScoreRequest(i, q, self.store.tokens_many(rows)))
    plan.selected = not plan.score_requests
    return plan

  def _draw_questions(self, n: int) -> list:
    """n questions: a bucket by weight over the non-empty buckets, then a question uniformly, no replacement.

    Plain Python over the K+1 buckets (numpy's per-call cost would dominate for 9 numbers); weights are taken
    relative to the heaviest non-empty bucket, so a narrow sigma never leaves every weight at 0.
    """
    remaining = [len(m) for m in self._members]
    swaps = [dict() for _ in self._members]  # sparse Fisher-Yates per bucket: the lists stay untouched
    log_w = self._log_w_list
    out = []
    for _ in range(n):
      nonempty = [k for k in range(1, self.K) if remaining[k]]
      top = max(log_w[k] for k in nonempty)
      weights = [math.exp(log_w[k] - top) for k in nonempty]
      u = self.rng.random() * sum(weights)
      k = nonempty[-1]  # float round-off at the top of the running sum lands in the last bucket
      for kk, wk in zip(nonempty, weights):
        u -= wk
        if u < 0:
          k = kk
          break
      j = int(self.rng.integers(remaining[k]))
      last = remaining[k] - 1
      pick = swaps[k].get(j, j)
      swaps[k][j] = swaps[k].get(last, last)
      remaining[k] -= 1
      out.append(self._members[k][pick])
    return out

  def _draw_fresh(self, n: int, next_fresh: base.NextFresh) -> list:
    """Exactly n fresh questions, skipping retired ones (asking the iterator again for the shortfall)."""
    out, run = [], 0
    while len(out) < n:
      want = n - len(out)
      got = [int(q) for q in next_fresh(want)]
      if not got or len(got) > want:
        raise ValueError(f"replay/exgrpo: next_fresh({want}) returned {len(got)} question ids")
      for q in got:
        if q in self._retired:
          self._totals["skipped_retired"] += 1
          run += 1
          if run > 2 * len(self._retired) + 1:
            raise base.QuestionsExhausted(
                f"replay/exgrpo: {run} consecutive fresh questions were retired (solved {self.K} of {self.K}), so "
                f"the policy seems to solve every question RL draws from ({len(self._retired)} retired): nothing is "
                "left to learn from; give harder or more questions (data.source, data.rl_train_size)")
        else:
          out.append(q)
          run = 0
    return out

  # --- select ------------------------------------------------------------------------------------------------------
  def select(self, plan: Plan, mean_entropies: Sequence[np.ndarray]) -> Plan:
    """Per replay question, the stored answer with the lowest mean per-token entropy (first on ties)."""
    if len(mean_entropies) != len(plan.score_requests):
      raise ValueError(f"replay/exgrpo: select got {len(mean_entropies)} entropy arrays for "
                       f"{len(plan.score_requests)} score requests")
    chosen = []
    for sr, ent in zip(plan.score_requests, mean_entropies):
      ent = np.asarray(ent, np.float64).reshape(-1)
      if ent.shape[0] != len(sr.tokens) or not np.isfinite(ent).all():
        raise ValueError(f"replay/exgrpo: mean entropies for qid {sr.qid} must be {len(sr.tokens)} finite floats, "
                         f"got {ent.tolist()}")
      j = int(np.argmin(ent))
      plan.stored[sr.request_index] = self.store.rollout(plan.candidates[sr.request_index][j])
      chosen.append(ent[j])
    plan.selected = True
    plan.info["selected_entropy"] = float(np.mean(chosen)) if chosen else 0.0
    return plan

  # --- compose -----------------------------------------------------------------------------------------------------
  def compose(self, plan: Plan, sampled: Sequence[Group]) -> list:
    """One group per request: fresh groups of K; replay groups of K-1 new samples + the stored answer last."""
    base.check_sampled(plan, sampled, "exgrpo.compose")
    if not plan.selected:
      raise ValueError(f"replay/exgrpo: compose before select at step {plan.step}: "
                       f"{len(plan.score_requests)} replay questions still need their answer chosen")
    groups = []
    for i, (req, g) in enumerate(zip(plan.requests, sampled)):
      rollouts, source = list(g.rollouts), "fresh"
      if req.kind == "replay":
        stored = plan.stored.get(i)
        if stored is None or stored.logprobs is None or len(stored.logprobs) != len(stored.tokens):
          raise ValueError(f"replay/exgrpo: the replayed answer of qid {req.qid} has no recorded log-probs")
        rollouts.append(stored)
        source = "replay"
      groups.append(self._advantages(Group(req.qid, rollouts, source)))
    plan.composed = groups
    m = self._batch_metrics(groups, plan.step)
    m["replay/replay_questions"] = float(sum(r.kind == "replay" for r in plan.requests))
    m["replay/scored_answers"] = float(sum(len(s.tokens) for s in plan.score_requests))
    m["replay/selected_entropy"] = plan.info.get("selected_entropy", 0.0)
    self._step_metrics = m
    return groups

  # --- observe -----------------------------------------------------------------------------------------------------
  def observe(self, plan: Plan, sampled: Sequence[Group]) -> None:
    """Store, bucket and retire from the final groups (the replayed answer counts in k), evict, switch phase."""
    self._require_composed(plan, sampled)
    solve_rate = self._step_metrics.get("replay/solve_rate", 0.0)
    starts_now = not self.active and solve_rate > self.start_solve_rate
    storing = self.active or starts_now or self.store_before_start
    pending: dict = {}  # qid -> new correct answers of this step (deduplicated), stored in one batch below
    latest_k: dict = {}  # qid -> its latest k in 1..K-1 this step
    retired_now = 0
    for g in plan.composed:
      q = g.qid
      if q in self._retired:  # the same question twice in one step, already retired by the first group
        continue
      k, n = base.num_correct(g), len(g.rollouts)
      if k == n:
        self._retire(q)
        pending.pop(q, None)
        latest_k.pop(q, None)
        retired_now += 1
      elif k > 0 and storing:
        new = pending.setdefault(q, [])
        rows = self._answers.get(q)
        stored_lengths = set(self.store.get("length", np.asarray(rows)).tolist()) if rows else set()
        for r in g.rollouts:
          if r.reward >= base.CORRECT_THRESHOLD and not r.replayed and not self._is_duplicate(
              q, r.tokens, new, stored_lengths):
            new.append(r)
        latest_k[q] = k
    answers = [(q, r) for q, rs in pending.items() for r in rs]
    rows = self.store.add_many([r.tokens for _, r in answers], [r.logprobs for _, r in answers],
                               qid=[q for q, _ in answers], step=[r.step for _, r in answers],
                               reward=[r.reward for _, r in answers], finished=[r.finished for _, r in answers])
    for (q, _), row in zip(answers, rows):
      self._answers.setdefault(q, []).append(int(row))
    for q, k in latest_k.items():
      self._set_bucket(q, k)
    self._totals["stored"] += len(answers)
    evicted_before = (self._totals["evicted_rows"], self._totals["evicted_tokens"])
    self._evict_to_cap()
    self.active = self.active or starts_now
    self._step_metrics.update({
        "replay/stored": float(len(answers)),
        "replay/retired_now": float(retired_now),
        "replay/evicted": float(self._totals["evicted_rows"] - evicted_before[0]),
        "replay/evicted_tokens": float(self._totals["evicted_tokens"] - evicted_before[1]),
    })

  def _is_duplicate(self, q: int, tokens: np.ndarray, pending: list, stored_lengths: set) -> bool:
    """Same token ids as a stored or pending answer of q (lengths first: most candidates differ there)."""
    n = len(tokens)
    if any(len(r.tokens) == n and np.array_equal(r.tokens, tokens) for r in pending):
      return True
    if n not in stored_lengths:
      return False
    rows = np.asarray(self._answers[q])
    same_length = rows[self.store.get("length", rows) == n]
    return any(np.array_equal(self.store.tokens(int(row)), tokens) for row in same_length)

  def _set_bucket(self, q: int, k: int) -> None:
    if not self._answers.get(q):
      return  # nothing stored for q, so there is no entry to bucket
    old = self._bucket.get(q)
    if old == k:
      return
    if old is not None:
      self._unbucket(q)
    self._bucket[q] = k
    self._pos[q] = len(self._members[k])
    self._members[k].append(q)

  def _unbucket(self, q: int) -> None:
    k = self._bucket.pop(q)
    members, i = self._members[k], self._pos.pop(q)
    last = members.pop()
    if last != q:
      members[i] = last
      self._pos[last] = i

  def _remove_question(self, q: int) -> None:
    for row in self._answers.pop(q, []):
      self.store.delete(row)
    if q in self._bucket:
      self._unbucket(q)

  def _retire(self, q: int) -> None:
    self._remove_question(q)
    self._retired.add(q)

  def _evict_to_cap(self) -> None:
    while self.max_tokens and self.store.live_tokens > self.max_tokens:
      row = self.store.oldest()
      q = int(self.store.get("qid", row))
      self._totals["evicted_rows"] += 1
      self._totals["evicted_tokens"] += int(self.store.get("length", row))
      self._answers[q].remove(row)
      self.store.delete(row)
      if not self._answers[q]:
        del self._answers[q]
        self._unbucket(q)

  # --- introspection, metrics, state ---------------------------------------------------------------------------------
  @property
  def num_questions(self) -> int:
    return len(self._answers)

  def bucket_of(self, q: int) -> int:
    """The bucket of question q, or -1 when it is not in the buffer."""
    return self._bucket.get(q, -1)

  def answers_of(self, q: int) -> list:
    """The stored answers of question q (token ids), oldest first."""
    return [self.store.tokens(r) for r in self._answers.get(q, [])]

  def is_retired(self, q: int) -> bool:
    return q in self._retired

  def metrics(self) -> dict:
    m = dict(self._step_metrics)
    m.update(self._store_metrics(self.store))
    m.update({
        "replay/phase": float(self.active),
        "replay/buffer_questions": float(len(self._answers)),
        "replay/retired": float(len(self._retired)),
        "replay/evicted_total": float(self._totals["evicted_rows"]),
        "replay/skipped_retired_total": float(self._totals["skipped_retired"]),
    })
    for k in range(1, self.K):
      m[f"replay/bucket_{k}"] = float(len(self._members[k]))
    return m

  def _state_dict(self) -> dict:
    d = super()._state_dict()
    d.update(self.store.state_dict("exgrpo/store/"))
    qids = list(self._answers)
    d.update({
        "exgrpo/q_ids": np.asarray(qids, np.int64),
        "exgrpo/q_counts": np.asarray([len(self._answers[q]) for q in qids], np.int64),
        "exgrpo/q_rows": np.asarray([r for q in qids for r in self._answers[q]], np.int64),
        "exgrpo/members": np.asarray([q for m in self._members for q in m], np.int64),
        "exgrpo/member_sizes": np.asarray([len(m) for m in self._members], np.int64),
        "exgrpo/retired": np.asarray(sorted(self._retired), np.int64),
        "exgrpo/active": np.asarray(self.active),
        "exgrpo/totals": np.asarray([self._totals[k] for k in sorted(self._totals)], np.int64),
    })
    return d

  def _load_state_dict(self, d: dict) -> None:
    sizes = np.asarray(d["exgrpo/member_sizes"], np.int64)
    if len(sizes) != self.K + 1:
      raise ValueError(f"replay/exgrpo: the saved state has {len(sizes) - 1} as group size, this run has {self.K}")
    super()._load_state_dict(d)
    self.store.load_state_dict(d, "exgrpo/store/")
    qids, counts = np.asarray(d["exgrpo/q_ids"], np.int64), np.asarray(d["exgrpo/q_counts"], np.int64)
    rows = [int(r) for r in np.asarray(d["exgrpo/q_rows"], np.int64)]
    starts = np.cumsum(counts) - counts
    self._answers = {int(q): rows[s:s + c] for q, s, c in zip(qids, starts, counts)}
    members = [int(q) for q in np.asarray(d["exgrpo/members"], np.int64)]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    self._members = [members[bounds[k]:bounds[k + 1]] for k in range(self.K + 1)]
    self._bucket = {q: k for k, m in enumerate(self._members) for q in m}
    self._pos = {q: i for m in self._members for i, q in enumerate(m)}
    self._retired = {int(q) for q in np.asarray(d["exgrpo/retired"], np.int64)}
    self.active = bool(np.asarray(d["exgrpo/active"]))
    self._totals = dict(zip(sorted(self._totals), (int(x) for x in np.asarray(d["exgrpo/totals"]))))
