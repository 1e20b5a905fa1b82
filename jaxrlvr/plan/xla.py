"""XLA's own per-device memory figures for the four device phases of an RL step, from abstract inputs.

Each phase is the jitted function the trainer runs: the update (`step.make_update_fn`), the scorer of old log-probs
(`step.make_score_fn` over the update batch), and one sampler call's prefill and decode (`rollout.lower_sampler_phases`). They
are lowered with `jax.ShapeDtypeStruct` arguments that carry the real NamedShardings on the requested mesh and
compiled, never run: nothing of the model's size is allocated, so a 7B-wide model compiles on a laptop. The figure
of a phase is `CompiledMemoryStats` argument + output + temp - alias bytes: what the executable holds on one device
while it runs (donated state is counted once). `plan/report.py --xla` prints these next to the planner's; tests/
test_plan_xla.py holds the planner to them.

On CPU take these figures with `memory_lib.CPU_MEMORY_FLAGS` in XLA_FLAGS before JAX starts its CPU client (the
per-compile option is ignored): XLA:CPU's default scheduler runs the rematerialised forward of every layer before
the backward starts, so remat saved nothing (the 7B-wide update: 18.8 GB more temporaries a layer with remat, 21.6
GB without; 2.7 GB with the flag), and its YNNPACK fusion computes a one-layer model's MLP in tiles.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import rollout
from jaxrlvr import step as step_lib
from jaxrlvr.plan import memory as memory_lib

PHASES = ("update", "score", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
  """One compiled phase's CompiledMemoryStats, bytes per device."""
  argument: int
  output: int
  alias: int
  temp: int

  @property
  def total(self) -> int:
    return self.argument + self.output + self.temp - self.alias

  @classmethod
  def of(cls, compiled: Any) -> "PhaseMemory":
    m = compiled.memory_analysis()
    return cls(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
               temp=m.temp_size_in_bytes)


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_params(model_config: models.ModelConfig, mesh: Any) -> tuple[Any, Any]:
  """(graphdef, params) of the model as `parallel.create_model` builds it, with ShapeDtypeStruct parameters."""
  abstract = nnx.eval_shape(lambda: models.Transformer(model_config, rngs=nnx.Rngs(0)))
  abstract.activation_sharding = parallel.batch_sharding(mesh)  # as parallel.create_model sets it
  graphdef, state = nnx.split(abstract)
  params = jax.tree.map(lambda v, s: _abstract(v.shape, v.dtype, s), state, parallel.param_shardings(state, mesh))
  return graphdef, params


def _update_batch(w: memory_lib.Workload, batch_sharding, *, kl: bool) -> dict:
  rows, s, t = w.rows, w.seq_len, w.completion_len
  batch = {"input_ids": (rows, s), "attention_mask": (rows, s), "completion_mask": (rows, t),
           "advantages": (rows, t), "old_logp": (rows, t), "behaviour_logp": (rows, t), "replayed": (rows,),
           "clip": (rows,)}
  if kl:
    batch["ref_logp"] = (rows, t)
  dtypes = {"input_ids": jnp.int32, "attention_mask": jnp.int32, "completion_mask": jnp.int32,
            "replayed": jnp.bool_, "clip": jnp.bool_}
  return {k: _abstract(shape, dtypes.get(k, jnp.float32), batch_sharding) for k, shape in batch.items()}


def compile_phases(config: Any, mesh: Any, model_config: models.ModelConfig | None = None,
                   phases: tuple[str, ...] = PHASES) -> dict[str, PhaseMemory]:
  """phase -> PhaseMemory of the trainer's jitted functions for `config` on `mesh` (a real mesh of local devices).

  `model_config` replaces the config's architecture (e.g. a preset with fewer layers); the sizes (rows, lengths,
  sampler bounds) are those `memory_lib.workload` derives from the config.
  """
  return {phase: PhaseMemory.of(compiled)
          for phase, (compiled, _) in compile_programs(config, mesh, model_config, phases).items()}


def compile_programs(config: Any, mesh: Any, model_config: models.ModelConfig | None = None,
                     phases: tuple[str, ...] = PHASES, *, backend: str | None = None,
                     compiler_options: dict | None = None) -> dict[str, tuple[Any, float]]:
  """phase -> (compiled executable, seconds its lowering and compile took) of the trainer's jitted functions for
  `config` on `mesh`: local devices, or a topology's compile-only ones (`plan/topology.py`), whose platform
  `backend` names for the planner's workload (default: the mesh's). `compiler_options` go to every `.compile`
  (e.g. XLA:TPU's xla_tpu_max_hbm_size_mib)."""
  unknown = set(phases) - set(PHASES)
  if unknown:
    raise ValueError(f"plan/xla.py: unknown phases {sorted(unknown)}; known: {PHASES}")
  backend = backend or mesh.devices.flat[0].platform
  w = memory_lib.workload(config, tuple(mesh.shape[a] for a in parallel.MESH_AXES), mesh=mesh, mesh_kind="devices",
                           model=model_config, backend=backend if backend in memory_lib.BACKENDS else "gpu")
  cfg = w.model
  graphdef, params = abstract_params(cfg, mesh)
  batch_sharding = parallel.batch_sharding(mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  out: dict[str, tuple[Any, float]] = {}
  start = time.perf_counter()
  if "update" in phases:
    optimizer = step_lib.make_optimizer(config)
    opt_state = jax.tree.map(lambda x, s: _abstract(x.shape, x.dtype, s), jax.eval_shape(optimizer.init, params),
                             step_lib.optimizer_state_sharding(params, optimizer, mesh))
    counter = _abstract((), jnp.int32, replicated)
    state = step_lib.TrainState(params=params, opt_state=opt_state, step=counter, skipped=counter)
    update = step_lib.make_update_fn(graphdef, config, optimizer, state_sharding=jax.tree.map(lambda x: x.sharding,
                                                                                               state),
                                     batch_sharding=batch_sharding)
    batch = _update_batch(w, batch_sharding, kl=config.loss.kl_coef > 0)
    out["update"] = (update.lower(state, batch).compile(compiler_options), time.perf_counter() - start)
  if "score" in phases:
    start = time.perf_counter()
    score = step_lib.make_score_fn(graphdef, temperature=config.rollout.temperature or 1.0,
                                   batch_sharding=batch_sharding, max_chunk_rows=w.micro_rows * w.batch_shards)
    batch = _update_batch(w, batch_sharding, kl=False)
    del batch["old_logp"]  # the trainer scores the batch before it has old log-probs
    out["score"] = (score.lower(params, batch).compile(compiler_options), time.perf_counter() - start)
  sampler_phases = [p for p in ("prefill", "decode") if p in phases]
  if sampler_phases:
    start = time.perf_counter()
    r = config.rollout
    compiled = rollout.lower_sampler_phases(
        graphdef, params, mesh, use_engine=bool(w.engine), phases=tuple(sampler_phases), max_new_tokens=w.completion_len,
        prompt_len=w.prompt_len, rows_per_shard=w.rollout_rows, prefill_rows_per_shard=w.prefill_rows,
        capacity=w.seq_len, top_k=int(r.top_k), top_p=r.top_p,
        prefill_rows_per_device=int(r.prefill_rows_per_device), prefill_chunk_tokens=int(r.prefill_chunk_tokens),
        decode_chunk_steps=int(r.decode_chunk_steps), decode_copy=bool(w.decode_copy),
        compute_dtype=w.model.compute_dtype, compiler_options=compiler_options)
    seconds = (time.perf_counter() - start) / len(compiled)  # the two compile together: their mean
    out.update({phase: (c, seconds) for phase, c in compiled.items()})
  return out
