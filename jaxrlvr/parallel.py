"""The device mesh, logical-axis rules, sharded model creation and batch sharding helpers.

One mesh with axes ('data', 'fsdp', 'tensor'). Parameters carry logical axis names ('vocab', 'embed', 'q_heads',
'kv_heads', 'head_dim', 'mlp', 'norm'); rules map each name to mesh axes. A dimension whose size is not divisible by
the mesh axes its rule names keeps only the leading axes that divide it (often none: replicated), so e.g. Qwen2.5's 2
kv heads on a tensor axis of 4 are replicated instead of failing. Batches are sharded over ('data', 'fsdp').

Axis types are Auto: jax >= 0.10 `jax.make_mesh` defaults to Explicit axes, with which `with_sharding_constraint`
and GSPMD propagation behave differently.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlvr.models.config import ModelConfig
from jaxrlvr.models.transformer import Transformer

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical name -> mesh axis, tuple of mesh axes, or None (replicated).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
)


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


def _rules_dict(rules: Any) -> dict[str, tuple[str, ...]]:
  rules = DEFAULT_RULES if rules is None else rules
  items = rules.items() if isinstance(rules, Mapping) else rules
  out = {}
  for name, axes in items:
    out[name] = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
  return out


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Any = None) -> PartitionSpec:
  """PartitionSpec for an array with logical axis `names` and `shape`.

  Each dimension takes the mesh axes of its rule, minus axes of size 1 and axes an earlier dimension already uses,
  then keeps the longest leading run whose product divides the dimension (replicated when none does). Unknown
  logical names are an error naming the name, so a typo never silently replicates a 7B matrix.
  """
  table = _rules_dict(rules)
  used: set[str] = set()
  spec = []
  for name, size in zip(names, shape):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise KeyError(f"parallel.py: logical axis {name!r} has no rule; rules cover {sorted(table)}")
    axes = [a for a in table[name] if a not in used and mesh.shape[a] > 1]
    while axes and size % math.prod(mesh.shape[a] for a in axes):
      axes.pop()
    used.update(axes)
    spec.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
  return PartitionSpec(*spec)


def _names(var: nnx.Variable) -> tuple | None:
  return var.get_metadata().get("out_sharding")


def param_specs(model_or_state: Any, mesh: Mesh, rules: Any = None) -> nnx.State:
  """A State of PartitionSpecs, one per variable, from its logical names (unnamed variables are replicated)."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

  def spec(v):
    names = _names(v)
    return v.replace(PartitionSpec() if not names else logical_to_spec(names, v.shape, mesh, rules))

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Any = None) -> nnx.State:
  """A State of NamedShardings (same structure as the model state), usable as jit in/out_shardings."""
  specs = param_specs(model_or_state, mesh, rules)
  return jax.tree.map(lambda p: NamedSharding(mesh, p), specs)


def create_model(model_config: ModelConfig, mesh: Mesh, *, seed: int = 0, rules: Any = None) -> Transformer:
  """A randomly initialised Transformer whose parameters are created already sharded on `mesh`.

  The abstract model (`nnx.eval_shape`) gives the shapes and logical names; the init then runs under jit with those
  out_shardings, so no device ever holds the full unsharded parameters.
  """
  def init() -> Transformer:
    return Transformer(model_config, rngs=nnx.Rngs(seed))

  abstract = nnx.eval_shape(init)
  graphdef, abs_state = nnx.split(abstract)
  shardings = param_shardings(abs_state, mesh, rules)
  state = jax.jit(lambda: nnx.state(init()), out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def model_from_config(config: Any, mesh: Mesh, *, rules: Any = None) -> tuple[Transformer, ModelConfig]:
  """The run's model, sharded on `mesh`: loaded from `config.model.path` when set (an HF directory), else created
  from the preset `config.model.preset` with seed `config.seed`. dtypes, attention and remat come from config.model.
  """
  from jaxrlvr.models import config as config_lib  # models/__init__ imports hf, which imports this module lazily
  from jaxrlvr.models import hf

  m = config.model
  if m.path:
    return hf.load_pretrained(m.path, dtype=m.param_dtype, compute_dtype=m.compute_dtype, mesh=mesh, rules=rules,
                              attention=m.attention, remat=m.remat)
  model_config = config_lib.from_config(config)
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
    names = _names(v)
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


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
  """Joins this process to a multi-process JAX job; a no-op for a single process.

  Sources, first match wins: explicit arguments (main's --coordinator_address/--num_processes/--process_id), the
  JAXRLVR_COORDINATOR / JAXRLVR_NUM_PROCESSES / JAXRLVR_PROCESS_ID variables that `launch/local.sh` and
  `launch/slurm.sbatch` set, then JAX's own cluster detection (TPU pods, SLURM with more than one task).
  """
  import os  # pylint: disable=g-import-not-at-top
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAXRLVR_COORDINATOR", "")
  num_processes = num_processes or int(env.get("JAXRLVR_NUM_PROCESSES", "0"))
  process_id = process_id if process_id >= 0 else int(env.get("JAXRLVR_PROCESS_ID", "-1"))
  if coordinator_address:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"parallel.py: coordinator {coordinator_address!r} needs num_processes >= 1 and 0 <= "
                       f"process_id < num_processes, got {num_processes} and {process_id}")
    if num_processes == 1:
      return
    if env.get("JAX_PLATFORMS", "") == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif int(env.get("SLURM_NTASKS", "1")) > 1 or env.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
    jax.distributed.initialize()
