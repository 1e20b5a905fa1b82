"""A sampler call's prefill and decode lowered and compiled on abstract inputs, never run: the planner's `--xla`
figures (jaxrlvr/plan/xla.py) of the static sampler's functions (sampler.py) or the engine's (engine.py).

The inputs are `jax.ShapeDtypeStruct`s that carry the real shardings on the given mesh, so nothing of the model's
size is allocated and a 7B-wide model compiles on a laptop.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlvr.rollout import engine
from jaxrlvr.rollout import sampler
from jaxrlvr.rollout.bounded import BATCH_AXES, batch_shards


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def lower_sampler_phases(graphdef: Any, params: Any, mesh: Any, *, use_engine: bool = False,
                         phases: tuple[str, ...] = ("prefill", "decode"), max_new_tokens: int, prompt_len: int,
                         rows_per_shard: int, prefill_rows_per_shard: int, capacity: int, top_k: int,
                         top_p: float, prefill_rows_per_device: int, prefill_chunk_tokens: int,
                         decode_chunk_steps: int, decode_copy: bool, compute_dtype: Any,
                         compiler_options: dict | None = None) -> dict[str, Any]:
  """phase -> compiled executable of one sampler call on `mesh`: "prefill" and "decode" of the static sampler, or
  with `use_engine` the rollout engine's insert (its prefill, `prefill_rows_per_shard` prompts a shard) and decode chunk
  over `rows_per_shard` slots a shard. `decode_copy` (rollout.decode_weights="replicated") reads the weights in the
  decode layout: the engine's copy made before its calls, the static sampler's gathered inside each program before
  its loops. `params` are abstract (ShapeDtypeStructs with their shardings)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  by_shard = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
  shards = batch_shards(mesh)
  key = jax.eval_shape(lambda: jax.random.key(0))
  if use_engine:
    return _engine_phases(graphdef, params, mesh, phases=phases, max_new_tokens=max_new_tokens,
                          prompt_len=prompt_len, slots=rows_per_shard, prompts=prefill_rows_per_shard,
                          shards=shards, capacity=capacity, top_k=top_k, top_p=top_p,
                          chunk_steps=decode_chunk_steps, prefill_tokens=prefill_chunk_tokens,
                          decode_copy=decode_copy, compute_dtype=compute_dtype, key=key, replicated=replicated,
                          by_shard=by_shard, compiler_options=compiler_options)
  layout = sampler.decode_weight_layout(params, mesh, "replicated" if decode_copy else "training", compute_dtype)
  spec = sampler._Spec(  # pylint: disable=protected-access  (the sampler's own compiled functions)
      graphdef=graphdef, max_new_tokens=max_new_tokens, top_k=top_k, nucleus=top_p < 1.0,
      return_logits=False, mesh=mesh, prefill_rows=prefill_rows_per_device, prefill_tokens=prefill_chunk_tokens,
      **layout)
  prefill, decode, _ = sampler._compiled(spec)  # pylint: disable=protected-access
  rows = rows_per_shard * shards
  controls = (_abstract(key.shape, key.dtype, replicated), _abstract((4,), jnp.int32, replicated),
              _abstract((), jnp.int32, replicated), _abstract((), jnp.float32, replicated),
              _abstract((), jnp.float32, replicated))
  inputs = (_abstract((rows, prompt_len), jnp.int32, by_shard), _abstract((rows, prompt_len), jnp.int32, by_shard),
            _abstract((rows,), jnp.bool_, by_shard), _abstract((rows,), jnp.int32, by_shard))
  compiled_prefill = prefill.lower(params, *inputs, controls).compile(compiler_options)
  out = {}
  if "prefill" in phases:
    out["prefill"] = compiled_prefill
  if "decode" in phases:
    shapes = jax.eval_shape(prefill, params, *inputs, controls)
    loop_state = jax.tree.map(lambda x, s: _abstract(x.shape, x.dtype, s), shapes, compiled_prefill.output_shardings)
    out["decode"] = decode.lower(params, loop_state).compile(compiler_options)
  return out


def _engine_phases(graphdef, params, mesh, *, phases, max_new_tokens, prompt_len, slots, prompts, shards, capacity,
                   top_k, top_p, chunk_steps, prefill_tokens, decode_copy, compute_dtype, key,
                   replicated, by_shard, compiler_options) -> dict[str, Any]:
  if decode_copy:
    params = jax.eval_shape(lambda p: engine.decode_layout(p, mesh, compute_dtype), params)
  spec = engine.EngineSpec(graphdef=graphdef, max_new_tokens=max_new_tokens, capacity=capacity,
                           top_k=top_k, nucleus=top_p < 1.0, chunk_steps=chunk_steps,
                           mesh=mesh, prefill_tokens=prefill_tokens)
  fns = engine.compiled(spec)
  controls = engine.Controls(rng=_abstract(key.shape, key.dtype, replicated),
                             stop_ids=_abstract((4,), jnp.int32, replicated),
                             temperature=_abstract((), jnp.float32, replicated),
                             top_p=_abstract((), jnp.float32, replicated))
  init = fns.init.lower(params, slots * shards, controls)
  state = jax.tree.map(lambda x, sharding: _abstract(x.shape, x.dtype, sharding), init.out_info,
                       init.compile(compiler_options).output_shardings)
  out = {}
  if "prefill" in phases:
    entries = (shards, slots)  # source, dest and row keys [shards, slots a shard]
    inputs = (_abstract((prompts * shards, prompt_len), jnp.int32, by_shard),
              _abstract((prompts * shards,), jnp.int32, by_shard),
              *(_abstract(entries, jnp.int32, by_shard) for _ in range(3)))
    out["prefill"] = fns.insert.lower(params, state, *inputs).compile(compiler_options)
  if "decode" in phases:
    out["decode"] = fns.decode_chunk.lower(params, state, _abstract((), jnp.int32, replicated)).compile(
        compiler_options)
  return out
