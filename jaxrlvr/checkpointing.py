"""Orbax checkpoints: everything a run needs to continue exactly (docs/operations.md, "Checkpoint, resume and export").

A checkpoint step directory has three items:
  train: the device state (params, optimizer state, step, RNG, and a method's delayed sampler weights), sharded;
  host:  the host state (replay buffer, data-iterator position, phase switch, ...) of every process: each process
         packs its own into bytes (orbax refuses zero-size arrays and the replay state has many that start empty),
         and the blobs form one [P, L] uint8 array with row i on process i's first device, so each process writes
         and restores only its own row (the first 8 bytes of a row are its length, the rest zero padding);
  meta:  JSON: the step, the run's config (checked on resume), the process count P and the blob width L.
Orbax writes each step into a temporary directory (`<step>.orbax-checkpoint-tmp-<n>`) and renames it when complete
(with several processes: after all of them finished their part), so a write that dies half-way never damages the last
good checkpoint and is never taken as the latest; a new manager removes such leftovers. `keep` old steps are kept.
A write that fails (no space, a read-only or vanished directory) raises `CheckpointError` naming the directory; a
latest checkpoint that cannot be read is moved to WORKDIR/checkpoints-unreadable/ and the one before it is used, and
a run whose checkpoints are all unreadable stops rather than start over. A checkpoint restores only with the process
count that wrote it: the replay buffers and data positions are per host.
"""
import glob
import io
import json
import os
import shutil

import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import orbax.checkpoint as ocp

from jaxrlvr import config_lib
from jaxrlvr import faults
from jaxrlvr import logs
from jaxrlvr import multihost

# Config keys that may change when an unfinished run resumes (or a finished one is extended); any other change is
# refused. A finished run with nothing left to do refuses every change but total_steps: it would have no effect.
# Where the process keeps things, not what a run computes: any change is fine, even on a finished run.
WHERE_ONLY = ("compilation_cache_dir",)
RESUMABLE_CHANGES = (*WHERE_ONLY, "total_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "mesh.", "reward.num_workers", "reward.timeout_s", "warm_start.cache_dir", "eval.",
                     "data.eval_size",
                     # when a diverged run stops, or what a judge that is down does; not what a step computes
                     "optim.max_nonfinite_steps", "exprl.judge.on_failure",
                     # how memory is spent, not what is computed: a run that ran out of memory resumes with other
                     # bounds or another attention kernel (same math, float rounding aside)
                     "rollout.max_rows_per_device", "rollout.kv_cache_gb", "rollout.prefill_rows_per_device",
                     "rollout.prefill_chunk_tokens", "rollout.engine", "rollout.decode_slots",
                     "rollout.decode_chunk_steps", "rollout.decode_weights",
                     "model.attention", "model.attention_block_size", "model.scan_layers", "train.share_prompts",
                     "train.pack_completions", "train.pack_max_prompts",
                     "train.replayed_grad_share",  # a diagnostic: the update is the same
                     "train.stop_if_unsolvable_steps",  # watches a run from step 0 only: a resumed one ignores it
                     "health.", "train.stop_on_collapse")  # what the run says (or whether it stops), not computes


_SEP = "::"  # nesting separator of packed host-state keys (replay state keys themselves contain '/')


def pack_host_state(state: dict) -> np.ndarray:
  """Nested dict of numpy arrays and JSON-able leaves -> one uint8 array (an .npz with a JSON entry)."""
  arrays, plain = {}, {}

  def walk(prefix, value):
    if isinstance(value, dict):
      for k, v in value.items():
        if not isinstance(k, str) or _SEP in k:
          raise ValueError(f"host state key {prefix + str(k)!r} must be a string without {_SEP!r}")
        walk(f"{prefix}{k}{_SEP}", v)
    elif isinstance(value, np.ndarray):
      arrays[prefix[:-len(_SEP)]] = value
    else:
      plain[prefix[:-len(_SEP)]] = value

  walk("", state)
  buffer = io.BytesIO()
  np.savez(buffer, __json__=np.frombuffer(json.dumps(plain).encode(), np.uint8), **arrays)
  return np.frombuffer(buffer.getvalue(), np.uint8)


def unpack_host_state(blob: np.ndarray) -> dict:
  with np.load(io.BytesIO(np.asarray(blob, np.uint8).tobytes()), allow_pickle=False) as f:
    flat = {k: f[k] for k in f.files if k != "__json__"}
    flat.update(json.loads(f["__json__"].tobytes().decode()))
  nested: dict = {}
  for path, value in flat.items():
    node = nested
    *parents, leaf = path.split(_SEP)
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return nested


def _flatten_config(config: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in config.items():
    if isinstance(v, dict):
      out.update(_flatten_config(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = list(v) if isinstance(v, tuple) else v  # as config.json holds it
  return out


def _changes(saved: dict, current: dict, allowed) -> list[str]:
  a, b = _flatten_config(saved), _flatten_config(current)
  changed = []
  for key in sorted(set(a) | set(b)):
    if a.get(key) != b.get(key) and not any(key == p or (p.endswith(".") and key.startswith(p)) for p in allowed):
      changed.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
  return changed


def incompatible_changes(saved: dict, current: dict) -> list[str]:
  """Keys whose change would make a resumed run differ from the one that wrote the checkpoint."""
  return _changes(saved, current, RESUMABLE_CHANGES)


def refused_changes(saved: dict, current: dict, *, step: int) -> list[str]:
  """The changes ("key: old -> new") that stop `current` from taking over the run whose checkpoint at `step` holds
  `saved`: `incompatible_changes` when the run goes on (step < current total_steps); when it has nothing left to do,
  every change but total_steps, since the run would end at once and silently ignore it."""
  if step < current["total_steps"]:
    return incompatible_changes(saved, current)
  return _changes(saved, current, ("total_steps", *WHERE_ONLY))


def extension_note(saved: dict, current: dict, *, step: int) -> str | None:
  """The line that says a finished run (its checkpoint at `step` >= the saved total_steps) is being extended; None
  when the run was unfinished or has nothing left to do."""
  before, after = saved["total_steps"], current["total_steps"]
  if not before <= step < after:
    return None
  note = f"finished at step {step}; total_steps={after} extends it from {before} to {after} steps"
  if _flatten_config(current).get("optim.schedule") == "cosine":
    note += " (the cosine learning-rate schedule now decays over the longer run)"
  return note


class CheckpointError(faults.RunError):
  """A checkpoint that cannot be written, or no readable checkpoint left to resume from."""


class Checkpointer:
  """Saves and restores (train state, host state, meta) under WORKDIR/checkpoints/<step>."""

  def __init__(self, workdir: str, *, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.unreadable_directory = self.directory + "-unreadable"  # where checkpoints that cannot be read are moved
    self._set_aside: list[int] = []
    # Synchronous saves: `save` waits for each checkpoint anyway (below), and an asynchronous manager counts that
    # wait as the next save's "waiting for previous save", warning on every save of a loaded machine.
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                             enable_async_checkpointing=False,
                                                             cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, train_state, host_state: dict, meta: dict) -> None:
    """Every process calls this with the same `step`, its own `host_state` and the same `meta`."""
    blob = pack_host_state(host_state)
    width = multihost.agree_max(_LENGTH_BYTES + blob.size)  # one global shape
    row = np.zeros((1, width), np.uint8)
    row[0, :_LENGTH_BYTES] = np.frombuffer(np.asarray(blob.size, "<u8").tobytes(), np.uint8)
    row[0, _LENGTH_BYTES:_LENGTH_BYTES + blob.size] = blob
    blobs = jax.make_array_from_process_local_data(_host_sharding(), row, (jax.process_count(), width))
    meta = {**meta, "num_processes": jax.process_count(), "host_bytes": width}
    previous = self.latest_step()
    try:
      self._manager.save(step, args=ocp.args.Composite(
          train=ocp.args.StandardSave(train_state),
          host=ocp.args.StandardSave({"blobs": blobs}),
          meta=ocp.args.JsonSave(meta)))
      # Waiting keeps "checkpoint written" meaning "on disk": a SIGKILL right after must find it.
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  (the disk's answer, whatever orbax wraps it in)
      if multihost.is_main():  # the half-written temporary directory: never the latest, but it takes space
        for partial in glob.glob(os.path.join(self.directory, f"{step}{ocp.utils.TMP_DIR_SUFFIX}*")):
          shutil.rmtree(partial, ignore_errors=True)
      kept = ("there is no earlier checkpoint" if previous is None
              else f"the checkpoint of step {previous} is intact and the same command resumes from it")
      raise CheckpointError(f"cannot write the checkpoint of step {step} in {self.directory} "
                            f"({faults.error_reason(e)}); {kept} once the directory can be written (free space, "
                            "permissions)") from e

  def restore(self, step: int, abstract_train_state):
    """`abstract_train_state`: a pytree of jax.ShapeDtypeStruct with shardings (jax.eval_shape of the state).

    Returns (train state, this process's host state, meta)."""
    meta = self.read_meta(step)
    self.check_processes(meta)
    width = int(meta["host_bytes"])
    abstract_host = {"blobs": jax.ShapeDtypeStruct((jax.process_count(), width), np.uint8,
                                                   sharding=_host_sharding())}
    restored = self._manager.restore(step, args=ocp.args.Composite(
        train=ocp.args.StandardRestore(abstract_train_state),
        host=ocp.args.StandardRestore(abstract_host),
        meta=ocp.args.JsonRestore()))
    row = np.asarray(restored.host["blobs"].addressable_shards[0].data)[0]  # [L]: this process's row
    size = int(np.frombuffer(row[:_LENGTH_BYTES].tobytes(), "<u8")[0])
    return restored.train, unpack_host_state(row[_LENGTH_BYTES:_LENGTH_BYTES + size]), restored.meta

  def latest_readable_step(self) -> int | None:
    """The latest step whose metadata can be read. A later one that cannot is moved aside (`set_aside`); when every
    checkpoint was, raises CheckpointError rather than let the run start over."""
    while (step := self.latest_step()) is not None:
      try:
        self.read_meta(step)
        error = None
      except Exception as e:  # pylint: disable=broad-except  (truncated JSON, a missing item, an I/O error)
        error = e
      if not multihost.agree_any(error is not None):
        return step
      self.set_aside(step, error or "unreadable on another process")
    if self._set_aside:
      raise CheckpointError(f"no readable checkpoint is left in {self.directory}: the ones of steps {self._set_aside} "
                            f"could not be read and were moved to {self.unreadable_directory}; move back one that "
                            "can be repaired, or start again in a new --workdir")
    return None

  def restore_readable(self, step: int, abstract_target, config: ml_collections.ConfigDict):
    """`restore` of `step`, or of the latest earlier one that reads when it cannot be read (each checked against
    `config` like the first); `abstract_target(meta)` gives the restore target. Returns (step, train, host)."""
    while True:
      try:
        train, host, _ = self.restore(step, abstract_target(self.read_meta(step)))
        error = None
      except config_lib.ConfigError:
        raise
      except Exception as e:  # pylint: disable=broad-except  (a truncated or missing array file)
        error = e
      if not multihost.agree_any(error is not None):
        return step, train, host
      self.set_aside(step, error or "unreadable on another process")
      step = self.latest_readable_step()  # raises when none is left
      self.check_config(self.read_meta(step), config, step=step)

  def set_aside(self, step: int, error) -> None:
    """Moves the checkpoint of `step` to WORKDIR/checkpoints-unreadable/ (kept, not deleted: it may be repairable)
    and says so; every process calls it."""
    target = os.path.join(self.unreadable_directory, str(step))
    if multihost.is_main():
      os.makedirs(self.unreadable_directory, exist_ok=True)
      if os.path.exists(target):
        target += f".{len(os.listdir(self.unreadable_directory))}"
      shutil.move(os.path.join(self.directory, str(step)), target)
      message = (f"the checkpoint of step {step} in {self.directory} cannot be read ({faults.error_reason(error)}); "
                 f"moved it to {target} and resuming from the one before it")
      logs.say(message)
    multihost.barrier(f"checkpoint-set-aside-{step}")
    self._set_aside.append(step)
    self._manager.reload()

  def check_processes(self, meta: dict) -> None:
    saved = meta.get("num_processes")
    if saved is None:
      raise config_lib.ConfigError(
          f"the checkpoint in {self.directory} has no num_processes in its metadata: it predates multi-host "
          "checkpoints (per-process replay state) and cannot be resumed by this version")
    if saved != jax.process_count():
      raise config_lib.ConfigError(
          f"the checkpoint in {self.directory} was written by {saved} process(es) (meta num_processes={saved!r}) "
          f"but this run has {jax.process_count()}: the replay buffers and data positions are per process, so it "
          "resumes only with the same number of processes")

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def check_config(self, meta: dict, config: ml_collections.ConfigDict, *, step: int) -> None:
    """Raises ConfigError listing the `refused_changes` of `config` against the checkpoint at `step`."""
    changes = refused_changes(meta["config"], config.to_dict(), step=step)
    if not changes:
      return
    if step >= config.total_steps:
      raise config_lib.ConfigError(
          f"the run in {os.path.dirname(self.directory)} is finished (step {step} of {config.total_steps}) and would "
          f"ignore these config changes: {'; '.join(changes)}. Nothing was run; restore those values, use a new "
          "--workdir, or extend the run with a larger --config.total_steps.")
    raise config_lib.ConfigError(
        f"the config differs from the one that wrote the checkpoint at step {step} in {self.directory} in ways that "
        f"break resumption: {'; '.join(changes)}. Use a new --workdir, or restore those values.")

  def close(self) -> None:
    self._manager.close()


_LENGTH_BYTES = 8  # each host blob row starts with its byte count, little-endian uint64


def _host_sharding() -> NamedSharding:
  """Row i of a [P, L] array on process i's first device (and nowhere else)."""
  devices = [min((d for d in jax.devices() if d.process_index == i), key=lambda d: d.id)
             for i in range(jax.process_count())]
  return NamedSharding(Mesh(np.asarray(devices), ("hosts",)), PartitionSpec("hosts"))


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a pytree of arrays, the restore target orbax needs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
