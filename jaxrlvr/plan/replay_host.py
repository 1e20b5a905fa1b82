"""The host replay buffer at its expected size: the bytes each method's store holds over all hosts (plan/report.py's
docstring says how the sizes are chosen)."""
from typing import Any

import numpy as np

EXGRPO_STORE_FRACTION = 202_011 / (700 * 128 * 8)  # ExGRPO paper: trajectories stored / rollouts sampled
TOKENS_PER_TRAJECTORY = 1000  # see plan/report.py's docstring
ROW_INDEX_BYTES = 52  # per stored row: order queue (2 x int64) + ~36 bytes in the owner's Python list of row ids
STORE_SLACK = 8 / 7  # replay/storage.py compacts a page once its dead tokens exceed 1/8


def replay_estimate(config: Any, *, trajectories: int | None, tokens_per_trajectory: int | None,
                    store_fraction: float) -> tuple[int, int, int]:
  """(host bytes, trajectories, tokens per trajectory) of the replay buffer at its expected size."""
  from jaxrlvr.replay import RolloutStore  # pylint: disable=g-import-not-at-top
  r, name = config.replay, config.replay.name
  rollouts = config.rollout.batch_size * config.rollout.group_size
  if trajectories is None:
    if name == "exgrpo":
      trajectories = round(config.total_steps * rollouts * store_fraction)
    elif name == "advantage_priority":
      trajectories = min(r.capacity, r.tau_max * rollouts)
    elif name == "bapo":
      trajectories = r.window * rollouts
    else:
      trajectories = 0
  if tokens_per_trajectory is None:
    tokens_per_trajectory = min(TOKENS_PER_TRAJECTORY, config.rollout.max_new_tokens)
  max_tokens = r.get("max_tokens", 0)
  if max_tokens and trajectories * tokens_per_trajectory > max_tokens:
    trajectories = max_tokens // tokens_per_trajectory
  # Measure the store's own accounting: one row of 1 token, then one of 3: A = row + tok, B = 2 row + 4 tok.
  store = RolloutStore()
  store.add(np.zeros(1, np.int32), np.zeros(1, np.float32), qid=0, step=0)
  one = store.live_nbytes()
  store.add(np.zeros(3, np.int32), np.zeros(3, np.float32), qid=1, step=0)
  per_token = (store.live_nbytes() - 2 * one) // 2
  per_row = one - per_token
  live = trajectories * (tokens_per_trajectory * per_token + per_row)
  return int(live * STORE_SLACK + trajectories * ROW_INDEX_BYTES), int(trajectories), int(tokens_per_trajectory)
