"""The order in which fresh questions are drawn: deterministic, reshuffled each epoch, one slice per host.

Every host computes the same permutation of all qids for an epoch (from `seed` and the epoch number) and takes
its own stride of it, `perm[host_id::num_hosts]`, cut to `len(source) // num_hosts` so all hosts have the same
count (the few left over rotate through the hosts as the permutation changes). The state is (epoch, position):
two integers in the checkpoint, and a restored iterator continues with exactly the qids the original would have
drawn next.
"""
import numpy as np


class QuestionIterator:
  """Draws qids from a source, host-local, forever (epoch after epoch).

  Args:
    source: anything with `len()` (only the length is used).
    seed: the shuffling seed (the run's seed).
    shuffle: False walks qids in order (evaluation, debugging).
    host_id, num_hosts: this host's index and the host count (`jax.process_index()`, `jax.process_count()`).
  """

  def __init__(self, source, *, seed: int, shuffle: bool = True, host_id: int = 0, num_hosts: int = 1):
    if not 0 <= host_id < num_hosts:
      raise ValueError(f"QuestionIterator: host_id ({host_id}) must be in [0, num_hosts={num_hosts})")
    self.num_questions = len(source)
    self.per_host = self.num_questions // num_hosts
    if self.per_host < 1:
      raise ValueError(f"QuestionIterator: {self.num_questions} questions cannot be split over {num_hosts} hosts")
    self.seed, self.shuffle, self.host_id, self.num_hosts = seed, shuffle, host_id, num_hosts
    self.epoch = 0
    self.position = 0
    self._order = self._epoch_order(0)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """This host's qids for an epoch, in drawing order."""
    if self.shuffle:
      order = np.random.default_rng([self.seed, epoch]).permutation(self.num_questions)
    else:
      order = np.arange(self.num_questions)
    return order[self.host_id::self.num_hosts][:self.per_host]

  def next(self, n: int, *, exclude=None) -> list[int]:
    """The next n qids of this host. qids in `exclude` (e.g. ExGRPO's retired set) are passed over, not
    returned later: drawing exactly n fresh questions never skips one that could be used."""
    if n < 0:
      raise ValueError(f"QuestionIterator.next: n ({n}) must be >= 0")
    out = []
    passed_over = 0
    while len(out) < n:
      if self.position == self.per_host:
        self.epoch += 1
        self.position = 0
        self._order = self._epoch_order(self.epoch)
      qid = int(self._order[self.position])
      self.position += 1
      if exclude is not None and qid in exclude:
        passed_over += 1
        if passed_over > self.per_host:
          raise ValueError(f"QuestionIterator: every one of this host's {self.per_host} questions is excluded")
        continue
      passed_over = 0
      out.append(qid)
    return out

  def state_dict(self) -> dict[str, int]:
    return {"epoch": self.epoch, "position": self.position, "num_questions": self.num_questions,
            "num_hosts": self.num_hosts, "seed": self.seed}

  def load_state_dict(self, state: dict[str, int]) -> None:
    """Restores (epoch, position); the source size, host count and seed must be those it was saved with."""
    for key in ("num_questions", "num_hosts", "seed"):
      if key in state and int(state[key]) != getattr(self, key):
        raise ValueError(f"QuestionIterator.load_state_dict: saved {key}={int(state[key])} but this iterator has "
                         f"{key}={getattr(self, key)}; the data or the host count changed since the checkpoint")
    epoch, position = int(state["epoch"]), int(state["position"])
    if not 0 <= position <= self.per_host:
      raise ValueError(f"QuestionIterator.load_state_dict: position {position} outside [0, {self.per_host}]")
    self.epoch, self.position = epoch, position
    self._order = self._epoch_order(epoch)
