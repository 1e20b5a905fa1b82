"""Host side of the sampler: ragged prompts -> left-padded arrays cut into sampler calls of one shape.

`jaxrlvr.rollout.generate` samples a list of prompts in one or more sampler calls. With `max_rows_per_device` > 0
a call holds at most that many rows on each batch shard of the mesh (data x fsdp; 1 without a mesh), which bounds
the KV cache and the decode's state; the prompts are then cut into consecutive calls, all padded to the same row
count and the same prompt bucket (that of the longest prompt overall), so one compiled prefill and decode serve them
all. Row r of the prompts keeps the random stream of the key fold_in(rng, r) however the rows are split.

Multi-host: each process splits its own rows; the processes agree (`multihost.agree_max`) on the bucket, the rows of
a call and the number of calls, so that they enter the same collectives. Process p's row r has the key index
p x (rows of process p's unsplit, padded batch) + r, i.e. its global row in the unsplit layout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jaxrlvr import multihost

BATCH_AXES = ("data", "fsdp")

# `generate`'s arguments that bound a sampler call's memory; the `rollout.*` config keys carry the same names.
MEMORY_LIMITS = ("max_rows_per_device", "prefill_rows_per_device", "prefill_chunk_tokens")


def bucket_length(n: int) -> int:
  """Padded prompt length for a longest prompt of `n` tokens: powers of two from 16 up to 512, then multiples of 512.

  Powers of two keep the number of compiled shapes logarithmic; above 512 they would waste up to half the cache, so
  the step becomes linear (at most 512 wasted slots, i.e. < 50% once n > 512).
  """
  if n < 1:
    raise ValueError(f"rollout/sampler.py: bucket_length needs a positive prompt length, got n={n}")
  if n <= 512:
    return max(16, 1 << (n - 1).bit_length())
  return -(-n // 512) * 512


def batch_shards(mesh: Any) -> int:
  """Pieces the batch dimension is cut into: data x fsdp of the mesh, 1 without one."""
  return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


@dataclasses.dataclass(frozen=True)
class Calls:
  """This process's prompts laid out for `count` sampler calls of `rows` rows each (call i: rows [i*rows, (i+1)*rows)).

  ids, mask [count * rows, bucket] int32, left-padded; real [count * rows] bool (False: a row that only pads the
  batch; it holds one real pad token so no row is fully masked, and starts as done); row_keys [count * rows] int32,
  the index folded into the rng for the row's random draws; batch: the number of prompts (the first `batch` rows).
  """
  ids: np.ndarray
  mask: np.ndarray
  real: np.ndarray
  row_keys: np.ndarray
  count: int
  rows: int
  batch: int

  def call(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids, mask, real, row_keys) of call i."""
    part = slice(i * self.rows, (i + 1) * self.rows)
    return self.ids[part], self.mask[part], self.real[part], self.row_keys[part]


def plan_calls(prompts: Sequence[Sequence[int]], *, pad_id: int, vocab_size: int | None, mesh: Any,
               pad_batch_to: int, max_rows_per_device: int) -> Calls:
  """Left-pads the ragged prompts and cuts them into sampler calls (see the module docstring).

  Without a row limit, or when the limit holds the whole batch, there is one call of B rows rounded up to the batch
  shards and `pad_batch_to` (what `generate` always did). Otherwise every call has max_rows_per_device x shards
  rows, and the last one is padded up to that.
  """
  batch = len(prompts)
  if batch == 0:
    raise ValueError("rollout/sampler.py: generate got an empty list of prompts")
  lengths = [len(p) for p in prompts]
  if min(lengths) == 0:
    raise ValueError(f"rollout/sampler.py: prompt {lengths.index(0)} is empty; every prompt needs at least one token")
  if pad_batch_to < 1:
    raise ValueError(f"rollout/sampler.py: pad_batch_to={pad_batch_to} must be >= 1")
  multiple = int(pad_batch_to)
  local_shards = 1
  if mesh is not None:
    shards = batch_shards(mesh)
    if shards % jax.process_count():
      raise ValueError(f"rollout/sampler.py: the batch axes {BATCH_AXES} have {shards} shards, not a multiple of the "
                       f"{jax.process_count()} processes; each process must own whole batch shards")
    local_shards = shards // jax.process_count()
    multiple = multiple * local_shards // np.gcd(multiple, local_shards)
  # Every process must build the same shapes and make the same number of calls: agree on the longest prompt and the
  # largest local batch; the rest follows from those two.
  padded_batch = multihost.agree_max(-(-batch // multiple) * multiple)
  width = bucket_length(multihost.agree_max(max(lengths)))
  rows = padded_batch
  if max_rows_per_device > 0:
    rows = min(rows, max_rows_per_device * local_shards)
  count = -(-padded_batch // rows)
  total = count * rows
  ids = np.full((total, width), pad_id, np.int32)
  mask = np.zeros((total, width), np.int32)
  for row, prompt in enumerate(prompts):
    ids[row, width - len(prompt):] = np.asarray(prompt, np.int32)
    mask[row, width - len(prompt):] = 1
  mask[batch:, -1] = 1
  if vocab_size is not None and (ids.max() >= vocab_size or ids.min() < 0):
    raise ValueError(f"rollout/sampler.py: prompt token ids must lie in [0, vocab_size={vocab_size}); got min {ids.min()}, "
                     f"max {ids.max()} (pad_id={pad_id})")
  # Padding rows of a last call that runs past the unsplit batch get keys other processes' rows also use: they are
  # done from the start, so their draws are never read.
  row_keys = (jax.process_index() * padded_batch + np.arange(total)).astype(np.int32)
  return Calls(ids=ids, mask=mask, real=np.arange(total) < batch, row_keys=row_keys, count=count, rows=rows,
               batch=batch)


def stop_array(eos_ids: Sequence[int]) -> np.ndarray:
  """Stop ids as an int32 array padded with -1 to a multiple of 4 slots, so most stop sets share one compile."""
  eos = [int(e) for e in eos_ids]
  if any(e < 0 for e in eos):
    raise ValueError(f"rollout/sampler.py: eos_ids={eos} must be non-negative token ids")
  slots = max(4, -(-len(eos) // 4) * 4)
  return np.asarray(eos + [-1] * (slots - len(eos)), np.int32)


def check_sampling_args(max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                        limits: dict[str, int]) -> None:
  """One line naming the argument for a value `generate` cannot use; `limits` maps MEMORY_LIMITS to their values."""
  if max_new_tokens < 1:
    raise ValueError(f"rollout/sampler.py: max_new_tokens={max_new_tokens} must be >= 1")
  if temperature < 0:
    raise ValueError(f"rollout/sampler.py: temperature={temperature} must be >= 0 (0 is greedy)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"rollout/sampler.py: top_p={top_p} must lie in (0, 1]")
  if top_k < 0:
    raise ValueError(f"rollout/sampler.py: top_k={top_k} must be >= 0 (0 switches it off)")
  for name, value in limits.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"rollout/sampler.py: {name}={value!r} must be an integer >= 0 (0: no limit)")
