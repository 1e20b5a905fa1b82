"""The device mesh, sharded model creation and batch sharding helpers.

One mesh with axes ('data', 'fsdp', 'tensor'). Parameters carry logical axis names that the rules of
`models/sharding.py` map to mesh axes (`DEFAULT_RULES`, `logical_to_spec`, `param_specs` and `param_shardings` are
re-exported here). Batches are sharded over ('data', 'fsdp').

Axis types are Auto: jax >= 0.10 `jax.make_mesh` defaults to Explicit axes, with which `with_sharding_constraint`
and GSPMD propagation behave differently.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlvr import config_lib
from jaxrlvr import models
# The rules live with the model (models.hf places loaded tensors with them); callers reach them through this module.
from jaxrlvr.models import BATCH_AXES, DEFAULT_RULES, MESH_AXES, ModelConfig, Transformer
from jaxrlvr.models import logical_names, logical_to_spec, param_shardings, param_specs


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh with Auto axis types; one size may be -1 to take the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  sizes = {"data": int(data), "fsdp": int(fsdp), "tensor": int(tensor)}
  fill = [k for k, v in sizes.items() if v == -1]
  if len(fill) > 1:
    raise ValueError(f"parallel.py: only one mesh axis may be -1, got {sizes}")
  if any(v == 0 or v < -1 for v in sizes.values()):
    raise ValueError(f"parallel.py: mesh sizes must be positive or -1, got {sizes}")
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if fill:
    if n % fixed:
      raise ValueError(f"parallel.py: mesh {sizes}: the fixed sizes multiply to {fixed}, which does not divide the "
                       f"{n} devices")
    sizes[fill[0]] = n // fixed
  if math.prod(sizes.values()) != n:
    raise ValueError(f"parallel.py: mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
                     f"{math.prod(sizes.values())} devices, but there are {n}")
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:  # a topology-aware device order where the platform has one
    grid = mesh_utils.create_device_mesh(shape, devices)
  except (ValueError, NotImplementedError, AssertionError):  # odd device subsets: plain order is correct, only slower
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(config: Any, devices: Sequence[Any] | None = None) -> Mesh:
  """The mesh of `config.mesh` (keys data, fsdp, tensor)."""
  m = config.mesh
  return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, devices=devices)


def create_model(model_config: ModelConfig, mesh: Mesh, *, seed: int = 0, rules: Any = None) -> Transformer:
  """A randomly initialised Transformer whose parameters are created already sharded on `mesh`.

  The abstract model (`nnx.eval_shape`) gives the shapes and logical names; the init then runs under jit with those
  out_shardings, so no device ever holds the full unsharded parameters.
  """
  def init() -> Transformer:
    return Transformer(model_config, rngs=nnx.Rngs(seed))

  abstract = nnx.eval_shape(init)
  abstract.activation_sharding = batch_sharding(mesh)  # rows of the hidden states over the batch axes
  graphdef, abs_state = nnx.split(abstract)
  shardings = param_shardings(abs_state, mesh, rules)
  state = jax.jit(lambda: nnx.state(init()), out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def model_from_config(config: Any, mesh: Mesh, *, rules: Any = None) -> tuple[Transformer, ModelConfig]:
  """The run's model, sharded on `mesh`: loaded from `config.model.path` when set (an HF directory), else created
  from the preset `config.model.preset` with seed `config.seed`. dtypes, attention, remat and scan_layers come from
  config.model (scan_layers off when a config from before the option lacks it).
  """
  m = config.model
  if m.path:
    return models.load_pretrained(m.path, dtype=m.param_dtype, compute_dtype=m.compute_dtype, mesh=mesh,
                                  rules=rules, attention=m.attention, attention_block_size=m.attention_block_size,
                                  remat=m.remat, scan_layers=m.get("scan_layers", False))
  model_config = models.from_config(config)
  return create_model(model_config, mesh, seed=config.seed, rules=rules), model_config


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding for [B, ...] arrays: the batch dimension over ('data', 'fsdp'), the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def batch_shards(mesh: Mesh) -> int:
  """How many pieces `batch_sharding` cuts the batch dimension into: data x fsdp."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def shard_batch(tree: Any, mesh: Mesh) -> Any:
  """Puts host arrays [B, ...] (this process's rows) on the mesh as global arrays sharded over the batch axes.

  On one process this is `device_put`; with several, each process passes its own rows and the global batch is their
  concatenation in process order (every process must pass the same number of rows).
  """
  sharding = batch_sharding(mesh)
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def put_global(tree: Any, sharding: NamedSharding) -> Any:
  """Puts host arrays that every process holds in full (the same global value everywhere) on `sharding`; each
  process transfers only the pieces its own devices hold. On one process this is `device_put`."""
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  return jax.tree.map(
      lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index, x=np.asarray(x): x[index]), tree)


def onto_mesh(tree: Any, mesh: Mesh) -> Any:
  """Replicates over `mesh` the leaves that live elsewhere (e.g. optimizer step counters that an un-sharded jit left
  on one device): with several processes a jitted function needs every argument on the same devices."""
  devices = set(mesh.devices.flat)

  def move(x):
    if isinstance(x, jax.Array) and x.sharding.device_set != devices:
      return put_global(np.asarray(x), replicated(mesh))
    return x

  return jax.tree.map(move, tree)


def _path_str(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def param_count(model_or_state: Any) -> int:
  """Number of parameters (nnx.Param entries) of a model, abstract model or State."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
  return int(sum(math.prod(v.shape) for _, v in nnx.to_flat_state(state) if isinstance(v, nnx.Param)))


def describe_sharding(model: Any, mesh: Mesh | None = None, rules: Any = None) -> str:
  """A table of parameter path, shape, logical names and PartitionSpec.

  The spec is the array's actual sharding when it has a NamedSharding; otherwise (abstract or single-device models)
  the one the rules would give on `mesh`, or '-' without a mesh.
  """
  rows = [("path", "shape", "logical", "spec")]
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = logical_names(v)
    value = v.get_value()
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, NamedSharding):
      spec = str(sharding.spec)
    elif mesh is not None and names:
      spec = str(logical_to_spec(names, v.shape, mesh, rules))
    else:
      spec = "-"
    rows.append((_path_str(path), str(tuple(v.shape)), str(tuple(names) if names else ()), spec))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.append(f"total parameters: {param_count(model):,}")
  return "\n".join(lines)


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1, *,
                           heartbeat_timeout_s: int = 100) -> None:
  """Joins this process to a multi-process JAX job; a no-op for a single process.

  Sources, first match wins: explicit arguments (main's --coordinator_address/--num_processes/--process_id), the
  JAXRLVR_COORDINATOR / JAXRLVR_NUM_PROCESSES / JAXRLVR_PROCESS_ID variables that `launch/local.sh` and
  `launch/slurm.sbatch` set, then JAX's own cluster detection (TPU pods, SLURM with more than one task).
  heartbeat_timeout_s: how long JAX's coordination service waits for a silent process before it ends the others
  (a collective with a dead process may otherwise wait for ever on GPU and TPU; multihost.PeerLost).
  """
  import os  # pylint: disable=g-import-not-at-top
  env = os.environ

  def env_int(name: str, default: int) -> int:
    value = env.get(name, "")
    if not value:
      return default
    if not value.lstrip("-").isdigit():
      raise config_lib.ConfigError(f"{name}={value!r} is not an integer")
    return int(value)

  coordinator_address = coordinator_address or env.get("JAXRLVR_COORDINATOR", "")
  num_processes = num_processes or env_int("JAXRLVR_NUM_PROCESSES", 0)
  process_id = process_id if process_id >= 0 else env_int("JAXRLVR_PROCESS_ID", -1)
  if coordinator_address:
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise config_lib.ConfigError(f"--coordinator_address={coordinator_address!r} (or JAXRLVR_COORDINATOR) is not "
                                   "host:port, e.g. 10.0.0.1:1234")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise config_lib.ConfigError(
          f"--coordinator_address={coordinator_address!r} needs --num_processes >= 1 and 0 <= --process_id < "
          f"--num_processes (or JAXRLVR_NUM_PROCESSES / JAXRLVR_PROCESS_ID), got {num_processes} and {process_id}")
    if num_processes == 1:
      return
    if env.get("JAX_PLATFORMS", "") == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
  elif int(env.get("SLURM_NTASKS", "1")) > 1 or env.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
