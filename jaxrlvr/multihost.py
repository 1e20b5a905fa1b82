"""What the hosts of a multi-process run must agree on, and the small collectives that make them agree.

Every process runs the same loop (JAX's multi-controller model). Host-side state differs by design: each host owns
its slice of the questions, its own replay strategy and reward workers. Everything that decides a *shape* or a
*branch* around a collective must nevertheless be the same on every host, or one host waits in a collective the
others never enter. The rules the trainer uses (train.py):

  step              the resume step is read from the shared checkpoint directory; `check_same` verifies it.
  padded rows       the entropy batch of ExGRPO's stored answers: `agree_max` of the per-host row counts.
  phase switch      ExGRPO turns replay on when the *global* batch solve rate exceeds its threshold (the method is
                    defined on the batch, and the batch is the union of the hosts' pieces): `agree_phase`.
  sampler calls     a host with no request for some policy delay (BAPO's re-roll FIFO may be empty on one host only)
                    still joins that sampler call: `missing_delays`.
  metrics           host-side metrics are averaged over hosts (`host_mean`), so every host computes the same row;
                    rates over equal-sized host batches are then the global rates, counts are per-host means.
  evaluation        the held-out prompts are split over the hosts and the completions all-gathered
                    (`gather_rows`), so every host scores the same completions and reports the same metrics.

On one process every helper returns its input unchanged and runs no collective, so single-host runs are exactly
what they were.

A host that dies (killed, out of memory, a lost machine) takes its end of every collective with it: the next
collective of the others fails (gloo on CPU: at once, the connection is reset) or waits until JAX's coordination
service misses its heartbeats (`--heartbeat_timeout_s` of main.py, JAX's 100 s by default) and ends them. A failed
collective here raises `PeerLost`, which main.py reports in one line before it exits at once (exit code 2), not
through the shutdown barrier, which would wait for the dead host and then abort with a stack dump.
"""
from collections.abc import Iterable, Mapping
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils


def process_count() -> int:
  return jax.process_count()


def is_main() -> bool:
  """Host 0 writes logs, the progress bar, config.json, metrics and shared cache files."""
  return jax.process_index() == 0


class PeerLost(RuntimeError):
  """A collective of a multi-process run failed: another process has most likely stopped (its log says why)."""


def peer_lost(error: BaseException) -> PeerLost:
  """The PeerLost that says which process saw `error` (a failed collective) and what to do."""
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  return PeerLost(f"process {jax.process_index()} of {jax.process_count()}: a collective with the other processes "
                  f"failed ({first}); another process of this run has most likely stopped, and its log says why. "
                  "Start the job again with the same command: it resumes from the last checkpoint")


def _allgather(x: np.ndarray) -> np.ndarray:
  """[P, ...]: every host's `x` (same shape and dtype on every host), in process order."""
  try:
    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))
  except (RuntimeError, ValueError) as e:  # gloo reports a reset peer as a ValueError, XLA as a JaxRuntimeError
    raise peer_lost(e) from e


def _allgather_exact(values: np.ndarray) -> np.ndarray:
  """[P, N] float64 gathered bit-exactly: without jax_enable_x64 a float64 would travel as float32, so the values
  travel as pairs of uint32 words."""
  words = np.ascontiguousarray(np.asarray(values, np.float64)).view(np.uint32)  # [2N]
  return _allgather(words).view(np.float64)  # [P, N]


def agree_max(value: int) -> int:
  """The largest `value` over hosts (e.g. the padded row count of a batch every host must build alike)."""
  if process_count() == 1:
    return int(value)
  return int(_allgather_exact(np.asarray([value], np.float64)).max())  # exact up to 2**53 (blob sizes in bytes)


def agree_any(flag: bool) -> bool:
  """True on every host when it is True on any host."""
  if process_count() == 1:
    return bool(flag)
  return bool(_allgather(np.asarray(flag, np.int32)).max())


def check_same(value: int, what: str) -> int:
  """Raises on every host when the hosts disagree on an integer that must be global (e.g. the resume step)."""
  if process_count() == 1:
    return int(value)
  values = _allgather(np.asarray(value, np.int32)).tolist()
  if len(set(values)) != 1:
    raise RuntimeError(f"multihost.py: the hosts disagree on {what}: {values} (process 0, 1, ...); every host must "
                       "see the same workdir and config")
  return int(value)


def broadcast_flag(flag: bool) -> bool:
  """Host 0's `flag` on every host (a decision only host 0 may take, e.g. whether a shared cache file exists)."""
  if process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))


def barrier(name: str) -> None:
  """Waits until every host got here (e.g. host 0 finished writing a file the others read next)."""
  if process_count() > 1:
    multihost_utils.sync_global_devices(name)


def host_mean(metrics: Mapping[str, float]) -> dict[str, float]:
  """The mean of each host-side scalar metric over hosts; every host must report the same keys."""
  if process_count() == 1:
    return dict(metrics)
  keys = sorted(metrics)
  fingerprint = zlib.crc32("\n".join(keys).encode())
  fingerprints = _allgather(np.asarray(fingerprint, np.uint32))
  if len(set(fingerprints.tolist())) != 1:
    raise RuntimeError(f"multihost.py: the hosts log different metric keys; this host has {keys}")
  values = _allgather_exact(np.asarray([float(metrics[k]) for k in keys], np.float64))  # [P, N]
  return dict(zip(keys, values.mean(axis=0).tolist()))


def agree_phase(strategy) -> None:
  """ExGRPO's one-way switch to replay, decided on the global batch solve rate (correct / all rollouts of every
  host's composed groups), the same rule the single-host method applies to its one batch. Call it after `observe`;
  strategies without a phase are left alone.
  """
  if process_count() == 1 or not hasattr(strategy, "active") or not hasattr(strategy, "start_solve_rate"):
    return
  metrics = strategy.metrics()  # this host's batch: replay/solve_rate over replay/batch_rollouts rollouts
  n = float(metrics.get("replay/batch_rollouts", 0.0))
  rows = _allgather_exact(np.asarray([float(metrics.get("replay/solve_rate", 0.0)) * n, n, float(strategy.active)]))
  strategy.active = global_phase(rows, strategy.start_solve_rate)


def global_phase(rows: np.ndarray, threshold: float) -> bool:
  """The phase every host takes, from rows [P, 3] of (correct rollouts, rollouts, phase after the host's own
  observe) of each host.

  Each host's observe switched on its own rate; the global rate decides. If every host is on, either the phase was
  already on (all hosts switched together earlier; the switch is one-way) or every host's rate exceeded the
  threshold, and then so does the global rate, their weighted mean: both cases stay on.
  """
  rows = np.asarray(rows, np.float64)
  return bool(rows[:, 0].sum() / max(rows[:, 1].sum(), 1.0) > threshold or rows[:, 2].min() > 0)


def missing_delays(local: Iterable[int]) -> list[int]:
  """The policy delays some other host samples at this step and this host does not (sorted).

  `rollout.sample_groups` calls the sampler once per delay present in its requests; a sampler call is a collective,
  so a host without requests for a delay must join that call with a throw-away prompt.
  """
  local = sorted({int(d) for d in local})
  if process_count() == 1:
    return []
  flags = np.zeros(64, np.int32)
  for d in local:
    if not 0 <= d < len(flags):
      raise ValueError(f"multihost.py: policy delay {d} outside [0, {len(flags)})")
    flags[d] = 1
  union = _allgather(flags).max(axis=0)
  return [d for d in np.flatnonzero(union).tolist() if d not in local]


def split_rows(num_rows: int) -> tuple[int, int]:
  """This host's contiguous share [start, stop) of `num_rows` rows, ceil(num_rows / P) per host (the last ones may
  get fewer, or none)."""
  per_host = -(-num_rows // process_count())
  start = min(jax.process_index() * per_host, num_rows)
  return start, min(start + per_host, num_rows)


def gather_rows(local: np.ndarray, num_rows: int) -> np.ndarray:
  """The inverse of `split_rows`: every host's rows [stop - start, ...] concatenated, [num_rows, ...]."""
  if process_count() == 1:
    return np.asarray(local)[:num_rows]
  per_host = -(-num_rows // process_count())
  local = np.asarray(local)
  padded = np.zeros((per_host, *local.shape[1:]), local.dtype)
  padded[:len(local)] = local
  return _allgather(padded).reshape(-1, *local.shape[1:])[:num_rows]  # [P * per_host, ...] -> [num_rows, ...]


def local_rows(x: jax.Array) -> np.ndarray:
  """This host's rows of a batch-sharded global array, in order (the inverse of `parallel.shard_batch`)."""
  if process_count() == 1:
    return np.asarray(x)
  shards = {}
  for shard in x.addressable_shards:  # shards repeated over 'tensor' hold the same rows: keep one per row range
    shards.setdefault(shard.index[0].start or 0, shard)
  return np.concatenate([np.asarray(shards[start].data) for start in sorted(shards)], axis=0)
