"""The verifiable math reward: 1.0 when math-verify says the completion's final answer equals the gold answer.

math-verify times itself with `signal.alarm`, which works only in a process's main thread and cannot interrupt
code running inside C (a huge integer power, a regex); some inputs (`9^{9^{9^{9^{9}}}}`, deep nesting, megabyte
strings) take seconds or never finish. So scoring runs in a pool of persistent worker processes (`math_worker.py`,
a fresh interpreter each), and the parent enforces a wall-clock deadline per item: an item that overruns is
scored 0, its worker is killed and replaced, and the batch always completes. A worker that dies (killed by the
system, out of memory) is replaced and its items are re-queued, the one it was on included: that item is scored 0
only if it kills a second worker too (then it is the item's fault). `worker_restarts` counts the replacements.

Before anything goes to a worker, a fast path settles the common case exactly: the gold answer is a plain
integer and the completion ends in its only `\\boxed{<integer>}` (see `fast_verdict` for why this gives the same
verdict as math-verify). Everything else goes to math-verify. `benchmarks/rewards.py` measures both.
"""
import collections
import dataclasses
import math
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import time
import weakref

import numpy as np

_HEADER = struct.Struct("<I")
_WORKER_MODULE = "jaxrlvr.rewards.math_worker"

# A canonical integer as math-verify prints it back: no sign on zero, no leading zeros, at most 20 digits.
_CANONICAL_INT = re.compile(r"-?(?:0|[1-9]\d{0,19})")
_BOXED_INT = re.compile(r"\\boxed\{(-?(?:0|[1-9]\d{0,19}))\}")
_END = re.compile(r"[\s.]*")  # What may follow the final answer: whitespace and full stops.
# The math environments the final box may sit in: (opening, closing, inline). Inline ones cannot span lines.
_ENVIRONMENTS = (("$", "$", True), ("\\[", "\\]", False), ("\\(", "\\)", True))


def _closed_before(text: str, opening: str, closing: str) -> bool:
  """Whether every `opening` in text is followed by a `closing` later in text (no environment left open)."""
  return text.rfind(opening) < text.rfind(closing) or opening not in text


def fast_verdict(completion: str, gold: str) -> float | None:
  """math-verify's verdict where it is cheap to know exactly, else None (math-verify must decide).

  Applies when `gold` is a canonical integer G and the completion's only `\\boxed` is `\\boxed{N}` (N a
  canonical integer) at its very end (only whitespace and full stops after), either bare or alone inside one
  `$...$`, `\\[...\\]` or `\\(...\\)` that nothing can chain to, and "I hope" does not occur. Then the
  verdict is N == G. Why (math_verify 0.9 `parse`, default extraction):
  - Patterns are tried in priority groups, and within a group from the match that ends last. Group 0 needs
    "... I hope" after its answer; it is absent. Group 50 holds the boxed patterns and the "final answer ... is X"
    anchors. The match ending last is the one around the box (nothing but whitespace and full stops follows,
    so no other environment can close after it): the box's environment (or the bare box), or a "final answer is"
    whose first environment is the box's. A chain "X and/or/, <box env>" is excluded by requiring no connector
    before the environment, and no earlier `$`, `\\[` or `\\(` is left open to swallow the box. Each of these
    candidates extracts "N", which parses to Integer(N), so groups 100-300 (the rest of the text) are never
    consulted.
  - Gold `$G$` parses to Integer(G). `verify` compares Integers exactly and the string fallbacks by equality.
  `tests/test_rewards.py` checks this against math-verify itself on a table of near misses and a fuzzed set.
  """
  if not _CANONICAL_INT.fullmatch(gold) or gold == "-0":
    return None
  if completion.count("\\boxed") != 1 or "I hope" in completion:
    return None
  box_start = completion.find("\\boxed{")
  box = _BOXED_INT.match(completion, box_start) if box_start >= 0 else None
  if box is None or box.group(1) == "-0":
    return None
  verdict = 1.0 if box.group(1) == gold else 0.0
  before, after = completion[:box_start], completion[box.end():]
  if _END.fullmatch(after):
    return verdict  # A bare box: no environment closes after it.
  for opening, closing, inline in _ENVIRONMENTS:
    strip = (lambda t: t.strip(" \t")) if inline else str.strip  # Display math may span lines.
    tail = strip(after)
    if not tail.startswith(closing) or not _END.fullmatch(tail, len(closing)):
      continue
    head = before.rstrip(" \t") if inline else before.rstrip()
    if not head.endswith(opening):
      return None
    prefix = head[:-len(opening)]
    if prefix.endswith("\\") or prefix.rstrip().endswith((",", "and", "or")):
      return None  # An escaped delimiter, or a chain "X and <box>" that extracts {X, N}.
    line = prefix[prefix.rfind("\n") + 1:]
    if opening == "$":
      if "$" in line or (prefix and prefix[-1].isdigit()):
        return None  # Another $ on the line could pair with ours; "5$" does not open an environment.
    elif not _closed_before(line if inline else prefix, opening, closing):
      return None  # An earlier opening left unclosed would take the box into its own match.
    return verdict
  return None


def strip_think(completion: str) -> str | None:
  """The text after `</think>` when the completion is `...<think>...</think>...`, else None.

  The ExGRPO reference scores only what follows the reasoning and gives 0 without the format. Exactly one
  opening and one closing tag, in that order, are required; the `r1` prompt template therefore does not
  pre-fill `<think>` (the completion has to open it).
  """
  if completion.count("<think>") != 1 or completion.count("</think>") != 1:
    return None
  open_at = completion.find("<think>")
  close_at = completion.find("</think>")
  if close_at < open_at:
    return None
  return completion[close_at + len("</think>"):]


@dataclasses.dataclass(eq=False)  # Identity, not field equality: workers are looked up in a list.
class _Worker:
  """One worker process and the parent's view of it."""
  proc: subprocess.Popen
  started: float
  ready: bool = False
  inflight: collections.deque = dataclasses.field(default_factory=collections.deque)  # item ids, in order
  head_since: float = 0.0  # when the worker began the oldest in-flight item
  outbuf: bytearray = dataclasses.field(default_factory=bytearray)
  inbuf: bytearray = dataclasses.field(default_factory=bytearray)

  @property
  def fd_in(self) -> int:
    return self.proc.stdin.fileno()

  @property
  def fd_out(self) -> int:
    return self.proc.stdout.fileno()


def _spawn_worker() -> _Worker:
  # The package root goes on PYTHONPATH so the worker finds jaxrlvr even when the parent found it through a
  # sys.path edit (a notebook); the worker's stderr is the parent's, so a broken environment is visible.
  package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
  # Its own process group: Ctrl-C in the terminal reaches the trainer, which closes the pool, and not the workers
  # (no tracebacks from them). A worker whose parent dies sees end of input and exits.
  proc = subprocess.Popen(
      [sys.executable, "-m", _WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
      bufsize=0, close_fds=True, start_new_session=True)
  os.set_blocking(proc.stdin.fileno(), False)
  os.set_blocking(proc.stdout.fileno(), False)
  return _Worker(proc=proc, started=time.monotonic())


def _stop_worker(worker: _Worker, *, kill: bool) -> None:
  try:
    if kill:
      worker.proc.kill()
    else:
      worker.proc.stdin.close()  # End of input: the worker returns from its loop.
  except OSError:
    pass
  try:
    worker.proc.wait(timeout=None if kill else 2.0)
  except subprocess.TimeoutExpired:
    worker.proc.kill()
    worker.proc.wait()
  for stream in (worker.proc.stdin, worker.proc.stdout):
    try:
      stream.close()
    except OSError:
      pass


def _stop_all(workers: list[_Worker]) -> None:
  """Closes every worker's input first (they exit in parallel), then reaps them."""
  for worker in workers:
    try:
      worker.proc.stdin.close()
    except OSError:
      pass
  for worker in workers:
    _stop_worker(worker, kill=worker.proc.poll() is None and bool(worker.inflight))


class MathRewardPool:
  """Persistent math-verify workers. Create once per run, `score` every step, `close` at the end.

  Args:
    num_workers: worker processes (one per spare core is plenty; the fast path needs none).
    timeout_s: wall-clock budget per item. An item over budget scores 0 and its worker is replaced.
    require_think: score only what follows `</think>`; 0 without the `<think>...</think>` format.
    literal_numbers: when the gold answer is a number, the answer math-verify extracts must be a number written
      out (`math_worker.is_number`: 861, -3, 2.5, 1,024); math-verify evaluates expressions, so `\\boxed{27+79-81}`
      would otherwise earn the reward for 25 by restating the question.
    max_inflight: items queued per worker ahead of its answers, to hide the pipe round trip.
    start_timeout_s: how long a new worker may take to import math-verify before it counts as broken.
    fast_path: settle plain-integer answers without math-verify (`fast_verdict`); off only to measure it.
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, *, require_think: bool = False,
               literal_numbers: bool = False, max_inflight: int = 4, start_timeout_s: float = 60.0,
               fast_path: bool = True):
    if num_workers < 1:
      raise ValueError(f"MathRewardPool: num_workers ({num_workers}) must be >= 1")
    if not timeout_s > 0:
      raise ValueError(f"MathRewardPool: timeout_s ({timeout_s}) must be > 0")
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self.require_think = require_think
    self.literal_numbers = literal_numbers
    self.max_inflight = max_inflight
    self.start_timeout_s = start_timeout_s
    self.fast_path = fast_path
    # Workers start now, so they import math-verify while the caller does other work (model compile).
    self._workers = [_spawn_worker() for _ in range(num_workers)]
    self._finalizer = weakref.finalize(self, _stop_all, self._workers)

  @classmethod
  def from_config(cls, config) -> "MathRewardPool":
    """Reads `config.reward.{num_workers, timeout_s, require_think, literal_numbers}`."""
    return cls(num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s,
               require_think=config.reward.require_think, literal_numbers=config.reward.literal_numbers)

  def wait_ready(self) -> None:
    """Blocks until every worker has imported math-verify (a trainer may call this before its first step)."""
    while not all(w.ready for w in self._workers):
      waiting = {w.fd_out: w for w in self._workers if not w.ready}
      deadline = min(w.started for w in waiting.values()) + self.start_timeout_s
      readable, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
      if not readable:
        self._fail_start(next(iter(waiting.values())), f"did not become ready within {self.start_timeout_s} s")
      for fd in readable:
        worker = waiting[fd]
        data = os.read(fd, 1 << 16)
        if not data:
          self._fail_start(worker, f"exited with code {worker.proc.poll()} before it was ready")
        worker.inbuf += data
        self._read_results(worker, np.zeros(0, np.float32), collections.Counter())

  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._workers]

  def close(self) -> None:
    self._finalizer()

  def __enter__(self) -> "MathRewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def score(self, completions: list[str], answers: list[str], *, timeout_s: float | None = None,
            require_think: bool | None = None, literal_numbers: bool | None = None
            ) -> tuple[np.ndarray, dict[str, float]]:
    """Scores each completion against its gold answer.

    Returns:
      rewards: [N] float32 of 0/1.
      info: counts of `fast_path` (settled without math-verify), `verified` (sent to math-verify), `timeouts`,
        `crashes` (items scored 0 after killing two workers), `worker_restarts` (workers replaced after a timeout or
        a death), `missing_think`, `not_literal` (scored 0 by `literal_numbers`), and `seconds` for the batch.
    """
    if not self._finalizer.alive:
      raise RuntimeError("MathRewardPool.score called after close()")
    if len(completions) != len(answers):
      raise ValueError(f"math reward: {len(completions)} completions but {len(answers)} answers")
    timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
    require_think = self.require_think if require_think is None else require_think
    literal_numbers = self.literal_numbers if literal_numbers is None else literal_numbers
    t0 = time.monotonic()
    rewards = np.zeros(len(completions), np.float32)
    info = dict(fast_path=0, verified=0, timeouts=0, crashes=0, worker_restarts=0, missing_think=0, not_literal=0)
    jobs = {}
    for i, (completion, gold) in enumerate(zip(completions, answers)):
      if not isinstance(completion, str) or not isinstance(gold, str):
        raise TypeError(f"math reward: item {i} must be (str, str), got "
                        f"({type(completion).__name__}, {type(gold).__name__})")
      if require_think:
        completion = strip_think(completion)
        if completion is None:
          info["missing_think"] += 1
          continue
      verdict = fast_verdict(completion, gold) if self.fast_path else None
      if verdict is not None:
        rewards[i] = verdict
        info["fast_path"] += 1
      else:
        jobs[i] = (completion, gold)
    info["verified"] = len(jobs)
    if jobs:
      try:
        self._run(jobs, rewards, info, timeout_s, literal_numbers)
      except BaseException:
        # Interrupted mid-batch: answers still in flight would be read as the next batch's. Start clean.
        self._replace_busy_workers()
        raise
    info["seconds"] = time.monotonic() - t0
    return rewards, info

  # The event loop: one thread, non-blocking pipes, select() with the nearest deadline as its timeout.
  def _run(self, jobs: dict, rewards: np.ndarray, info: dict, timeout_s: float, literal_numbers: bool) -> None:
    # math-verify's own alarms (whole seconds) are set past our deadline, so an overrun is always ours: killed,
    # replaced and counted, the same way whichever stage hangs.
    alarm_s = int(math.ceil(timeout_s)) + 1
    # Items sharing a gold answer (a question's K samples) go to the same worker: its caches then parse that
    # gold once and each distinct answer string once, which is most of math-verify's cost. A worker whose
    # queue runs dry takes items from the back of the longest other queue.
    by_gold = collections.defaultdict(list)
    for item, (_, gold) in jobs.items():
      by_gold[gold].append(item)
    queues = [collections.deque() for _ in self._workers]
    for items in by_gold.values():
      min(queues, key=len).extend(items)
    remaining = len(jobs)
    crashed = collections.Counter()  # item -> workers it was on when they died
    while remaining:
      now = time.monotonic()
      for slot, worker in enumerate(self._workers):  # Dispatch.
        while worker.ready and len(worker.inflight) < self.max_inflight:
          if queues[slot]:
            item = queues[slot].popleft()
          else:
            donor = max(queues, key=len)
            if not donor:
              break
            item = donor.pop()
          completion, gold = jobs[item]
          payload = pickle.dumps((item, completion, gold, alarm_s, literal_numbers), protocol=pickle.HIGHEST_PROTOCOL)
          if not worker.inflight:
            worker.head_since = now
          worker.outbuf += _HEADER.pack(len(payload)) + payload
          worker.inflight.append(item)
      wait = min(self._deadline(w, timeout_s) for w in self._workers) - now
      readers = {w.fd_out: w for w in self._workers}
      writers = {w.fd_in: w for w in self._workers if w.outbuf}
      readable, writable, _ = select.select(list(readers), list(writers), [], min(max(wait, 0.0), 1.0))
      for fd in writable:
        worker = writers[fd]
        try:
          sent = os.write(fd, worker.outbuf[:1 << 20])
          del worker.outbuf[:sent]
        except BlockingIOError:
          pass
        except (BrokenPipeError, ConnectionResetError):
          pass  # The worker died; its stdout reports EOF below or on the next select.
      for fd in readable:
        worker = readers[fd]
        if worker not in self._workers:
          continue  # Replaced earlier in this round.
        try:
          data = os.read(fd, 1 << 16)
        except BlockingIOError:
          continue
        if not data:
          remaining -= self._retire(worker, queues, rewards, info, reason="crashes", crashed=crashed)
          continue
        worker.inbuf += data
        remaining -= self._read_results(worker, rewards, info)
      now = time.monotonic()
      for worker in list(self._workers):
        if now >= self._deadline(worker, timeout_s):
          if not worker.ready:
            self._fail_start(worker, f"did not become ready within {self.start_timeout_s} s")
          remaining -= self._retire(worker, queues, rewards, info, reason="timeouts")

  def _deadline(self, worker: _Worker, timeout_s: float) -> float:
    if not worker.ready:
      return worker.started + self.start_timeout_s
    if worker.inflight:
      return worker.head_since + timeout_s
    return float("inf")

  def _read_results(self, worker: _Worker, rewards: np.ndarray, info: dict) -> int:
    done = 0
    while len(worker.inbuf) >= _HEADER.size:
      (size,) = _HEADER.unpack_from(worker.inbuf)
      if len(worker.inbuf) < _HEADER.size + size:
        break
      message = pickle.loads(bytes(worker.inbuf[_HEADER.size:_HEADER.size + size]))
      del worker.inbuf[:_HEADER.size + size]
      if message[0] == "ready":
        worker.ready = True
        continue
      item, value, not_literal = message
      expected = worker.inflight.popleft()
      if item != expected:
        raise RuntimeError(f"math reward worker {worker.proc.pid} answered item {item}, expected {expected}")
      rewards[item] = value
      info["not_literal"] += int(not_literal)
      worker.head_since = time.monotonic()
      done += 1
    return done

  def _retire(self, worker: _Worker, queues: list[collections.deque], rewards: np.ndarray, info: dict,
              *, reason: str, crashed: collections.Counter | None = None) -> int:
    """Replaces a worker whose head item overran or who died. An overrun head item scores 0; so does the head
    item of a death when it was on a worker that died before (else it is re-queued with the rest)."""
    if not worker.ready:
      code = worker.proc.poll()
      self._fail_start(worker, f"exited with code {code} before it was ready")
    _stop_worker(worker, kill=True)
    slot = self._workers.index(worker)
    self._workers[slot] = _spawn_worker()  # In place: the finalizer holds this list.
    info["worker_restarts"] += 1
    if not worker.inflight:
      return 0
    if crashed is not None:
      crashed[worker.inflight[0]] += 1
      if crashed[worker.inflight[0]] < 2:  # the system's doing, not the item's (yet): score it again
        queues[slot].extendleft(reversed(worker.inflight))
        return 0
    head = worker.inflight.popleft()
    rewards[head] = 0.0
    info[reason] += 1
    queues[slot].extendleft(reversed(worker.inflight))
    return 1

  def _fail_start(self, worker: _Worker, what: str) -> None:
    """Raises for a worker that never became ready; its slot gets a fresh worker so the pool stays usable."""
    _stop_worker(worker, kill=True)
    if worker in self._workers:
      self._workers[self._workers.index(worker)] = _spawn_worker()
    raise RuntimeError(
        f"math-verify worker `{sys.executable} -m {_WORKER_MODULE}` {what}; run that command to see why "
        "(math-verify must be importable in this interpreter)")

  def _replace_busy_workers(self) -> None:
    for i, worker in enumerate(self._workers):
      if worker.inflight or worker.outbuf or worker.inbuf:
        _stop_worker(worker, kill=True)
        self._workers[i] = _spawn_worker()


_DEFAULT_POOL: MathRewardPool | None = None


def default_pool() -> MathRewardPool:
  """The pool `math_reward` uses: created at first use with up to 2 workers, closed at interpreter exit."""
  global _DEFAULT_POOL
  if _DEFAULT_POOL is None or not _DEFAULT_POOL._finalizer.alive:  # pylint: disable=protected-access
    _DEFAULT_POOL = MathRewardPool(num_workers=max(1, min(2, os.cpu_count() or 1)))
  return _DEFAULT_POOL


def math_reward(completions: list[str], answers: list[str], *, timeout_s: float = 5.0,
                require_think: bool = False, literal_numbers: bool = False) -> np.ndarray:
  """[N] float32 of 0/1: does each completion's final answer equal its gold answer (public API)?

  Gold is parsed as "$" + answer + "$", the completion with math-verify's default extraction. Uses the module's
  default pool; a trainer that wants the timeout and crash counts keeps its own `MathRewardPool`.
  """
  pool = default_pool()
  rewards, _ = pool.score(completions, answers, timeout_s=timeout_s, require_think=require_think,
                          literal_numbers=literal_numbers)
  return rewards

