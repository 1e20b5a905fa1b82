"""XLA's own per-device memory figures for the four device phases of an RL step, from abstract inputs.

Each phase is the jitted function the trainer runs: the update (`step.make_update_fn`), the scorer of old log-probs
(`step.make_score_fn` over the update batch), and one sampler call's prefill and decode (`sampling._compiled`). They
are lowered with `jax.ShapeDtypeStruct` arguments that carry the real NamedShardings on the requested mesh and
compiled, never run: nothing of the model's size is allocated, so a 7B-wide model compiles on a laptop. The figure
of a phase is `CompiledMemoryStats` argument + output + temp - alias bytes: what the executable holds on one device
while it runs (donated state is counted once). `plan.py --xla` prints these next to the planner's; tests/
test_plan_xla.py holds the planner to them.

On CPU take these figures with `plan_memory.CPU_MEMORY_FLAGS` in XLA_FLAGS before JAX starts its CPU client (the
per-compile option is ignored): XLA:CPU's default scheduler runs the rematerialised forward of every layer before
the backward starts, so remat saved nothing (the 7B-wide update: 18.8 GB more temporaries a layer with remat, 21.6
GB without; 2.7 GB with the flag), and its YNNPACK fusion computes a one-layer model's MLP in tiles.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlvr import engine
from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import plan_memory
from jaxrlvr import sampling
from jaxrlvr import step as step_lib
from jaxrlvr.models.config import ModelConfig

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


def abstract_params(model_config: ModelConfig, mesh: Any) -> tuple[Any, Any]:
  """(graphdef, params) of the model as `parallel.create_model` builds it, with ShapeDtypeStruct parameters."""
  abstract = nnx.eval_shape(lambda: models.Transformer(model_config, rngs=nnx.Rngs(0)))
  abstract.activation_sharding = parallel.batch_sharding(mesh)  # as parallel.create_model sets it
  graphdef, state = nnx.split(abstract)
  params = jax.tree.map(lambda v, s: _abstract(v.shape, v.dtype, s), state, parallel.param_shardings(state, mesh))
  return graphdef, params


def _update_batch(w: plan_memory.Workload, batch_sharding, *, kl: bool) -> dict:
  rows, s, t = w.rows, w.seq_len, w.completion_len
  batch = {"input_ids": (rows, s), "attention_mask": (rows, s), "completion_mask": (rows, t),
           "advantages": (rows, t), "old_logp": (rows, t), "behaviour_logp": (rows, t), "replayed": (rows,),
           "clip": (rows,)}
  if kl:
    batch["ref_logp"] = (rows, t)
  dtypes = {"input_ids": jnp.int32, "attention_mask": jnp.int32, "completion_mask": jnp.int32,
            "replayed": jnp.bool_, "clip": jnp.bool_}
  return {k: _abstract(shape, dtypes.get(k, jnp.float32), batch_sharding) for k, shape in batch.items()}


def compile_phases(config: Any, mesh: Any, model_config: ModelConfig | None = None,
                   phases: tuple[str, ...] = PHASES) -> dict[str, PhaseMemory]:
  """phase -> PhaseMemory of the trainer's jitted functions for `config` on `mesh` (a real mesh of local devices).

  `model_config` replaces the config's architecture (e.g. a preset with fewer layers); the sizes (rows, lengths,
  sampler bounds) are those `plan_memory.workload` derives from the config.
  """
  unknown = set(phases) - set(PHASES)
  if unknown:
    raise ValueError(f"plan_xla.py: unknown phases {sorted(unknown)}; known: {PHASES}")
  w = plan_memory.workload(config, tuple(mesh.shape[a] for a in parallel.MESH_AXES), mesh=mesh, mesh_kind="devices",
                           model=model_config)
  cfg = w.model
  graphdef, params = abstract_params(cfg, mesh)
  batch_sharding = parallel.batch_sharding(mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  out: dict[str, PhaseMemory] = {}
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
    out["update"] = PhaseMemory.of(update.lower(state, batch).compile())
  if "score" in phases:
    score = step_lib.make_score_fn(graphdef, temperature=config.rollout.temperature or 1.0,
                                   batch_sharding=batch_sharding, max_chunk_rows=w.micro_rows * w.batch_shards)
    batch = _update_batch(w, batch_sharding, kl=False)
    del batch["old_logp"]  # the trainer scores the batch before it has old log-probs
    out["score"] = PhaseMemory.of(score.lower(params, batch).compile())
  if w.engine and ("prefill" in phases or "decode" in phases):
    out.update(_engine_phases(config, w, mesh, graphdef, params, phases))
  elif "prefill" in phases or "decode" in phases:
    r = config.rollout
    spec = sampling._Spec(  # pylint: disable=protected-access  (the sampler's own compiled functions)
        graphdef=graphdef, max_new_tokens=w.completion_len, greedy=r.temperature == 0, top_k=int(r.top_k),
        nucleus=r.top_p < 1.0, return_logits=False, mesh=mesh, prefill_rows=int(r.prefill_rows_per_device),
        prefill_tokens=int(r.prefill_chunk_tokens))
    prefill, decode, _ = sampling._compiled(spec)  # pylint: disable=protected-access
    rows = w.rollout_rows * w.batch_shards
    key = jax.eval_shape(lambda: jax.random.key(0))
    controls = (_abstract(key.shape, key.dtype, replicated), _abstract((4,), jnp.int32, replicated),
                _abstract((), jnp.int32, replicated), _abstract((), jnp.float32, replicated),
                _abstract((), jnp.float32, replicated))
    inputs = (_abstract((rows, w.prompt_len), jnp.int32, batch_sharding),
              _abstract((rows, w.prompt_len), jnp.int32, batch_sharding),
              _abstract((rows,), jnp.bool_, batch_sharding), _abstract((rows,), jnp.int32, batch_sharding))
    compiled_prefill = prefill.lower(params, *inputs, controls).compile()
    if "prefill" in phases:
      out["prefill"] = PhaseMemory.of(compiled_prefill)
    if "decode" in phases:
      shapes = jax.eval_shape(prefill, params, *inputs, controls)
      loop_state = jax.tree.map(lambda x, s: _abstract(x.shape, x.dtype, s), shapes,
                                compiled_prefill.output_shardings)
      out["decode"] = PhaseMemory.of(decode.lower(params, loop_state).compile())
  return out


def _engine_phases(config: Any, w: plan_memory.Workload, mesh: Any, graphdef: Any, params: Any,
                   phases: tuple[str, ...]) -> dict[str, PhaseMemory]:
  """The rollout engine's insert (its prefill) and decode chunk for rollout.engine="continuous": w.rollout_rows slots
  a device, w.prefill_rows distinct prompts a device per insert, the weights in the decode layout when
  rollout.decode_weights="replicated"."""
  r = config.rollout
  if w.decode_copy:
    params = jax.eval_shape(lambda p: engine.decode_layout(p, mesh, w.model.compute_dtype), params)
  spec = engine.EngineSpec(graphdef=graphdef, max_new_tokens=w.completion_len, capacity=w.seq_len,
                           greedy=r.temperature == 0, top_k=int(r.top_k), nucleus=r.top_p < 1.0,
                           chunk_steps=int(r.decode_chunk_steps), mesh=mesh, prefill_tokens=int(r.prefill_chunk_tokens))
  fns = engine.compiled(spec)
  replicated, by_shard = NamedSharding(mesh, PartitionSpec()), parallel.batch_sharding(mesh)
  key = jax.eval_shape(lambda: jax.random.key(0))
  controls = engine.Controls(rng=_abstract(key.shape, key.dtype, replicated),
                             stop_ids=_abstract((4,), jnp.int32, replicated),
                             temperature=_abstract((), jnp.float32, replicated),
                             top_p=_abstract((), jnp.float32, replicated))
  slots = w.rollout_rows * w.batch_shards
  init = fns.init.lower(params, slots, controls)
  state = jax.tree.map(lambda x, sharding: _abstract(x.shape, x.dtype, sharding), init.out_info,
                       init.compile().output_shardings)
  out = {}
  if "prefill" in phases:
    prompts = w.prefill_rows * w.batch_shards
    entries = (w.batch_shards, w.rollout_rows)  # source, dest and row keys [shards, slots a shard]
    inputs = (_abstract((prompts, w.prompt_len), jnp.int32, by_shard), _abstract((prompts,), jnp.int32, by_shard),
              *(_abstract(entries, jnp.int32, by_shard) for _ in range(3)))
    out["prefill"] = PhaseMemory.of(fns.insert.lower(params, state, *inputs).compile())
  if "decode" in phases:
    out["decode"] = PhaseMemory.of(fns.decode_chunk.lower(params, state, _abstract((), jnp.int32, replicated))
                                   .compile())
  return out
