"""Attention for the decoder: one entry point, `attend`, and the implementations it dispatches to.

Shapes: B batch, T queries, S key slots (the KV cache's capacity, or T without a cache), N query heads, K kv heads,
G = N // K query heads per kv head, H head_dim. Keys and values arrive heads-first, [B, K, S, H], the cache's layout.
Masking: query t (at slot `query_slots[t]`) sees slot s when s <= query_slots[t] and `key_mask[b, s]`; a query with
no such key (a left-padding query) sees its own slot only, so no softmax row is empty and nothing is NaN. An int32
`key_mask` holds segment ids instead (0: padding): a row packs several sequences one after another, and a query sees
only the keys of its own segment (see `attention_weights_mask`; not "blockwise").

Implementations (`ModelConfig.attention`):
- "xla": scores [B, K, G*T, S] in float32, then softmax. Fastest where T x S is small (XLA:CPU), quadratic memory.
- "blockwise": online softmax over key blocks in plain XLA, with a hand-written backward pass that recomputes each
  block (FlashAttention-2), so forward and backward memory is linear in T; runs on every backend.
- "cudnn": cuDNN's fused flash kernel through `jax.nn.dot_product_attention` (NVIDIA GPU, bfloat16/float16).
- "splash": JAX's Pallas splash-attention kernel for TPU (`models/splash.py`), under a shard_map over the batch and
  head mesh axes; in Pallas' interpreter off TPU (slow: for tests). It takes the calls with T = S and query t at slot
  t (the update's and the scorer's self-attention, no cache), with a [B, S] key_mask, boolean or segment ids; not a
  decode step or prefill chunk (T != S) nor a [B, T, S] mask, for which "auto" keeps the rules below.
- "auto": chosen per call by `resolve` from the platform of the mesh the call runs on, the dtype and (T, S).

`attend` reads the mesh from q's type (inside jit, the AbstractMesh its sharding is on; the model's activations are
held to the run's mesh), so a program compiled ahead for a TPU topology from a CPU host picks splash, while
`jax.default_backend()` there says "cpu". Without a mesh, the platform is `jax.default_backend()`.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlvr.models import splash as splash_lib

IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "splash")

# "auto" uses "xla" while q_len * kv_len is at most this, a flash-style path above. On the 2-core development
# CPU (`python benchmarks/attention.py`, batch 16, the tiny preset's heads, block 512; docs/benchmarks.md,
# "Attention") blockwise took 0.9-2.6x xla's time up to T = S = 768 (mostly more) and ~0.5x at 1024; decode steps
# (T = 1) ran 1.3-1.7x faster on xla at every S measured (256 to 32,768), whose scores are linear in S anyway.
XLA_MAX_SCORES = 768 * 768

_MASKED = float(jnp.finfo(jnp.float32).min)


def resolve(implementation: str, *, q_len: int, kv_len: int, dtype: Any, head_dim: int | None = None,
            backend: str | None = None, per_query_mask: bool = False) -> str:
  """The implementation that `implementation` means for one call: itself unless it is "auto".

  "auto" on TPU: "splash" for a call with q_len = kv_len and a [B, S] key_mask (the update and the scorer; at every
  length: the kernel pads T to whole 128-slot blocks, and no TPU timing here says plain XLA is faster for short
  calls). Otherwise, on every backend: "xla" when q_len * kv_len <= XLA_MAX_SCORES (the embedded default's T = S =
  42, decode steps up to S = 589,824 slots: scores of at most 2.3 MiB a row and head). Above that, on a GPU with a
  bfloat16/float16 compute dtype, "cudnn" when cuDNN accepts the call, its backward pass included ("blockwise"
  otherwise); everywhere else "blockwise" (on TPU: decode steps and prefill chunks past the limit).

  `backend` is the platform the call runs on ("tpu", "gpu", "cpu"): `attend` passes its mesh's, the planner the one
  it plans for; None means `jax.default_backend()`. When it is not this host's, cuDNN is assumed to accept
  half-precision calls whose head_dim is a multiple of 8 up to 128. `per_query_mask`: the call has a [B, T, S]
  mask, which splash cannot take.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"models/attention.py: attention={implementation!r} is not one of {IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  backend = jax.default_backend() if backend is None else backend
  if backend == "tpu" and q_len == kv_len and not per_query_mask:
    return "splash"
  if q_len * kv_len <= XLA_MAX_SCORES:
    return "xla"
  if backend == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    if backend == jax.default_backend() and head_dim is not None:
      supported = _cudnn_accepts(q_len, kv_len, jnp.dtype(dtype).name, head_dim)
    else:
      supported = head_dim is None or (head_dim % 8 == 0 and head_dim <= 128)
    return "cudnn" if supported else "blockwise"
  return "blockwise"


def mesh_of(x: jax.Array) -> Any:
  """The mesh `x` is laid out on (inside jit, an AbstractMesh), or None when it has none."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return None if mesh is None or mesh.empty else mesh


def platform_of(mesh: Any) -> str:
  """"tpu", "gpu" or "cpu": the platform of `mesh`'s devices (`jax.default_backend()` for None)."""
  if mesh is None:
    return jax.default_backend()
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return mesh.abstract_device.platform if mesh.abstract_device is not None else jax.default_backend()
  return mesh.devices.flat[0].platform


@functools.lru_cache(maxsize=None)
def _cudnn_accepts(q_len: int, kv_len: int, dtype: str, head_dim: int) -> bool:
  """Whether cuDNN's fused attention takes these shapes, forward and backward (its checks run at trace time)."""
  q = jax.ShapeDtypeStruct((1, q_len, 1, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), dtype)
  mask = jax.ShapeDtypeStruct((1, 1, q_len, kv_len), bool)

  def loss(q, k, v, mask):
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
    return out.astype(jnp.float32).sum()

  try:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, mask)
  except (ValueError, NotImplementedError, RuntimeError):
    return False
  return True


def attend(q: jax.Array, k: jax.Array, v: jax.Array, query_slots: jax.Array, key_mask: jax.Array, *,
           implementation: str, block_size: int, mesh: Any = None) -> jax.Array:
  """q [B, T, N, H], k/v [B, K, S, H], query_slots [T] int32, key_mask [B, S] bool (or int32 segment ids, see
  `attention_weights_mask`) -> [B, T, N, H] in q's dtype. A [B, T, S] bool `key_mask` is the whole mask, used as
  given: which slots each query sees (the caller allows every query at least one).

  `block_size` is the query and key block of "blockwise" and, in whole 128-slot lanes, of "splash"
  (`splash.blocks`); the others ignore it. `mesh` is the mesh the call runs on (default: q's, `mesh_of`): its
  platform resolves "auto", and splash runs under a shard_map on it.
  """
  t, s = q.shape[1], k.shape[2]
  mesh = mesh_of(q) if mesh is None else mesh
  platform = platform_of(mesh)
  chosen = resolve(implementation, q_len=t, kv_len=s, dtype=q.dtype, head_dim=q.shape[-1], backend=platform,
                   per_query_mask=key_mask.ndim == 3)
  if chosen == "splash":
    if key_mask.ndim == 3 or t != s:
      raise ValueError(f"models/attention.py: splash attention takes T = S and a [B, S] key_mask (no cache); this "
                       f"call has T = {t}, S = {s} and a {key_mask.ndim}-d mask: use attention 'auto'")
    # Query t sits at slot t here (T = S: no cache, or a prefill filling one from slot 0); splash assumes it.
    return splash_lib.splash_attention(q, k, v, key_mask, block_size=block_size, mesh=mesh,
                                       interpret=platform != "tpu")
  if key_mask.ndim == 3:
    if chosen == "blockwise":
      raise ValueError("models/attention.py: blockwise attention takes no per-query mask (packed completions); use "
                       f"attention 'xla' or 'cudnn' for these {t} x {s} scores")
    return dot_product_attention(q, k, v, key_mask, implementation=chosen, platform=platform)
  if chosen == "blockwise":
    if packed(key_mask):
      raise ValueError("models/attention.py: blockwise attention takes no segment ids (packed rows); use attention "
                       f"'xla' or 'cudnn' for these {t} x {s} scores")
    return blockwise_attention(q, k, v, jnp.asarray(query_slots, jnp.int32), key_mask.astype(bool), block_size)
  mask = attention_weights_mask(query_slots, key_mask)  # [B, T, S]
  return dot_product_attention(q, k, v, mask, implementation=chosen, platform=platform)


def packed(key_mask: jax.Array) -> bool:
  """Whether `key_mask` holds segment ids (integers) rather than a mask of real keys (bool)."""
  return jnp.issubdtype(key_mask.dtype, jnp.integer)


def attention_weights_mask(query_slots: jax.Array, key_mask: jax.Array) -> jax.Array:
  """Boolean [B, T, S]: causal by slot and restricted to real keys.

  `query_slots` [T] are the slots the queries occupy. `key_mask` [B, S] marks real keys (bool), or gives each slot
  its segment id (integers, 0 for padding): then a query sees only the keys of its own segment, as when each of a
  row's packed sequences ran alone. A 0/1 integer mask is one segment a row, the boolean mask's rule. A query on a
  padding slot (segment 0) sees every real key before it, as with a boolean mask. A query row with no allowed key
  (a left-padding query) is allowed its own slot only, so softmax never sees an empty row and nothing is NaN; rows
  with at least one real key are unchanged.
  """
  slots = jnp.arange(key_mask.shape[1])
  causal = slots[None, :] <= query_slots[:, None]  # [T, S]
  if packed(key_mask):
    query_segments = jnp.take(key_mask, query_slots, axis=1)[:, :, None]  # [B, T, 1]
    same = (key_mask[:, None, :] == query_segments) | (query_segments == 0)  # [B, T, S]
    allowed = causal[None] & (key_mask[:, None, :] > 0) & same
  else:
    allowed = causal[None] & key_mask[:, None, :].astype(bool)  # [B, T, S]
  empty = ~jnp.any(allowed, axis=-1, keepdims=True)  # [B, T, 1]
  own = (slots[None, :] == query_slots[:, None])[None]  # [1, T, S]
  return allowed | (empty & own)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, implementation: str,
                          platform: str | None = None) -> jax.Array:
  """q [B, T, N, H], k/v [B, K, S, H] (heads before slots), mask [B, T, S] -> [B, T, N, H] (grouped-query attention).

  `platform` is where the call runs (default `jax.default_backend()`; a GPU topology compiled from a CPU host is
  "gpu"): "cudnn" needs a GPU.

  Keys and values come heads-first, the KV cache's layout, so that both contractions below read the cache as stored:
  with [B, S, K, H], XLA:CPU ran the probabilities-times-values contraction as a transposed batched dot that took
  ~40% of a tiny-model decode step.
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[1]
  scale = 1.0 / math.sqrt(h)
  if implementation == "cudnn":
    # cuDNN's fused kernel runs on NVIDIA GPUs in half precision only; say so instead of failing inside lowering.
    platform = jax.default_backend() if platform is None else platform
    if platform != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
      raise ValueError(f"models/attention.py: attention='cudnn' needs a GPU backend and a bfloat16/float16 "
                       f"compute_dtype (backend {platform!r}, dtype {q.dtype}); use attention='auto'")
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, S, K, H], the layout of jax.nn.dot_product_attention
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn")
  g = n // kv_heads
  # Queries as [B, K, G*T, H]: both contractions are then plain batched matmuls over (B, K) that read keys and
  # values in the cache's layout (other orders made XLA:CPU pick transposed, several times slower, dot kernels).
  q = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, h)  # [B, K, G*T, H]
  scores = jnp.einsum("BKQH,BKSH->BKQS", q, k, preferred_element_type=jnp.float32) * scale  # [B, K, G*T, S]
  allowed = jnp.broadcast_to(mask[:, None, None], (b, 1, g, t, mask.shape[-1])).reshape(b, 1, g * t, -1)
  scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("BKQS,BKSH->BKQH", probs, v)  # [B, K, G*T, H]
  return out.reshape(b, kv_heads, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)  # [B, T, N, H]


# ---------------------------------------------------------------------------------------------------------------------
# Blockwise attention. Queries are processed in blocks of bq = min(block_size, T) (T padded up to a multiple of bq),
# keys in blocks of bk = min(block_size, S). S is not padded: the last key block starts at S - bk and the keys it
# shares with the block before are masked out of it, so any S works without copying the KV cache. A query block stops
# at the last key block its highest slot can see, which skips the upper triangle of causal attention and the empty
# tail of a KV cache. Only [B, K, G*bq, bk] scores exist at a time; the backward pass recomputes them from the saved
# log-sum-exp instead of keeping them (autodiff of the loops would stack every block's scores: T x S again).
# ---------------------------------------------------------------------------------------------------------------------


class _Layout:
  """Block sizes and the query reshapes shared by the forward and backward passes."""

  def __init__(self, q_shape: tuple[int, ...], num_slots: int, kv_heads: int, block_size: int):
    self.b, self.t, self.n, self.h = q_shape
    self.s, self.k, self.g = num_slots, kv_heads, self.n // kv_heads
    self.bq, self.bk = min(block_size, self.t), min(block_size, num_slots)
    self.nq, self.nk = -(-self.t // self.bq), -(-num_slots // self.bk)
    self.tp = self.nq * self.bq  # T padded to whole query blocks

  def to_blocks(self, x: jax.Array) -> jax.Array:
    """[B, T, N, X] -> [nq, B, K, G*bq, X], query rows ordered (g, t) as in the xla path; padding rows are zeros."""
    x = jnp.pad(x, ((0, 0), (0, self.tp - self.t), (0, 0), (0, 0)))  # [B, Tp, N, X]
    x = x.reshape(self.b, self.nq, self.bq, self.k, self.g, x.shape[-1])  # [B, nq, bq, K, G, X]
    return x.transpose(1, 0, 3, 4, 2, 5).reshape(self.nq, self.b, self.k, self.g * self.bq, -1)

  def from_blocks(self, x: jax.Array) -> jax.Array:
    """[nq, B, K, G*bq, X] -> [B, T, N, X]."""
    x = x.reshape(self.nq, self.b, self.k, self.g, self.bq, x.shape[-1])  # [nq, B, K, G, bq, X]
    x = x.transpose(1, 0, 4, 2, 3, 5).reshape(self.b, self.tp, self.n, -1)  # [B, Tp, N, X]
    return x[:, :self.t]

  def query_blocks(self, query_slots: jax.Array, key_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query block: slots [nq, bq], empty rows [nq, B, bq] and the number of key blocks to visit [nq].

    Padding queries repeat the last query's slot, so their rows are finite; their outputs are dropped and their
    output gradients are zero. A row is empty when its slot precedes the row's first real key.
    """
    slots = jnp.pad(query_slots, (0, self.tp - self.t), mode="edge").reshape(self.nq, self.bq)  # [nq, bq]
    first_real = jnp.where(jnp.any(key_mask, axis=1), jnp.argmax(key_mask, axis=1), self.s)  # [B]
    empty = slots[:, None, :] < first_real[None, :, None]  # [nq, B, bq]
    key_blocks = jnp.minimum(jnp.max(slots, axis=1) // self.bk + 1, self.nk)  # [nq]
    return slots, empty, key_blocks

  def key_block(self, j: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array):
    """Key block j: its start slot, k/v [B, K, bk, H], its slots [bk] and key_mask [B, bk]."""
    start = jnp.minimum(j * self.bk, self.s - self.bk)
    k_j = jax.lax.dynamic_slice_in_dim(k, start, self.bk, axis=2)
    v_j = jax.lax.dynamic_slice_in_dim(v, start, self.bk, axis=2)
    key_slots = start + jnp.arange(self.bk)  # [bk]
    return start, k_j, v_j, key_slots, jax.lax.dynamic_slice_in_dim(key_mask, start, self.bk, axis=1)

  def allowed(self, j, slots_i, empty_i, key_slots, real) -> jax.Array:
    """[B, 1, G*bq, bk]: the rule of `attention_weights_mask` for query block i and key block j, without the keys
    block j shares with block j - 1 (the last block's overlap), so that every slot is counted once."""
    fresh = key_slots >= j * self.bk  # [bk]
    visible = (key_slots[None, :] <= slots_i[:, None]) & fresh[None]  # [bq, bk]
    own = (key_slots[None, :] == slots_i[:, None]) & fresh[None]  # [bq, bk]
    allowed = (visible[None] & real[:, None, :]) | (empty_i[:, :, None] & own[None])  # [B, bq, bk]
    allowed = jnp.broadcast_to(allowed[:, None, None], (self.b, 1, self.g, self.bq, self.bk))
    return allowed.reshape(self.b, 1, self.g * self.bq, self.bk)


def _scores(q_i: jax.Array, k_j: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
  """[B, K, G*bq, bk] float32 scores, masked entries at float32's lowest value (as the xla path)."""
  s = jnp.einsum("BKQH,BKSH->BKQS", q_i, k_j, preferred_element_type=jnp.float32) * scale
  return jnp.where(allowed, s, _MASKED)


def _blockwise_forward(q, k, v, query_slots, key_mask, block_size):
  """Output [B, T, N, H] and the log-sum-exp of every query row [nq, B, K, G*bq] (float32)."""
  lay = _Layout(q.shape, k.shape[2], k.shape[1], block_size)
  scale = 1.0 / math.sqrt(lay.h)
  slots, empty, key_blocks = lay.query_blocks(query_slots, key_mask)

  def query_block(args):
    q_i, slots_i, empty_i, num_key_blocks = args  # q_i [B, K, G*bq, H]

    def key_step(j, carry):
      row_max, row_sum, acc = carry  # [B, K, G*bq], [B, K, G*bq], [B, K, G*bq, H] float32
      _, k_j, v_j, key_slots, real = lay.key_block(j, k, v, key_mask)
      allowed = lay.allowed(j, slots_i, empty_i, key_slots, real)
      s = _scores(q_i, k_j, allowed, scale)
      new_max = jnp.maximum(row_max, s.max(axis=-1))
      p = jnp.where(allowed, jnp.exp(s - new_max[..., None]), 0.0)
      correction = jnp.exp(row_max - new_max)
      row_sum = row_sum * correction + p.sum(axis=-1)
      pv = jnp.einsum("BKQS,BKSH->BKQH", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
      return new_max, row_sum, acc * correction[..., None] + pv

    rows = q_i.shape[:3]
    init = (jnp.full(rows, _MASKED, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(q_i.shape, jnp.float32))
    row_max, row_sum, acc = jax.lax.fori_loop(0, num_key_blocks, key_step, init)
    # Every row has at least one allowed key (its own slot if nothing else), so row_sum > 0.
    return (acc / row_sum[..., None]).astype(q.dtype), row_max + jnp.log(row_sum)

  out, lse = jax.lax.map(query_block, (lay.to_blocks(q), slots, empty, key_blocks))
  return lay.from_blocks(out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, query_slots: jax.Array, key_mask: jax.Array,
                        block_size: int) -> jax.Array:
  """`attend`'s "blockwise" path: the arguments and result of `attend`, memory linear in T forward and backward."""
  return _blockwise_forward(q, k, v, query_slots, key_mask, block_size)[0]


def _blockwise_fwd(q, k, v, query_slots, key_mask, block_size):
  out, lse = _blockwise_forward(q, k, v, query_slots, key_mask, block_size)
  return out, (q, k, v, query_slots, key_mask, out, lse)


def _blockwise_bwd(block_size, residuals, d_out):
  """FlashAttention-2's backward: with D = rowsum(dO * O) and p = exp(s - lse) per block, dv += p^T dO,
  ds = p * (dO v^T - D), dq += ds k * scale, dk += ds^T q * scale. Accumulated in float32."""
  q, k, v, query_slots, key_mask, out, lse = residuals
  lay = _Layout(q.shape, k.shape[2], k.shape[1], block_size)
  scale = 1.0 / math.sqrt(lay.h)
  slots, empty, key_blocks = lay.query_blocks(query_slots, key_mask)
  d_out_blocks = lay.to_blocks(d_out)  # [nq, B, K, G*bq, H]; zero on padding rows
  delta = jnp.sum(d_out_blocks.astype(jnp.float32) * lay.to_blocks(out).astype(jnp.float32), axis=-1)

  def query_block(carry, args):
    q_i, do_i, lse_i, delta_i, slots_i, empty_i, num_key_blocks = args

    def key_step(j, inner):
      dq_i, dk, dv = inner  # [B, K, G*bq, H], [B, K, S, H], [B, K, S, H] float32
      start, k_j, v_j, key_slots, real = lay.key_block(j, k, v, key_mask)
      allowed = lay.allowed(j, slots_i, empty_i, key_slots, real)
      p = jnp.where(allowed, jnp.exp(_scores(q_i, k_j, allowed, scale) - lse_i[..., None]), 0.0)  # [B, K, G*bq, bk]
      dv_j = jnp.einsum("BKQS,BKQH->BKSH", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
      dp = jnp.einsum("BKQH,BKSH->BKQS", do_i, v_j, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None])
      dq_i = dq_i + jnp.einsum("BKQS,BKSH->BKQH", ds.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32) * scale
      dk_j = jnp.einsum("BKQS,BKQH->BKSH", ds.astype(q_i.dtype), q_i, preferred_element_type=jnp.float32) * scale
      # Keys this block shares with the one before have p = 0 here, so adding the whole block counts each once.
      dk = jax.lax.dynamic_update_slice_in_dim(dk, jax.lax.dynamic_slice_in_dim(dk, start, lay.bk, 2) + dk_j, start, 2)
      dv = jax.lax.dynamic_update_slice_in_dim(dv, jax.lax.dynamic_slice_in_dim(dv, start, lay.bk, 2) + dv_j, start, 2)
      return dq_i, dk, dv

    dq_i, dk, dv = jax.lax.fori_loop(0, num_key_blocks, key_step, (jnp.zeros(q_i.shape, jnp.float32), *carry))
    return (dk, dv), dq_i

  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  (dk, dv), dq = jax.lax.scan(query_block, zeros, (lay.to_blocks(q), d_out_blocks, lse, delta, slots, empty,
                                                   key_blocks))
  return lay.from_blocks(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)
