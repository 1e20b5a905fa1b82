"""KV-cache sampler: one jitted prefill, then one jitted `lax.while_loop` decode over a preallocated cache.

Rollouts dominate the cost of an RL step, so shapes are kept fixed: ragged prompts are left-padded to a length bucket
(`bucket_length`), the batch is padded to a multiple of the mesh's batch shards, and the KV cache is preallocated at
bucket + max_new_tokens. Two batches whose prompts fall in the same bucket reuse the compiled prefill and decode.

Conventions the trainer relies on:
- `logprobs` are the log-probabilities of each sampled token under the distribution actually sampled from (after
  temperature, top-k, top-p), so replay ratios pi / pi_behaviour are exact. `entropies` are of that same distribution.
- Greedy (temperature 0): the sampled distribution is a point mass, whose log-prob and entropy carry no information.
  We return instead the log-softmax at temperature 1 of the argmax token and the temperature-1 entropy, i.e. what
  `jaxrlvr.scoring.score` gives for the same sequence; this is our documented choice.
- After the first stop token a row emits `pad_id` with log-prob and entropy 0; `lengths` count up to and including
  the stop token (max_new_tokens when none was produced).
- Randomness: a token is drawn by inverse-CDF sampling from one uniform number; row r's numbers come from the key
  fold_in(rng, r), so a row's samples do not depend on how many padding rows the batch or the mesh added after it,
  nor on how max_rows_per_device cuts the rows into calls (r is the row's index in the prompts; with several
  processes, process p's rows come after the unsplit, padded rows of processes < p).
  Only temperature 0, top_k and whether top_p < 1 are compiled in; temperature and top_p values, stop ids (up to 4
  without recompiling) and pad_id are traced.
- Bounded memory (`generate`'s max_rows_per_device, prefill_rows_per_device, prefill_chunk_tokens; 0 switches each
  off): the prompts are cut into sampler calls of at most max_rows_per_device rows per batch shard, one compiled
  shape for all of them (`rollout/bounded.py`); within a call the prefill writes the cache a block of rows at a time
  (prefill_rows_per_device rows of every device) and each block's prompt a chunk of prefill_chunk_tokens slots at a
  time, so the prefill's activations are those of one block and chunk. None of this changes a row's samples: the
  results are those of the unsplit call up to float rounding (the tests hold tokens exactly, float32 log-probs to
  1e-6). The cache and the decode are those of the whole call.
- `engine="continuous"` hands the call to the rollout engine (`rollout/engine.py` on the device, `rollout/scheduler.py` on the
  host): fixed decode slots that rows leave as they stop and queued rows enter, the same row randomness and outputs.
  The token draw itself (`SampleOutput`, `sample_logits`) lives in `rollout/decode.py`, shared by both.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlvr import multihost
from jaxrlvr.rollout import bounded
from jaxrlvr.rollout import scheduler
from jaxrlvr.rollout.bounded import BATCH_AXES, MEMORY_LIMITS

from jaxrlvr.rollout.decode import SampleOutput
from jaxrlvr.rollout.decode import already_laid_out, decode_shardings, in_decode_layout
from jaxrlvr.rollout.decode import sample as _sample

TENSOR_AXIS = "tensor"
ENGINES = ("static", "continuous")  # `generate`'s engine (config rollout.engine)
# `generate`'s arguments and rollout.* keys of the same names
ENGINE_SETTINGS = ("engine", "decode_slots", "decode_chunk_steps", "decode_weights")

# Incremented each time a jitted sampler function is traced (compiled): the no-recompilation test reads it.
TRACE_COUNTS: collections.Counter = collections.Counter()


# ----------------------------------------------------------------------------------------------------------------------
# The jitted loop.


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one compiled sampler (with the input shapes, the jit cache key)."""
  graphdef: Any
  max_new_tokens: int
  top_k: int
  nucleus: bool  # top_p < 1 (the values of temperature and top_p are traced: changing them does not recompile)
  return_logits: bool
  mesh: Any
  prefill_rows: int = 0  # rows of each device the prefill runs at once (0: all); the decode ignores it
  prefill_tokens: int = 0  # prompt slots the prefill writes at once (0: the whole bucket); the decode ignores it
  # decode_weights="replicated" on a mesh that splits the weights over the batch axes: each weight's sharding in
  # the loops (`decode.decode_shardings`), gathered once a call before them; None reads them where they are.
  weight_shardings: tuple | None = None
  compute_dtype: str = "float32"  # the dtype the weights are gathered in (the model's compute dtype)


@struct.dataclass
class _LoopState:
  """The decode carry; donated to the decode call so the cache and outputs are updated in place."""
  step: jax.Array  # [] int32: index of the token sampled next
  uniforms: jax.Array  # [B, N] f32: row r's draws, from the key fold_in(rng, row_keys[r])
  stop_ids: jax.Array  # [E] int32 stop tokens, -1 for unused slots (traced: a new stop set does not recompile)
  pad_id: jax.Array  # [] int32
  temperature: jax.Array  # [] f32
  top_p: jax.Array  # [] f32
  last_token: jax.Array  # [B] int32: the token fed at the next step
  position: jax.Array  # [B] int32: RoPE position of last_token
  done: jax.Array  # [B] bool: the row has produced a stop token
  tokens: jax.Array  # [B, N] int32
  logprobs: jax.Array  # [B, N] f32
  entropies: jax.Array  # [B, N] f32
  lengths: jax.Array  # [B] int32
  logits: Any  # [B, N, V] f32 when return_logits, else None
  cache: Any  # per layer {'k', 'v': [B, N_kv, S, H]}, or the token buffer [B, S] without a cache
  key_mask: jax.Array  # [B, S] 1 for real prompt tokens and every generated slot


def _record(spec: _Spec, state: _LoopState, logits: jax.Array) -> _LoopState:
  """Samples step `state.step` from `logits` [B, V] and writes it into the outputs."""
  step = state.step
  uniform = jax.lax.dynamic_index_in_dim(state.uniforms, step, axis=1, keepdims=False)  # [B]
  tok, logp, ent = _sample(logits, uniform, state.temperature, state.top_p, top_k=spec.top_k,
                           nucleus=spec.nucleus)  # [B] each
  active = ~state.done
  tok = jnp.where(active, tok, state.pad_id)
  logp = jnp.where(active, logp, 0.0)
  ent = jnp.where(active, ent, 0.0)
  is_stop = jnp.any(tok[:, None] == state.stop_ids[None, :], axis=1)  # [B]
  out_logits = state.logits
  if spec.return_logits:
    out_logits = jax.lax.dynamic_update_slice(out_logits, logits[:, None, :], (0, step, 0))
  return state.replace(
      step=step + 1,
      last_token=tok,
      done=state.done | (active & is_stop),
      tokens=jax.lax.dynamic_update_slice(state.tokens, tok[:, None], (0, step)),
      logprobs=jax.lax.dynamic_update_slice(state.logprobs, logp[:, None], (0, step)),
      entropies=jax.lax.dynamic_update_slice(state.entropies, ent[:, None], (0, step)),
      lengths=state.lengths + active.astype(jnp.int32),
      logits=out_logits,
  )


def _uniforms(rng: jax.Array, row_keys: jax.Array, steps: int) -> jax.Array:
  """All the random draws of a call, [B, N], made once before the loop rather than a key split per step.

  Row r draws its N numbers from the key fold_in(rng, row_keys[r]): one stream per row, about N / 2 hashes each (a
  key per (step, row) cost three hashes a draw, ~4% of a tiny-model call on CPU). row_keys [B] are the rows' indices
  in the whole (unsplit) batch, so how the rows are cut into calls does not change their draws.
  """
  draw = lambda row: jax.random.uniform(jax.random.fold_in(rng, row), (steps,))
  return jax.vmap(draw)(row_keys)  # [B, N]


def _constrain(spec: _Spec, x: jax.Array, tensor_dim: int | None = None) -> jax.Array:
  """Shards dim 0 of `x` over the batch axes (and `tensor_dim` over 'tensor' when it divides); no-op without mesh."""
  if spec.mesh is None:
    return x
  axes: list[Any] = [None] * x.ndim
  axes[0] = BATCH_AXES
  if tensor_dim is not None and x.shape[tensor_dim] % spec.mesh.shape[TENSOR_AXIS] == 0:
    axes[tensor_dim] = TENSOR_AXIS
  return jax.lax.with_sharding_constraint(x, NamedSharding(spec.mesh, P(*axes)))


def _initial_state(spec: _Spec, ids: jax.Array, mask: jax.Array, real: jax.Array, row_keys: jax.Array,
                   controls: tuple, cache: Any, vocab_size: int) -> _LoopState:
  """The carry before the first token; rows that only pad the batch (`real` False) start as done."""
  batch, prompt_len = ids.shape
  n = spec.max_new_tokens
  key_mask = jnp.concatenate([mask, jnp.ones((batch, n), mask.dtype)], axis=1)  # [B, S]
  rng, stop_ids, pad_id, temperature, top_p = controls
  return _LoopState(
      step=jnp.zeros((), jnp.int32),
      uniforms=_constrain(spec, _uniforms(rng, row_keys, n)),
      stop_ids=stop_ids,
      pad_id=pad_id,
      temperature=temperature,
      top_p=top_p,
      last_token=ids[:, -1],
      position=jnp.sum(mask, axis=1).astype(jnp.int32),  # the first generated token sits at position prompt_len
      done=~real,
      tokens=_constrain(spec, jnp.full((batch, n), pad_id, jnp.int32)),
      logprobs=_constrain(spec, jnp.zeros((batch, n), jnp.float32)),
      entropies=_constrain(spec, jnp.zeros((batch, n), jnp.float32)),
      lengths=jnp.zeros((batch,), jnp.int32),
      logits=(_constrain(spec, jnp.zeros((batch, n, vocab_size), jnp.float32)) if spec.return_logits else None),
      cache=cache,
      key_mask=_constrain(spec, key_mask),
  )


def _prefill(spec: _Spec, params: Any, ids: jax.Array, mask: jax.Array, real: jax.Array, row_keys: jax.Array,
             controls: tuple) -> _LoopState:
  """Writes the left-padded prompts [B, P] into a fresh cache of P + N slots and samples the first token."""
  TRACE_COUNTS["prefill"] += 1
  params = in_decode_layout(params, spec.weight_shardings, spec.compute_dtype)
  model = nnx.merge(spec.graphdef, params)
  batch = ids.shape[0]
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)  # [B, P]
  state = _initial_state(spec, ids, mask, real, row_keys, controls, None, _vocab_size(model))
  shards = bounded.batch_shards(spec.mesh)
  per_device = batch // shards
  if 0 < spec.prefill_rows < per_device:
    cache, last = _prefill_row_blocks(spec, params, ids, positions, state.key_mask, shards, spec.prefill_rows)
  else:
    cache, last = _prefill_rows(spec, params, ids, positions, state.key_mask)
  logits = model.logits(last)  # [B, V]; the last slot is a real token for every row (left padding)
  return _record(spec, state.replace(cache=cache), logits)


def _prefill_rows(spec: _Spec, params: Any, ids: jax.Array, positions: jax.Array,
                  key_mask: jax.Array) -> tuple[Any, jax.Array]:
  """Prefills rows ids [R, P] into a fresh cache of key_mask.shape[1] slots: (cache, hidden [R, D] of slot P - 1).

  With spec.prefill_tokens = C < P the prompt goes in C slots at a time, the cache index advancing. Chunk c starts
  at min(c * C, P - C): when C does not divide P the last chunk overlaps the one before and writes those slots again
  with the keys and values they already hold (the causal mask keeps every query to the slots before it), so every
  chunk has one shape and one loop body serves them all.
  """
  model = nnx.merge(spec.graphdef, params)
  rows, prompt_len = ids.shape
  cache = model.init_cache(rows, key_mask.shape[1])
  cache = jax.tree.map(lambda c: _constrain(spec, c, tensor_dim=1), cache)  # [R, N_kv, S, H]
  width = spec.prefill_tokens if 0 < spec.prefill_tokens < prompt_len else prompt_len
  if width == prompt_len:
    hidden, cache = model.hidden(ids, positions=positions, attention_mask=key_mask, cache=cache,
                                 cache_index=jnp.zeros((), jnp.int32))  # [R, P, D]
    return cache, hidden[:, -1]
  dtype = jnp.dtype(model.config.compute_dtype)  # the dtype of the final norm's output

  def chunk(c: jax.Array, carry: tuple) -> tuple:
    cache, _ = carry
    start = jnp.minimum(c * width, prompt_len - width)
    chunk_ids = jax.lax.dynamic_slice_in_dim(ids, start, width, axis=1)  # [R, C]
    chunk_positions = jax.lax.dynamic_slice_in_dim(positions, start, width, axis=1)  # [R, C]
    hidden, cache = nnx.merge(spec.graphdef, params).hidden(
        chunk_ids, positions=chunk_positions, attention_mask=key_mask, cache=cache, cache_index=start)  # [R, C, D]
    return cache, hidden[:, -1].astype(dtype)

  last = _constrain(spec, jnp.zeros((rows, model.config.hidden_size), dtype))
  return jax.lax.fori_loop(0, -(-prompt_len // width), chunk, (cache, last))


def _prefill_row_blocks(spec: _Spec, params: Any, ids: jax.Array, positions: jax.Array, key_mask: jax.Array,
                        shards: int, block: int) -> tuple[Any, jax.Array]:
  """`_prefill_rows` over blocks of `block` rows of every batch shard at a time, written into one cache for all rows.

  The batch [B] is viewed as [shards, B / shards] (device d's rows along dim 1), so a block takes the same rows of
  every device and each device works on `block` rows at a time. Block j starts at min(j * block, B / shards - block):
  when `block` does not divide a device's rows the last block overlaps the one before and writes those rows again
  with the same values, so every block has one shape.
  """
  batch = ids.shape[0]
  per_device = batch // shards

  def by_device(x: jax.Array, tensor_dim: int | None = None) -> jax.Array:
    return _constrain(spec, x.reshape(shards, per_device, *x.shape[1:]), tensor_dim)  # [B, ...] -> [shards, B/sh, ...]

  def rows_of(x: jax.Array, start: jax.Array) -> jax.Array:
    part = jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)  # [shards, block, ...]
    return _constrain(spec, part.reshape(shards * block, *x.shape[2:]))  # [shards * block, ...]

  model = nnx.merge(spec.graphdef, params)
  views = [by_device(x) for x in (ids, positions, key_mask)]
  cache = jax.tree.map(lambda c: by_device(c, tensor_dim=2), model.init_cache(batch, key_mask.shape[1]))
  last = by_device(jnp.zeros((batch, model.config.hidden_size), jnp.dtype(model.config.compute_dtype)))

  def run_block(j: jax.Array, carry: tuple) -> tuple:
    cache, last = carry
    start = jnp.minimum(j * block, per_device - block)
    block_cache, block_last = _prefill_rows(spec, params, *(rows_of(x, start) for x in views))
    write = lambda full, part: jax.lax.dynamic_update_slice_in_dim(
        full, part.reshape(shards, block, *part.shape[1:]).astype(full.dtype), start, axis=1)
    return jax.tree.map(write, cache, block_cache), write(last, block_last)

  cache, last = jax.lax.fori_loop(0, -(-per_device // block), run_block, (cache, last))
  cache = jax.tree.map(lambda c: _constrain(spec, c.reshape(batch, *c.shape[2:]), tensor_dim=1), cache)
  return cache, _constrain(spec, last.reshape(batch, -1))  # [B, N_kv, S, H] per layer, [B, D]


def _decode(spec: _Spec, params: Any, state: _LoopState) -> _LoopState:
  """Feeds back one token per step until every row has stopped or max_new_tokens tokens exist."""
  TRACE_COUNTS["decode"] += 1
  params = in_decode_layout(params, spec.weight_shardings, spec.compute_dtype)  # gathered here, not in the loop
  prompt_len = state.key_mask.shape[1] - spec.max_new_tokens

  def cond(s: _LoopState) -> jax.Array:
    return (s.step < spec.max_new_tokens) & ~jnp.all(s.done)

  def body(s: _LoopState) -> _LoopState:
    model = nnx.merge(spec.graphdef, params)
    hidden, cache = model.hidden(s.last_token[:, None], positions=s.position[:, None], attention_mask=s.key_mask,
                                 cache=s.cache, cache_index=prompt_len + s.step - 1)  # [B, 1, D]
    s = s.replace(cache=cache, position=s.position + 1)
    return _record(spec, s, model.logits(hidden[:, 0]))

  return jax.lax.while_loop(cond, body, state)


def _generate_uncached(spec: _Spec, params: Any, ids: jax.Array, mask: jax.Array, real: jax.Array,
                       row_keys: jax.Array, controls: tuple) -> _LoopState:
  """The same sampler without a KV cache: every step recomputes the whole fixed-size buffer [B, P + N].

  The reference for the cache (tests) and the baseline of the benchmark. Slots after the current step hold pad
  tokens the causal mask keeps out of view.
  """
  TRACE_COUNTS["uncached"] += 1
  params = in_decode_layout(params, spec.weight_shardings, spec.compute_dtype)
  model = nnx.merge(spec.graphdef, params)
  batch, prompt_len = ids.shape
  buffer = jnp.concatenate([ids, jnp.full((batch, spec.max_new_tokens), controls[2], ids.dtype)], axis=1)  # [B, S]
  state = _initial_state(spec, ids, mask, real, row_keys, controls, _constrain(spec, buffer), _vocab_size(model))
  positions = jnp.maximum(jnp.cumsum(state.key_mask, axis=1) - 1, 0).astype(jnp.int32)  # [B, S]

  def cond(s: _LoopState) -> jax.Array:
    return (s.step < spec.max_new_tokens) & ~jnp.all(s.done)

  def body(s: _LoopState) -> _LoopState:
    m = nnx.merge(spec.graphdef, params)
    hidden, _ = m.hidden(s.cache, positions=positions, attention_mask=s.key_mask)  # [B, S, D]
    last = jax.lax.dynamic_index_in_dim(hidden, prompt_len + s.step - 1, axis=1, keepdims=False)  # [B, D]
    s = _record(spec, s, m.logits(last))
    return s.replace(cache=jax.lax.dynamic_update_slice(s.cache, s.last_token[:, None], (0, prompt_len + s.step - 1)))

  return jax.lax.while_loop(cond, body, state)


def _vocab_size(model: Any) -> int:
  return int(model.unembedding().shape[-1])


@functools.lru_cache(maxsize=64)
def _compiled(spec: _Spec) -> tuple[Any, Any, Any]:
  """Jitted (prefill, decode, uncached) for one spec; jax.jit then caches one executable per input shape.

  The prefill's chunk sizes do not reach the decode: specs that differ only in them share one compiled decode.
  """
  prefill = jax.jit(functools.partial(_prefill, spec))
  loop_spec = dataclasses.replace(spec, prefill_rows=0, prefill_tokens=0)
  if loop_spec != spec:
    return (prefill, *_compiled(loop_spec)[1:])
  decode = jax.jit(functools.partial(_decode, spec), donate_argnums=(1,))
  uncached = jax.jit(functools.partial(_generate_uncached, spec))
  return prefill, decode, uncached


# ----------------------------------------------------------------------------------------------------------------------
# The host-side entry point.


def decode_weight_layout(params: Any, mesh: Any, decode_weights: str, compute_dtype: Any) -> dict:
  """`_Spec`'s weight_shardings and compute_dtype for `params` (concrete or abstract, with their shardings):
  "replicated" gathers weights split over the batch axes once a call, before the loops; "training" (or weights
  that nothing splits) reads them where they are, each decode step all-gathering what it uses (less memory, the
  gather's bytes every token)."""
  if decode_weights not in scheduler.DECODE_WEIGHTS:
    raise ValueError(f"rollout/sampler.py: decode_weights={decode_weights!r} is not one of "
                     f"{scheduler.DECODE_WEIGHTS}")
  dtype = jnp.dtype(compute_dtype).name
  if mesh is None or decode_weights != "replicated":
    return {"weight_shardings": None, "compute_dtype": dtype}
  leaves = jax.tree.leaves(params)
  shardings = decode_shardings(leaves, mesh)
  return {"weight_shardings": None if already_laid_out(leaves, shardings) else shardings, "compute_dtype": dtype}


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, rng: Any,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (),
             pad_id: int = 0, mesh: jax.sharding.Mesh | None = None, use_cache: bool = True,
             return_logits: bool = False, pad_batch_to: int = 1, max_rows_per_device: int = 0,
             prefill_rows_per_device: int = 0, prefill_chunk_tokens: int = 0, engine: str = "static",
             decode_slots: int = 0, decode_chunk_steps: int = scheduler.DEFAULT_CHUNK_STEPS,
             decode_weights: str = "replicated", on_rows_done: Any = None) -> SampleOutput:
  """Samples `max_new_tokens` tokens after each prompt (a list of token-id lists, ragged).

  Args:
    model: a `jaxrlvr.models.Transformer` (already sharded when `mesh` is given).
    prompts: B token-id lists, each non-empty; left-padded to `bucket_length(longest)`.
    max_new_tokens: N, the budget; the loop stops earlier once every row has produced a stop token.
    rng: a jax PRNG key (or an int seed).
    temperature: 0 is greedy; top_k 0 and top_p 1 switch those filters off.
    eos_ids: stop tokens (any number); pad_id fills the prompt padding and the slots after a stop.
    mesh: run sharded, the batch over ('data', 'fsdp') and KV heads over 'tensor'. With several processes (multi-host)
      each calls `generate` with its own prompts and gets its own rows back; every process must call it, with the
      same `rng` and settings, and a mesh whose batch shards divide evenly among the processes. On a multi-core CPU,
      one device per core (`JAX_NUM_CPU_DEVICES=2`) and a `data` mesh over them is the fast setting: the decode
      step's kernels are too small to be split across threads, so one device keeps one core busy.
    use_cache: False recomputes the full prefix at every step (reference and benchmark baseline).
    return_logits: also return the raw logits [B, N, V] (memory-heavy; tests and debugging).
    pad_batch_to: pad the batch to a multiple of this (besides the mesh's batch shards), so that callers whose batch
      size varies (ExGRPO's K-1 samples for replayed questions) can keep one compiled shape.
    max_rows_per_device: > 0 cuts the prompts into consecutive sampler calls of max_rows_per_device x (batch shards)
      rows each (per process with several), the last padded up, which bounds the KV cache; 0 samples all at once.
    prefill_rows_per_device: > 0 prefills that many rows of each device at a time (bounds the prefill's
      activations); 0, or at least the call's rows per device, prefills them all at once.
    prefill_chunk_tokens: > 0 writes each prompt into the cache that many slots at a time (the last chunk overlaps
      the one before when it does not divide the bucket); 0, or at least the bucket, the whole bucket at once.
    engine: "static" samples as above; "continuous" samples through the rollout engine (`rollout/scheduler.py`):
      rows leave their decode slot when they stop and queued rows take it, with the same row randomness. One
      process only, with the cache; its slots per batch shard are `decode_slots`, else max_rows_per_device, else
      one per row; `decode_chunk_steps` decode steps run between two looks at which rows are done;
      `decode_weights` "replicated" copies the weights out of their fsdp split once per call (the static sampler
      ignores decode_slots and decode_chunk_steps; it honours decode_weights, gathering inside its programs, before
      their loops).
    on_rows_done: if given, on_rows_done(rows, tokens, lengths) is called for every row once it is done: by the
      engine as rows finish, while it decodes on (reward scoring can overlap decoding); by the static sampler once,
      for all rows, at the end.
  Returns:
    SampleOutput of host numpy arrays with B rows.
  """
  limits = dict(zip(MEMORY_LIMITS, (max_rows_per_device, prefill_rows_per_device, prefill_chunk_tokens)))
  if engine not in ENGINES:
    raise ValueError(f"rollout/sampler.py: engine={engine!r} is not one of {ENGINES}")
  if engine == "continuous":
    if not use_cache or return_logits:
      raise ValueError("rollout/sampler.py: engine='continuous' samples with the cache and returns no logits; use "
                       "engine='static' for use_cache=False or return_logits=True")
    bounded.check_sampling_args(max_new_tokens, temperature, top_p, top_k, limits)
    return scheduler.generate(
        model, prompts, **_engine_arguments(
            max_new_tokens=max_new_tokens, rng=rng, temperature=temperature, top_p=top_p, top_k=top_k,
            eos_ids=eos_ids, pad_id=pad_id, mesh=mesh, pad_batch_to=pad_batch_to,
            max_rows_per_device=max_rows_per_device, prefill_rows_per_device=prefill_rows_per_device,
            prefill_chunk_tokens=prefill_chunk_tokens, decode_slots=decode_slots,
            decode_chunk_steps=decode_chunk_steps, decode_weights=decode_weights),
        on_rows_done=on_rows_done)
  bounded.check_sampling_args(max_new_tokens, temperature, top_p, top_k, limits)
  vocab = getattr(getattr(model, "config", None), "vocab_size", None)
  calls = bounded.plan_calls(prompts, pad_id=pad_id, vocab_size=vocab, mesh=mesh, pad_batch_to=pad_batch_to,
                                      max_rows_per_device=int(max_rows_per_device))
  if isinstance(rng, int):
    rng = jax.random.key(rng)
  elif not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):  # a legacy uint32 key (jax.random.PRNGKey)
    rng = jax.random.wrap_key_data(rng)
  graphdef, params = nnx.split(model)
  spec = _Spec(graphdef=graphdef, max_new_tokens=int(max_new_tokens), top_k=int(top_k),
               nucleus=top_p < 1.0, return_logits=bool(return_logits), mesh=mesh,
               prefill_rows=int(prefill_rows_per_device), prefill_tokens=int(prefill_chunk_tokens),
               **decode_weight_layout(params, mesh, decode_weights, model.config.compute_dtype))
  prefill, decode, uncached = _compiled(spec)
  scalars = (bounded.stop_array(eos_ids), np.asarray(pad_id, np.int32), np.asarray(temperature, np.float32),
             np.asarray(top_p, np.float32))
  if mesh is not None:
    rng = jax.random.wrap_key_data(_to_global(mesh, np.asarray(jax.random.key_data(rng)), P()),
                                   impl=jax.random.key_impl(rng))
    scalars = tuple(_to_global(mesh, x, P()) for x in scalars)
  controls = (rng, *scalars)
  pieces = []
  for i in range(calls.count):
    inputs = calls.call(i)  # ids, mask [rows, bucket], real, row_keys [rows]
    if mesh is not None:
      inputs = tuple(_to_global(mesh, x, P(BATCH_AXES)) for x in inputs)
    if use_cache:
      state = decode(params, prefill(params, *inputs, controls))
    else:
      state = uncached(params, *inputs, controls)
    outputs = (state.tokens, state.logprobs, state.entropies, state.lengths, state.logits)
    del state  # this call's KV cache: freed before the next call allocates its own
    if jax.process_count() > 1:  # this process's rows only
      outputs = jax.tree.map(multihost.local_rows, outputs)
    pieces.append(jax.device_get(outputs))  # waits for the call, so that at most one cache is alive at a time
  tokens, logprobs, entropies, lengths, logits = (
      None if parts[0] is None else np.concatenate(parts, axis=0)[:calls.batch] for parts in zip(*pieces))
  if on_rows_done is not None:
    on_rows_done(np.arange(calls.batch), tokens, lengths)
  return SampleOutput(tokens=tokens, logprobs=logprobs, entropies=entropies, lengths=lengths, logits=logits)


def prepare(model: nnx.Module, prompts: Sequence[Sequence[int]], *, engine: str = "static", **kwargs: Any) -> bool:
  """Compiles, or loads from the persistent compilation cache, what `generate(model, prompts, engine=engine,
  **kwargs)` runs, and samples nothing, where the sampler can: the rollout engine (`scheduler.prepare`). Returns
  whether it did; the static sampler compiles at its first call."""
  if engine != "continuous":
    return False
  scheduler.prepare(model, prompts, **_engine_arguments(**kwargs))
  return True


def _engine_arguments(*, max_new_tokens: int, rng: Any, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      eos_ids: Sequence[int] = (), pad_id: int = 0, mesh: jax.sharding.Mesh | None = None,
                      pad_batch_to: int = 1, max_rows_per_device: int = 0, prefill_rows_per_device: int = 0,
                      prefill_chunk_tokens: int = 0, decode_slots: int = 0,
                      decode_chunk_steps: int = scheduler.DEFAULT_CHUNK_STEPS,
                      decode_weights: str = "replicated") -> dict:
  """`generate`'s arguments as the rollout engine (`scheduler.generate`) names them; max_rows_per_device bounds its
  slots when decode_slots does not."""
  return dict(max_new_tokens=max_new_tokens, rng=rng, temperature=temperature, top_p=top_p, top_k=top_k,
              eos_ids=eos_ids, pad_id=pad_id, mesh=mesh, decode_slots=decode_slots or max_rows_per_device,
              chunk_steps=decode_chunk_steps, prefill_rows_per_device=prefill_rows_per_device,
              prefill_chunk_tokens=prefill_chunk_tokens, pad_batch_to=pad_batch_to, decode_weights=decode_weights)


def _to_global(mesh: jax.sharding.Mesh, local: np.ndarray, spec: P) -> jax.Array:
  """A global array from this process's part: its rows when `spec` shards dim 0, the whole value if replicated."""
  sharding = NamedSharding(mesh, spec)
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local)
