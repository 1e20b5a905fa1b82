"""Compact host storage for replayed rollouts: token ids and behaviour log-probs in flat paged arrays.

Why this shape. The released ExGRPO code keeps decoded text plus float32 log-probs in Python objects, about
8.8 KB per trajectory at 7B scale; a run stores ~200k trajectories of ~1k tokens. Here a stored rollout is a
*row*: a slice (page, offset, length) of two flat arrays plus a few scalars in per-row numpy arrays. Nothing is
a Python object per token, and nothing per row except the owner's own index (a list of row ids per question).

- Token ids: int32, 4 bytes (vocabularies up to 2^31).
- Log-probs: float16, 2 bytes. Log-probs live in (-inf, 0]; float16 keeps 11 significant bits, so a value x is
  stored with absolute error <= |x| * 2^-11: 5e-4 at x = -1, 5e-3 at x = -10. The replay ratio exp(logp - old)
  inherits that error as a relative error: <= 0.05% for tokens the policy gave probability >= 0.37, <= 0.5% for
  tokens at probability 4.5e-5. bfloat16 (8 bits) would be 8x worse for the same bytes, so float16 it is.
  Values below -65504 (float16's range) are stored as -65504; NaN is refused.
- Pages: appends fill the current page; a row never spans pages. The first page holds 16k tokens and each new
  page doubles the capacity, up to `page_tokens` (4M by default, 24 MB) a page.
  Deleting a row marks its tokens dead; an emptied page is recycled. When an append finds no room, the page with
  the most dead tokens is compacted in place (its live rows move left and get new offsets) if they are >= 1/8 of
  it, before any new page is allocated; the page holding the oldest row is left alone, since oldest-first
  eviction will empty it. Allocated bytes therefore stay within ~8/7 of the live bytes plus a partly filled and a
  draining page, i.e. ~6-7 bytes per stored token at scale, all included.
- Row ids are stable while a row lives and reused after deletion (last freed, first reused), so owners keep row
  ids in their own indexes, and a restored store hands out exactly the ids the original would have.
- Insertion order is kept in a queue so the oldest live row is found in O(1) amortised time (eviction rules).
"""
from typing import Optional, Sequence

import numpy as np

from jaxrlvr.replay.base import Rollout

LOGPROB_MIN = -65504.0  # the most negative finite float16
MIN_PAGE_TOKENS = 1 << 14  # the first page; later ones double the capacity up to `page_tokens`

# Per-row metadata: name -> dtype. `group` is the owner's group id (BAPO); -1 when unused.
_META = {
    "qid": np.int64, "step": np.int32, "reward": np.float32, "advantage": np.float32, "group_std": np.float32,
    "order": np.int64, "group": np.int64, "page": np.int32, "offset": np.int32,
    "length": np.int32, "finished": np.bool_, "alive": np.bool_,
}
_SAVED_META = ("qid", "step", "reward", "advantage", "group_std", "order", "group", "finished")


class RolloutStore:
  """Rows of (token ids, float16 log-probs, metadata) in paged flat arrays; see the module docstring."""

  def __init__(self, *, page_tokens: int = 1 << 22):
    if page_tokens < 1:
      raise ValueError(f"replay/storage: page_tokens must be >= 1, got {page_tokens}")
    self.page_tokens = int(page_tokens)
    self._reset(slots=0)

  def _reset(self, slots: int) -> None:
    self._tok: list = []  # per page: int32 [cap]
    self._lp: list = []  # per page: float16 [cap]
    self._fill: list = []  # per page: tokens written (live + dead)
    self._dead: list = []  # per page: dead tokens
    self._cur = -1
    cap = max(16, slots)
    self._meta = {k: np.zeros(cap, dt) for k, dt in _META.items()}
    self._n_slots = slots  # row ids in use or freed: [0, n_slots)
    self._free: list = []  # freed row ids, reused last-in first-out
    self._next_order = 0
    self.num_rows = 0
    self.live_tokens = 0
    self._q_rows = np.zeros(16, np.int64)  # insertion-order queue of (row, order); stale entries skipped lazily
    self._q_ord = np.zeros(16, np.int64)
    self._q_head = 0
    self._q_tail = 0

  # --- rows ------------------------------------------------------------------------------------------------------
  def add(self, tokens: np.ndarray, logprobs: np.ndarray, *, qid: int, step: int, reward: float = 0.0,
          advantage: float = 0.0, group_std: float = 0.0, finished: bool = True, group: int = -1) -> int:
    """Store one rollout; returns its row id. See `add_many`."""
    return int(self.add_many([tokens], [logprobs], qid=[qid], step=[step], reward=[reward], advantage=[advantage],
                             group_std=[group_std], finished=[finished], group=[group])[0])

  def add_many(self, tokens: Sequence[np.ndarray], logprobs: Sequence[Optional[np.ndarray]], *, qid, step,
               reward, advantage=None, group_std=None, finished=None, group=None) -> np.ndarray:
    """Store n rollouts in one pass (one cast and one copy per page touched); returns their row ids [n].

    Metadata arguments are sequences of length n (`advantage`, `group_std` default to 0, `finished` to True,
    `group` to -1). The behaviour log-probs are required: a replayed row without them is an error.
    """
    n = len(tokens)
    for i, lp in enumerate(logprobs):
      if lp is None or len(lp) != len(tokens[i]) or np.ndim(tokens[i]) != 1:
        got = None if lp is None else np.shape(lp)
        raise ValueError(f"replay/storage: qid {qid[i]} (step {step[i]}) has tokens {np.shape(tokens[i])} and "
                         f"behaviour log-probs {got}; they must be recorded when the rollout is sampled (a "
                         "replayed ratio without them would silently be 1), 1-D and of the same length")
    if n == 0:
      return np.zeros(0, np.int64)
    lengths = np.fromiter((len(t) for t in tokens), np.int64, n)  # [n]
    tok = np.concatenate(tokens).astype(np.int32, copy=False)  # [sum(lengths)]
    lp = np.concatenate(logprobs).astype(np.float32, copy=False)
    if np.isnan(lp).any():
      bad = int(np.searchsorted(np.cumsum(lengths), int(np.flatnonzero(np.isnan(lp))[0]), side="right"))
      raise ValueError(f"replay/storage: qid {qid[bad]} (step {step[bad]}) has NaN behaviour log-probs")
    with np.errstate(over="ignore"):
      lp16 = lp.astype(np.float16)
    lp16[lp16 == -np.inf] = LOGPROB_MIN  # below float16's range
    rows = np.fromiter((self._new_row() for _ in range(n)), np.int64, n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    pages, offsets = np.zeros(n, np.int32), np.zeros(n, np.int32)
    i = 0
    while i < n:  # rows i..j-1 go to one page, back to back
      page = self._place(int(lengths[i]))
      off = self._fill[page]
      room = len(self._tok[page]) - off
      j = max(i + 1, int(np.searchsorted(ends, starts[i] + room, side="right")))
      a, b = int(starts[i]), int(ends[j - 1])
      self._tok[page][off:off + b - a] = tok[a:b]
      self._lp[page][off:off + b - a] = lp16[a:b]
      pages[i:j], offsets[i:j] = page, off + starts[i:j] - a
      self._fill[page] = off + b - a
      i = j
    m = self._meta
    m["qid"][rows], m["step"][rows], m["reward"][rows] = qid, step, reward
    m["advantage"][rows] = 0.0 if advantage is None else advantage
    m["group_std"][rows] = 0.0 if group_std is None else group_std
    m["finished"][rows] = True if finished is None else finished
    m["group"][rows] = -1 if group is None else group
    m["page"][rows], m["offset"][rows], m["length"][rows] = pages, offsets, lengths
    orders = np.arange(self._next_order, self._next_order + n, dtype=np.int64)
    m["order"][rows] = orders
    m["alive"][rows] = True
    self._push_queue(rows, orders)
    self._next_order += n
    self.num_rows += n
    self.live_tokens += int(ends[-1])
    return rows

  def delete(self, row: int) -> None:
    m = self._meta
    if not (0 <= row < self._n_slots) or not m["alive"][row]:
      raise KeyError(f"replay/storage: row {row} is not stored")
    m["alive"][row] = False
    length, page = int(m["length"][row]), int(m["page"][row])
    self._dead[page] += length
    self._free.append(row)
    self.num_rows -= 1
    self.live_tokens -= length
    if self._dead[page] == self._fill[page]:
      self._recycle(page)

  def alive(self, row: int) -> bool:
    return 0 <= row < self._n_slots and bool(self._meta["alive"][row])

  def get(self, name: str, rows) -> np.ndarray:
    """Metadata `name` (see _META) of `rows` (an int or an int array)."""
    return self._meta[name][rows]

  def rows(self) -> np.ndarray:
    """Live row ids, ascending."""
    return np.flatnonzero(self._meta["alive"][:self._n_slots])

  def tokens(self, row: int) -> np.ndarray:
    p, o, n = self._where(row)
    return self._tok[p][o:o + n].copy()

  def tokens_many(self, rows) -> list:
    """Copies of the token ids of `rows` (one fancy-index per field instead of one lookup per row)."""
    rows = np.asarray(rows, np.int64)
    m = self._meta
    if not m["alive"][rows].all():
      raise KeyError(f"replay/storage: rows {rows[~m['alive'][rows]].tolist()} are not stored")
    return [self._tok[p][o:o + n].copy() for p, o, n in zip(m["page"][rows].tolist(), m["offset"][rows].tolist(),
                                                            m["length"][rows].tolist())]

  def logprobs(self, row: int) -> np.ndarray:
    p, o, n = self._where(row)
    return self._lp[p][o:o + n].astype(np.float32)

  def rollout(self, row: int, *, advantage: Optional[float] = None) -> Rollout:
    """Row `row` as a replayed Rollout: its recorded behaviour log-probs and birth step."""
    m = self._meta
    return Rollout(qid=int(m["qid"][row]), tokens=self.tokens(row), logprobs=self.logprobs(row),
                   reward=float(m["reward"][row]), step=int(m["step"][row]), replayed=True, advantage=advantage,
                   finished=bool(m["finished"][row]))

  def oldest(self) -> int:
    """The live row inserted first, or -1 when empty."""
    m = self._meta
    while self._q_head < self._q_tail:
      row, order = int(self._q_rows[self._q_head]), int(self._q_ord[self._q_head])
      if m["alive"][row] and m["order"][row] == order:
        return row
      self._q_head += 1
    return -1

  def nbytes(self) -> int:
    """Bytes held: pages, per-row arrays, the order queue and the free list (8 bytes a slot, as a list of ints)."""
    pages = sum(t.nbytes + l.nbytes for t, l in zip(self._tok, self._lp))
    meta = sum(a.nbytes for a in self._meta.values())
    return pages + meta + self._q_rows.nbytes + self._q_ord.nbytes + 8 * len(self._free)

  def live_nbytes(self) -> int:
    """Bytes of the live rows alone (6 a token + the per-row fields): a figure that does not depend on page
    layout, so a restored run reports the same value (metrics must match an uninterrupted run)."""
    return 6 * self.live_tokens + self.num_rows * sum(np.dtype(dt).itemsize for dt in _META.values())

  def capacity_tokens(self) -> int:
    return sum(len(t) for t in self._tok)

  # --- internals ---------------------------------------------------------------------------------------------------
  def _where(self, row: int):
    m = self._meta
    if not self.alive(row):
      raise KeyError(f"replay/storage: row {row} is not stored")
    return int(m["page"][row]), int(m["offset"][row]), int(m["length"][row])

  def _new_row(self) -> int:
    if self._free:
      return self._free.pop()
    row = self._n_slots
    if row == len(self._meta["alive"]):
      for k, a in self._meta.items():
        grown = np.zeros(2 * len(a), a.dtype)
        grown[:len(a)] = a
        self._meta[k] = grown
    self._n_slots += 1
    return row

  def _place(self, length: int) -> int:
    """The page to append `length` tokens to: the current page, else the roomiest page, else a new one."""
    if self._cur >= 0 and len(self._tok[self._cur]) - self._fill[self._cur] >= length:
      return self._cur
    free = [len(t) - f for t, f in zip(self._tok, self._fill)]
    best = int(np.argmax(free)) if free else -1
    if best >= 0 and free[best] >= length:
      self._cur = best
      return best
    # Before growing, reclaim dead space: compact the page with the most dead tokens if that is >= 1/8 of it.
    # Compacting only when room is needed (not on every delete), and not the page of the oldest row (the one
    # oldest-first eviction is draining) unless it is the current page, lets drained pages empty out and be
    # recycled without being moved.
    oldest = self.oldest()
    draining = int(self._meta["page"][oldest]) if oldest >= 0 else -1
    draining = -1 if draining == self._cur else draining  # a lone page must still be compactable
    dead = [d if p != draining else -1 for p, d in enumerate(self._dead)]
    deadest = int(np.argmax(dead)) if dead else -1
    if deadest >= 0 and dead[deadest] * 8 >= len(self._tok[deadest]) and dead[deadest] >= length:
      self._compact(deadest)
      self._cur = deadest
      return deadest
    # Pages grow geometrically up to page_tokens, so a small buffer stays small and a large one has big pages.
    size = max(length, min(self.page_tokens, max(MIN_PAGE_TOKENS, self.capacity_tokens())))
    released = [p for p, t in enumerate(self._tok) if len(t) == 0]
    page = released[0] if released else len(self._tok)
    if page == len(self._tok):
      self._tok.append(None)
      self._lp.append(None)
      self._fill.append(0)
      self._dead.append(0)
    self._tok[page] = np.empty(size, np.int32)  # never read before written: no need to zero 24 MB
    self._lp[page] = np.empty(size, np.float16)
    self._fill[page] = self._dead[page] = 0
    self._cur = page
    return page

  def _recycle(self, page: int) -> None:
    """A page with no live rows: reuse it, or release its memory when another empty page is already kept."""
    self._fill[page] = self._dead[page] = 0
    others_empty = any(f == 0 and len(t) > 0 for p, (t, f) in enumerate(zip(self._tok, self._fill)) if p != page)
    if others_empty and page != self._cur:
      self._tok[page] = np.zeros(0, np.int32)
      self._lp[page] = np.zeros(0, np.float16)

  def _compact(self, page: int) -> None:
    """Move the live rows of `page` left over the dead ones (in chunks, so temporaries stay small)."""
    m = self._meta
    n = self._n_slots
    rows = np.flatnonzero(m["alive"][:n] & (m["page"][:n] == page))
    rows = rows[np.argsort(m["offset"][rows], kind="stable")]
    lengths = m["length"][rows].astype(np.int64)
    old = m["offset"][rows].astype(np.int64)
    new = np.cumsum(lengths) - lengths
    tok, lp = self._tok[page], self._lp[page]
    ends = new + lengths
    chunk = 1 << 20
    start = 0
    while start < len(rows):
      # Rows [start, stop) hold ~`chunk` tokens (at least one row); their new slots lie left of the old position
      # of every later row, so a chunk never overwrites tokens a later chunk still has to read.
      stop = max(start + 1, int(np.searchsorted(ends, new[start] + chunk, side="right")))
      ln = lengths[start:stop]
      idx = np.repeat(old[start:stop] - new[start:stop], ln) + np.arange(new[start], new[start] + ln.sum())
      a, b = int(new[start]), int(new[start] + ln.sum())
      tok[a:b] = tok[idx]
      lp[a:b] = lp[idx]
      start = stop
    m["offset"][rows] = new.astype(np.int32)
    self._fill[page] = int(lengths.sum())
    self._dead[page] = 0

  def _push_queue(self, rows: np.ndarray, orders: np.ndarray) -> None:
    """Append (row, order) pairs to the insertion-order queue, dropping stale entries when it has to grow."""
    n = len(rows)
    if self._q_tail + n > len(self._q_rows):
      live_rows, live_ords = self._q_rows[self._q_head:self._q_tail], self._q_ord[self._q_head:self._q_tail]
      keep = self._meta["alive"][live_rows] & (self._meta["order"][live_rows] == live_ords)
      live_rows, live_ords = live_rows[keep], live_ords[keep]
      cap = max(16, 2 * (len(live_rows) + n))
      self._q_rows, self._q_ord = np.zeros(cap, np.int64), np.zeros(cap, np.int64)
      self._q_rows[:len(live_rows)], self._q_ord[:len(live_rows)] = live_rows, live_ords
      self._q_head, self._q_tail = 0, len(live_rows)
    self._q_rows[self._q_tail:self._q_tail + n] = rows
    self._q_ord[self._q_tail:self._q_tail + n] = orders
    self._q_tail += n

  # --- state -------------------------------------------------------------------------------------------------------
  def state_dict(self, prefix: str = "store/") -> dict:
    """Flat dict of numpy arrays: the live rows (in row-id order), their tokens and log-prob bits, the free list."""
    rows = self.rows()
    toks = [self.tokens(r) for r in rows]
    lps = [self._lp[p][o:o + n] for p, o, n in (self._where(r) for r in rows)]
    d = {
        "rows": rows.astype(np.int64),
        "lengths": self._meta["length"][rows].astype(np.int64),
        "tokens": np.concatenate(toks) if toks else np.zeros(0, np.int32),
        "logprob_bits": np.concatenate(lps).view(np.uint16) if lps else np.zeros(0, np.uint16),
        "free": np.asarray(self._free, np.int64),
        "scalars": np.array([self._n_slots, self._next_order, self.page_tokens], np.int64),
    }
    for k in _SAVED_META:
      d[f"meta_{k}"] = self._meta[k][rows]
    return {prefix + k: v for k, v in d.items()}

  def load_state_dict(self, d: dict, prefix: str = "store/") -> None:
    g = lambda k: np.asarray(d[prefix + k])
    n_slots, next_order, page_tokens = (int(x) for x in g("scalars"))
    self.page_tokens = page_tokens
    self._reset(slots=n_slots)
    rows, lengths = g("rows").astype(np.int64), g("lengths").astype(np.int64)
    tokens, bits = g("tokens").astype(np.int32), g("logprob_bits").astype(np.uint16)
    starts = np.cumsum(lengths) - lengths
    for i, row in enumerate(rows):
      page = self._place(int(lengths[i]))
      off, n, s = self._fill[page], int(lengths[i]), int(starts[i])
      self._tok[page][off:off + n] = tokens[s:s + n]
      self._lp[page][off:off + n] = bits[s:s + n].view(np.float16)
      self._fill[page] = off + n
      self._meta["page"][row], self._meta["offset"][row], self._meta["length"][row] = page, off, n
    for k in _SAVED_META:
      self._meta[k][rows] = g(f"meta_{k}")
    self._meta["alive"][rows] = True
    self._free = [int(x) for x in g("free")]
    self._next_order = next_order
    self.num_rows = len(rows)
    self.live_tokens = int(lengths.sum())
    by_age = rows[np.argsort(self._meta["order"][rows], kind="stable")]
    self._push_queue(by_age, self._meta["order"][by_age])
