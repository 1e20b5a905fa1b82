"""The rollout engine, host side: a queue of rows, the slots they occupy, and the loop of insert / decode / harvest.

`generate` samples like `jaxrlvr.rollout.generate` (same arguments, same `SampleOutput`, same row randomness) but
through the engine of `rollout/engine.py`:

  queue of rows (prompt, row key) in the order given
  loop:
    insert: take rows from the front of the queue into free slots; each batch shard prefills the prompts entering
      its own slots, identical ones once (GRPO's K samples of a question), in calls of U distinct prompts a shard at
      most (`prefill_rows_per_device`, else an eighth of its slots, or what the first fill needs) padded to the
      bucket of the longest prompt: two insert shapes a call at most;
    compact: once the queue is empty, the live rows move to a smaller batch as soon as they fit one of
      `compaction_sizes` (steps of 3/4 and 2/3, down to `MIN_SLOTS_PER_DEVICE` per batch shard), each shard keeping
      its own rows: the tail of a run decodes fewer rows;
    decode a chunk of up to `chunk_steps` steps; it stops early once enough slots are done for the queued rows;
    read its report: each slot's new tokens (log-probs, entropies) go to its row's outputs on the host; the rows
      that are done are harvested and their slots freed. With the queue empty the next chunk is dispatched before
      this report is read, so that the devices do not wait for the host.

Slot s lives on shard s // (S / shards). The first fill hands the slots out in order, so a question's samples share
a shard and one prefill; later ones round-robin over the shards, so the shards hold about the same number of live
rows. Nothing moves between devices: a row's prompt is prefilled on the shard of its slot.
"""
from __future__ import annotations

import collections
import functools
import itertools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlvr.rollout import bounded
from jaxrlvr.rollout import engine
from jaxrlvr.rollout.bounded import bucket_length
from jaxrlvr.rollout.decode import SampleOutput

MIN_SLOTS_PER_DEVICE = 4  # compaction stops here: below it a decode step costs about the same whatever the rows
DEFAULT_CHUNK_STEPS = 16
DECODE_WEIGHTS = ("replicated", "training")  # the parameters' layout in the decode loop (config rollout.decode_weights)


def _slot_order(num_slots: int, shards: int) -> list[int]:
  """Slots in the order they are handed out: the first free slot of every shard, then the second, ..."""
  per_shard = num_slots // shards
  return sorted(range(num_slots), key=lambda s: (s % per_shard, s // per_shard))


def _check(prompts: Sequence[Sequence[int]], vocab_size: int | None, decode_slots: int, chunk_steps: int) -> None:
  if not prompts:
    raise ValueError("rollout/scheduler.py: generate got an empty list of prompts")
  for row, prompt in enumerate(prompts):
    if len(prompt) == 0:
      raise ValueError(f"rollout/scheduler.py: prompt {row} is empty; every prompt needs at least one token")
    if vocab_size is not None and (max(prompt) >= vocab_size or min(prompt) < 0):
      raise ValueError(f"rollout/scheduler.py: prompt {row} has token ids outside [0, vocab_size={vocab_size})")
  for name, value in (("decode_slots", decode_slots), ("decode_chunk_steps", chunk_steps)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"rollout/scheduler.py: {name}={value!r} must be an integer >= 0")
  if chunk_steps < 1:
    raise ValueError(f"rollout/scheduler.py: decode_chunk_steps={chunk_steps} must be >= 1")
  if jax.process_count() > 1:
    raise ValueError("rollout/scheduler.py: the rollout engine runs in one process; with several processes set "
                     "rollout.engine='static'")


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, rng: Any,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (),
             pad_id: int = 0, mesh: jax.sharding.Mesh | None = None, decode_slots: int = 0,
             chunk_steps: int = DEFAULT_CHUNK_STEPS, prefill_rows_per_device: int = 0, prefill_chunk_tokens: int = 0,
             pad_batch_to: int = 1, row_keys: Sequence[int] | None = None, decode_weights: str = "replicated",
             stats: dict | None = None,
             on_rows_done: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None) -> SampleOutput:
  """Samples `max_new_tokens` tokens after each prompt through the engine; see `jaxrlvr.rollout.generate` for the
  arguments they share and the outputs.

  Args (the engine's own):
    decode_slots: decode slots per batch shard; 0 gives every row a slot (the rows rounded up to the batch shards
      and `pad_batch_to`, as the static sampler pads its batch). With fewer slots than rows, rows queue.
    chunk_steps: decode steps between two looks at which rows are done.
    prefill_rows_per_device: at most this many distinct prompts per batch shard in one prefill (0: the slots').
    decode_weights: "replicated" (on a mesh) copies the parameters once into `engine.decode_layout` (replicated
      over the batch axes, in the compute dtype) so that the decode loop gathers no weight; "training" decodes
      from the parameters as they are.
    row_keys: the index folded into `rng` for each row's draws (default: its index in `prompts`); a row keeps its
      samples under any order of the prompts when its key goes with it.
    stats: if given, filled with the run's counters: row_steps (every slot of every decode step run, and the first
      token of each row), useful_row_steps (the tokens sampled), decode_steps, kv_slot_steps (cache slots the
      decode attention read, summed over slots and steps; estimated at the end of each chunk), chunks,
      chunks_ahead (those dispatched before the report of the one before was read), inserts and compactions.
    on_rows_done: if given, called as rows finish, on_rows_done(rows [R], tokens [R, N], lengths [R]) (rows: their
      indices in `prompts`), each row once, while the device decodes the next chunk: reward scoring can overlap
      decoding. The rows of the last chunk come after it, before `generate` returns.
  """
  run = _start(model, prompts, max_new_tokens=max_new_tokens, rng=rng, temperature=temperature, top_p=top_p,
               top_k=top_k, eos_ids=eos_ids, pad_id=pad_id, mesh=mesh, decode_slots=decode_slots,
               chunk_steps=chunk_steps, prefill_rows_per_device=prefill_rows_per_device,
               prefill_chunk_tokens=prefill_chunk_tokens, pad_batch_to=pad_batch_to, row_keys=row_keys,
               decode_weights=decode_weights)
  run.on_rows_done = on_rows_done
  run.until_done()
  if stats is not None:
    stats.update(run.counters, useful_row_steps=int(run.lengths.sum()))
  return SampleOutput(tokens=run.tokens, logprobs=run.logprobs, entropies=run.entropies, lengths=run.lengths)


def prepare(model: nnx.Module, prompts: Sequence[Sequence[int]], **kwargs: Any) -> None:
  """Compiles, or loads from the persistent compilation cache, what `generate(model, prompts, **kwargs)` would run,
  and samples nothing: the programs of its spec and shapes, and its first fill of the slots (run once and thrown
  away). A later `generate` with prompts of the same count, bucket and distinct prompts per shard then compiles
  nothing. The trainer prepares its first rollout this way in the background while the step-0 evaluation runs."""
  run = _start(model, prompts, **kwargs)
  run.insert()
  jax.block_until_ready(run.state)


def _start(model: nnx.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, rng: Any,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (),
           pad_id: int = 0, mesh: jax.sharding.Mesh | None = None, decode_slots: int = 0,
           chunk_steps: int = DEFAULT_CHUNK_STEPS, prefill_rows_per_device: int = 0, prefill_chunk_tokens: int = 0,
           pad_batch_to: int = 1, row_keys: Sequence[int] | None = None,
           decode_weights: str = "replicated") -> _Run:
  """A `generate` call's arguments checked, its programs compiled (`_warm_up`), its empty slots: its `_Run`."""
  limits = {"max_rows_per_device": 0, "prefill_rows_per_device": prefill_rows_per_device,
            "prefill_chunk_tokens": prefill_chunk_tokens}
  bounded.check_sampling_args(max_new_tokens, temperature, top_p, top_k, limits)
  vocab = getattr(getattr(model, "config", None), "vocab_size", None)
  _check(prompts, vocab, decode_slots, chunk_steps)
  rows, n = len(prompts), int(max_new_tokens)
  keys = np.arange(rows, dtype=np.int32) if row_keys is None else np.asarray(row_keys, np.int32)
  if keys.shape != (rows,):
    raise ValueError(f"rollout/scheduler.py: row_keys has {keys.size} entries for {rows} prompts")
  shards = bounded.batch_shards(mesh)
  multiple = int(np.lcm(int(pad_batch_to), shards))
  padded_rows = -(-rows // multiple) * multiple
  num_slots = padded_rows if decode_slots == 0 else min(decode_slots * shards, padded_rows)
  # Distinct prompts a refill prefills at once (refills are a few rows: an eighth of the slots); the first fill of
  # the empty slots may take more (`_Run.insert`), unless prefill_rows_per_device bounds them.
  if prefill_rows_per_device:
    unique_cap = min(prefill_rows_per_device * shards, num_slots)
  else:
    unique_cap = max(shards, -(-(num_slots // 8) // shards) * shards)
  bucket = bucket_length(max(map(len, prompts)))  # every insert's prompt width: one compiled insert per call

  if isinstance(rng, int):
    rng = jax.random.key(rng)
  elif not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):  # a legacy uint32 key (jax.random.PRNGKey)
    rng = jax.random.wrap_key_data(rng)
  if decode_weights not in DECODE_WEIGHTS:
    raise ValueError(f"rollout/scheduler.py: decode_weights={decode_weights!r} is not one of {DECODE_WEIGHTS}")
  graphdef, params = nnx.split(model)
  if mesh is not None and decode_weights == "replicated":
    params = engine.decode_layout(params, mesh, model.config.compute_dtype)
  spec = engine.EngineSpec(graphdef=graphdef, max_new_tokens=n, capacity=bucket + n,
                           top_k=int(top_k), nucleus=top_p < 1.0, chunk_steps=int(chunk_steps),
                           mesh=mesh, prefill_tokens=int(prefill_chunk_tokens),
                           segment_sizes=(engine.FIRST_SEGMENT, engine.MAX_SEGMENT))
  fns = engine.compiled(spec)
  replicate = functools.partial(_put_replicated, mesh)  # the scalars
  controls = engine.Controls(rng=replicate(rng), stop_ids=replicate(bounded.stop_array(eos_ids)),
                             temperature=replicate(np.asarray(temperature, np.float32)),
                             top_p=replicate(np.asarray(top_p, np.float32)))
  # Once the queue is empty a row has at most N steps left: ceil(N / chunk) chunks, so that many boundaries minus one.
  sizes = compaction_sizes(num_slots, shards, max_levels=-(-n // int(chunk_steps)) - 1)
  # Rows queue only when there are fewer slots than rows; without a queue nothing refills, so the refill insert is
  # not compiled (the evaluation's first fill of all its distinct prompts is another shape).
  refill_prompts = unique_cap // shards if num_slots < rows else 0
  if (num_slots, unique_cap, refill_prompts) not in fns.warmed:
    _warm_up(fns, params, controls, [num_slots, *sizes], shards, refill_prompts, bucket, mesh)
    fns.warmed.add((num_slots, unique_cap, refill_prompts))
  state = fns.init(params, num_slots, controls)

  return _Run(fns, params, state, prompts, keys, pad_id=pad_id, mesh=mesh, shards=shards, unique_cap=unique_cap,
              bucket=bucket, max_new_tokens=n, chunk_steps=spec.chunk_steps, segments=spec.segments,
              bounded=bool(prefill_rows_per_device), sizes=sizes)


def _put_replicated(mesh: Any, x: Any) -> Any:
  """`x` on every device of `mesh` (as it is without one)."""
  return x if mesh is None else jax.device_put(x, NamedSharding(mesh, P()))


def _put_by_shard(mesh: Any, x: Any) -> Any:
  """`x` split along its dim 0 over the batch shards of `mesh` (as it is without one)."""
  return x if mesh is None else jax.device_put(x, NamedSharding(mesh, P(bounded.BATCH_AXES)))


def _warm_up(fns: engine.Compiled, params: Any, controls: engine.Controls, sizes: list[int], shards: int,
             refill_prompts: int, bucket: int, mesh: Any) -> None:
  """Compiles, before the first real call of these shapes, what a call may reach later: the refill insert of
  `refill_prompts` prompts a shard (0: none, no row will queue) and every compaction level's decode chunk and
  compaction, by running them on empty slots (a chunk with every slot done runs no step; an insert whose entries
  are all padding writes nothing). A run then compiles nothing after its first call of each kind, whichever
  compaction levels its rows happen to reach. One empty state is alive at a time."""
  by_shard, replicated = functools.partial(_put_by_shard, mesh), functools.partial(_put_replicated, mesh)
  state = fns.init(params, sizes[0], controls)
  per_shard = sizes[0] // shards
  if refill_prompts:
    padding = np.full((shards, per_shard), per_shard, np.int32)  # every entry out of range: dropped
    state, _ = fns.insert(params, state, by_shard(np.zeros((shards * refill_prompts, bucket), np.int32)),
                          by_shard(np.ones((shards * refill_prompts,), np.int32)),
                          *map(by_shard, (np.zeros_like(padding), padding, np.zeros_like(padding))))
  for i, size in enumerate(sizes):
    state, _ = fns.decode_chunk(params, state, np.asarray(size + 1, np.int32))
    if i + 1 < len(sizes):
      keep = np.tile(np.arange(sizes[i + 1] // shards, dtype=np.int32), (shards, 1))
      state = fns.compact(state, replicated(keep))
  jax.block_until_ready(state)


class _Chunk(NamedTuple):
  """A dispatched decode chunk whose report the host has not read yet."""
  report: engine.ChunkReport  # on the device
  occupant: list[int]  # the row each slot held when it was dispatched: the report's slots are these
  ahead: bool  # dispatched before the report of the chunk before it was read


class _Run:
  """One `generate` call's host state: the queue, which row each slot holds, the outputs, and the loop."""

  def __init__(self, fns: engine.Compiled, params: Any, state: engine.EngineState, prompts: Sequence[Sequence[int]],
               keys: np.ndarray, *, pad_id: int, mesh: Any, shards: int, unique_cap: int, bucket: int,
               max_new_tokens: int, chunk_steps: int, segments: tuple, bounded: bool, sizes: Sequence[int]):
    self.fns, self.params, self.state = fns, params, state
    self.prompts, self.keys, self.pad_id = prompts, keys, pad_id
    self.mesh, self.shards, self.unique_cap, self.bucket, self.segments = mesh, shards, unique_cap, bucket, segments
    self.bounded = bounded  # prefill_rows_per_device caps every insert at unique_cap
    rows, n = len(prompts), max_new_tokens
    self.tokens = np.full((rows, n), pad_id, np.int32)
    self.logprobs = np.zeros((rows, n), np.float32)
    self.entropies = np.zeros((rows, n), np.float32)
    self.lengths = np.zeros((rows,), np.int32)
    self.known_step = np.zeros((rows,), np.int32)  # a row's tokens sampled, as of the last report read
    self.max_new_tokens, self.chunk_steps = n, chunk_steps
    self.queue = collections.deque(range(rows))
    self.occupant = [-1] * state.slots.done.shape[0]  # the row each slot holds, -1 when free (as the host knows)
    self.slot_of: dict[int, int] = {}  # the slot of each row in occupant
    self.firsts: list[tuple[np.ndarray, np.ndarray, engine.Sampled]] = []  # inserts' first tokens not yet read
    self.counters = collections.Counter()
    self.sizes = list(sizes)  # compaction_sizes: the smaller batches the live rows may move to
    self.on_rows_done: Callable | None = None
    self.pending: list[int] = []  # rows harvested but not yet handed to on_rows_done

  def until_done(self) -> None:
    """Insert, decode a chunk, read its report, until every row is done. While rows queue, a chunk's report is read
    before the next insert, which fills the slots it frees. Once the queue is empty the next chunk needs nothing
    from the last one's report, so it is dispatched before that report is read: the devices do not idle while the
    host reads it, and a compaction comes a chunk later than it could."""
    in_flight = None  # the last chunk dispatched, its report not read
    while in_flight is not None or self.queue or self.slot_of:
      if in_flight is None:
        self.insert()
        if not self.queue:
          self.compact()
        in_flight = self.dispatch(ahead=False)
      following = self.dispatch(ahead=True) if not self.queue and self.may_outlast_a_chunk() else None
      self.hand_over()  # the devices decode (dispatch is asynchronous) while the host hands these rows over
      self.read(in_flight)
      if following is not None and self.slot_of:
        self.compact()  # applies to the state after `following`
      in_flight = following
    self.hand_over()

  def may_outlast_a_chunk(self) -> bool:
    """Whether a row may still be live after the chunk in flight, which runs at most chunk_steps steps (the host
    knows the rows' steps as of the report before it)."""
    return any(self.known_step[row] + self.chunk_steps < self.max_new_tokens for row in self.slot_of)

  def hand_over(self) -> None:
    """The rows harvested since the last call, to `on_rows_done`."""
    if self.on_rows_done is not None and self.pending:
      rows = np.asarray(self.pending, np.int64)
      self.pending = []
      self.on_rows_done(rows, self.tokens[rows], self.lengths[rows])

  def insert(self) -> None:
    """Fills free slots from the front of the queue. Each batch shard prefills the distinct prompts of the rows
    entering its own slots, at most `cap` a shard per insert call: `unique_cap / shards`, or for the first fill of
    empty slots as many as its fullest shard needs (padded to a power of two): one prefill of 64 prompts cost a
    third of eight prefills of 8 on the 12M model of benchmarks/sampler.py.

    The first fill hands out the slots in order, so that consecutive rows (a question's K samples) share a shard and
    its prefill; refills hand them out round-robin over the shards, which keeps the shards' live rows even."""
    occupant, size, shards = self.occupant, len(self.occupant), self.shards
    per_shard = size // shards
    first_fill = all(o < 0 for o in occupant)
    free = list(range(size)) if first_fill else [s for s in _slot_order(size, shards) if occupant[s] < 0]
    cap = self.unique_cap // shards
    if first_fill and not self.bounded:
      rows = list(itertools.islice(self.queue, size))
      needed = max(len({tuple(self.prompts[r]) for r in rows[d * per_shard:(d + 1) * per_shard]})
                   for d in range(shards))
      cap = min(per_shard, max(cap, 1 << max(needed - 1, 0).bit_length()))
    while self.queue and free:
      distinct: list[dict[tuple, int]] = [{} for _ in range(shards)]  # per shard: prompt -> its index there
      entries = []  # (row, slot)
      while self.queue and free:
        prompt, slot = tuple(self.prompts[self.queue[0]]), free[0]
        mine = distinct[slot // per_shard]
        if prompt not in mine:
          if len(mine) == cap:
            break
          mine[prompt] = len(mine)
        entries.append((self.queue.popleft(), free.pop(0)))
      ids = np.full((shards, cap, self.bucket), self.pad_id, np.int32)  # right-padded
      prompt_lengths = np.ones((shards, cap), np.int32)
      for d, mine in enumerate(distinct):
        for prompt, i in mine.items():
          ids[d, i, :len(prompt)] = prompt
          prompt_lengths[d, i] = len(prompt)
      # Shard d's entry m: its prompt source[d, m] into its slot dest[d, m]; unused entries have dest = S / shards,
      # out of range (dropped).
      source = np.zeros((shards, per_shard), np.int32)
      dest = np.full((shards, per_shard), per_shard, np.int32)
      entry_keys = np.zeros((shards, per_shard), np.int32)
      used = [0] * shards
      at = []  # each entry's index in the insert's first tokens [shards * M] (M = S / shards): d * M + m
      for row, slot in entries:
        d = slot // per_shard
        m = used[d]
        source[d, m], dest[d, m] = distinct[d][tuple(self.prompts[row])], slot % per_shard
        entry_keys[d, m] = self.keys[row]
        used[d] += 1
        at.append(d * per_shard + m)
        occupant[slot], self.slot_of[row], self.known_step[row] = row, slot, 1
      by_shard = functools.partial(_put_by_shard, self.mesh)
      self.state, first = self.fns.insert(self.params, self.state, by_shard(ids.reshape(shards * cap, -1)),
                                          *map(by_shard, (prompt_lengths.reshape(-1), source, dest, entry_keys)))
      self.firsts.append((np.asarray([row for row, _ in entries]), np.asarray(at), first))  # read with a report
      self.counters["inserts"] += 1
      self.counters["row_steps"] += len(entries)  # each entering row samples its first token

  def compact(self) -> None:
    """With the queue empty: moves the live rows to a smaller batch (`compaction_sizes`) once they fit in it. Each
    batch shard keeps its own rows (no row moves between devices), so the new size must hold the fullest shard's."""
    old, shards = len(self.occupant), self.shards
    per_old = old // shards
    live = [[s for s in range(d * per_old, (d + 1) * per_old) if self.occupant[s] >= 0] for d in range(shards)]
    fullest = max(len(rows) for rows in live)
    smaller = [n for n in self.sizes if n < old]
    if not smaller or smaller[0] < fullest * shards:
      return
    size = smaller[0]  # one level at a time: a compaction compiles per (old, new) pair, so only neighbours pair up
    per_new = size // shards
    keep = np.zeros((shards, per_new), np.int32)  # shard d's new slot j is its old local slot keep[d, j]
    for d in range(shards):
      spare = [s for s in range(d * per_old, (d + 1) * per_old) if self.occupant[s] < 0]
      keep[d] = np.asarray(live[d] + spare[:per_new - len(live[d])]) - d * per_old
    self.state = self.fns.compact(self.state, _put_replicated(self.mesh, keep))
    self.occupant = [self.occupant[d * per_old + int(keep[d, j])] for d in range(shards) for j in range(per_new)]
    self.slot_of = {row: slot for slot, row in enumerate(self.occupant) if row >= 0}
    self.counters["compactions"] += 1
    self.compact()  # the next level, if the rows fit it too

  def dispatch(self, *, ahead: bool) -> _Chunk:
    """Dispatches one decode chunk (asynchronously: this returns before it runs)."""
    size = len(self.occupant)
    free_now = sum(o < 0 for o in self.occupant)
    # With rows queued, stop the chunk once enough slots are done to be worth an insert.
    exit_when_done = free_now + max(1, min(len(self.queue), size // 8)) if self.queue else size + 1
    self.state, report = self.fns.decode_chunk(self.params, self.state, np.asarray(exit_when_done, np.int32))
    self.counters["chunks_ahead"] += int(ahead)
    return _Chunk(report=report, occupant=list(self.occupant), ahead=ahead)

  def read(self, chunk: _Chunk) -> None:
    """Reads a chunk's report (and the first tokens of the inserts before it): each slot's new columns go to its
    row's outputs, and the rows that are done are harvested and their slots freed."""
    firsts, self.firsts = self.firsts, []
    report, first_tokens = jax.device_get((chunk.report, [first for _, _, first in firsts]))
    for (rows, at, _), first in zip(firsts, first_tokens):
      self.tokens[rows, 0], self.logprobs[rows, 0], self.entropies[rows, 0] = (
          first.tokens[at], first.logprobs[at], first.entropies[at])
    steps, size = int(report.steps), len(chunk.occupant)
    self.counters["row_steps"] += steps * size
    self.counters["decode_steps"] += steps
    self.counters["chunks"] += 1
    occupant = np.asarray(chunk.occupant)
    slots = np.flatnonzero(occupant >= 0)
    live = np.asarray([occupant[s] in self.slot_of for s in slots], bool)  # not harvested by an earlier report
    slots = slots[live]
    rows = occupant[slots]
    # The cache slots the chunk's attention read, about: every slot of the segments up to the furthest live row.
    reach = max([len(self.prompts[row]) + int(report.step[s]) - 1 for s, row in zip(slots, rows)] or [0])
    visited = next(start + length for start, length in self.segments if reach < start + length)
    self.counters["kv_slot_steps"] += steps * size * visited
    # Slot s sampled its row's columns [start, step) as the chunk's columns [0, step - start).
    start, step = report.start[slots], report.step[slots]
    offset = np.arange(report.sampled.tokens.shape[1])
    new = offset[None, :] < (step - start)[:, None]  # [slots, chunk]
    where = (np.broadcast_to(rows[:, None], new.shape)[new], (start[:, None] + offset[None, :])[new])
    for out, buffer in ((self.tokens, report.sampled.tokens), (self.logprobs, report.sampled.logprobs),
                        (self.entropies, report.sampled.entropies)):
      out[where] = buffer[slots][new]
    self.known_step[rows] = step
    done = rows[report.done[slots]]
    if not len(done) and steps == 0 and not chunk.ahead:
      raise RuntimeError("rollout/scheduler.py: a decode chunk made no progress")  # a scheduler bug, never expected
    self.lengths[done] = self.known_step[done]
    for row in done.tolist():
      self.occupant[self.slot_of.pop(row)] = -1
      self.pending.append(row)


def compaction_sizes(num_slots: int, shards: int, max_levels: int | None = None) -> list[int]:
  """The batch sizes compaction may go down to: S 3/4, S/2, S 3/8, S/4, ... (steps of 3/4 and 2/3), multiples of
  the batch shards, down to MIN_SLOTS_PER_DEVICE per shard. Halving alone left 72% of the row-steps useful on the
  long-tail workload; these finer steps compile a few more decode shapes (one per size reached).

  `max_levels`: at most this many sizes; when the fine steps have more, the first `max_levels` of them that halve
  the one before (S/2, S/4, ...). Every size costs a compiled decode chunk and compaction before the first call
  (`_warm_up`: 2-3 s each for the tiny model on this CPU), while compaction happens only between chunks, so a call
  decodes at no more sizes than it has chunk boundaries once its queue is empty. The embedded default (26 tokens,
  16-step chunks) has one boundary: eleven compiled shapes cost it more than the tail it saved."""
  sizes, size = [], num_slots
  floor = MIN_SLOTS_PER_DEVICE * shards
  while True:
    size = size * 3 // 4 if size & (size - 1) == 0 else size * 2 // 3  # 2^k -> 3 2^(k-2) -> 2^(k-1) -> ...
    size -= size % shards
    if size < floor or size <= 0 or (sizes and size >= sizes[-1]):
      break
    sizes.append(size)
  if max_levels is None or len(sizes) <= max_levels:
    return sizes
  halvings = []
  for size in sizes:
    if not halvings and size <= num_slots // 2 or halvings and size <= halvings[-1] // 2:
      halvings.append(size)
  return halvings[:max(0, max_levels)]
