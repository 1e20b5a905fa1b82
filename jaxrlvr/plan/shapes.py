"""The sizes the planner works on: the accelerators it checks, a step's workload on a mesh (rows, micro-batches,
sampler calls, per-device heads and widths), and each parameter's per-device shape from its sharding rule.

`plan/memory.py` turns these into bytes; nothing here allocates: the model is built with `nnx.eval_shape`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import run_setup
from jaxrlvr.rollout import bucket_length

GB = 1e9
BACKENDS = ("gpu", "tpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  memory: float  # bytes per device
  devices_per_host: int
  backend: str  # jax.default_backend() on it: what "auto" attention and the schedule are planned for


ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 80GB", 80 * GB, 8, "gpu"),
    "h200": Accelerator("NVIDIA H200 141GB", 141 * GB, 8, "gpu"),
    "v5p": Accelerator("TPU v5p (95 GB a chip)", 95 * GB, 4, "tpu"),
    "v5e": Accelerator("TPU v5e (16 GB a chip)", 16 * GB, 4, "tpu"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """The sizes the formulas use, derived from the config and the mesh (all per device unless named otherwise)."""
  model: models.ModelConfig
  mesh_shape: tuple[int, int, int]
  mesh_kind: str  # "devices" (specs from a real mesh) or "abstract" (jax.sharding.AbstractMesh)
  backend: str  # "gpu", "tpu" or "cpu": resolves attention="auto" and the schedule-dependent terms
  batch_shards: int  # data x fsdp
  rows: int  # rows of the global update batch (run_setup.batch_rows)
  micro_rows: int  # one micro-batch, one device; also one scoring pass (step.make_score_fn's chunks)
  rollout_rows: int  # one sampler call, one device (rollout.max_rows_per_device bounds it)
  sampler_calls: int  # calls a step's rollouts take
  prefill_rows: int  # rows of a device the prefill runs at once (rollout.prefill_rows_per_device)
  prefill_tokens: int  # prompt slots it writes at once (rollout.prefill_chunk_tokens)
  prompt_len: int  # bucketed, as the sampler and the batch pad it
  completion_len: int
  heads: int  # query heads on one device (split over tensor where the rule allows)
  kv_heads: int
  mlp: int
  vocab: int
  compute_bytes: int
  param_bytes: int
  engine: bool = False  # rollout.engine="continuous": rollout_rows are its decode slots, one state for the step
  # rollout.decode_weights="replicated": the sampler reads a copy of the weights without their fsdp split (the
  # engine's made once a call, the static sampler's gathered in each of its programs, before their loops)
  decode_copy: bool = False

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.completion_len

  def attention(self, q_len: int, kv_len: int) -> str:
    """The implementation attention="auto" (or the configured one) runs for a call of these lengths."""
    m = self.model
    return models.resolve_attention(m.attention, q_len=q_len, kv_len=kv_len, dtype=m.compute_dtype,
                                 head_dim=m.head_dim, backend=self.backend)


def shard_shape(shape: Sequence[int], spec: PartitionSpec, axis_sizes: dict[str, int]) -> tuple[int, ...]:
  """Per-device shape of an array of `shape` laid out by `spec` on a mesh with `axis_sizes` (exact division)."""
  out = []
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  for dim, entry in zip(shape, entries):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    parts = math.prod(axis_sizes[a] for a in axes)
    if dim % parts:
      raise ValueError(f"plan/report.py: dimension {dim} of {tuple(shape)} is not divisible by {parts} ({spec})")
    out.append(dim // parts)
  return tuple(out)


def spec_mesh(mesh_shape: Sequence[int]) -> tuple[Any, str]:
  """A real mesh over the first local devices when there are enough, else an AbstractMesh of the same shape."""
  mesh_shape = tuple(int(s) for s in mesh_shape)
  n = math.prod(mesh_shape)
  if jax.device_count() >= n:
    return parallel.make_mesh(*mesh_shape, devices=jax.devices()[:n]), "devices"
  return AbstractMesh(mesh_shape, parallel.MESH_AXES), "abstract"


@functools.lru_cache(maxsize=16)
def _abstract_params(cfg: models.ModelConfig):
  # Tracing an 8B model's constructor takes about a second, and one model is often planned on several meshes and for
  # several methods (the CLI's accelerator table, the tests).
  return nnx.state(nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def param_table(cfg: models.ModelConfig, mesh: Any) -> list[tuple[str, tuple[int, ...], PartitionSpec, int]]:
  """(path, global shape, PartitionSpec, dtype bytes) of every parameter, from an abstract model (no memory)."""
  state = _abstract_params(cfg)
  specs = dict(nnx.to_flat_state(parallel.param_specs(state, mesh)))
  table = []
  for path, var in nnx.to_flat_state(state):
    spec = specs[path].get_value()
    table.append((".".join(str(p) for p in path), tuple(var.shape), spec, jnp.dtype(var.dtype).itemsize))
  return table


def per_device_count(shape, spec, mesh, mesh_kind: str, drop_axes: Sequence[str] = ()) -> int:
  """Elements on one device; `drop_axes` are treated as unsharded (an all-gathered copy over them)."""
  if drop_axes:
    spec = PartitionSpec(*[_drop(e, drop_axes) for e in spec])
  if mesh_kind == "devices" and not drop_axes:
    return math.prod(NamedSharding(mesh, spec).shard_shape(shape))
  return math.prod(shard_shape(shape, spec, dict(mesh.shape)))


def _drop(entry, axes):
  if entry is None:
    return None
  kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
  return None if not kept else (kept[0] if len(kept) == 1 else kept)


def _split(name: str, size: int, mesh: Any) -> int:
  """`size` divided by the mesh axes the sharding rule of logical axis `name` gives it (1 when it does not divide)."""
  spec = parallel.logical_to_spec((name,), (size,), mesh)
  return shard_shape((size,), spec, dict(mesh.shape))[0]


def workload(config: Any, mesh_shape: Sequence[int], *, backend: str = "gpu", mesh: Any = None,
             mesh_kind: str | None = None, model: models.ModelConfig | None = None) -> Workload:
  """The sizes of one RL step on a (data, fsdp, tensor) mesh; `model` replaces the config's architecture."""
  if len(mesh_shape) != 3 or any(int(s) < 1 for s in mesh_shape):
    raise ValueError(f"plan/report.py: mesh {tuple(mesh_shape)} must be three positive sizes (data, fsdp, tensor)")
  if backend not in BACKENDS:
    raise ValueError(f"plan/report.py: backend={backend!r} is not one of {BACKENDS}")
  if mesh is None:
    mesh, mesh_kind = spec_mesh(mesh_shape)
  cfg = run_setup.model_config(config) if model is None else model
  data, fsdp, _ = (int(s) for s in mesh_shape)
  shards = data * fsdp
  rows = run_setup.batch_rows(config, shards)
  t, r = config.train, config.rollout
  # bounded.plan_calls: the step's rollouts padded to the shards, cut into calls of at most max rows each.
  per_device = -(-r.batch_size * r.group_size // shards)
  engine = r.get("engine", "static") == "continuous"
  # The engine's decode slots per device (scheduler.generate): decode_slots, else max_rows_per_device, else a
  # slot per row; rows beyond them queue in the same state. The static sampler: calls of max_rows_per_device rows.
  max_rows = run_setup.rows_per_sampler_call(config)
  bound = (r.get("decode_slots", 0) or max_rows) if engine else max_rows
  call_rows = min(per_device, bound) if bound > 0 else per_device
  prompt_len = bucket_length(config.data.max_prompt_len)
  return Workload(
      model=cfg, mesh_shape=tuple(int(s) for s in mesh_shape), mesh_kind=mesh_kind, backend=backend,
      batch_shards=shards, rows=rows, micro_rows=rows // (t.num_minibatches * t.num_microbatches * shards),
      rollout_rows=call_rows, sampler_calls=1 if engine else -(-per_device // call_rows),
      engine=engine, decode_copy=r.get("decode_weights", "replicated") == "replicated",
      prefill_rows=r.prefill_rows_per_device if 0 < r.prefill_rows_per_device < call_rows else call_rows,
      prefill_tokens=r.prefill_chunk_tokens if 0 < r.prefill_chunk_tokens < prompt_len else prompt_len,
      prompt_len=prompt_len, completion_len=r.max_new_tokens,
      heads=_split("q_heads", cfg.num_heads, mesh), kv_heads=_split("kv_heads", cfg.num_kv_heads, mesh),
      mlp=_split("mlp", cfg.intermediate_size, mesh), vocab=_split("vocab", cfg.vocab_size, mesh),
      compute_bytes=jnp.dtype(cfg.compute_dtype).itemsize, param_bytes=jnp.dtype(cfg.param_dtype).itemsize)
