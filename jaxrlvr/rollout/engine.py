"""The rollout engine, device side: a fixed batch of decode slots, prompts prefilled into free slots, jitted decode
chunks. The host side (which row goes where, when rows leave and enter) is `rollout/scheduler.py`.

Why: a static batch is decoded until its longest row stops, and every step attends over the whole preallocated
cache. RL answers spread from a few tokens to the cap, so most of that work is wasted. Here a row leaves its slot as
soon as it stops and a queued row takes the slot; between decode chunks the host reads which slots are done.

Shapes: S decode slots, C cache slots per row (the capacity: the prompt bucket plus N), N max_new_tokens, U prompts
prefilled at once, Lb their length bucket, K kv heads, G query heads per kv head, H head_dim, D hidden, V vocab.

- Layout. A slot's prompt sits at cache slots [0, P) (not left-padded): a token's cache slot is its RoPE position,
  and row r sees slots <= its position. The KV cache of each layer is a tuple of segments, [S, K, L_i, H] each,
  covering slots [start_i, start_i + L_i) with L_i = 64, 64, 128, 256, 512, 512, ... (`segment_bounds`; a
  remainder under 64 slots joins the last).
- Attention over what the slots hold. A decode step reads only the segments up to the one holding the furthest
  live row (`_attend`: a `lax.switch` over their number); each is a whole array, read in place by its dot. Slicing
  a window out of one [S, K, C, H] array instead made XLA:CPU copy the window before the dot: at C = 544, 64 slots,
  a 512-slot window cost 11.6 ms a step against 7.3 ms over the whole cache (the copy writes and re-reads it).
  With the segments, 64 rows of the long-tail model (benchmarks/sampler_long_tail.py) decode at 3.5-5 ms a step
  while their rows are short, against 7.7 ms over the whole 544-slot cache. Past a row's position its slots are
  masked: other rows change which segments are read, not what a row sees.
- Randomness. Row r's uniforms are jax.random.uniform(fold_in(rng, r), (N,)), the static sampler's, drawn when the
  row enters; its token t uses uniforms[t]. A row's tokens do not depend on the slot count, its slot, or when it
  entered (up to the float rounding of batched kernels of another size).
- The decoder block. `_layer_step` is `models.transformer.Block` for one token per slot with a per-row cache slot,
  written with the block's own parameters and norms; the tests hold it to the static sampler and transformers.
- Static shapes. `insert` compiles per (S, U, Lb), `decode_chunk` and `compact` per S; nothing depends on a step.
  Temperature, top_p and stop ids are traced (`Controls`), so changing them does not recompile. The host fills
  what follows a row's stop with pad_id.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlvr.models import apply_rope, rope_inv_freq
from jaxrlvr.rollout.bounded import BATCH_AXES
from jaxrlvr.rollout.decode import already_laid_out, decode_shardings, in_decode_layout, sample

TENSOR_AXIS = "tensor"
FIRST_SEGMENT = 64  # cache slots of the first segment; each next one doubles, up to MAX_SEGMENT
MAX_SEGMENT = 512
_MASKED = float(jnp.finfo(jnp.float32).min)

# Incremented each time a jitted engine function is traced (compiled): the no-recompilation tests read it.
TRACE_COUNTS: collections.Counter = collections.Counter()


def segment_bounds(capacity: int, first: int = FIRST_SEGMENT,
                   largest: int = MAX_SEGMENT) -> tuple[tuple[int, int], ...]:
  """(start, size) of each cache segment covering [0, capacity): sizes first, first, 2 first, ... up to `largest`,
  the last one cut to what is left (so the segments hold exactly `capacity` slots). A remainder smaller than
  `first` joins the segment before it: a segment costs a cache write and a branch level at every step, which a
  few extra slots read do not (the short workload's 80 slots are one segment, not 64 + 16)."""
  bounds, start, size = [], 0, first
  while start < capacity:
    take = min(size, capacity - start)
    bounds.append((start, take))
    start += take
    if len(bounds) > 1:
      size = min(2 * size, largest)
  if len(bounds) > 1 and bounds[-1][1] < first:
    (start, size), (_, rest) = bounds[-2], bounds.pop()
    bounds[-1] = (start, size + rest)
  return tuple(bounds)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """Everything static about one compiled engine (with the state's shapes, the jit cache key)."""
  graphdef: Any
  max_new_tokens: int  # N
  capacity: int  # C cache slots per decode slot
  top_k: int
  nucleus: bool  # top_p < 1
  chunk_steps: int  # decode steps per chunk at most
  mesh: Any = None
  prefill_tokens: int = 0  # prompt slots the prefill writes at once (0: the whole bucket)
  segment_sizes: tuple[int, int] = (FIRST_SEGMENT, MAX_SEGMENT)  # the first cache segment's slots, the largest's

  @property
  def segments(self) -> tuple[tuple[int, int], ...]:
    return segment_bounds(self.capacity, *self.segment_sizes)


@struct.dataclass
class Controls:
  """The traced sampling settings: a new value does not recompile."""
  rng: jax.Array  # the run's key; row r draws from fold_in(rng, r)
  stop_ids: jax.Array  # [E] int32, -1 for unused entries
  temperature: jax.Array  # [] f32
  top_p: jax.Array  # [] f32


@struct.dataclass
class Slots:
  """Per decode slot (leading dim S); donated to every call, so the cache is updated in place. The sampled tokens
  are not kept here: each call hands its own to the host (`Sampled`, `ChunkReport`), which assembles the rows."""
  cache: Any  # per layer {'k': (segment [S, K, L_i, H], ...), 'v': (...)}
  length: jax.Array  # [S] int32 tokens in the slot's cache = position (and cache slot) of the token fed next
  last_token: jax.Array  # [S] int32 the token fed at the next step
  step: jax.Array  # [S] int32 tokens sampled so far; the row's length once it is done
  done: jax.Array  # [S] bool the slot decodes no more (its row stopped or reached N, or it is empty)
  uniforms: jax.Array  # [S, N] f32 the row's draws


@struct.dataclass
class Sampled:
  """Tokens an insert sampled (each entry's first), or a chunk's [S, chunk] buffers (column j: step j of the chunk)."""
  tokens: jax.Array  # int32
  logprobs: jax.Array  # f32
  entropies: jax.Array  # f32


@struct.dataclass
class ChunkReport:
  """What the host reads of a decode chunk. Its own buffers, not the state's: the state is donated to the next call,
  so the host can read a chunk's report while the chunk after it runs."""
  start: jax.Array  # [S] int32 each slot's step before the chunk: its column of the row for the buffers' column 0
  step: jax.Array  # [S] int32 its step after the chunk (columns [start, step) were sampled)
  done: jax.Array  # [S] bool
  steps: jax.Array  # [] int32 decode steps the chunk ran
  sampled: Sampled  # [S, chunk] each


@struct.dataclass
class EngineState:
  slots: Slots
  controls: Controls


def _constrain(mesh: Any, x: jax.Array, tensor_dim: int | None = None) -> jax.Array:
  """Dim 0 of `x` over the batch axes (and `tensor_dim` over 'tensor' when it divides); no-op without a mesh."""
  if mesh is None:
    return x
  axes: list[Any] = [None] * x.ndim
  axes[0] = BATCH_AXES
  if tensor_dim is not None and x.shape[tensor_dim] % mesh.shape[TENSOR_AXIS] == 0:
    axes[tensor_dim] = TENSOR_AXIS
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*axes)))


def _constrain_slots(mesh: Any, slots: Slots) -> Slots:
  cache = jax.tree.map(lambda c: _constrain(mesh, c, tensor_dim=1), slots.cache)
  rest = {f.name: _constrain(mesh, getattr(slots, f.name)) for f in dataclasses.fields(slots) if f.name != "cache"}
  return Slots(cache=cache, **rest)


def decode_layout(params: Any, mesh: Any, compute_dtype: Any) -> Any:
  """The parameters as the decode reads them (`decode.decode_shardings`: replicated over the batch axes, kept
  sharded over 'tensor' only), floating ones cast to the compute dtype (the model casts every weight to it where it
  uses it, so no number changes), as one copy made per sampler call on the host's side of the engine's many decode
  chunks. It costs the memory of the weights per device without their fsdp split, which the planner counts. Weights
  already so (one device, a data-parallel mesh) are returned as they are: copied, 158 ms a call on the smollm2
  preset.
  """
  leaves, treedef = jax.tree.flatten(params)
  shardings = decode_shardings(leaves, mesh)
  dtype = jnp.dtype(compute_dtype)
  cast_free = all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in leaves)  # bf16 included
  if not any(isinstance(x, jax.core.Tracer) for x in leaves) and cast_free and already_laid_out(leaves, shardings):
    return params
  return jax.tree.unflatten(treedef, _relayout(leaves, shardings, dtype.name))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _relayout(leaves: list, shardings: tuple, dtype: str) -> list:
  """One program for every leaf (per-leaf dispatches queue up on XLA:CPU's launch pool; see jaxrlvr/xla_cpu.py)."""
  TRACE_COUNTS["relayout"] += 1
  return in_decode_layout(leaves, shardings, dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The state: created empty, prefilled into, decoded, compacted.


def _init(spec: EngineSpec, params: Any, num_slots: int, controls: Controls) -> EngineState:
  """`num_slots` empty slots (all done)."""
  TRACE_COUNTS["init"] += 1
  c = nnx.merge(spec.graphdef, params).config
  s, n = num_slots, spec.max_new_tokens
  dtype = jnp.dtype(c.compute_dtype)
  zeros = lambda size: jnp.zeros((s, c.num_kv_heads, size, c.head_dim), dtype)
  cache = [{kind: tuple(zeros(size) for _, size in spec.segments) for kind in ("k", "v")}
           for _ in range(c.num_layers)]
  slots = Slots(cache=cache, length=jnp.zeros((s,), jnp.int32), last_token=jnp.zeros((s,), jnp.int32),
                step=jnp.zeros((s,), jnp.int32), done=jnp.ones((s,), bool), uniforms=jnp.zeros((s, n), jnp.float32))
  return EngineState(slots=_constrain_slots(spec.mesh, slots), controls=controls)


def _prefill(spec: EngineSpec, params: Any, ids: jax.Array, prompt_lengths: jax.Array) -> tuple[Any, jax.Array]:
  """Prompts ids [U, Lb] (right-padded, lengths [U]) into a fresh cache [U, K, Lb, H] per layer; and the final-norm
  hidden state [U, D] of each prompt's last token.

  With spec.prefill_tokens = W < Lb the prompts go in W slots at a time; chunk c starts at min(c W, Lb - W), so
  every chunk has one shape (the last may rewrite slots the one before wrote, with the same values).
  """
  model = nnx.merge(spec.graphdef, params)
  rows, width = ids.shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))  # slot = position: no padding
  key_mask = positions < prompt_lengths[:, None]  # [U, Lb]
  cache = jax.tree.map(lambda x: _constrain(spec.mesh, x, tensor_dim=1), model.init_cache(rows, width))
  last_index = prompt_lengths - 1  # [U]
  chunk = spec.prefill_tokens if 0 < spec.prefill_tokens < width else width
  if chunk == width:
    hidden, cache = model.hidden(ids, positions=positions, attention_mask=key_mask, cache=cache,
                                 cache_index=jnp.zeros((), jnp.int32))  # [U, Lb, D]
    return cache, jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]

  def one_chunk(i: jax.Array, carry: tuple) -> tuple:
    cache, last = carry
    start = jnp.minimum(i * chunk, width - chunk)
    piece = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)  # [U, W]
    hidden, cache = nnx.merge(spec.graphdef, params).hidden(piece(ids), positions=piece(positions),
                                                            attention_mask=key_mask, cache=cache, cache_index=start)
    inside = (last_index >= start) & (last_index < start + chunk)  # [U]: this chunk holds the row's last token
    here = jnp.take_along_axis(hidden, jnp.clip(last_index - start, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
    return cache, jnp.where(inside[:, None], here.astype(last.dtype), last)

  last = jnp.zeros((rows, model.config.hidden_size), jnp.dtype(model.config.compute_dtype))
  return jax.lax.fori_loop(0, -(-width // chunk), one_chunk, (cache, _constrain(spec.mesh, last)))


def _insert(spec: EngineSpec, params: Any, state: EngineState, ids: jax.Array, prompt_lengths: jax.Array,
            source: jax.Array, dest: jax.Array, row_keys: jax.Array) -> tuple[EngineState, Sampled]:
  """Prefills prompts and puts them into slots, each batch shard on its own: ids [shards * U, Lb] (shard d's U
  prompts in its part, right-padded, lengths [shards * U]); entry m of shard d copies its prompt source[d, m] into
  its slot dest[d, m] (an index among its S / shards slots) for row key row_keys[d, m] and samples the row's first
  token, returned as Sampled [shards * M] (entry (d, m) at d * M + m). Entries with dest[d, m] = S / shards (out of
  range) are padding and dropped, so that one compiled insert serves any number of rows.

  Nothing crosses devices: indexing the whole batch with replicated entries instead made the partitioner keep
  copies of every slot's cache (6.45 GB of temporaries a layer at 7B on fsdp=8); per shard, as `_compact` does,
  the insert holds one prompt cache beside the slots'.
  """
  TRACE_COUNTS["insert"] += 1
  model = nnx.merge(spec.graphdef, params)
  slots, ctl = state.slots, state.controls
  n, shards = spec.max_new_tokens, source.shape[0]
  by_shard = lambda x, tensor_dim=None: _constrain(spec.mesh, x.reshape(shards, -1, *x.shape[1:]), tensor_dim)
  flat = lambda x: _constrain(spec.mesh, x.reshape(-1, *x.shape[2:]))  # [shards, n, ...] -> [shards * n, ...]
  per_shard = jax.vmap(lambda rows, index: rows[index])  # [shards, U, ...], [shards, M] -> [shards, M, ...]
  cache, last = _prefill(spec, params, ids, prompt_lengths)
  logits = flat(per_shard(by_shard(model.logits(last)), source))  # [shards * M, V]
  draw = lambda row: jax.random.uniform(jax.random.fold_in(ctl.rng, row), (n,))
  uniforms = _constrain(spec.mesh, jax.vmap(draw)(row_keys.reshape(-1)))  # [shards * M, N]
  tok, logp, ent = sample(logits, uniforms[:, 0], ctl.temperature, ctl.top_p, top_k=spec.top_k,
                          nucleus=spec.nucleus)  # [shards * M] each
  stop = jnp.any(tok[:, None] == ctl.stop_ids[None, :], axis=1) | (n == 1)

  def put(full: jax.Array, part: jax.Array) -> jax.Array:
    """full [S, ...] with shard d's slots dest[d] set to part [shards * M, ...]."""
    set_rows = jax.vmap(lambda f, d, p: f.at[d].set(p.astype(f.dtype), mode="drop"))
    return flat(set_rows(by_shard(full), dest, by_shard(part)))  # via [shards, S / shards, ...]

  width = ids.shape[1]

  def put_prompt(segments: tuple, prompt: jax.Array) -> tuple:
    """The prompts' keys or values [shards * U, K, Lb, H] into the segments that cover slots [0, Lb)."""
    prompt = per_shard(by_shard(prompt, tensor_dim=2), source)  # [shards, M, K, Lb, H]
    out = []
    for (start, size), segment in zip(spec.segments, segments):
      if start < width:
        used = min(size, width - start)
        set_rows = jax.vmap(lambda f, d, p, used=used: f.at[d, :, :used].set(p.astype(f.dtype), mode="drop"))
        updated = set_rows(by_shard(segment, tensor_dim=2), dest, prompt[:, :, :, start:start + used])
        segment = _constrain(spec.mesh, updated.reshape(segment.shape), tensor_dim=1)
      out.append(segment)
    return tuple(out)

  new_cache = [{kind: put_prompt(slots.cache[i][kind], layer[kind]) for kind in ("k", "v")}
               for i, layer in enumerate(cache)]
  lengths = flat(per_shard(by_shard(prompt_lengths), source))  # [shards * M]
  slots = slots.replace(
      cache=new_cache, length=put(slots.length, lengths), last_token=put(slots.last_token, tok),
      step=put(slots.step, jnp.ones_like(tok)), done=put(slots.done, stop), uniforms=put(slots.uniforms, uniforms))
  return state.replace(slots=_constrain_slots(spec.mesh, slots)), Sampled(tokens=tok, logprobs=logp, entropies=ent)


def _attend(q: jax.Array, keys: tuple, values: tuple, segments: tuple, position: jax.Array,
            reach: jax.Array) -> jax.Array:
  """q [S, K, G, H] over the cache segments: slot s is visible to row r when s <= position[r].

  Only the segments up to the one holding `reach` (the furthest position of a live row) are read: a `lax.switch`
  over their number n, whose branch n is one softmax over the scores of segments 0..n-1 (each a dot that reads its
  segment in place). A row's slots past its own position are masked: other rows change which segments are read,
  not what a row sees. One softmax rather than an online one merged segment by segment: fewer small kernels a step
  (each merge is a dozen), and the static sampler's arithmetic.
  """
  scale = 1.0 / float(q.shape[-1]) ** 0.5

  def upto(n: int) -> Any:
    def run(q: jax.Array, position: jax.Array) -> jax.Array:
      scores = jnp.concatenate([jnp.einsum("SKGH,SKLH->SKGL", q, keys[i].astype(q.dtype),
                                           preferred_element_type=jnp.float32) for i in range(n)], axis=-1) * scale
      end = segments[n - 1][0] + segments[n - 1][1]
      visible = jnp.arange(end)[None, :] <= position[:, None]  # [S, W]; slot 0 is every row's first token
      probs = jax.nn.softmax(jnp.where(visible[:, None, None, :], scores, _MASKED), axis=-1)
      out = None
      for (start, size), v in zip(segments[:n], values[:n]):
        part = jnp.einsum("SKGL,SKLH->SKGH", probs[..., start:start + size].astype(q.dtype), v.astype(q.dtype))
        out = part if out is None else out + part
      return out
    return run

  starts = jnp.asarray([start for start, _ in segments])
  count = jnp.sum((starts <= reach).astype(jnp.int32))  # >= 1: segment 0 starts at slot 0
  if len(segments) == 1:
    return upto(1)(q, position)
  return jax.lax.switch(count - 1, [upto(n) for n in range(1, len(segments) + 1)], q, position)


def _set_rows(full: jax.Array, index: jax.Array, value: jax.Array, axis: int) -> jax.Array:
  """full[r, ..., index[r], ...] = value[r] (index along `axis` of full, counted with the row dim) for every row r
  whose index lies in [0, size); rows with an index out of range keep their values (the write is dropped).

  Written per row (vmap of an indexed update: a scatter with a batch dimension, which each device runs on its own
  rows) rather than as one scatter over (row, index) pairs: under a mesh the partitioner all-gathered such a
  scatter's index pairs, 54 all-gathers a decode step of the long-tail model on two devices.
  """
  size = full.shape[axis]
  index = jnp.where((index >= 0) & (index < size), index, size)  # a negative index would count from the end
  where = (slice(None),) * (axis - 1)
  return jax.vmap(lambda row, i, v: row.at[(*where, i)].set(v.astype(row.dtype), mode="drop"))(full, index, value)


def _write(segments: tuple, bounds: tuple, new: jax.Array, position: jax.Array, active: jax.Array) -> tuple:
  """new [S, K, H] at cache slot position[r] of each active row; the segments it misses keep their values."""
  return tuple(_set_rows(segment, jnp.where(active, position - start, size), new, axis=2)
               for (start, size), segment in zip(bounds, segments))


def heads_minor_o_proj(model: Any) -> tuple[jax.Array, ...]:
  """Each layer's o_proj [N, H, D] as [H, N, D], made once a decode chunk for `_layer_step`. The model sums the
  heads' outputs in the order (H, N) (jnp.einsum orders the contracted labels of "BTNH,NHD->BTD" by name), and
  inside the decode loop XLA:CPU copied every o_proj into that layout at every step (8.4 ms of a ~110 ms step on the
  smollm2-135m preset). Given [H, N, D], the same dot reads it in place and sums in the same order: the same numbers,
  for one copy a chunk and its memory (`plan/memory.py`'s `o_proj_copy`)."""
  return tuple(jnp.swapaxes(block.attn.o_proj[...], 0, 1) for block in model.layers)


def _layer_step(spec: EngineSpec, block: Any, o_proj: jax.Array, x: jax.Array, position: jax.Array,
                active: jax.Array, reach: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
  """One decoder block on one token per slot, x [S, D]: the block's own parameters and norms (its o_proj as
  [H, N, D], `heads_minor_o_proj`), the computation of `models.transformer.Block` for T = 1 with a per-row cache
  slot. A nested jit, as `models.transformer` runs its blocks: traced once for all the layers of a decode step, not
  once per layer."""
  graphdef, state = nnx.split(block)
  return _layer_step_jit(spec, graphdef, state, o_proj, x, position, active, reach, cache)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer_step_jit(spec: EngineSpec, graphdef: Any, state: Any, o_proj: jax.Array, x: jax.Array,
                    position: jax.Array, active: jax.Array, reach: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
  block = nnx.merge(graphdef, state)
  attn = block.attn
  c = attn.config
  dt = x.dtype
  h = block.input_norm(x)
  q = jnp.einsum("SD,DNH->SNH", h, attn.q_proj[...].astype(dt))
  k = jnp.einsum("SD,DKH->SKH", h, attn.k_proj[...].astype(dt))
  v = jnp.einsum("SD,DKH->SKH", h, attn.v_proj[...].astype(dt))
  if c.qkv_bias:
    q = q + attn.q_bias[...].astype(dt)
    k = k + attn.k_bias[...].astype(dt)
    v = v + attn.v_bias[...].astype(dt)
  if c.qk_norm:
    q, k = attn.q_norm(q), attn.k_norm(k)
  inv_freq = rope_inv_freq(c)
  q = apply_rope(q[:, None], position[:, None], inv_freq)[:, 0]  # [S, N, H]
  k = apply_rope(k[:, None], position[:, None], inv_freq)[:, 0]  # [S, K, H]
  cache = {"k": _write(cache["k"], spec.segments, k, position, active),
           "v": _write(cache["v"], spec.segments, v, position, active)}
  rows, heads, head_dim = q.shape
  q = q.reshape(rows, c.num_kv_heads, heads // c.num_kv_heads, head_dim)  # [S, N, H] -> [S, K, G, H]
  out = _attend(q, cache["k"], cache["v"], spec.segments, position, reach).reshape(rows, heads, head_dim)
  x = x + jnp.einsum("SHN,HND->SD", out.swapaxes(1, 2), o_proj.astype(dt))  # contracted as (H, N), as the model does
  x = x + block.mlp(block.post_attn_norm(x)[:, None])[:, 0]  # the MLP takes [B, T, D]
  return _constrain(spec.mesh, x), cache


def _decode_step(spec: EngineSpec, model: Any, o_proj: tuple[jax.Array, ...], state: EngineState,
                 uniform: jax.Array) -> tuple[EngineState, tuple]:
  """Feeds every live slot's last token and samples its next one with its draw uniform [S]; done slots only
  recompute what they hold; `o_proj` is `heads_minor_o_proj(model)`. Returns the state and the step's (token,
  logprob, entropy) [S] each, which `_decode_chunk` records."""
  slots, ctl = state.slots, state.controls
  n = spec.max_new_tokens
  active = ~slots.done
  position = slots.length
  reach = jnp.max(jnp.where(active, position, 0))
  x = _constrain(spec.mesh, jnp.take(model.embed[...], slots.last_token, axis=0).astype(model.config.compute_dtype))
  cache = []
  for block, layer_o_proj, layer_cache in zip(model.layers, o_proj, slots.cache):
    x, layer_cache = _layer_step(spec, block, layer_o_proj, x, position, active, reach, layer_cache)
    cache.append(layer_cache)
  logits = model.logits(model.final_norm(x))  # [S, V] float32
  tok, logp, ent = sample(logits, uniform, ctl.temperature, ctl.top_p, top_k=spec.top_k,
                          nucleus=spec.nucleus)
  stop = jnp.any(tok[:, None] == ctl.stop_ids[None, :], axis=1)
  step = slots.step + active.astype(jnp.int32)
  slots = slots.replace(cache=cache, length=position + active.astype(jnp.int32),
                        last_token=jnp.where(active, tok, slots.last_token), step=step,
                        done=slots.done | (active & (stop | (step >= n))))
  return state.replace(slots=slots), (tok, logp, ent)


def _decode_chunk(spec: EngineSpec, params: Any, state: EngineState,
                  exit_when_done: jax.Array) -> tuple[EngineState, ChunkReport]:
  """Up to spec.chunk_steps decode steps; stops early once every slot is done, or once at least `exit_when_done`
  slots are (the host has queued rows for them). Returns the state and the chunk's report.

  Step j of the chunk works on columns of [S, chunk_steps] buffers, the same column j for every slot: a slot live
  at step j was live at every step before it (no row enters during a chunk), so its column j is its own column
  start + j of its row. Its draws are gathered into such a buffer once before the loop, and its sampled tokens
  (log-probs, entropies) are written to buffers with a dynamic_update_slice, which the report hands to the host
  (which writes a slot's columns [start, step) of its row). Read and written at each row's own column on the
  device instead, they cost a gather and three scatters a step.
  """
  TRACE_COUNTS["decode"] += 1
  width = spec.chunk_steps
  rows = state.slots.done.shape[0]
  start = state.slots.step  # [S] each slot's column of its first token of this chunk
  offset = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, chunk]
  draws = _constrain(spec.mesh, jnp.take_along_axis(
      state.slots.uniforms, jnp.minimum(start[:, None] + offset, spec.max_new_tokens - 1), axis=1))  # [S, chunk]

  o_proj = heads_minor_o_proj(nnx.merge(spec.graphdef, params))  # before the loop: once a chunk

  def cond(carry: tuple) -> jax.Array:
    steps, s, _ = carry
    done = s.slots.done
    return (steps < width) & ~jnp.all(done) & (jnp.sum(done.astype(jnp.int32)) < exit_when_done)

  def body(carry: tuple) -> tuple:
    steps, s, buffers = carry
    uniform = jax.lax.dynamic_index_in_dim(draws, steps, axis=1, keepdims=False)  # [S]
    s, sampled = _decode_step(spec, nnx.merge(spec.graphdef, params), o_proj, s, uniform)
    buffers = tuple(jax.lax.dynamic_update_slice_in_dim(b, x[:, None].astype(b.dtype), steps, axis=1)
                    for b, x in zip(buffers, sampled))
    return steps + 1, s, buffers

  empty = tuple(_constrain(spec.mesh, jnp.zeros((rows, width), dtype))
                for dtype in (jnp.int32, jnp.float32, jnp.float32))
  steps, state, buffers = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, empty))
  # The report's step and done are copies: as outputs of their own they outlive the donated state.
  report = ChunkReport(start=start, step=jnp.copy(state.slots.step), done=jnp.copy(state.slots.done), steps=steps,
                       sampled=Sampled(*buffers))
  return state, report


def _compact(spec: EngineSpec, state: EngineState, keep: jax.Array) -> EngineState:
  """The slots `keep` [shards, S' / shards] only: shard d keeps its own slots keep[d] (indices among its S / shards),
  in that order. Each shard gathers from its own rows, so nothing moves between devices (indexing the whole batch
  instead made the partitioner all-gather every slot's cache: 35 ms a compaction of the long-tail model on two
  CPU devices, 9% of the run)."""
  TRACE_COUNTS["compact"] += 1
  shards, per_shard = keep.shape

  def take(x: jax.Array) -> jax.Array:
    by_shard = _constrain(spec.mesh, x.reshape(shards, -1, *x.shape[1:]))  # [S, ...] -> [shards, S / shards, ...]
    kept = jax.vmap(lambda rows, index: rows[index])(by_shard, keep)  # [shards, S' / shards, ...]
    return kept.reshape(shards * per_shard, *x.shape[1:])

  return state.replace(slots=_constrain_slots(spec.mesh, jax.tree.map(take, state.slots)))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """The jitted functions of one spec; jax.jit compiles one executable per input shape (S, U, Lb). `warmed` holds
  the slot counts whose whole chain of shapes has been compiled (`scheduler._warm_up`)."""
  init: Any
  insert: Any
  decode_chunk: Any
  compact: Any
  warmed: set = dataclasses.field(default_factory=set)


@functools.lru_cache(maxsize=32)
def compiled(spec: EngineSpec) -> Compiled:
  return Compiled(init=jax.jit(functools.partial(_init, spec), static_argnums=(1,)),
                  insert=jax.jit(functools.partial(_insert, spec), donate_argnums=(1,)),
                  decode_chunk=jax.jit(functools.partial(_decode_chunk, spec), donate_argnums=(1,)),
                  compact=jax.jit(functools.partial(_compact, spec)))
