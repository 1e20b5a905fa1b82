"""JAX's Pallas splash-attention kernel (TPU) behind `models/attention.py`'s "splash" implementation.

Splash computes causal attention within segments: query t sees key s when s <= t and both carry the same segment id,
with an online softmax over [block_q, block_kv] tiles held in the TPU core's memory, forward and backward (its dq and
dkv kernels), so nothing of size T x S reaches HBM. It covers `attend`'s calls with T = S and query t at slot t:
the update's and the scorer's self-attention without a cache (and a prefill that fills a cache from slot 0). It
cannot take a decode step or a prefill chunk (T != S: its causal rule is by position within the call), nor a
per-query [B, T, S] mask (packed completions); `attend` keeps those on the other implementations.

The module's masking rules become segment ids, one id per query and one per key:
- a real slot keeps its segment (1 for a boolean mask, the id for packed rows);
- a padding slot's key gets an id of its own, -(slot + 1), so no real query sees it;
- a padding query that follows real keys takes the segment of the last real key before it, so it sees that
  segment's earlier keys; one before any real key (left padding) takes its slot's own id and sees its own slot only.
For boolean masks this is exactly `attention_weights_mask`. In a packed row (several segments) a padding query after
them sees only the last segment, where the xla path lets it see every earlier real key: no real query reads a
padding query's output, so the model's real positions, its loss and its gradients are the same either way.

GQA uses the kernel's own grouping (make_splash_mha takes k/v with K heads, query head n reading kv head n // G,
the grouping of the xla path), so kv heads are not repeated, except under a head-sharded mesh whose 'tensor' axis
divides N but not K: then each shard needs whole groups, and k/v are repeated to N heads first.

Sharding: a pallas_call is not partitioned by XLA, so on a mesh the kernel runs under `jax.shard_map`, rows split
over the batch axes ('data', 'fsdp') and heads over 'tensor', where they divide (replicated otherwise). Off TPU the
kernel runs in Pallas' interpreter (slow; for tests).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

# The kernel's segment-id and mask tiles are laid out over the TPU's 128 lanes: block sizes must be multiples of it,
# on TPU and in the interpreter alike.
LANES = 128


def blocks(length: int, block_size: int) -> tuple[int, int]:
  """(block, padded length) for a call of `length` slots: the length rounded up to whole lanes, and the largest
  multiple of the lanes up to `block_size` (at least one lane) that divides it, so that at most 127 slots are
  padding (T = 1280 with block_size 512 runs in blocks of 256, not padded to 1536)."""
  padded = -(-length // LANES) * LANES
  block = max(LANES, block_size // LANES * LANES)
  while padded % block:
    block -= LANES
  return block, padded


def segment_ids(key_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(query ids, key ids), each [B, T] int32, from a [B, T] key_mask (bool, or int32 segment ids with 0 for padding),
  by the rules of the module docstring."""
  segments = key_mask.astype(jnp.int32)  # a boolean mask: one segment, 1
  slots = jnp.arange(segments.shape[1], dtype=jnp.int32)
  real = segments > 0
  own = -(slots + 1)[None, :]  # [1, T]: a padding slot's id, shared with nothing else
  last_real = jax.lax.cummax(jnp.where(real, slots[None, :], -1), axis=1)  # [B, T]: -1 before the first real key
  last_segment = jnp.take_along_axis(segments, jnp.maximum(last_real, 0), axis=1)
  key_ids = jnp.where(real, segments, own)
  query_ids = jnp.where(real, segments, jnp.where(last_real >= 0, last_segment, own))
  return query_ids, key_ids


def _kernel(num_heads: int, length: int, block: int, interpret: bool):
  """make_splash_mha for one row: causal over `length` slots, every forward and backward tile `block` square."""
  # Imported here: the Pallas TPU modules take ~1 s to import, which a run that never picks splash should not pay.
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top

  mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * num_heads)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret), splash


def _attend_local(q, k, v, query_ids, key_ids, *, block: int, interpret: bool):
  """One device's rows and heads: q [b, N, Tp, H] (scaled), k/v [b, K, Tp, H], ids [b, Tp] -> [b, N, Tp, H]."""
  kernel, splash = _kernel(q.shape[1], q.shape[2], block, interpret)
  one_row = lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=splash.SegmentIds(q=qi, kv=ki))
  return jax.vmap(one_row)(q, k, v, query_ids, key_ids)


def _axes_dividing(mesh, names: tuple[str, ...], size: int) -> tuple[str, ...]:
  """The longest leading run of the mesh axes `names` (those the mesh has, of size > 1) whose product divides size;
  the rule `models/sharding.logical_to_spec` applies to the model's arrays."""
  axes = [a for a in names if a in mesh.shape and mesh.shape[a] > 1]
  while axes and size % math.prod(mesh.shape[a] for a in axes):
    axes.pop()
  return tuple(axes)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array, *, block_size: int, mesh=None,
                     interpret: bool = False) -> jax.Array:
  """q [B, T, N, H], k/v [B, K, T, H], key_mask [B, T] (bool, or int32 segment ids) -> [B, T, N, H] in q's dtype:
  `attend` for T = S with query t at slot t.

  T is padded up to whole blocks (`blocks`) with padding slots, which no real query sees. `mesh` (a Mesh or
  the AbstractMesh of a traced array; None or empty: one device) places the kernel under a shard_map.
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[1]
  block, padded = blocks(t, block_size)
  # Splash takes no softmax scale: scale q, in float32 and back, as the other paths scale the scores.
  q = (q.astype(jnp.float32) * (1.0 / math.sqrt(h))).astype(q.dtype).transpose(0, 2, 1, 3)  # [B, N, T, H]
  if padded != t:  # trailing padding slots, seen by no real query; their outputs are dropped below
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, padded - t), (0, 0))) for x in (q, k, v))
    key_mask = jnp.pad(key_mask, ((0, 0), (0, padded - t)))
  query_ids, key_ids = segment_ids(key_mask)
  local = lambda q, k, v, qi, ki: _attend_local(q, k, v, qi, ki, block=block, interpret=interpret)

  if mesh is None or mesh.empty:
    out = local(q, k, v, query_ids, key_ids)
  else:
    batch = _axes_dividing(mesh, ("data", "fsdp"), b) or None
    heads = _axes_dividing(mesh, ("tensor",), n) or None
    if heads and kv_heads % mesh.shape["tensor"]:
      # A shard of N / tensor query heads needs its groups' kv heads whole: give every query head its own.
      k, v = jnp.repeat(k, n // kv_heads, axis=1), jnp.repeat(v, n // kv_heads, axis=1)
    rows_heads = PartitionSpec(batch, heads)
    # check_vma=False: splash's pallas_call does not say how its outputs vary over the mesh axes, which the check needs.
    out = jax.shard_map(local, mesh=mesh, in_specs=(rows_heads,) * 3 + (PartitionSpec(batch),) * 2,
                        out_specs=rows_heads, check_vma=False)(q, k, v, query_ids, key_ids)
  return out[:, :, :t].transpose(0, 2, 1, 3)  # [B, T, N, H]
