"""The update batch's completions packed into fewer rows: the host's plan for `scoring.score_packed_completions`.

RL answers are ragged: on the smollm2-135m preset half of them stop before their 64-token cap (mean 47), so a
quarter of the update's completion slots are padding that the body and the head compute anyway. Packed, a row of
the completion width holds several answers one after another, each after its own group's prompt (at most
`max_prompts` groups a row), and the update runs over fewer rows: `train.pack_completions` lists the packed row
counts it may use, as fractions of a micro-batch's rows; a batch takes the smallest that fits and the unpacked
update otherwise. Each count is one more compiled update, so a few; the trainer compiles them ahead, after the
unpacked one, and packs into a count once its update is ready. The log-probs, the loss and the gradient are those
of the unpacked update up to float rounding.

Plans are made per micro-batch, on the rows that `step.make_update_fn` gives it, by first-fit decreasing: the
longest answers first, each into the first packed row with room for it and for its prompt. Only on one batch shard:
across shards the gathers that unpack the log-probs and hand each packed row its prompts would move data between
devices, which this plan does not arrange.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging


def micro_batch_rows(rows: int, num_minibatches: int, num_microbatches: int, group: int) -> np.ndarray:
  """[M, n, r]: the batch rows each micro-batch of the update takes, in its order (`step._split_rows`: blocks of
  `group` rows dealt round the micro-batches)."""
  groups = rows // (group * num_minibatches * num_microbatches)
  index = np.arange(rows).reshape(groups, num_minibatches, num_microbatches, group)  # [g, M, n, K]
  return np.moveaxis(index, 0, 2).reshape(num_minibatches, num_microbatches, groups * group)  # [M, n, g K]


def packed_row_counts(micro_rows: int, fractions: Sequence[float]) -> tuple[int, ...]:
  """The packed row counts of `train.pack_completions` for micro-batches of `micro_rows` rows, smallest first;
  counts that pack nothing (the micro-batch's own row count or more) are left out."""
  counts = {max(1, math.ceil(f * micro_rows)) for f in fractions}
  return tuple(sorted(c for c in counts if c < micro_rows))


def row_options(config: ml_collections.ConfigDict, *, shared: bool, batch_shards: int, num_hosts: int,
                micro_rows: int) -> tuple[int, ...]:
  """The packed row counts a micro-batch of the run's shared-prompt update may take (`train.pack_completions`):
  none unless prompts are shared (whole groups a micro-batch) on one batch shard and one process."""
  fractions = tuple(config.train.pack_completions)
  if not fractions:
    return ()
  if not shared or batch_shards > 1 or num_hosts > 1:
    logging.info("train.pack_completions=%s is off: it packs the shared-prompt update (train.share_prompts, whole "
                 "groups a micro-batch) on one batch shard and one process; this run has shared prompts %s, %d "
                 "batch shard(s), %d process(es)", fractions, shared, batch_shards, num_hosts)
    return ()
  return packed_row_counts(micro_rows, fractions)


def example(config: ml_collections.ConfigDict, packed_rows: int, *, rows: int, sharding) -> dict:
  """The shapes, dtypes and sharding of `plan_batch`'s arrays at `packed_rows` rows a micro-batch, for an update
  batch of `rows` rows (to compile the packed update ahead)."""
  parts = config.train.num_minibatches * config.train.num_microbatches
  width = config.rollout.max_new_tokens
  spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  packed = (parts * packed_rows, width)
  return {"packing": {"ids": spec(packed), "positions": spec(packed), "segments": spec(packed),
                      "blocks": spec(packed), "starts": spec(packed, jnp.bool_),
                      "prompts": spec((parts * packed_rows, config.train.pack_max_prompts))},
          "unpack": spec((rows, width))}


def plan_micro_batch(input_ids: np.ndarray, attention_mask: np.ndarray, *, prompt_len: int, group_size: int,
                     packed_rows: int, max_prompts: int) -> dict | None:
  """The plan of one micro-batch's rows (`scoring.score_packed_completions`: its `packing` dict and `unpack`, with
  indices into this micro-batch), or None when its answers do not fit in `packed_rows` rows.

  input_ids, attention_mask [r, P + T]: every `group_size` consecutive rows share their prompt. A row's answer is
  its real completion tokens (attention_mask), which start at column P; a row without any (filler) takes no room.
  """
  rows, length = input_ids.shape
  width = length - prompt_len
  answer_lengths = attention_mask[:, prompt_len:].sum(axis=1)
  prompt_lengths = attention_mask[:, :prompt_len].sum(axis=1)
  free = []  # per packed row: [free slots, its groups in prompt-block order]
  place = {}  # row -> (packed row, offset of its answer)
  for row in sorted(range(rows), key=lambda r: -answer_lengths[r]):  # stable: equal lengths in row order
    size, group = int(answer_lengths[row]), row // group_size
    if size == 0:
      continue
    for packed, (room, groups) in enumerate(free):
      if room >= size and (group in groups or len(groups) < max_prompts):
        break
    else:
      if len(free) == packed_rows:
        return None
      free.append([width, []])
      packed = len(free) - 1
    room, groups = free[packed]
    if group not in groups:
      groups.append(group)
    place[row] = (packed, width - room)
    free[packed][0] = room - size

  ids = np.zeros((packed_rows, width), np.int32)
  positions = np.zeros((packed_rows, width), np.int32)
  segments = np.zeros((packed_rows, width), np.int32)
  blocks = np.zeros((packed_rows, width), np.int32)
  starts = np.zeros((packed_rows, width), bool)
  prompts = np.zeros((packed_rows, max_prompts), np.int32)
  unpack = np.full((rows, width), packed_rows * width, np.int32)  # padding: the zero after the packed tokens
  for packed, (_, groups) in enumerate(free):
    prompts[packed, :len(groups)] = groups  # unused blocks repeat group 0: no token sees them
  counts = np.zeros(packed_rows, np.int32)
  for row in sorted(place):
    packed, offset = place[row]
    size, group = int(answer_lengths[row]), row // group_size
    span = slice(offset, offset + size)
    counts[packed] += 1
    ids[packed, span] = input_ids[row, prompt_len:prompt_len + size]
    positions[packed, span] = prompt_lengths[row] + np.arange(size)
    segments[packed, span] = counts[packed]
    blocks[packed, span] = free[packed][1].index(group)
    starts[packed, offset] = True
    unpack[row, :size] = packed * width + offset + np.arange(size)
  return {"packing": {"ids": ids, "positions": positions, "segments": segments, "blocks": blocks, "starts": starts,
                      "prompts": prompts}, "unpack": unpack}


def plan_batch(batch: dict, *, prompt_len: int, group_size: int, num_minibatches: int, num_microbatches: int,
               packed_row_options: Sequence[int], max_prompts: int) -> dict | None:
  """The update batch's packing at the smallest of `packed_row_options` (rows a micro-batch) that every micro-batch
  fits: {"packing": {name: [M n Rp, ...]}, "unpack": [R, T]}, to join the batch (`step.make_update_fn`), or None
  when none fits. `batch` is the host's update batch (numpy, `rollout.build_batch`), laid out in whole groups."""
  rows = batch["input_ids"].shape[0]
  micro = micro_batch_rows(rows, num_minibatches, num_microbatches, group_size)  # [M, n, r]
  for packed_rows in packed_row_options:
    plans = []
    for index in micro.reshape(-1, micro.shape[-1]):
      plan = plan_micro_batch(batch["input_ids"][index], batch["attention_mask"][index], prompt_len=prompt_len,
                              group_size=group_size, packed_rows=packed_rows, max_prompts=max_prompts)
      if plan is None:
        break
      plans.append((index, plan))
    else:
      unpack = np.zeros(batch["completion_mask"].shape, np.int32)
      for index, plan in plans:
        unpack[index] = plan["unpack"]
      # Micro-batch after micro-batch, in `micro`'s order: step._split_rows(x, M, n, Rp) gives each its own rows.
      packing = {k: np.concatenate([plan["packing"][k] for _, plan in plans]) for k in plans[0][1]["packing"]}
      return {"packing": packing, "unpack": unpack}
  return None
