"""Logical-axis rules: how the model's named parameter axes map onto the ('data', 'fsdp', 'tensor') device mesh.

Parameters carry logical axis names ('vocab', 'embed', 'q_heads', 'kv_heads', 'head_dim', 'mlp', 'norm'); rules map
each name to mesh axes. A dimension whose size is not divisible by the mesh axes its rule names keeps only the
leading axes that divide it (often none: replicated), so e.g. Qwen2.5's 2 kv heads on a tensor axis of 4 are
replicated instead of failing.

This lives beside the model, below `jaxrlvr.parallel`: the checkpoint loader (`models.hf`) places each tensor with
these rules, and `parallel` (mesh, sharded creation, batches) builds on the model package, never the other way round.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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
      raise KeyError(f"models/sharding.py: logical axis {name!r} has no rule; rules cover {sorted(table)}")
    axes = [a for a in table[name] if a not in used and mesh.shape[a] > 1]
    while axes and size % math.prod(mesh.shape[a] for a in axes):
      axes.pop()
    used.update(axes)
    spec.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
  return PartitionSpec(*spec)


def logical_names(var: nnx.Variable) -> tuple | None:
  """The logical axis names a variable was created with (None when it has none)."""
  return var.get_metadata().get("out_sharding")


def param_specs(model_or_state: Any, mesh: Mesh, rules: Any = None) -> nnx.State:
  """A State of PartitionSpecs, one per variable, from its logical names (unnamed variables are replicated)."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

  def spec(v):
    names = logical_names(v)
    return v.replace(PartitionSpec() if not names else logical_to_spec(names, v.shape, mesh, rules))

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Any = None) -> nnx.State:
  """A State of NamedShardings (same structure as the model state), usable as jit in/out_shardings."""
  specs = param_specs(model_or_state, mesh, rules)
  return jax.tree.map(lambda p: NamedSharding(mesh, p), specs)
